"""Device twins: constants, scaling, the modeled clock, the bench/CLI wiring and the GPU check script."""

import math

import pytest
import torch

from specfit_hf.clock import clock
from specfit_hf.eagle3.testing import tiny_draft, tiny_target
from specfit_hf.offload import offload_experts
from specfit_hf.twin import (
    MODELS,
    TWINS,
    TwinTimeline,
    distinct_experts,
    effective_tokens,
    get_twin,
    sanity_table,
    twin_names,
)

RTX4090 = "qwen3-30b-a3b@rtx4090-pcie4"


def test_model_sizes_match_public_figures():
    qwen, mixtral = MODELS["qwen3-30b-a3b"], MODELS["mixtral-8x7b"]
    assert qwen.expert_bytes == pytest.approx(9.44e6, rel=1e-3)  # reference-facts.md
    assert mixtral.expert_bytes == pytest.approx(352e6, rel=2e-3)
    assert qwen.total_params == pytest.approx(30.5e9, rel=0.01)  # model cards: 30.5 B, 46.7 B
    assert mixtral.total_params == pytest.approx(46.7e9, rel=0.01)
    # one token's experts over all layers: 3.62 GB and 22.5 GB (reference-facts.md)
    assert qwen.layers * qwen.top_k * qwen.expert_bytes == pytest.approx(3.62e9, rel=0.01)
    assert mixtral.layers * mixtral.top_k * mixtral.expert_bytes == pytest.approx(22.5e9, rel=0.01)
    assert qwen.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2


def test_every_twin_has_sources_and_a_graphs_variant():
    required = {"qwen3-30b-a3b@rtx4090-pcie4", "qwen3-30b-a3b@rtx5090-pcie5", "qwen3-30b-a3b@h100-pcie5",
                "mixtral-8x7b@rtx4090-pcie4", "qwen3-30b-a3b@gh200-c2c"}
    assert required <= set(TWINS)
    for name in required:
        eager, graphs = get_twin(name), get_twin(name + "+graphs")
        assert eager.seconds_per_launch > 0 and graphs.seconds_per_launch == 0
        assert graphs.decode_step_seconds() < eager.decode_step_seconds()
        meta = eager.meta()
        for part in ("model", "device", "link"):
            assert meta[part]["source"]
        assert "MEASURED" in meta["host_overhead_source"] and meta["scaling"]
    assert get_twin("qwen3-30b-a3b@gh200-c2c").expert_transfer_seconds() < get_twin(RTX4090).expert_transfer_seconds() / 5
    with pytest.raises(KeyError, match="choose from"):
        get_twin("llama@toaster")
    assert "published" in sanity_table() and len(twin_names()) == len(TWINS)


def test_distinct_expert_scaling():
    # one token reads top_k experts on either side; uniform routing round-trips
    assert distinct_experts(effective_tokens(4, 64, 4, 1), 128, 8) == pytest.approx(8)
    n_eff = effective_tokens(20.0, 64, 4, 16)
    assert distinct_experts(n_eff, 64, 4) == pytest.approx(20.0)
    assert effective_tokens(64, 64, 4, 10) == 10  # saturated: every token counts
    # correlated routing (few distinct experts for many tokens) stays few on the real model
    assert distinct_experts(effective_tokens(6, 64, 4, 32), 128, 8) < 16
    assert distinct_experts(64, 128, 8) == pytest.approx(126, abs=1)  # reference-facts.md: n=64 -> 126


