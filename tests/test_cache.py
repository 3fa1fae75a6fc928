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
@settings(derandomize=True, max_examples=15, deadline=None)
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


def _sliding_configs():
    """gpt-oss (sliding and full layers alternate) and Mistral (every layer slides), window 4."""
    from transformers import GptOssConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    gpt_oss = GptOssConfig(**common, intermediate_size=24, num_hidden_layers=2, num_local_experts=8,
                           num_experts_per_tok=2, sliding_window=4)
    mistral = MistralConfig(**common, intermediate_size=48, num_hidden_layers=2, sliding_window=4)
    return {"gpt_oss": gpt_oss, "mistral": mistral}


def _sliding_model(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_sliding_configs()[name], attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, t in model.named_parameters():
            if pname.endswith(("sinks", "_bias", "router.bias")):
                t.normal_(0, 0.5)  # zero-initialised sinks/biases would hide their handling
    return model


def test_sliding_window_layers_keep_the_block_until_commit_then_the_window():
    from specfit_hf.generation.cache import TreeSlidingLayer

    cfg = _sliding_configs()["gpt_oss"]  # window 4: layer 0 slides, layer 1 is full attention
    assert DynamicCache(config=cfg).is_sliding == [True, False]  # what transformers would build
    for cache in (SpecFitCache(config=cfg), SpecFitCache.from_dynamic(DynamicCache(config=cfg))):
        assert isinstance(cache.layers[0], TreeSlidingLayer) and cache.is_sliding == [True, False]
        keys = torch.arange(9.0).reshape(1, 1, 9, 1).repeat(1, 2, 1, 8)
        for layer in range(2):
            cache.update(keys, -keys, layer_idx=layer)
        assert [lay.keys.shape[-2] for lay in cache.layers] == [9, 9]  # a block is never cut before commit
        assert cache.get_seq_length() == 9 and cache.sliding_offset == 0
        cache.keep([0, 1, 2, 3, 5, 8])  # commit: prefix 0..3 plus accepted 5, 8
        assert cache.get_seq_length() == 6
        assert cache.layers[1].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5, 8]
        # the sliding layer keeps the last window - 1 = 3 committed positions
        assert cache.layers[0].keys[0, 0, :, 0].tolist() == [3, 5, 8] and cache.sliding_offset == 3
        assert cache.get_mask_sizes(2, 0) == (5, 3)
        cache.crop_to(5)
        assert cache.layers[0].keys[0, 0, :, 0].tolist() == [3, 5] and cache.get_seq_length() == 5
        with pytest.raises(ValueError, match="dropped"):
            cache.crop_to(2)
    # A sliding layer that has already dropped positions cannot be adopted.
    dyn = DynamicCache(config=cfg)
    for layer in range(2):
        dyn.update(torch.zeros(1, 2, 9, 8), torch.zeros(1, 2, 9, 8), layer_idx=layer)
    with pytest.raises(UnsupportedCacheLayerError, match="dropped"):
        SpecFitCache.from_dynamic(dyn)


def test_sliding_layers_hold_only_the_window_after_generate():
    from specfit_hf.generation import SpecFitConfig

    target = _sliding_model("gpt_oss")
    ids = torch.tensor([[3, 9, 27, 14, 5, 60, 41]])
    cfg = SpecFitConfig(max_new_tokens=16, min_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                        policy="eagle3", max_depth=4, tree_top_k=2, max_verify_nodes=6)
    out = target.generate(ids, assistant_model=target, generation_config=cfg)
    cache = out.past_key_values
    assert cache.layers[0].keys.shape[-2] <= 3 < cache.layers[1].keys.shape[-2]  # window 4 vs full history
    assert cache.get_seq_length() == cache.layers[1].keys.shape[-2]


def test_model_tree_masks_apply_the_window_per_layer_type():
    from specfit_hf.generation.tree_mask import model_tree_masks

    parents = torch.tensor([-1, 0, 1, 2, 0])  # a chain of depth 3 plus a second child of the root
    mask = tree_attention_mask(parents, prefix_len=6)
    masks = model_tree_masks(_sliding_configs()["gpt_oss"], mask, 6 + block_depths(parents))
    assert set(masks) == {"full_attention", "sliding_attention"} and masks["full_attention"] is mask
    visible = masks["sliding_attention"][0, 0] == 0
    # Row 3 (depth 3, position 9) sees positions 6..9 only: prefix 6..5 -> nothing; block 0, 1, 2, 3.
    assert visible[3].nonzero().reshape(-1).tolist() == [6, 7, 8, 9]
    # Row 4 (depth 1, position 7) sees prefix positions 4, 5, the root and itself.
    assert visible[4].nonzero().reshape(-1).tolist() == [4, 5, 6, 10]
    # sliding layers that dropped their first 2 positions get a mask without those columns
    cut = model_tree_masks(_sliding_configs()["gpt_oss"], mask, 6 + block_depths(parents), sliding_offset=2)
    assert torch.equal(cut["sliding_attention"], masks["sliding_attention"][..., 2:])
    assert cut["full_attention"] is mask
    single = model_tree_masks(_sliding_configs()["mistral"], mask, 6 + block_depths(parents))
    assert torch.equal(single, masks["sliding_attention"])
    with pytest.raises(ValueError, match="queries"):
        model_tree_masks(_sliding_configs()["mistral"], mask, torch.arange(3))


@pytest.mark.parametrize("name", ["gpt_oss", "mistral"])
def test_generate_with_sliding_window_target_matches_generate(name):
    from specfit_hf.generation import SpecFitConfig

    from test_generation import noisy_copy

    target = _sliding_model(name)
    drafts = {"self": target, "noisy": noisy_copy(target, scale=0.2)}
    accepted = {k: 0 for k in drafts}
    g = torch.Generator().manual_seed(3)
    for trial in range(4):
        ids = torch.randint(0, VOCAB, (1, 6 + trial), generator=g)  # window 4 < prompt + 20 new tokens
        ref = target.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        for draft_name, draft in drafts.items():
            for tree_settings in (dict(policy="eagle3", max_depth=4, tree_top_k=3, max_verify_nodes=8),
                             dict(policy="specfit", max_depth=5, tree_top_k=3)):
                cfg = SpecFitConfig(max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                    return_dict_in_generate=True, **tree_settings)
                out = target.generate(ids, assistant_model=draft, generation_config=cfg)
                assert torch.equal(out.sequences, ref), (name, draft_name, tree_settings, trial)
                assert isinstance(out.past_key_values, SpecFitCache)
                accepted[draft_name] += sum(c.tokens_accepted for c in out.cycles)
    assert accepted["self"] >= 4 * 2 * 5  # paths past the window were accepted
    assert accepted["noisy"] > 0


def test_config_less_cache_keeps_the_window_exact():
    """A user-supplied ``SpecFitCache()`` (no config) still gives the target's own greedy tokens."""
    from specfit_hf.generation import SpecFitConfig

    target = _sliding_model("gpt_oss")
    ids = torch.tensor([[3, 9, 27, 14, 5, 60, 41]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=16, min_new_tokens=16)
    cfg = SpecFitConfig(max_new_tokens=16, min_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                        policy="eagle3", max_depth=4, tree_top_k=2, max_verify_nodes=6)
    out = target.generate(ids, assistant_model=target, generation_config=cfg, past_key_values=SpecFitCache())
    assert torch.equal(out.sequences, ref)
    assert sum(c.tokens_accepted for c in out.cycles) > 0
