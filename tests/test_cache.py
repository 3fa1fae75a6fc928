"""SpecFitCache: keeping the accepted path by gathering equals recomputing from scratch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, MistralConfig

from specfit_hf.generation import SpecFitCache, UnsupportedCacheLayerError, tree_attention_mask
from specfit_hf.generation.tree_mask import ancestor_matrix, block_depths

from test_generation import VOCAB, one_thread, shared_tiny_model  # noqa: F401  (one_thread is a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def tree_blocks(draw, max_nodes=9):
    """A verify block: root (parent -1) then nodes whose parents precede them, plus a leaf to keep."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    leaf = draw(st.integers(0, n - 1))
    return parents, tokens, leaf


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
@given(block=tree_blocks(), prefix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
       continuation=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
@settings(max_examples=15, deadline=None)
def test_gather_then_continue_equals_recompute(name, block, prefix, continuation):
    m = shared_tiny_model(name)
    parents, tokens, leaf = block
    p = torch.tensor(parents)
    with torch.no_grad():
        cache = SpecFitCache(config=m.config)
        m(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        m(torch.tensor([tokens]), attention_mask=tree_attention_mask(p, len(prefix)),
          position_ids=(len(prefix) + block_depths(p))[None], past_key_values=cache, use_cache=True)
        # Keep the root-to-leaf path, as the loop does after verification.
        path = torch.nonzero(ancestor_matrix(p)[leaf]).reshape(-1)
        cache.keep_prefix_and(len(prefix), path)
        assert cache.get_seq_length() == len(prefix) + path.numel()
        seq = prefix + [tokens[i] for i in path.tolist()]
        cont = m(torch.tensor([continuation]), past_key_values=cache, use_cache=True).logits[0]
        fresh = m(torch.tensor([seq + continuation])).logits[0, len(seq):]
    torch.testing.assert_close(cont, fresh, atol=2e-5, rtol=1e-4)


def test_keep_orders_and_crops():
    cache = SpecFitCache()
    keys = torch.arange(10.0).reshape(1, 1, 10, 1).repeat(1, 2, 1, 3)
    cache.update(keys, -keys, layer_idx=0)
    cache.keep([0, 1, 2, 7, 4])
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 7, 4]
    assert cache.layers[0].values[0, 1, :, 2].tolist() == [0, -1, -2, -7, -4]
    cache.keep_prefix_and(2, [0, 1])  # contiguous: a crop
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 7]
    cache.crop_to(1)
    assert cache.get_seq_length() == 1
    with pytest.raises(IndexError):
        cache.keep([3])


def test_from_dynamic_shares_tensors():
    dyn = DynamicCache()
    dyn.update(torch.ones(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), layer_idx=0)
    cache = SpecFitCache.from_dynamic(dyn)
    assert cache.get_seq_length() == 4 and cache.layers[0] is dyn.layers[0]
    cache.keep([1, 3])
    assert cache.get_seq_length() == 2


def test_sliding_window_layers_are_rejected():
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    with pytest.raises(UnsupportedCacheLayerError, match="sliding-window"):
        SpecFitCache(config=cfg)
    # The same error for an existing cache adopted later.
    with pytest.raises(UnsupportedCacheLayerError):
        SpecFitCache.from_dynamic(DynamicCache(config=cfg))


def test_generate_rejects_sliding_window_target():
    from transformers import MistralForCausalLM

    from specfit_hf.generation import SpecFitConfig

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    target = MistralForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedCacheLayerError):
        target.generate(torch.tensor([[1, 2, 3]]), assistant_model=target,
                        generation_config=SpecFitConfig(max_new_tokens=3))
