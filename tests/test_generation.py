"""Tree speculative decoding through ``model.generate``: losslessness (greedy) and the generation contract."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import (
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

from specfit_hf.generation import CycleRecord, SpecFitCache, SpecFitConfig, hf_integration
from specfit_hf.testing import GEN_VOCAB as VOCAB
from specfit_hf.testing import noisy_copy, tiny_llama, tiny_qwen3_moe  # noqa: F401  (other tests import them here)

pytestmark = pytest.mark.usefixtures("one_thread")




_SHARED_MODELS: dict = {}


def shared_tiny_model(name: str):
    """One tiny random target per kind ("qwen3_moe" or "llama"), built once per test session."""
    if name not in _SHARED_MODELS:
        _SHARED_MODELS[name] = tiny_qwen3_moe(0) if name == "qwen3_moe" else tiny_llama(0)
    return _SHARED_MODELS[name]


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's many small forwards on one thread: for tiny shapes intra-op threading
    only adds overhead, and the CI box is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompts(n: int, seed: int = 0, vocab: int = VOCAB) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, int(torch.randint(1, 12, (1,), generator=g))), generator=g) for _ in range(n)]


TREE_SETTINGS = [
    dict(policy="eagle3", max_depth=1, tree_top_k=1, max_verify_nodes=1),  # one-token chain
    dict(policy="eagle3", max_depth=4, tree_top_k=3, max_verify_nodes=8),
    dict(policy="eagle3", max_depth=7, tree_top_k=10, max_verify_nodes=60),  # EAGLE-3 defaults
    dict(policy="specfit", max_depth=4, tree_top_k=3),  # throughput-optimal subtree (the default policy)
    dict(policy="specfit", max_depth=7, tree_top_k=10),
]


@pytest.fixture(scope="module")
def targets():
    return {"qwen3_moe": tiny_qwen3_moe(0), "llama": tiny_llama(0)}


@pytest.mark.parametrize("target_name", ["qwen3_moe", "llama"])
def test_greedy_matches_target_generate(targets, target_name):
    target = targets[target_name]
    drafts = {"random": tiny_llama(7, layers=1), "self": target, "noisy": noisy_copy(target)}
    accepted_nodes = {name: 0 for name in drafts}
    for i, ids in enumerate(prompts(20, seed=1)):
        ref = target.generate(ids, do_sample=False, max_new_tokens=16)
        for j, tree_settings in enumerate(TREE_SETTINGS):
            # Rotate the drafts over prompts; the target-as-draft always runs the EAGLE-3 tree.
            draft_names = {list(drafts)[(i + j) % 3]}
            if tree_settings["max_depth"] == 7:
                draft_names.add("self")
            for draft_name in sorted(draft_names):
                cfg = SpecFitConfig(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, **tree_settings)
                out = target.generate(ids, assistant_model=drafts[draft_name], generation_config=cfg)
                assert torch.equal(out.sequences, ref), (target_name, draft_name, tree_settings, i)
                accepted_nodes[draft_name] += sum(c.tokens_accepted for c in out.cycles)
    # The self draft proposes the target's own greedy tokens: long paths get accepted.
    assert accepted_nodes["self"] > 5 * 20
    assert accepted_nodes["noisy"] > 0


def test_self_draft_accepts_full_depth(targets):
    target = targets["llama"]
    ids = prompts(1, seed=3)[0]
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=25, do_sample=False, max_depth=4, tree_top_k=1, max_verify_nodes=4,
                        return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=target, generation_config=cfg)
    # A chain drafted by the target itself is always accepted: depth + bonus per cycle.
    assert [c.tokens_committed for c in out.cycles[:-1]] == [5] * (len(out.cycles) - 1)
    assert out.sequences.shape[1] == ids.shape[1] + 25


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_exact_max_new_tokens(targets, max_new):
    target = targets["qwen3_moe"]
    for ids in prompts(3, seed=max_new):
        cfg = SpecFitConfig(policy="eagle3", max_new_tokens=max_new, do_sample=False, max_depth=5, tree_top_k=2, max_verify_nodes=10)
        out = target.generate(ids, assistant_model=target, generation_config=cfg)
        assert out.shape[1] == ids.shape[1] + max_new
        assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=max_new))


def test_eos_inside_tree_stops_like_generate(targets):
    target = targets["llama"]
    ids = prompts(1, seed=5)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    new = ref[0, ids.shape[1]:].tolist()
    eos = new[6]  # a token the target emits mid-way: it lands inside an accepted tree path
    expected = target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    expected = expected[:, : ids.shape[1] + new.index(eos) + 1]
    for eos_arg in (eos, [VOCAB - 1, eos]):
        cfg = SpecFitConfig(policy="eagle3", max_new_tokens=20, do_sample=False, eos_token_id=eos_arg, pad_token_id=0,
                            max_depth=7, tree_top_k=2, max_verify_nodes=14, return_dict_in_generate=True)
        out = target.generate(ids, assistant_model=target, generation_config=cfg)
        assert torch.equal(out.sequences, expected)
        assert out.sequences[0, -1].item() == eos
        # The cache holds everything but the last token, as after stock generation.
        assert out.past_key_values.get_seq_length() == out.sequences.shape[1] - 1


class _StopAfterToken(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_inside_tree(targets):
    target = targets["llama"]
    ids = prompts(1, seed=6)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=20)
    stop_tok = ref[0, ids.shape[1] + 4].item()
    criteria = StoppingCriteriaList([_StopAfterToken(stop_tok)])
    expected = target.generate(ids, do_sample=False, max_new_tokens=20, stopping_criteria=criteria)
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=20, do_sample=False, max_depth=6, tree_top_k=2, max_verify_nodes=12)
    out = target.generate(ids, assistant_model=target, generation_config=cfg, stopping_criteria=criteria)
    assert torch.equal(out, expected)


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_tokens_as_committed(targets):
    target = targets["qwen3_moe"]
    ids = prompts(1, seed=8)[0]
    streamer = _Collect()
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=15, do_sample=False, max_depth=4, tree_top_k=2, max_verify_nodes=8,
                        return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=target, generation_config=cfg, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()  # generate() streams the prompt first
    flat = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert flat == out.sequences[0, ids.shape[1]:].tolist()
    # prefill token, then one chunk per cycle with that cycle's committed tokens
    assert [len(c) for c in streamer.chunks[2:]] == [c.tokens_committed for c in out.cycles]


def test_cycle_records(targets):
    target = targets["qwen3_moe"]
    ids = prompts(1, seed=9)[0]
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=12, do_sample=False, max_depth=3, tree_top_k=2, max_verify_nodes=5,
                        return_dict_in_generate=True, output_scores=True)
    out = target.generate(ids, assistant_model=tiny_llama(3, layers=1), generation_config=cfg)
    assert all(isinstance(c, CycleRecord) for c in out.cycles)
    assert 1 + sum(c.tokens_committed for c in out.cycles) == 12
    for c in out.cycles:
        assert c.nodes_verified <= 5 and c.nodes_drafted >= c.nodes_verified
        assert c.tokens_accepted + 1 >= c.tokens_committed >= 1
        assert c.cycle_seconds >= c.draft_seconds + c.verify_seconds > 0
        assert c.experts_loaded is None  # no offload runtime attached
        assert c.kind == "eagle3"  # a policy without kinds of its own names its drafting cycles after itself
    assert len(out.scores) == 12
    assert isinstance(out.past_key_values, SpecFitCache)


def test_policy_learning_time_is_counted_in_the_next_cycle(targets, monkeypatch):
    # observe() runs after a cycle is recorded; its host time must land in a cycle (the next one)
    # and be reported as policy time, else the policy's share of a cycle is understated
    from specfit_hf.clock import advance, simulated
    from specfit_hf.selection.policy import Eagle3Policy

    learn = 0.003  # seconds each observe() takes (on the simulated clock)
    original = Eagle3Policy.observe

    def slow_observe(self, *args):
        original(self, *args)
        advance(learn)

    monkeypatch.setattr(Eagle3Policy, "observe", slow_observe)
    target = targets["llama"]
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=10, do_sample=False, max_depth=2, tree_top_k=1,
                        max_verify_nodes=2, return_dict_in_generate=True)
    with simulated():
        out = target.generate(prompts(1, seed=11)[0], assistant_model=tiny_llama(5, layers=1), generation_config=cfg)
    cycles = out.cycles
    assert len(cycles) >= 3
    assert cycles[0].observe_seconds == 0.0  # nothing learnt before the first cycle
    for c in cycles[1:]:
        assert c.observe_seconds == pytest.approx(learn)
        assert c.policy_seconds == pytest.approx(c.select_seconds + learn)
        assert c.cycle_seconds == pytest.approx(learn)  # the only time that passed in it (host time frozen)


def test_autoregressive_policy_skips_drafting(targets):
    target = targets["llama"]
    ids = prompts(1, seed=10)[0]
    cfg = SpecFitConfig(max_new_tokens=8, do_sample=False, policy="autoregressive", return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=tiny_llama(4, layers=1), generation_config=cfg)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=8))
    assert all(c.nodes_drafted == 0 and c.tokens_committed == 1 and c.kind == "plain" for c in out.cycles)


def test_specfit_cycle_records_name_the_gates_kind(targets, monkeypatch):
    # CycleRecord.kind is what the drafting gate chose for the cycle (or the lookup chain that replaced it),
    # so a cycle's time can be traced to the choice
    from specfit_hf.offload import offload_experts
    from specfit_hf.selection.gate import DraftingGate

    chosen = []
    original = DraftingGate.choose

    def choose(self):
        chosen.append(original(self))
        return chosen[-1]

    monkeypatch.setattr(DraftingGate, "choose", choose)
    target = targets["qwen3_moe"]
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    try:
        cfg = SpecFitConfig(policy="specfit", max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
        out = target.generate(prompts(1, seed=12)[0], assistant_model=tiny_llama(6, layers=1), generation_config=cfg)
    finally:
        runtime.detach()
    kinds = [c.kind for c in out.cycles]
    assert len(kinds) == len(chosen) and len(set(kinds)) >= 2
    for kind, choice, c in zip(kinds, chosen, out.cycles):
        assert kind in (choice, "lookup") and (kind == "plain") == (c.nodes_drafted == 0)


def test_batch_size_above_one_is_rejected(targets):
    target = targets["llama"]
    ids = torch.randint(0, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(ids, assistant_model=target, generation_config=SpecFitConfig(policy="eagle3", max_new_tokens=4))


def test_unknown_policy_is_rejected(targets):
    target = targets["llama"]
    with pytest.raises(ValueError, match="unknown selection policy"):
        target.generate(prompts(1)[0], assistant_model=target,
                        generation_config=SpecFitConfig(max_new_tokens=4, policy="no-such-policy"))


def test_stock_generation_unchanged(targets):
    """Without a SpecFitConfig, generate takes transformers' own paths with identical results."""
    target = targets["llama"]
    draft = tiny_llama(11, layers=1)
    assert hf_integration.is_installed()
    ids = prompts(1, seed=12)[0]
    with_wrapper = {
        "greedy": target.generate(ids, do_sample=False, max_new_tokens=10),
        "assisted": target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=10),
        "assisted_cfg": target.generate(ids, assistant_model=draft,
                                         generation_config=GenerationConfig(max_new_tokens=10, do_sample=False)),
    }
    torch.manual_seed(0)
    with_wrapper["sample"] = target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=10)
    hf_integration.uninstall()
    try:
        assert not hf_integration.is_installed()
        original = {
            "greedy": target.generate(ids, do_sample=False, max_new_tokens=10),
            "assisted": target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=10),
            "assisted_cfg": target.generate(ids, assistant_model=draft,
                                            generation_config=GenerationConfig(max_new_tokens=10, do_sample=False)),
        }
        torch.manual_seed(0)
        original["sample"] = target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=10)
    finally:
        hf_integration.install()
    for key in original:
        assert torch.equal(with_wrapper[key], original[key]), key
    # The wrapper is a pure delegation for non-SpecFit configs: a mismatched-vocab draft
    # is still rejected by transformers' own validation.
    other_vocab = tiny_llama(13, layers=1, vocab=VOCAB + 8)
    with pytest.raises(ValueError, match="different tokenizers"):
        target.generate(ids, assistant_model=other_vocab, do_sample=False, max_new_tokens=4)
    assert "specfit_hf" in GenerationMixin._assisted_decoding.__module__