def test_roofline_shape():
    t = get_twin(RTX4090 + "+graphs")  # the device alone (no host overhead)
    one = t.target_forward_seconds(1, 512, 8)
    # a GPU verify block costs about one token when it reads no more experts (weights are read once)
    assert t.target_forward_seconds(8, 512, 8) < 1.1 * one
    assert t.target_forward_seconds(8, 512, 52) > 1.5 * one  # ...but distinct experts cost bytes
    assert t.draft_level_seconds(10, 0) < 0.1 * one  # a draft level is a few percent of a target step
    memory = (t.model.nonexpert_bytes + 48 * 8 * t.model.expert_bytes + 513 * t.model.kv_bytes_per_token) / 1008e9
    assert t.decode_step_seconds(512) == pytest.approx(memory)
    huge = t.target_forward_seconds(4096, 0, 128)  # a long prefill is compute-bound
    flops = 4096 * 2 * (t.model.nonexpert_bytes / 2 + 48 * 8 * t.model.expert_bytes / 2)
    assert huge > flops / 165.2e12
    # transformers eager adds the measured host time per kernel: 86 kernels per Qwen3 layer, flat in tokens
    eager = get_twin(RTX4090)
    host = 48 * 86 * 22.3e-6
    for n, d in ((1, 8), (8, 52)):
        assert eager.target_forward_seconds(n, 512, d) == pytest.approx(t.target_forward_seconds(n, 512, d) + host)
    assert eager.draft_level_seconds(1, 0) - t.draft_level_seconds(1, 0) == pytest.approx(55 * 22.3e-6)
    assert get_twin("mixtral-8x7b@rtx4090-pcie4").launches_per_target_layer == 79


@pytest.fixture(scope="module")
def pair():
    return tiny_target(num_layers=4), tiny_draft()


@torch.inference_mode()
def test_timeline_charges_modeled_time_for_forwards_and_misses(pair):
    target, draft = pair
    twin = get_twin(RTX4090)
    runtime = offload_experts(target, device="cpu", cache_fraction=1.0)
    try:
        with TwinTimeline(twin, target, draft) as timeline:
            ids = torch.randint(0, 96, (1, 6))
            target(input_ids=ids)  # loads experts (cold cache)
            misses = runtime.stats.total.misses
            assert misses > 0
            start = clock()
            target(input_ids=ids[:, :1])  # every expert resident now: no transfer
            span = clock() - start
            modeled = twin.target_forward_seconds(1, 0, 8)
            assert span == pytest.approx(modeled, abs=2e-3)  # the CPU's time is replaced, not added
            assert timeline.events["target"][0] == 2
            runtime.flush()
            before = runtime.stats.total.misses
            start = clock()
            target(input_ids=ids[:, :1])
            span = clock() - start
            loaded = runtime.stats.total.misses - before
            per_miss = twin.miss_scale(runtime) * twin.expert_transfer_seconds()
            assert twin.miss_scale(runtime) == (48 / 4) * (8 / 2)
            assert span == pytest.approx(modeled + loaded * per_miss, abs=2e-3)
            # a draft level is charged too
            n = timeline.events["draft_level"][0]
            draft(torch.randint(0, 96, (1, 3)), hidden_states=torch.randn(1, 3, 32))
            assert timeline.events["draft_level"][0] == n + 1 and timeline.events["draft_head"][0] >= 1
        assert "twin" not in repr(runtime.link)  # detach gives the previous link back
    finally:
        runtime.detach()
    with pytest.raises(ValueError, match="offload_experts"):
        TwinTimeline(twin, target, draft).attach()


def test_expert_heads_are_charged_as_draft_work_on_the_twin(pair):
    # the draft's expert heads run on the device in a deployment: their CPU time is replaced by the
    # real heads' roofline (one linear per real MoE layer), and detach gives the method back
    import time

    target, _ = pair
    draft = tiny_draft(expert_predictor={"moe_layers": [0, 1, 2, 3], "num_experts": 8, "top_k": 2})
    twin = get_twin(RTX4090)
    m = twin.model
    assert m.expert_heads_params == 48 * 2048 * 128
    rows = 7
    expected = (max(2 * m.expert_heads_params / 1008e9, 2 * m.expert_heads_params * rows / 165.2e12)
                + twin.launches_per_expert_heads * twin.seconds_per_launch)
    assert twin.expert_heads_seconds(rows) == pytest.approx(expected)
    hidden = torch.randn(rows, draft.config.hidden_size)
    reference = draft.predict_experts(hidden)
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    try:
        with TwinTimeline(twin, draft=draft, target=target) as timeline:
            original = type(draft).predict_experts

            def slow(self, *args, **kwargs):
                time.sleep(0.05)  # a slow CPU: the twin replaces its time
                return original(self, *args, **kwargs)

            type(draft).predict_experts, saved = slow, original
            try:
                timeline.detach()
                timeline.attach()  # wraps the (slow) method the class has now
                start = clock()
                out = draft.predict_experts(hidden)
                span = clock() - start
            finally:
                type(draft).predict_experts = saved
            assert torch.equal(out, reference)  # the twin changes the clock, never the result
            assert span == pytest.approx(twin.expert_heads_seconds(rows), abs=2e-3)
            assert timeline.events["expert_heads"][0] == 1
            # a generate call's predictor calls a snapshot of the heads (expert_predictor_fn): charged alike
            predict = draft.expert_predictor_fn()
            start = clock()
            out = predict(hidden)
            span = clock() - start
            assert torch.equal(out, reference)
            assert span == pytest.approx(twin.expert_heads_seconds(rows), abs=2e-3)
            assert timeline.events["expert_heads"][0] == 2
        assert "expert_predictor_fn" not in vars(draft)
        assert "predict_experts" not in vars(draft)  # detached: the class's method again
    finally:
        runtime.detach()


