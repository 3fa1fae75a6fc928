"""Offloaded-expert runtime: exactness per architecture, cache accounting, API, errors.

Tiny random models (2-3 layers, hidden 32, 16 experts, fp32, CPU).  The reference is the
same model before offloading; ``detach`` must give it back unchanged.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PhimoeConfig, Qwen3Config, Qwen3MoeConfig

from specfit_hf.offload import (
    SUPPORTED_MODEL_TYPES,
    EmulatedLink,
    ExpertCache,
    TransferStats,
    get_runtime,
    offload_experts,
)
from specfit_hf.offload.pinning import PAGE_SIZE, pinned_bytes, pinning_plan
from specfit_hf.testing import MOE_ARCHS, MOE_EXPERTS, MOE_TOP_K, MOE_VOCAB, build_moe, moe_config
from specfit_hf.testing import MOE_COMMON_KWARGS as _COMMON  # noqa: N811

warnings.filterwarnings("ignore", message=".*eos_token_id.*")

# The builders live in specfit_hf.testing (one home for the tiny models); the names stay.
NUM_EXPERTS = MOE_EXPERTS
TOP_K = MOE_TOP_K
VOCAB = MOE_VOCAB
make_config = moe_config
build_model = build_moe
ARCHS = MOE_ARCHS
PROMPT = torch.tensor([[5, 17, 33, 2, 71, 9, 40, 12, 88, 3]])
NEW_TOKENS = 32


def _greedy(model):
    out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.fixture(scope="module")
def reference():
    """Per architecture: (model, prefill logits, greedy sequences, greedy logits), built once."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = build_model(arch)
            with torch.no_grad():
                logits = model(PROMPT).logits
            cache[arch] = (model, logits, *_greedy(model))
        return cache[arch]

    return get


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["top_k", "quarter", "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_logits_equal_original(reference, arch, slots, policy):
    model, ref_logits, ref_seq, ref_gen_logits = reference(arch)
    num_slots = {"top_k": TOP_K, "quarter": NUM_EXPERTS // 4, "all": NUM_EXPERTS}[slots]
    runtime = offload_experts(model, device="cpu", slots_per_layer=num_slots, policy=policy)
    try:
        assert get_runtime(model) is runtime
        with torch.no_grad():
            logits = model(PROMPT).logits
        assert (logits - ref_logits).abs().max().item() <= 1e-5
        seq, gen_logits = _greedy(model)
        assert torch.equal(seq, ref_seq)
        assert (gen_logits - ref_gen_logits).abs().max().item() <= 1e-5

        total = runtime.stats.total
        # every MoE layer looked up at least top_k experts per forward (prefill x2 + 31 decode steps)
        assert total.hits + total.misses >= TOP_K * len(runtime.moe_layers) * (2 + NEW_TOKENS - 1)
        assert total.bytes_h2d == total.misses * runtime.expert_bytes
        if slots == "top_k":
            # a 10-token prefill routes to more than 2 distinct experts: the waves path ran
            assert total.multi_wave_forwards > 0
        if slots == "all":
            # everything fits: each expert is loaded at most once per layer
            assert total.misses <= NUM_EXPERTS * len(runtime.moe_layers)
            assert total.multi_wave_forwards == 0
    finally:
        runtime.detach()
    assert get_runtime(model) is None
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, ref_logits)


def test_moe_layers_and_shapes():
    model = build_model("deepseek_v3")
    runtime = offload_experts(model, device="cpu", slots_per_layer=4)
    try:
        assert runtime.moe_layers == [1, 2]  # first_k_dense_replace=1: layer 0 is dense
        assert runtime.num_experts == NUM_EXPERTS and runtime.top_k == TOP_K
        experts = model.model.layers[1].mlp.experts
        assert experts.gate_up_proj.shape[0] == 4  # the module now holds the slots
        # gate_up [2*24, 32] + down [32, 24] fp32
        assert runtime.expert_bytes == (2 * 24 * 32 + 32 * 24) * 4
        # shared experts and the dense layer's MLP are untouched
        assert model.model.layers[0].mlp.gate_proj.weight.shape == (48, 32)
        with pytest.raises(ValueError, match="no routed experts"):
            runtime.cached_experts(0)
    finally:
        runtime.detach()
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == NUM_EXPERTS


def test_resident_masks_read_every_layers_cache_through_frozen_forwards():
    """The layers' expert -> slot maps are rows of one table: the one-comparison residency read matches each
    layer's own cache after loads, after a frozen (oracle) forward restores them, and after a flush."""
    model = build_model("qwen3_moe")
    runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS // 2)

    def per_layer():
        return np.stack([np.isin(np.arange(NUM_EXPERTS), sorted(runtime.cached_experts(i)))
                         for i in runtime.moe_layers])

    try:
        assert runtime._slot_table is not None
        with torch.no_grad():
            model(PROMPT)
            before = runtime.resident_masks()
            assert before.any() and np.array_equal(before, per_layer())
            with runtime.frozen():
                model(torch.tensor([[60, 61, 62, 63, 1, 2, 3]]))
                assert not np.array_equal(runtime.resident_masks(), before)
            assert np.array_equal(runtime.resident_masks(), before)
            assert np.array_equal(per_layer(), before)
            model(PROMPT[:, :3])
            assert np.array_equal(runtime.resident_masks(), per_layer())
        runtime.flush()
        assert not runtime.resident_masks().any()
    finally:
        runtime.detach()
    with pytest.raises(ValueError, match="int64 array of shape"):
        ExpertCache(8, 4, slot_of=np.zeros(7, dtype=np.int64))


@pytest.mark.parametrize("arch", ARCHS)
def test_route_matches_the_models_routing(arch):
    """route(layer, router input) reproduces the model's own top-k (biased / grouped routers too)."""
    model = build_model(arch, seed=1)
    runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS // 2)
    try:
        seen = {}
        handles = []
        for idx in runtime.moe_layers:
            block = model.model.layers[idx].mlp
            router = block.router if arch == "gpt_oss" else block.gate
            handles.append(router.register_forward_pre_hook(
                lambda mod, args, idx=idx: seen.__setitem__(idx, args[0].reshape(-1, args[0].shape[-1]).clone())))
        with torch.no_grad():
            model(PROMPT)
        for h in handles:
            h.remove()
        for idx in runtime.moe_layers:
            routed = runtime.last_routing(idx)
            assert routed.shape == (PROMPT.shape[1], TOP_K)
            predicted = runtime.route(idx, seen[idx])
            assert predicted.dtype == torch.long
            assert torch.equal(predicted.sort(-1).values, routed.sort(-1).values)
    finally:
        runtime.detach()


def _router_topk_recorder(model, runtime, arch):
    """Independent record of each MoE layer's top-k per forward, from the router modules."""
    log: dict[int, list[set[int]]] = {idx: [] for idx in runtime.moe_layers}
    handles = []
    for idx in runtime.moe_layers:
        block = model.model.layers[idx].mlp
        router = block.router if arch == "gpt_oss" else block.gate
        handles.append(router.register_forward_hook(
            lambda mod, args, out, idx=idx: log[idx].append(set(out[2].flatten().tolist()))))
    return log, handles


def _simulate_lru(forwards: list[set[int]], num_slots: int) -> tuple[int, int, set[int]]:
    """Reference LRU over expert sets: (hits, misses, final resident set)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = misses = 0
    for needed in forwards:
        assert len(needed) <= num_slots
        for expert in sorted(needed):  # ascending id = the runtime's tie-break
            if expert in cache:
                hits += 1
                cache.move_to_end(expert)
            else:
                misses += 1
                if len(cache) >= num_slots:
                    victim = next(e for e in cache if e not in needed)
                    del cache[victim]
                cache[expert] = None
    return hits, misses, set(cache)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_lru_miss_counts_match_simulation(arch):
    model = build_model(arch, seed=2)
    num_slots = NUM_EXPERTS // 4
    runtime = offload_experts(model, device="cpu", slots_per_layer=num_slots, policy="lru")
    log, handles = _router_topk_recorder(model, runtime, arch)
    try:
        # scripted: 2-token prefill (<= 4 distinct experts), 24 greedy decode steps, a flush,
        # then 8 more steps from a new prompt
        model.generate(PROMPT[:, :2], max_new_tokens=24, min_new_tokens=24, do_sample=False)
        before_flush = {idx: list(log[idx]) for idx in runtime.moe_layers}
        runtime.flush()
        assert all(runtime.cached_experts(idx) == set() for idx in runtime.moe_layers)
        model.generate(PROMPT[:, 4:6], max_new_tokens=8, min_new_tokens=8, do_sample=False)
        stats = runtime.stats
        for idx in runtime.moe_layers:
            first = before_flush[idx]
            second = log[idx][len(first):]
            h1, m1, _ = _simulate_lru(first, num_slots)
            h2, m2, resident = _simulate_lru(second, num_slots)
            assert (stats.layers[idx].hits, stats.layers[idx].misses) == (h1 + h2, m1 + m2)
            assert runtime.cached_experts(idx) == resident
            mask = runtime.resident_mask(idx)
            assert mask.dtype == torch.bool and set(mask.nonzero().flatten().tolist()) == resident
            assert stats.layers[idx].forwards == len(first) + len(second) == 24 + 8
        masks = runtime.resident_masks()  # every layer at once, in moe_layers order
        assert masks.shape == (len(runtime.moe_layers), runtime.num_experts)
        assert all((masks[i] == runtime.resident_mask(idx).numpy()).all() for i, idx in enumerate(runtime.moe_layers))
        assert stats.total.misses == sum(stats.layers[i].misses for i in runtime.moe_layers)
        assert stats.total.multi_wave_forwards == 0
    finally:
        for h in handles:
            h.remove()
        runtime.detach()


def test_first_row_misses_count_what_the_first_token_alone_needed():
    model = build_model("qwen3_moe", seed=4)
    runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS // 2, policy="lru")
    try:
        with torch.no_grad():
            model(PROMPT[:, :1])  # one row: every miss is the first row's
            assert runtime.stats.total.first_row_misses == runtime.stats.total.misses > 0
            partial = []
            for trial in range(6):
                if trial % 2:
                    runtime.flush()
                before = {idx: runtime.resident_mask(idx).clone() for idx in runtime.moe_layers}
                stats_before = runtime.stats.total.copy()
                model(PROMPT[:, 2 + trial: 6 + trial])  # four rows
                delta = runtime.stats.total - stats_before
                expected = 0
                for idx in runtime.moe_layers:
                    first = runtime.last_routing(idx)[0].unique()
                    expected += int((~before[idx][first]).sum())  # the first row's experts not resident before
                assert delta.first_row_misses == expected
                assert 0 <= delta.first_row_misses <= delta.misses
                partial.append(0 < delta.first_row_misses < delta.misses)
            assert any(partial)  # the other rows' misses are not counted
    finally:
        runtime.detach()


def test_device_unique_finds_each_experts_first_row():
    """The CUDA path's one-sync unique (run here on CPU tensors) against numpy's."""
    from specfit_hf.offload.runtime import _unique_on_device

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 2, 5, 17):
        routing = torch.randint(0, 12, (rows, 4), generator=gen)
        needed, first_row, inverse = _unique_on_device(routing)
        want, first_pair = np.unique(routing.numpy(), return_index=True)
        np.testing.assert_array_equal(needed, want)
        assert (first_row is None) == (rows == 1)
        if first_row is not None:
            np.testing.assert_array_equal(first_row, first_pair // 4)
        np.testing.assert_array_equal(needed[inverse.numpy()], routing.numpy())


def test_first_uses_count_each_rows_new_experts_and_loads():
    """Per row of a forward: the distinct experts it was the first to route to, and the loads among them
    (against the definition, on the routing and the residents before the forward)."""
    model = build_model("qwen3_moe", seed=4)
    runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS // 2, policy="lru")
    view = runtime.view()
    try:
        with torch.no_grad():
            deeper_share_more = []
            for trial in range(6):
                if trial % 3 == 0:
                    runtime.flush()
                rows = 1 + trial  # a one-row forward first, then blocks of 2..6 rows
                before = {idx: runtime.resident_mask(idx).clone() for idx in runtime.moe_layers}
                uses_before, loads_before = view.first_uses()
                misses_before = runtime.stats.total.copy()
                model(PROMPT[:, 3 + trial: 3 + trial + rows])
                uses, loads = (a - b for a, b in zip(view.first_uses(), (uses_before, loads_before)))
                want_uses, want_loads = np.zeros_like(uses), np.zeros_like(loads)
                for idx in runtime.moe_layers:
                    routing = runtime.last_routing(idx).numpy()
                    seen: set[int] = set()
                    for r, experts in enumerate(routing):
                        new = set(experts.tolist()) - seen
                        seen |= new
                        want_uses[r] += len(new)
                        want_loads[r] += sum(not bool(before[idx][e]) for e in new)
                np.testing.assert_array_equal(uses, want_uses)
                np.testing.assert_array_equal(loads, want_loads)
                delta = runtime.stats.total - misses_before
                assert loads.sum() == delta.misses and loads[0] == delta.first_row_misses
                assert uses[0] == len(runtime.moe_layers) * runtime.top_k  # a row's own experts are distinct
                assert not uses[rows:].any()
                if rows > 2:
                    deeper_share_more.append(uses[rows - 1] < uses[0])
            assert any(deeper_share_more)  # later rows share experts with earlier ones
    finally:
        runtime.detach()


def test_non_persistent_cache_misses_every_forward():
    model = build_model("qwen3_moe", seed=3)
    runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS)
    log, handles = _router_topk_recorder(model, runtime, "qwen3_moe")
    try:
        runtime.persistent = False
        model.generate(PROMPT[:, :3], max_new_tokens=6, min_new_tokens=6, do_sample=False)
        for idx in runtime.moe_layers:
            layer = runtime.stats.layers[idx]
            assert layer.hits == 0
            assert layer.misses == sum(len(s) for s in log[idx])
        runtime.persistent = True
        runtime.reset_stats()
        assert runtime.stats.total == TransferStats()
        with torch.no_grad():
            model(PROMPT[:, :1])
            before = runtime.stats.total.copy()
            model(PROMPT[:, :1])  # same token, same position: same experts, all resident now
        diff = runtime.stats.total - before
        assert diff.misses == 0 and diff.hits == TOP_K * len(runtime.moe_layers)
    finally:
        for h in handles:
            h.remove()
        runtime.detach()


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_offloaded_is_bit_identical_when_experts_fit(arch, impl):
    """bf16: every forward's experts fit in the slots -> logits bit-identical to the plain model,
    although evictions put experts in slots out of id order (the runtime sums in id order).
    ``eager`` (the experts loop) is order-sensitive; ``grouped_mm`` is the 5.23 default."""
    # top-4: with top-2 the two terms of a token's sum commute, and order would never show.
    model = build_model(arch, seed=2, top_k=4).to(torch.bfloat16)
    model.config._experts_implementation = impl
    prompt = PROMPT[:, :2]  # 2 tokens x top-4 <= 8 distinct experts: fits in 8 slots, no waves
    gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(prompt, **gen)
        ref_logits = torch.stack(ref.logits)
    runtime = offload_experts(model, device="cpu", slots_per_layer=8)
    try:
        with torch.no_grad():
            out = model.generate(prompt, **gen)
        assert runtime.stats.total.multi_wave_forwards == 0
        assert runtime.stats.total.misses > 8 * len(runtime.moe_layers)  # experts were evicted
        assert torch.equal(out.sequences, ref.sequences)
        assert torch.equal(torch.stack(out.logits), ref_logits)  # bit-identical, not just close
    finally:
        runtime.detach()


def test_waves_sum_each_wave_in_expert_order():
    """With waves, a token whose experts share one wave is still bit-identical in bf16."""
    model = build_model("qwen3_moe", seed=4, top_k=3).to(torch.bfloat16)
    model.config._experts_implementation = "eager"
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=gen).to(torch.bfloat16)
    weights = torch.rand(6, 3, generator=gen).to(torch.bfloat16)
    # 6 distinct experts, 3 slots -> 2 waves ({3, 9, 12} resident first, then {1, 5, 7}); each token in one.
    idx = torch.tensor([[12, 3, 9], [3, 9, 12], [7, 1, 5], [1, 7, 5], [12, 9, 3], [5, 7, 1]])
    with torch.no_grad():
        expected = experts(hidden, idx, weights)
    runtime = offload_experts(model, device="cpu", slots_per_layer=3)
    try:
        with torch.no_grad():
            # 9, 12, 14 fill slots 0, 1, 2; then 3 replaces 14: ids 3, 9, 12 sit in slots 2, 0, 1
            experts(hidden[:1], torch.tensor([[9, 12, 14]]), weights[:1])
            experts(hidden[:1], torch.tensor([[3, 9, 12]]), weights[:1])
            got = experts(hidden, idx, weights)
        assert runtime.stats.layers[0].multi_wave_forwards == 1
        assert torch.equal(got, expected)
    finally:
        runtime.detach()


def test_waves_leave_the_busiest_experts_resident():
    """A prefill needs more experts than fit: the ones it routed the most rows to stay for the decode."""
    model = build_model("qwen3_moe", seed=4)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    # 7 distinct experts, 3 slots; rows per expert: 13: 6, 2: 5, 11: 4, 4: 3, 8: 2, 0: 2, 6: 1.  Waves
    # by rows, the short one first: [6], [0, 8, 4], [11, 2, 13]
    pairs = [[13, 2]] * 5 + [[13, 11]] * 1 + [[11, 4]] * 3 + [[8, 0]] * 1 + [[8, 13]] * 1 + [[6, 0]] * 1
    idx = torch.tensor(pairs)
    hidden = torch.randn(len(pairs), 32, generator=gen)
    weights = torch.rand(len(pairs), 2, generator=gen)
    with torch.no_grad():
        expected = experts(hidden, idx, weights)
    runtime = offload_experts(model, device="cpu", slots_per_layer=3)
    try:
        with torch.no_grad():
            got = experts(hidden, idx, weights)
            assert runtime.stats.layers[0].multi_wave_forwards == 1
            assert (got - expected).abs().max().item() <= 1e-5
            assert runtime.cached_experts(0) == {13, 2, 11}
            # the next forward (a decode step on the busiest experts) loads nothing
            misses = runtime.stats.layers[0].misses
            experts(hidden[:1], torch.tensor([[2, 13]]), weights[:1])
            assert runtime.stats.layers[0].misses == misses
            # then LRU as usual: 11, unused since the prefill, is the victim
            experts(hidden[:1], torch.tensor([[4, 13]]), weights[:1])
            assert runtime.cached_experts(0) == {13, 2, 4}
    finally:
        runtime.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_tree_speculation_with_offload_is_greedy_identical(arch, dtype):
    """Every architecture: greedy through the draft tree with experts offloaded equals the plain
    model's own generate (fp32 and bf16), and draft tokens are accepted.  gpt-oss's window (8) is
    shorter than prompt + generated tokens (28)."""
    from specfit_hf.generation import SpecFitConfig
    from specfit_hf.testing import noisy_copy

    plain = build_model(arch, seed=3).to(dtype)
    ref = plain.generate(PROMPT, max_new_tokens=18, min_new_tokens=18, do_sample=False)
    draft = noisy_copy(plain, scale=0.1, seed=5)
    target = build_model(arch, seed=3).to(dtype)
    if dtype == torch.bfloat16:
        target.config._experts_implementation = plain.config._experts_implementation = "eager"
        ref = plain.generate(PROMPT, max_new_tokens=18, min_new_tokens=18, do_sample=False)
    runtime = offload_experts(target, device="cpu", slots_per_layer=8)
    try:
        cfg = SpecFitConfig(policy="eagle3", max_new_tokens=18, min_new_tokens=18, do_sample=False, max_depth=4,
                            tree_top_k=2, max_verify_nodes=6, return_dict_in_generate=True)
        out = target.generate(PROMPT, assistant_model=draft, generation_config=cfg)
        assert runtime.stats.total.misses > 0
    finally:
        runtime.detach()
    assert torch.equal(out.sequences, ref)
    assert sum(c.tokens_accepted for c in out.cycles) > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_experts_module_waves_and_shared_experts(arch):
    """Direct experts calls: many tokens on one expert; more distinct experts than slots."""
    model = build_model(arch, seed=4)
    runtime_probe = None
    layer_idx = 1 if arch == "deepseek_v3" else 0
    experts = model.model.layers[layer_idx].mlp.experts
    gen = torch.Generator().manual_seed(0)
    num_tokens = 40
    hidden = torch.randn(num_tokens, 32, generator=gen)
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    cases = {
        # every token on experts 5 and 9
        "shared": torch.tensor([[5, 9]]).repeat(num_tokens, 1),
        # all 16 experts used, 2 slots -> 8 waves; token t uses (t % 16, (t + 7) % 16)
        "waves": torch.stack([torch.arange(num_tokens) % 16, (torch.arange(num_tokens) + 7) % 16], 1),
        # one token alone on expert 15, others on 0/1: an odd last wave
        "lonely": torch.cat([torch.tensor([[15, 0]]), torch.tensor([[0, 1]]).repeat(num_tokens - 1, 1)]),
    }
    with torch.no_grad():
        expected = {name: experts(hidden, idx, weights) for name, idx in cases.items()}
    runtime_probe = offload_experts(model, device="cpu", slots_per_layer=TOP_K)
    try:
        for name, idx in cases.items():
            with torch.no_grad():
                got = experts(hidden, idx, weights)
            assert (got - expected[name]).abs().max().item() <= 1e-5, name
        layer = runtime_probe.stats.layers[layer_idx]
        assert layer.multi_wave_forwards == 2  # "waves" and "lonely"
        # shared: 2 misses.  waves: 16 distinct, 5 and 9 resident -> 2 hits, 14 misses; the
        # residents go first, then the missing ones by rows routed to them (15 has 4, 7 has 6,
        # the rest 5; ties by id): [5, 9], [15, 0], ..., [14, 7], so 14 and 7 stay resident.
        # lonely: {0, 1, 15} -> 3 misses; the short wave first: [15] (1 row), then [0, 1].
        assert (layer.hits, layer.misses) == (0 + 2 + 0, 2 + 14 + 3)
        assert runtime_probe.cached_experts(layer_idx) == {0, 1}
    finally:
        runtime_probe.detach()


def test_emulated_link_waits_and_counts():
    model = build_model("qwen3_moe", seed=5)
    link = EmulatedLink(gbps=0.5, latency_us=500.0)
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K, link=link)
    try:
        with torch.no_grad():
            model(PROMPT[:, :1])
        total = runtime.stats.total
        per_expert = runtime.expert_bytes / 0.5e9 + 500e-6
        assert total.misses == TOP_K * len(runtime.moe_layers)
        assert total.transfer_seconds >= total.misses * per_expert
    finally:
        runtime.detach()
    src, dst = torch.randn(1000), torch.zeros(1000)
    start = time.perf_counter()
    took = EmulatedLink(gbps=4e-3, latency_us=200.0).copy([(dst, src)], nbytes=4000)  # 1 ms + 0.2 ms
    assert time.perf_counter() - start >= 1.2e-3 and took >= 1.2e-3
    assert torch.equal(dst, src)
    with pytest.raises(ValueError):
        EmulatedLink(gbps=0)


def test_virtual_link_advances_the_clock_instead_of_waiting():
    from specfit_hf.offload import clock

    src, dst = torch.randn(1000), torch.zeros(1000)
    link = EmulatedLink(gbps=4e-5, latency_us=0.0, virtual=True)  # 4000 bytes -> 100 ms
    wall, virtual = time.perf_counter(), clock()
    took = link.copy([(dst, src)], nbytes=4000)
    wall, virtual = time.perf_counter() - wall, clock() - virtual
    assert torch.equal(dst, src)
    assert took >= 0.1 and virtual >= 0.1  # the timeline holds the whole transfer
    assert wall < 0.05  # without the machine waiting it out
    assert virtual == pytest.approx(0.1, abs=0.02)

    model = build_model("qwen3_moe", seed=5)
    link = EmulatedLink(gbps=0.005, virtual=True)  # ~0.2 ms per expert: far above the real copy
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K, link=link)
    try:
        wall, start = time.perf_counter(), clock()
        with torch.no_grad():
            model(PROMPT[:, :1])
        wall, elapsed = time.perf_counter() - wall, clock() - start
        total = runtime.stats.total
        emulated = total.misses * link.transfer_seconds(runtime.expert_bytes)
        assert total.misses == TOP_K * len(runtime.moe_layers)
        # a transfer takes its emulated time, or the real copy's if that is longer (as when waiting)
        assert emulated <= total.transfer_seconds <= 1.2 * emulated
        assert elapsed >= emulated  # the forward's measured time holds every transfer
        assert elapsed - wall >= 0.5 * emulated  # most of which was not waited out
    finally:
        runtime.detach()


def test_fused_kernel_path_on_cpu():
    """The fused-kernel wiring, exercised through the kernel package's torch backend."""
    pytest.importorskip("specfit_kernels")
    for arch in ("qwen3_moe", "gpt_oss"):
        model = build_model(arch, seed=6)
        with torch.no_grad():
            ref = model(PROMPT).logits
        runtime = offload_experts(model, device="cpu", slots_per_layer=NUM_EXPERTS // 4, use_fused_kernel=True)
        try:
            assert runtime.uses_fused_kernel
            with torch.no_grad():
                got = model(PROMPT).logits
            assert (got - ref).abs().max().item() <= 1e-5, arch
        finally:
            runtime.detach()


def test_lfu_evicts_least_used():
    cache = ExpertCache(num_experts=6, num_slots=3, policy="lfu")
    tick = 0
    for needed in ([0, 1, 2], [0, 1], [0], [1]):
        tick += 1
        cache.assign(np.array(needed), tick)
    # uses: 0 -> 3, 1 -> 3, 2 -> 1: expert 2 goes although 0 was used before 1
    _, loads, slots = cache.assign(np.array([4]), tick + 1)
    assert loads.tolist() == [4] and cache.resident() == {0, 1, 4}
    lru = ExpertCache(num_experts=6, num_slots=3, policy="lru")
    for t, needed in enumerate(([0, 1, 2], [0, 1], [0], [1]), 1):
        lru.assign(np.array(needed), t)
    lru.assign(np.array([4]), 5)
    assert lru.resident() == {0, 1, 4}
    lru.assign(np.array([5]), 6)
    assert lru.resident() == {1, 4, 5}  # 0 (tick 3) older than 1 (tick 4)


def test_assign_keeps_the_residents_it_is_told_to_and_refuses_when_none_is_left_to_evict():
    lru = ExpertCache(num_experts=6, num_slots=3, policy="lru")
    for t, needed in enumerate(([0], [1], [2]), 1):
        lru.assign(np.array(needed), t)
    lru.assign(np.array([4]), 4, keep=np.array([0, 5]))  # 0 is the oldest, but kept (5: not resident, ignored)
    assert lru.resident() == {0, 2, 4}
    with pytest.raises(ValueError, match="keeping 2 residents"):
        lru.assign(np.array([1, 3]), 5, keep=np.array([0, 2]))


# ---------------------------------------------------------------------- errors
def _untouched(model, params_before):
    assert get_runtime(model) is None
    for name, param in model.named_parameters():
        assert params_before[name] is param, name
    for module in model.modules():
        assert not hasattr(module, "_hf_hook")
        assert "forward" not in module.__dict__


def test_bad_inputs_raise_and_change_nothing():
    model = build_model("qwen3_moe", seed=7)
    params = dict(model.named_parameters())
    with torch.no_grad():
        ref = model(PROMPT).logits
    bad = [
        dict(slots_per_layer=TOP_K - 1),
        dict(slots_per_layer=2.5),
        dict(cache_fraction=0.0),
        dict(cache_fraction=1.5),
        dict(cache_fraction=-0.2),
        dict(cache_fraction=0.05),  # 1 slot < top_k
        dict(),  # neither
        dict(slots_per_layer=4, cache_fraction=0.5),  # both
        dict(slots_per_layer=4, policy="fifo"),
        dict(slots_per_layer=4, device="mps"),
    ]
    for kwargs in bad:
        kwargs.setdefault("device", "cpu")
        with pytest.raises(ValueError):
            offload_experts(model, **kwargs)
        _untouched(model, params)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            offload_experts(model, device="cuda", slots_per_layer=4)
        _untouched(model, params)
    with pytest.raises(TypeError):
        offload_experts(model, device="cpu", slots_per_layer=4, link=25.0)
    _untouched(model, params)

    runtime = offload_experts(model, device="cpu", cache_fraction=0.25)
    assert runtime.slots_per_layer == 4
    with pytest.raises(ValueError, match="already"):
        offload_experts(model, device="cpu", slots_per_layer=4)
    runtime.detach()
    with pytest.raises(RuntimeError):
        runtime.detach()
    _untouched(model, params)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, ref)


@pytest.mark.parametrize("arch, fmt", [("deepseek_v3", "native FP8"), ("gpt_oss", "MXFP4")])
def test_quantized_experts_are_refused_by_name(arch, fmt):
    """transformers' own FP8 / MXFP4 experts modules: a clear error naming the format, nothing changed."""
    if arch == "deepseek_v3":
        from transformers.integrations.finegrained_fp8 import FP8Experts as Quantized

        make = lambda cfg: Quantized(cfg, block_size=(16, 16))  # noqa: E731
    else:
        from transformers.integrations.mxfp4 import Mxfp4GptOssExperts as Quantized

        make = Quantized
    model = build_model(arch)
    layer = model.model.layers[-1].mlp
    layer.experts = make(model.config)
    before = {n: (p, p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=fmt) as err:
        offload_experts(model, device="cpu", slots_per_layer=TOP_K)
    assert ("FineGrainedFP8Config" if arch == "deepseek_v3" else "Mxfp4Config") + "(dequantize=True)" in str(err.value)
    assert get_runtime(model) is None
    after = {n: (p, p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    assert before.keys() == after.keys()
    assert all(before[n][0] is after[n][0] and before[n][1:] == after[n][1:] for n in before)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_of_offloaded_model_saves_full_experts(arch, tmp_path):
    """save_pretrained on an offloaded model writes the full experts: the checkpoint reloads and equals the original."""
    model = build_model(arch)
    with torch.no_grad():
        expected = model(PROMPT).logits
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K)
    try:
        with torch.no_grad():
            model(PROMPT)  # fill the slots with something
        state = model.state_dict()
        assert all(t.shape[0] == NUM_EXPERTS for n, t in state.items() if n.endswith(("gate_up_proj", "down_proj")))
        model.save_pretrained(tmp_path)
    finally:
        runtime.detach()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT).logits, expected)


def test_quantization_config_is_refused():
    model = build_model("qwen3_moe")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="bitsandbytes"):
        offload_experts(model, device="cpu", slots_per_layer=TOP_K)