def test_padded_draft_vocab_is_accepted_for_specfit(targets):
    target = targets["llama"]
    draft = tiny_llama(14, layers=1, vocab=VOCAB + 8)  # e.g. a padded embedding matrix
    ids = prompts(1, seed=14)[0]
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=10, do_sample=False, max_depth=3, tree_top_k=4, max_verify_nodes=10)
    out = target.generate(ids, assistant_model=draft, generation_config=cfg)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))


def test_smaller_draft_vocab_is_a_clear_error(targets):
    """A generic draft with fewer tokens than the target: ValueError before drafting, not an IndexError in torch."""
    target = targets["llama"]
    draft = tiny_llama(15, layers=1, vocab=VOCAB // 2)
    ids = torch.tensor([[VOCAB - 1, 3, 5]])  # a token the draft cannot embed
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=4, do_sample=False, max_depth=2, tree_top_k=2, max_verify_nodes=4)
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(32 tokens\) is smaller than the target's \(64\)"):
        target.generate(ids, assistant_model=draft, generation_config=cfg)


def test_config_defaults_and_round_trip(tmp_path):
    cfg = SpecFitConfig()
    assert (cfg.max_verify_nodes, cfg.max_depth, cfg.tree_top_k, cfg.policy) == (60, 7, 10, "specfit")
    cfg = SpecFitConfig(max_depth=5, tree_top_k=4, max_verify_nodes=32, policy="specfit",
                        policy_kwargs={"explore_every": 5}, max_new_tokens=7, do_sample=True, top_k=20)
    d = cfg.to_dict()
    assert d["max_depth"] == 5 and d["tree_top_k"] == 4 and d["top_k"] == 20 and d["policy_kwargs"] == {"explore_every": 5}
    assert SpecFitConfig.from_dict(d) == cfg
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["max_verify_nodes"] == 32 and saved["policy"] == "specfit"
    loaded = SpecFitConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, SpecFitConfig) and loaded.tree_settings() == cfg.tree_settings()
    assert loaded.max_new_tokens == 7 and loaded.top_k == 20
    with pytest.raises(ValueError):
        SpecFitConfig(policy="eagle3", max_depth=0)