@torch.inference_mode()
def test_a_tree_drafters_whole_forward_and_top_k_are_charged_as_device_work(pair, monkeypatch):
    # the rotary rows and embedding around the draft layer, and the log-softmax and top-k after its lm_head,
    # run on the device in a deployment: a slow CPU for them moves the twin's clock by nothing
    import time

    from specfit_hf.eagle3.kv import DraftKVCache

    target, draft = pair
    twin = get_twin(RTX4090 + "+graphs")  # no launch overhead: the roofline alone
    d = twin.model.draft
    rows = 3
    assert twin.draft_top_k_seconds(rows) == pytest.approx(2 * rows * d.draft_vocab * 4 / (1008e9))
    cls = type(draft)
    rotary_rows, compute_logits = cls.rotary_rows, cls.compute_logits

    def slow_rotary(self, *args, **kwargs):
        time.sleep(0.05)
        return rotary_rows(self, *args, **kwargs)

    def slow_logits(self, *args, **kwargs):
        time.sleep(0.05)
        return compute_logits(self, *args, **kwargs)

    ids = torch.randint(0, 96, (1, rows))
    hidden = torch.randn(rows, draft.config.hidden_size)

    def forward():
        cache = DraftKVCache()
        def attend(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, *cache.append(k, v), enable_gqa=True)

        return draft.draft_forward(ids, hidden, range(rows), attend)

    reference_out, reference_next = forward()
    reference_top = draft.top_children(reference_out, 4)
    monkeypatch.setattr(cls, "rotary_rows", slow_rotary)
    monkeypatch.setattr(cls, "compute_logits", slow_logits)
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    try:
        with TwinTimeline(twin, target, draft) as timeline:
            start = clock()
            out, nxt = forward()
            span = clock() - start
            assert torch.equal(out, reference_out) and torch.equal(nxt, reference_next)
            assert span == pytest.approx(twin.draft_level_seconds(rows, 0), abs=5e-3)  # not the 50 ms sleep
            assert timeline.events["draft_level"][0] == 1  # the layer's own hook nests: charged once
            start = clock()
            top = draft.top_children(out, 4)
            span = clock() - start
            assert all(torch.equal(a, b) for a, b in zip(top, reference_top))
            assert span == pytest.approx(twin.draft_matmul_seconds(d.lm_head_params, rows)
                                         + twin.draft_top_k_seconds(rows), abs=5e-3)
            assert timeline.events["draft_head"][0] == 1
        assert "draft_forward" not in vars(draft) and "top_children" not in vars(draft)
    finally:
        runtime.detach()


