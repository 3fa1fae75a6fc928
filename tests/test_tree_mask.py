"""Property tests: a tree-masked forward equals running every branch linearly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfit_hf.generation import SpecFitCache, ancestor_matrix, tree_attention_mask
from specfit_hf.generation.tree_mask import block_depths

from test_generation import VOCAB, one_thread, shared_tiny_model  # noqa: F401  (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def forests(draw, max_nodes=9):
    """Parent arrays with parents before children (-1 = hangs off the prefix), plus tokens."""
    n = draw(st.integers(1, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return parents, tokens


def naive_ancestors(parents):
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


@given(forests(max_nodes=30))
@settings(derandomize=True, max_examples=60, deadline=None)
def test_ancestor_matrix_matches_naive(forest):
    parents, _ = forest
    p = torch.tensor(parents)
    assert torch.equal(ancestor_matrix(p), naive_ancestors(parents))
    depth = naive_ancestors(parents).sum(1) - 1
    assert torch.equal(ancestor_matrix(p, max_depth=int(depth.max())), naive_ancestors(parents))
    assert torch.equal(block_depths(p), depth)


def test_mask_values_and_shape():
    mask = tree_attention_mask(torch.tensor([-1, 0, 0, 1]), prefix_len=2, dtype=torch.float16)
    assert mask.shape == (1, 1, 4, 6) and mask.dtype == torch.float16
    visible = mask[0, 0] == 0
    assert visible[:, :2].all()  # the prefix is visible to everyone
    assert visible[3, 2:].tolist() == [True, True, False, True]  # node 3 sees 0, 1 and itself, not 2
    assert (mask[0, 0][~visible] == torch.finfo(torch.float16).min).all()


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
@given(forest=forests(), prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
@settings(derandomize=True, max_examples=15, deadline=None)
def test_tree_forward_equals_linear_branches(name, forest, prefix):
    m = shared_tiny_model(name)
    parents, tokens = forest
    p = torch.tensor(parents)
    prefix_ids = torch.tensor([prefix])
    with torch.no_grad():
        cache = SpecFitCache(config=m.config)
        m(prefix_ids, past_key_values=cache, use_cache=True)
        mask = tree_attention_mask(p, len(prefix))
        positions = len(prefix) + block_depths(p)
        tree_logits = m(
            torch.tensor([tokens]), attention_mask=mask, position_ids=positions[None], past_key_values=cache,
            use_cache=True,
        ).logits[0]
        anc = naive_ancestors(parents)
        for i in range(len(tokens)):
            path = [tokens[j] for j in range(len(tokens)) if anc[i, j]]  # ancestors in order (parents precede)
            linear = m(torch.tensor([prefix + path])).logits[0, -1]
            torch.testing.assert_close(tree_logits[i], linear, atol=2e-5, rtol=1e-4)


def test_attention_layer_kinds_are_read_once_per_config(monkeypatch):
    from transformers import Qwen3MoeConfig

    from specfit_hf.generation import tree_mask

    config = Qwen3MoeConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            vocab_size=64)
    with pytest.raises(TypeError):
        hash(config)  # transformers configs compare by value: the cache cannot key on them
    calls = []
    read = tree_mask._read_attention_layer_kinds
    monkeypatch.setattr(tree_mask, "_read_attention_layer_kinds", lambda c: calls.append(c) or read(c))
    first = tree_mask._attention_layer_kinds(config)
    assert tree_mask._attention_layer_kinds(config) == first and len(calls) == 1
    config.layer_types = ["sliding_attention"] * 2  # a changed config is read again
    config.sliding_window = 8
    assert tree_mask._attention_layer_kinds(config) == (False, True, 8) and len(calls) == 2