def _has_offload_runtime() -> bool:
    try:
        from specfit_hf.offload import offload_experts  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not _has_offload_runtime(), reason="specfit_hf.offload.offload_experts not available yet")
def test_greedy_with_offloaded_experts():
    from specfit_hf.offload import get_runtime, offload_experts

    target = tiny_qwen3_moe(0)
    refs = [(ids, target.generate(ids, do_sample=False, max_new_tokens=12)) for ids in prompts(5, seed=15)]
    runtime = offload_experts(target, device="cpu", slots_per_layer=3)
    accepted = 0
    try:
        for ids, ref in refs:  # references from the model before offloading
            cfg = SpecFitConfig(policy="eagle3", max_new_tokens=12, do_sample=False, max_depth=4, tree_top_k=3, max_verify_nodes=10,
                                return_dict_in_generate=True)
            out = target.generate(ids, assistant_model=noisy_copy(tiny_qwen3_moe(0)), generation_config=cfg)
            assert torch.equal(out.sequences, ref)
            loaded = [c.experts_loaded for c in out.cycles]
            assert all(x is not None and x >= 0 for x in loaded)
            assert sum(loaded) > 0
            for c in out.cycles:  # per verified row: the root first, then the nodes in block order
                assert len(c.row_experts) == len(c.row_loads) == c.nodes_verified + 1
                assert sum(c.row_loads) == c.experts_loaded and c.row_loads[0] == c.root_experts_loaded
                assert c.row_experts[0] == len(runtime.moe_layers) * runtime.top_k
                assert all(0 <= load <= new for load, new in zip(c.row_loads, c.row_experts))
            accepted += sum(c.tokens_accepted for c in out.cycles)
        assert accepted > 0
    finally:
        get_runtime(target).detach()
        del runtime