def test_bench_with_a_twin_labels_rows_and_records_constants(pair):
    from specfit_hf.bench import run_benchmark

    class Tok:
        def __call__(self, text, return_tensors=None):
            class Out:
                input_ids = torch.tensor([[ord(c) % 96 for c in text]])

            return Out()

    target, draft = pair
    results = run_benchmark(target, draft, Tok(), {"math_reasoning": ["Question: 2+2?"]}, cache_fractions=(0.5,),
                            policies=["autoregressive", "static:d2k1n2"], max_new_tokens=6, twin=RTX4090,
                            progress=False)
    rows = results["runs"]
    assert {r["link"] for r in rows} == {RTX4090}
    assert all(r["outputs_identical_to_autoregressive"] for r in rows)
    ar = next(r for r in rows if r["policy"] == "autoregressive")
    # the modeled 4090 step (~11 ms plus misses) bounds decode speed whatever this CPU does
    assert ar["decode_tokens_per_s"] < 1 / get_twin(RTX4090 + "+graphs").decode_step_seconds(0)
    meta = results["meta"]
    assert meta["twin"]["name"] == RTX4090 and meta["twin"]["device"]["memory_gbps"] == 1008.0
    assert meta["link_timing"] == "twin" and not math.isnan(meta["twin"]["modeled_decode_step_s_all_resident"])


def test_cli_rejects_unknown_twin():
    from specfit_hf.cli import main

    with pytest.raises(SystemExit, match="unknown twin"):
        main(["bench", "--twin", "gpt@abacus"])


def test_twin_check_runs_reduced_on_cpu(capsys, example_module):
    module = example_module("twin_check")
    mape = module.main(["--device", "cpu", "--layers", "1", "--reduce", "32", "--tokens", "1", "8",
                        "--draft-nodes", "1", "8", "--copies", "1", "--repeats", "1", "--past", "16"])
    out = capsys.readouterr().out
    assert "MAPE" in out and "fitted host overhead" in out
    assert set(mape) == {"target", "draft level", "expert heads", "H2D copy", "all"}
    assert all(v >= 0 for v in mape.values())  # reported, not asserted against a bound


@torch.inference_mode()
def test_timeline_is_exact_on_a_simulated_clock(pair):
    from specfit_hf.clock import simulated

    target, draft = pair
    twin = get_twin(RTX4090 + "+graphs")
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    try:
        with TwinTimeline(twin, target, draft) as timeline, simulated():
            ids = torch.randint(0, 96, (1, 5))
            before, start = runtime.stats.total.misses, clock()
            target(input_ids=ids)
            span = clock() - start
            loaded = runtime.stats.total.misses - before
            modeled = timeline.events["target"][1]
            assert loaded > 0
            # real time stands still: the span is exactly the modeled forward plus the modeled transfers
            assert span == pytest.approx(modeled + loaded * twin.miss_scale(runtime) * twin.expert_transfer_seconds(),
                                         rel=1e-9)
    finally:
        runtime.detach()