def test_failure_midway_is_rolled_back(monkeypatch):
    import specfit_hf.offload.runtime as runtime_module

    model = build_model("qwen2_moe", seed=8)
    params = dict(model.named_parameters())
    with torch.no_grad():
        ref = model(PROMPT).logits
    real_add_hook = runtime_module.add_hook_to_module
    calls = []

    def failing_add_hook(module, hook):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("simulated failure on the second layer")
        return real_add_hook(module, hook)

    monkeypatch.setattr(runtime_module, "add_hook_to_module", failing_add_hook)
    with pytest.raises(RuntimeError, match="simulated"):
        offload_experts(model, device="cpu", slots_per_layer=4)
    _untouched(model, params)
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, ref)


def test_unsupported_models_name_the_supported_types():
    dense = AutoModelForCausalLM.from_config(Qwen3Config(**_COMMON, head_dim=8))
    with pytest.raises(ValueError) as err:
        offload_experts(dense, device="cpu", slots_per_layer=4)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(err.value)
    other_moe = AutoModelForCausalLM.from_config(
        PhimoeConfig(**{**_COMMON, "num_hidden_layers": 1}, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="qwen3_moe"):
        offload_experts(other_moe, device="cpu", slots_per_layer=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [False, None])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_cuda_copy_stream_path(arch, fused):
    """On CUDA: pinned host experts, copy stream, (optionally) the fused kernel; same logits."""
    model = build_model(arch, seed=9).to("cuda")
    prompt = PROMPT.to("cuda")
    with torch.no_grad():
        ref = model(prompt).logits
    ref_seq, _ = _greedy_on(model, prompt)
    runtime = offload_experts(model.to("cpu"), device="cuda", slots_per_layer=TOP_K, use_fused_kernel=fused)
    try:
        host = runtime._layers[runtime.moe_layers[0]].host["gate_up_proj"]
        assert host.device.type == "cpu" and host.is_pinned()
        # page-locked in place / exact size: never the power-of-two rounding of pin_memory()
        sizes = [t.numel() * t.element_size() for layer in runtime._layers.values() for t in layer.host.values()]
        assert sum(sizes) <= runtime.pinned_bytes <= pinned_bytes(sizes, "register", offset=PAGE_SIZE - 1)
        with torch.no_grad():
            got = model(prompt).logits
        # the Triton kernel may use TF32 / other accumulation orders
        tol = 1e-5 if not runtime.uses_fused_kernel else 2e-3
        assert (got - ref).abs().max().item() <= tol
        seq, _ = _greedy_on(model, prompt)
        assert torch.equal(seq, ref_seq)
        stats = runtime.stats.total
        assert stats.misses > 0 and stats.transfer_seconds > 0 and stats.multi_wave_forwards > 0
    finally:
        runtime.detach()
    assert model.model.embed_tokens.weight.device.type == "cpu"


def test_pinned_bytes_are_page_rounded_not_power_of_two():
    assert pinned_bytes([4096], "register", page=4096, offset=0) == 4096
    assert pinned_bytes([4096], "register", page=4096, offset=64) == 8192  # spans two pages
    assert pinned_bytes([5000, 1], "register", page=4096, offset=0) == 8192 + 4096
    assert pinned_bytes([5000, 1], "pin_memory") == 8192 + 1
    with pytest.raises(ValueError, match="method"):
        pinned_bytes([1], "mmap")


def test_pinning_plan_of_qwen3_30b_a3b_fits_its_expert_bytes():
    """The real Qwen3-30B-A3B shapes (meta device, no memory): ~1.0 bytes pinned per expert byte, was ~1.27."""
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    plan = pinning_plan(model)
    assert plan.expert_bytes == 48 * 128 * 3 * 2048 * 768 * 2  # 57.98 GB
    assert 1.0 <= plan.pinned_per_expert_byte < 1.0001
    assert plan.pin_memory_bytes == 48 * (2**30 + 2**29)  # 1 GiB + 512 MiB per layer: 77.3 GB
    assert plan.pin_memory_per_expert_byte == pytest.approx(4 / 3)  # the 77 GB for 58 GB


class _FakeCudart:
    """Stands in for torch.cuda.cudart() on a CPU host: records cudaHostRegister calls."""

    def __init__(self, refuse=()):
        self.registered, self.unregistered, self.refuse = {}, [], set(refuse)

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802
        if ptr in self.refuse:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_host_pinner_registers_in_place_and_copies_only_views(monkeypatch):
    """HostPinner's logic on a CPU host (the CUDA driver faked): an expert tensor that owns its
    pages is registered in place (same storage, no copy); a view into a shared storage is copied
    once into an exact-size tensor; a refused range falls back to one copy; unregister_all undoes."""
    from specfit_hf.offload import pinning

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(pinning, "_clear_last_cuda_error", lambda: None)
    pinner = pinning.HostPinner()
    own = torch.randn(64, 1024, 8)  # 2 MiB, its own allocation
    assert pinner.pin(own) is own and fake.registered == {own.data_ptr(): own.numel() * 4}
    shared = torch.randn(2, 64, 1024, 8)
    view = shared[1]  # a view: registering it would lock pages of shared[0] too
    pinned = pinner.pin(view)
    assert pinned is not view and torch.equal(pinned, view) and pinned.untyped_storage().nbytes() == view.numel() * 4
    assert pinner.copies == 1 and pinned.data_ptr() in fake.registered
    nbytes = own.numel() * 4 + view.numel() * 4
    assert nbytes <= pinner.pinned_bytes <= nbytes + 2 * pinning.PAGE_SIZE  # whole pages, never a power of two
    refused = torch.randn(64, 1024, 8)
    fake.refuse.add(refused.data_ptr())
    assert torch.equal(pinner.pin(refused), refused) and pinner.copies == 2
    pinner.unregister_all()
    assert sorted(fake.unregistered) == sorted(fake.registered) and pinner.pinned_bytes == 0
    with pytest.raises(ValueError, match="CPU tensor"):
        pinner.pin(torch.zeros(1, device="meta"))


def _greedy_on(model, prompt):
    out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_frozen_forward_leaves_cache_and_stats_untouched():
    """runtime.frozen(): exact forward, then cache state, slot contents and counters as before."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=16, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        ref = model(x).logits
        runtime = offload_experts(model, device="cpu", slots_per_layer=4)
        model(x[:, :3])
        before = {i: runtime.cached_experts(i) for i in runtime.moe_layers}
        slots_before = {i: runtime._layers[i].slots["gate_up_proj"].clone() for i in runtime.moe_layers}
        stats_before = runtime.stats.total.copy()
        with runtime.frozen():
            out = model(x).logits  # 12 tokens route to more experts than 4 slots: loads happen inside
            assert runtime.stats.total.misses > stats_before.misses
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        assert {i: runtime.cached_experts(i) for i in runtime.moe_layers} == before
        for i in runtime.moe_layers:
            assert torch.equal(runtime._layers[i].slots["gate_up_proj"], slots_before[i])
        assert runtime.stats.total == stats_before
        # and the cache still works exactly afterwards
        torch.testing.assert_close(model(x).logits, ref, atol=1e-5, rtol=0)
    runtime.detach()


# ---------------------------------------------------------------------- prefetch
def _routed(runtime) -> np.ndarray:
    """``[P, 2]`` (layer position, expert) pairs the last forward routed to, layer by layer."""
    pairs = []
    for position, layer in enumerate(runtime.moe_layers):
        for e in np.unique(runtime.last_routing(layer).numpy()).tolist():
            pairs.append((position, e))
    return np.array(pairs, dtype=np.int64)


@contextmanager
def _behind_a_link():
    """A tiny Qwen3-MoE with one token's worth of slots per layer behind a 1 GB/s virtual link, host time frozen:
    yields (model, runtime, seconds per expert copy, the experts its one-token forward of ``PROMPT[:, :1]``
    routes to), the cache flushed and the counters zero."""
    from specfit_hf.clock import simulated

    model = build_model("qwen3_moe", seed=5)
    link = EmulatedLink(gbps=1.0, virtual=True)
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K, link=link)
    try:
        with torch.no_grad(), simulated():
            model(PROMPT[:, :1])
            needed = _routed(runtime)
            runtime.flush()
            runtime.reset_stats()
            yield model, runtime, link.transfer_seconds(runtime.expert_bytes), needed
    finally:
        runtime.detach()


def test_prefetch_overlaps_other_work_and_forwards_wait_for_what_is_still_on_the_link():
    """On the emulated link's clock (host time frozen): experts prefetched before 5 ms of other work arrive
    during it, the forward that needs them loads nothing and waits only for the rest; its output is exact."""
    from specfit_hf.clock import advance, clock

    x = PROMPT[:, :1]
    with torch.no_grad():
        ref = build_model("qwen3_moe", seed=5)(x).logits
    with _behind_a_link() as (model, runtime, each, needed):
        assert len(needed) == TOP_K * len(runtime.moe_layers)
        # without prefetch: 5 ms of other work, then every expert loaded on the forward's path
        runtime.flush()
        start = clock()
        advance(5e-3)
        model(x)
        assert clock() - start == pytest.approx(5e-3 + len(needed) * each)
        # with it: the copies run during the 5 ms
        runtime.flush()
        runtime.reset_stats()
        start = clock()
        assert runtime.prefetch(needed) == len(needed)
        assert runtime.prefetch(needed) == 0  # resident already (in flight): nothing more to copy
        advance(5e-3)
        out = model(x).logits
        took = clock() - start
        total = runtime.stats.total
        assert total.misses == 0 and total.prefetches == len(needed) == total.prefetches_used
        assert total.bytes_h2d == len(needed) * runtime.expert_bytes
        assert took == pytest.approx(max(5e-3, len(needed) * each))
        assert total.wait_seconds == pytest.approx(max(0.0, len(needed) * each - 5e-3))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_loads_queue_behind_prefetches_and_evicted_prefetches_are_not_waited_for():
    """One copy engine: a forward's own loads wait for the prefetches still on the link, and a prefetched
    expert evicted unused is neither counted as used nor waited for again."""
    from specfit_hf.clock import clock

    with _behind_a_link() as (model, runtime, each, needed):
        wrong = np.array([(p, next(e for e in range(NUM_EXPERTS) if e not in needed[needed[:, 0] == p, 1]))
                          for p in range(len(runtime.moe_layers))])
        start = clock()
        assert runtime.prefetch(wrong) == len(wrong)
        model(PROMPT[:, :1])  # TOP_K slots: each layer's load evicts the wrong expert, after it crossed the link
        total = runtime.stats.total
        assert total.misses == len(needed) and total.prefetches_used == 0
        assert clock() - start == pytest.approx((len(wrong) + len(needed)) * each)
        assert runtime.prefetch(needed) == 0  # all resident


def test_prefetch_checks_its_pairs_and_frozen_forwards_do_not_wait():
    from specfit_hf.clock import clock, simulated

    model = build_model("qwen3_moe", seed=5)
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K, link=EmulatedLink(gbps=1.0, virtual=True))
    try:
        with pytest.raises(ValueError, match="layer positions"):
            runtime.prefetch(np.array([[len(runtime.moe_layers), 0]]))
        with pytest.raises(ValueError, match="expert ids"):
            runtime.prefetch(np.array([[0, NUM_EXPERTS]]))
        assert runtime.prefetch(np.empty((0, 2), dtype=np.int64)) == 0
        # more experts than slots for one layer: the first slot-count of them, in the given order
        assert runtime.prefetch(np.array([[0, e] for e in range(NUM_EXPERTS)])) == TOP_K
        assert runtime.cached_experts(runtime.moe_layers[0]) == set(range(TOP_K))
        with torch.no_grad(), simulated():
            runtime.flush()
            runtime.prefetch(np.array([[p, e] for p in range(len(runtime.moe_layers)) for e in range(TOP_K)]))
            start = clock()
            with runtime.frozen():
                model(PROMPT[:, :1])  # the oracle's probe: no emulated link, no waiting
            assert clock() == start
    finally:
        runtime.detach()


def test_prefetch_keeps_named_residents_and_takes_only_the_slots_they_leave():
    """A copy into a full layer evicts a resident: ``keep`` names those the next forward needs, and a layer takes
    only as many copies as its other slots hold (here one of TOP_K)."""
    with _behind_a_link() as (model, runtime, each, needed):
        model(PROMPT[:, :1])  # every layer's TOP_K slots hold the routed experts
        first = needed[needed[:, 0] == 0, 1]
        others = np.array([e for e in range(NUM_EXPERTS) if e not in first])
        kept = np.array([[0, first[0]]])
        assert runtime.prefetch(np.array([[0, e] for e in others]), keep=kept) == TOP_K - 1
        assert first[0] in runtime.cached_experts(runtime.moe_layers[0])
        # a layer whose residents are all kept takes no copy; without keep the same copies evict
        assert runtime.prefetch(np.array([[1, e] for e in range(NUM_EXPERTS)]), keep=needed) == 0
        assert runtime.prefetch(np.array([[1, e] for e in range(NUM_EXPERTS)])) == TOP_K
        with pytest.raises(ValueError, match="expert ids"):
            runtime.prefetch(np.array([[1, 0]]), keep=np.array([[1, NUM_EXPERTS]]))


def test_prefetches_used_count_those_a_forwards_first_row_used_first():
    """``first_row_prefetches_used``: of the prefetched experts a forward used, those its root (row 0) was the
    first to route to (a plain step in its place would have loaded them)."""
    x = PROMPT[:, :2]
    with _behind_a_link() as (model, runtime, each, _):
        model(x)
        rows = [runtime.last_routing(layer).numpy() for layer in runtime.moe_layers]
        root = [set(r[0].tolist()) for r in rows]
        second = np.array([(p, e) for p, r in enumerate(rows) for e in sorted(set(r[1].tolist()) - root[p])])
        firsts = np.array([(p, e) for p, r in enumerate(root) for e in sorted(r)])
        for pairs, by_root in ((firsts, len(firsts)), (second, 0)):
            runtime.flush()
            runtime.reset_stats()
            assert runtime.prefetch(pairs) == len(pairs)
            model(x)
            total = runtime.stats.total
            assert total.prefetches_used == len(pairs) and total.first_row_prefetches_used == by_root
            assert total.first_row_misses == len(firsts) - by_root


def test_prefetch_without_a_link_copies_at_once_and_counts_what_is_used():
    model = build_model("qwen3_moe", seed=5)
    x = PROMPT[:, :1]
    with torch.no_grad():
        ref = model(x).logits
    runtime = offload_experts(model, device="cpu", slots_per_layer=TOP_K)
    try:
        with torch.no_grad():
            model(x)
            needed = _routed(runtime)
            runtime.flush()
            runtime.reset_stats()
            assert runtime.prefetch(needed) == len(needed)
            out = model(x).logits
        total = runtime.stats.total
        assert total.misses == 0 and total.prefetches == total.prefetches_used == len(needed)
        assert total.wait_seconds == 0.0
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    finally:
        runtime.detach()