@given(seed=st.integers(0, 10_000), max_new=st.integers(1, 18), eos_at=st.integers(0, 17),
       tree=st.sampled_from(TREE_SETTINGS[1:]))
@settings(derandomize=True, max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_eos_and_max_new_tokens(targets, seed, max_new, eos_at, tree):
    """For any prompt, length budget and eos token (taken from the target's own output so that
    it falls inside accepted tree paths), tree decoding returns exactly what generate returns."""
    target = targets["qwen3_moe"]
    ids = prompts(1, seed=seed)[0]
    free = target.generate(ids, do_sample=False, max_new_tokens=18)
    eos = int(free[0, ids.shape[1] + eos_at])
    expected = target.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    cfg = SpecFitConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0, **tree)
    out = target.generate(ids, assistant_model=target, generation_config=cfg)
    assert torch.equal(out, expected)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == max_new or new[-1] == eos


def test_prompt_with_pad_tokens_matches_generate(targets):
    """generate masks prompt tokens equal to pad_token_id; the tree loop must do the same."""
    target = targets["llama"]
    ids = torch.tensor([[5, 5, 9, 3, 5, 17, 2]])  # pad 5 appears on the left and inside
    expected = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=5)
    unmasked = target.generate(ids, do_sample=False, max_new_tokens=12, attention_mask=torch.ones_like(ids))
    assert not torch.equal(expected, unmasked)  # the padding really changes the output
    cfg = SpecFitConfig(policy="eagle3", max_new_tokens=12, do_sample=False, pad_token_id=5, max_depth=4, tree_top_k=3,
                        max_verify_nodes=9)
    out = target.generate(ids, assistant_model=target, generation_config=cfg)
    assert torch.equal(out, expected)


def test_oracle_policy_gets_a_probe(targets):
    """The loop hands the oracle policy a probe of the whole tree; output stays lossless and the
    oracle's selection (nodes it knows the target accepts) commits more than one token per cycle."""
    target = targets["qwen3_moe"]
    ids = prompts(1, seed=16)[0]
    cfg = SpecFitConfig(max_new_tokens=14, do_sample=False, policy="oracle", max_depth=3, tree_top_k=3,
                        max_verify_nodes=12, return_dict_in_generate=True)
    out = target.generate(ids, assistant_model=noisy_copy(target), generation_config=cfg)
    assert torch.equal(out.sequences, target.generate(ids, do_sample=False, max_new_tokens=14))
    # Every node the oracle verifies is one the target accepts: verified == accepted.
    assert all(c.nodes_verified == c.tokens_accepted for c in out.cycles)
    assert sum(c.tokens_accepted for c in out.cycles) > 0