def test_specfit_prefetches_while_drafting_on_the_twin_and_stays_lossless(monkeypatch):
    """On the 4090 twin (host time frozen) the shipped pair's chains copy the experts their heads guess while
    the other levels are drafted: prefetches happen, most are used, and the output is the target's own.  The
    drafting gate counts a copy the verify used as one of the cycle's loads (and its root's: a plain step in the
    cycle's place copies nothing ahead), the cycle record only what was loaded on the verify's path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfit_hf.clock import simulated
    from specfit_hf.eagle3 import Eagle3DraftModel
    from specfit_hf.embedded import embedded_pair
    from specfit_hf.generation import SpecFitConfig
    from specfit_hf.selection.gate import DraftingGate
    from specfit_hf.selection.specfit import SpecFitPolicy

    paths = embedded_pair()
    if not (paths.target / "config.json").is_file() or not (paths.draft / "config.json").is_file():
        pytest.skip("the shipped model cards are not in this checkout")
    target = AutoModelForCausalLM.from_pretrained(paths.target).eval()
    draft = Eagle3DraftModel.from_pretrained(paths.draft).eval()
    tokenizer = AutoTokenizer.from_pretrained(paths.target)
    questions = ["Tom has 3 boxes of 12 apples. He gives away 7 apples. How many apples does he have left?",
                 "A train travels 60 miles per hour for 3 hours. How far does it travel?"]
    prompts = [tokenizer(q, return_tensors="pt").input_ids for q in questions]
    refs = [target.generate(ids, max_new_tokens=48, do_sample=False) for ids in prompts]
    counts = {}
    seen = {"record": [0, 0], "gate": [0, 0]}  # loads, root loads
    gate_observe, policy_observe = DraftingGate.observe, SpecFitPolicy.observe

    def count(key, loads, root):
        if loads is not None and root is not None:
            seen[key][0] += loads
            seen[key][1] += root

    def spy_gate(self, kind, tokens, seconds, loads=None, root_loads=None, *args, **kwargs):
        count("gate", loads, root_loads)
        return gate_observe(self, kind, tokens, seconds, loads, root_loads, *args, **kwargs)

    def spy_policy(self, tree, selection, result, record):
        count("record", record.experts_loaded, record.root_experts_loaded)
        return policy_observe(self, tree, selection, result, record)

    monkeypatch.setattr(DraftingGate, "observe", spy_gate)
    monkeypatch.setattr(SpecFitPolicy, "observe", spy_policy)
    for prefetch in (True, False):
        seen.update(record=[0, 0], gate=[0, 0])
        runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
        try:
            with TwinTimeline(RTX4090, target, draft), simulated():
                cfg = SpecFitConfig(max_new_tokens=48, do_sample=False,
                                    policy_kwargs={"prefetch": prefetch, "share_drafting": False,
                                                   "share_acceptance": False})
                for ids, ref in zip(prompts, refs):
                    runtime.flush()  # (a copy the next prefill used would be in no cycle)
                    assert torch.equal(target.generate(ids, assistant_model=draft, generation_config=cfg), ref)
            total = runtime.stats.total
            counts[prefetch] = (total.prefetches, total.prefetches_used, total.first_row_prefetches_used)
            copied = [seen["gate"][i] - seen["record"][i] for i in (0, 1)]
            assert copied == [total.prefetches_used, total.first_row_prefetches_used]
        finally:
            runtime.detach()
    assert counts[False] == (0, 0, 0)
    issued, used, by_roots = counts[True]
    assert issued > 0 and used >= issued // 2 and 0 < by_roots <= used


def test_twin_target_layers_overlap_copies_prefetched_before_the_forward(pair):
    """Inside a target forward the twin's clock moves layer by layer: experts prefetched just before it arrive
    while the first layers compute, so the forward takes less than its compute plus every transfer (and
    never less than its compute); without prefetches the forward's time is unchanged by the layer steps."""
    import numpy as np

    from specfit_hf.clock import simulated

    target, draft = pair
    twin = get_twin(RTX4090)
    ids = torch.randint(0, 96, (1, 1), generator=torch.Generator().manual_seed(3))
    runtime = offload_experts(target, device="cpu", cache_fraction=0.5)
    try:
        with torch.inference_mode(), TwinTimeline(twin, target, draft) as timeline, simulated():
            target(input_ids=ids)
            routed = np.array([(p, e) for p, layer in enumerate(runtime.moe_layers)
                               for e in np.unique(runtime.last_routing(layer).numpy()).tolist()])
            per_miss = twin.miss_scale(runtime) * twin.expert_transfer_seconds()
            spans = {}
            for how in ("none", "now", "ahead"):
                runtime.flush()
                runtime.reset_stats()
                before, start = timeline.events["target"][1], clock()
                if how == "now":
                    assert runtime.prefetch(routed) == len(routed)
                elif how == "ahead":  # the first layer's now, each other layer's as the one before it starts
                    runtime.prefetch_ahead(routed)
                    assert runtime.stats.total.prefetches == np.count_nonzero(routed[:, 0] == 0)
                target(input_ids=ids)
                spans[how] = (clock() - start, timeline.events["target"][1] - before)
                assert runtime.stats.total.prefetches_used == (0 if how == "none" else len(routed))
                assert runtime.stats.total.misses == (len(routed) if how == "none" else 0)
        span, modeled = spans["none"]
        assert span == pytest.approx(modeled + len(routed) * per_miss, rel=1e-9)
        for how in ("now", "ahead"):
            span, modeled = spans[how]
            assert modeled <= span < modeled + len(routed) * per_miss - per_miss
    finally:
        runtime.detach()
