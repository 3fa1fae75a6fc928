"""The side-by-side benchmark, link regimes and quality metrics on a tiny random MoE."""

import json
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from specfit_hf.bench import (
    LOOKUP_FAMILY,
    STATIC_FAMILY,
    PromptRun,
    Variant,
    default_variants,
    expand_policies,
    frozen_heap,
    lookup_variant,
    markdown_table,
    merge_results,
    run_benchmark,
    speedup_summary,
    static_family,
    static_label,
    static_variant,
    summarize,
    write_report,
)
from specfit_hf.quality import FinalAnswerAccuracy, Rouge, gsm8k_final_answer
from specfit_hf.regimes import REGIMES, LinkRegime, emulated_gbps, emulated_link_params

# A regime with a tiny transfer/compute ratio keeps the emulated waits short in tests.
FAST = LinkRegime("fast-test", "test link", token_expert_bytes=1e6, link_gbps=100.0, cached_step_seconds=1e-3,
                  expert_bytes=1e5)


class CharTokenizer:
    def __call__(self, text, return_tensors=None):
        class Out:
            pass

        out = Out()
        out.input_ids = torch.tensor([[ord(c) % 96 for c in text]])
        return out


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2)
    target = Qwen3MoeForCausalLM(cfg).eval()
    draft = Qwen3MoeForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())  # a draft equal to the target: long accepted paths
    return target, draft


def test_regime_ratio_carries_over():
    regime = REGIMES["qwen3-pcie4"]
    # rho from the public figures: 3.62 GB / 25 GB/s = 145 ms per uncached token
    assert regime.token_expert_bytes / (regime.link_gbps * 1e9) == pytest.approx(0.1448)
    gbps, latency_us = emulated_link_params(regime, expert_bytes=1000, experts_per_token=10, cached_step_seconds=0.01)
    # the emulated link moves one token's experts in rho x the cached step
    assert 10 * 1000 / (gbps * 1e9) == pytest.approx(regime.rho * 0.01)
    assert latency_us > 0
    with pytest.raises(ValueError):
        emulated_gbps(regime, token_expert_bytes=0, cached_step_seconds=1.0)


def test_summarize_speedups_and_identity():
    # (ttft, decode seconds, decode tokens): the prefill dominates end to end, decode differs
    runs = [
        PromptRun("autoregressive", 0, 0, [1, 2, 3, 4], 2.0, 4, 1.0, 8, 800, ttft_seconds=0.5,
                  decode_seconds=1.5, decode_tokens=3),
        PromptRun("specfit", 0, 0, [1, 2, 3, 4], 1.0, 2, 2.0, 4, 400, [0.4, 0.5], [0.5, 0.5], 0.1,
                  ttft_seconds=0.7, decode_seconds=0.3, decode_tokens=3, cycle_shapes=[(1, 1), (1, 1)],
                  cycle_loads=[1, 3], cycle_policy_seconds=[0.01, 0.02]),
        PromptRun("eagle3", 0, 0, [1, 2, 3, 5], 4.0, 1, 4.0, 16, 1600, ttft_seconds=1.0, decode_seconds=3.0,
                  decode_tokens=3),
    ]
    rows = summarize(runs, {0: [1, 2, 3, 4]})
    assert rows["specfit"]["tokens_per_s"] == pytest.approx(4.0)
    assert rows["specfit"]["decode_tokens_per_s"] == pytest.approx(10.0)
    assert rows["specfit"]["ttft_s"] == pytest.approx(0.7)
    assert rows["specfit"]["speedup_vs_autoregressive"] == pytest.approx(5.0)  # decode phase: 10 / 2
    assert rows["specfit"]["e2e_speedup_vs_autoregressive"] == pytest.approx(2.0)
    assert rows["specfit"]["speedup_vs_eagle3"] == pytest.approx(10.0)
    assert rows["specfit"]["experts_loaded_per_token"] == pytest.approx(1.0)
    assert rows["specfit"]["cycle_time_mape_pct"] == pytest.approx(10.0)
    # both cycles took 0.5 s: the routing-blind reference is exact, and so is the loads-known one
    assert rows["specfit"]["cycle_time_mape_blind_floor_pct"] == pytest.approx(0.0)
    assert rows["specfit"]["cycle_time_mape_loads_known_pct"] == pytest.approx(0.0)
    assert math.isnan(rows["autoregressive"]["cycle_time_mape_blind_floor_pct"])
    assert rows["specfit"]["selection_overhead_share"] == pytest.approx(0.1)
    assert rows["specfit"]["selection_overhead_median_share"] == pytest.approx(0.03)  # of 0.02 and 0.04
    assert math.isnan(rows["autoregressive"]["selection_overhead_median_share"])  # no cycles of its own
    assert rows["specfit"]["outputs_identical_to_autoregressive"] is True
    assert rows["eagle3"]["outputs_identical_to_autoregressive"] is False


def test_rows_split_time_by_cycle_kind_over_each_generations_start():
    # two generations of the same variant: the cycles until 24 decode tokens are committed are its start
    def run(index, kinds, tokens, seconds):
        n = len(kinds)
        return PromptRun("specfit", index, 0, [1] * (1 + sum(tokens)), 1.0, n, 2.0, 0, 0,
                         predicted_cycle_seconds=seconds, measured_cycle_seconds=seconds, cycle_kinds=kinds,
                         cycle_tokens=tokens, cycle_shapes=[(0, 0)] * n, cycle_loads=[0] * n)

    runs = [run(0, ["plain", "chain:2", "chain:2", "chain:2"], [1, 12, 12, 10], [0.01, 0.02, 0.02, 0.03]),
            run(1, ["chain:2", "probe:2", "chain:2"], [12, 12, 12], [0.02, 0.04, 0.01]),
            PromptRun("autoregressive", 0, 0, [1] * 36, 1.0, 35, 1.0, 0, 0)]
    rows = summarize(runs, {0: [1] * 36, 1: [1] * 37})
    split = rows["specfit"]["time_by_kind"]
    assert set(split["first"]) == {"plain", "chain:2", "probe:2"}
    assert split["first"]["chain:2"] == pytest.approx(
        {"cycles": 3, "tokens": 36, "seconds": 0.06, "ms_per_token": 60 / 36, "share": 0.06 / 0.11})
    assert split["first"]["probe:2"]["tokens"] == 12  # 12 tokens before it: still the generation's start
    assert split["rest"] == {"chain:2": pytest.approx(
        {"cycles": 2, "tokens": 22, "seconds": 0.04, "ms_per_token": 40 / 22, "share": 1.0})}
    assert rows["autoregressive"]["time_by_kind"] == {"first": {}, "rest": {}}  # no cycles recorded
    json.dumps(rows)  # results.json keeps it


def test_mape_floors_split_routing_luck_from_the_cost_model():
    from specfit_hf.selection import mape_floors

    # two shapes of cycle, each a straight line in its loads: known loads explain everything
    shapes = [(0, 0)] * 4 + [(2, 2)] * 4
    loads = [0, 1, 2, 5, 1, 3, 4, 8]
    seconds = [1.0 + 0.5 * x for x in loads[:4]] + [2.0 + 0.25 * x for x in loads[4:]]
    blind, known = mape_floors(shapes, loads, seconds)
    assert known == pytest.approx(0.0, abs=1e-9)
    # the group means miss by what the loads swing: (0, 0) mean 2.0 vs 1.0 .. 3.5, (2, 2) mean 3.0 vs 2.25 .. 4.0
    expected = 100 * np.mean([1.0, 0.5 / 1.5, 0.0, 1.5 / 3.5, 0.75 / 2.25, 0.25 / 2.75, 0.0, 1.0 / 4.0])
    assert blind == pytest.approx(expected)
    # too few cycles of a shape for a line: both references fall back to the mean
    assert mape_floors([(1, 1), (1, 1)], [0, 4], [1.0, 3.0]) == pytest.approx((50.0 * (1 + 1 / 3), 50.0 * (1 + 1 / 3)))
    assert all(math.isnan(v) for v in mape_floors([], [], []))
    with pytest.raises(ValueError, match="one shape"):
        mape_floors([(0, 0)], [1, 2], [1.0, 2.0])


def test_warmup_and_steady_decode_split():
    from specfit_hf.bench import _TimingStreamer

    streamer = _TimingStreamer()
    # the prompt (5 tokens), the first token at t=1, then cycles of 2, 3 and 1 tokens
    streamer.puts = [(0.5, 5), (1.0, 1), (2.0, 2), (4.0, 3), (5.0, 1)]
    assert streamer.first_token_time(5, 7) == (1.0, 1)
    # 4 decode tokens: the 2-token cycle, then 2 of the 3-token cycle's (2/3 of its 2 s)
    assert streamer.warmup(5, 7, 4) == pytest.approx((4.0, 1.0 + 2.0 * 2 / 3))
    assert streamer.warmup(5, 7, 2) == pytest.approx((2.0, 1.0))  # a window ending with a cycle
    assert streamer.warmup(5, 7, 50) == pytest.approx((6.0, 4.0))  # shorter than the window: all of it
    runs = [PromptRun("specfit", 0, 0, [1] * 7, 5.0, 4, 1.75, 0, 0, ttft_seconds=1.0, decode_seconds=4.0,
                      decode_tokens=6, warmup_seconds=1.0 + 4 / 3, warmup_tokens=4.0)]
    row = summarize(runs, {0: [1] * 7})["specfit"]
    assert row["decode_tokens_per_s"] == pytest.approx(6 / 4.0)
    assert row["warmup_decode_tokens_per_s"] == pytest.approx(4 / (1.0 + 4 / 3))
    assert row["steady_decode_tokens_per_s"] == pytest.approx(2 / (4.0 - 1.0 - 4 / 3))
    table = markdown_table([{"category": "c", "cache_fraction": 0.5, "link": "l", "policy": "specfit", **row}])
    assert f"{row['warmup_decode_tokens_per_s']:.1f} / {row['steady_decode_tokens_per_s']:.1f}" in table


def test_run_benchmark_grid_and_report(pair, tmp_path):
    target, draft = pair
    tree = {"max_verify_nodes": 6, "max_depth": 3, "tree_top_k": 2}
    variants = [
        Variant("autoregressive", None),
        Variant("eagle3-vanilla", "eagle3", persistent_cache=False, config=tree),
        Variant("eagle3", "eagle3", config=tree),
    ]
    prompts = {"math_reasoning": ["Question: 2+2?", "Question: why?"], "summarization": ["Article: x y z"]}
    results = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.25, 1.0), links=(FAST,),
                            variants=variants, max_new_tokens=8, progress=False)
    rows = results["runs"]
    assert len(rows) == 2 * 2 * 3  # categories x cache fractions x policies
    for row in rows:
        for key in ("category", "cache_fraction", "link", "policy", "tokens_per_s", "decode_tokens_per_s", "ttft_s",
                    "warmup_decode_tokens_per_s", "steady_decode_tokens_per_s", "mean_accepted",
                    "experts_loaded_per_token", "outputs_identical_to_autoregressive"):
            assert key in row
        assert row["warmup_decode_tokens_per_s"] > 0  # 7 decode tokens: all warm-up, no steady part
        assert math.isnan(row["steady_decode_tokens_per_s"])
        assert row["outputs_identical_to_autoregressive"] is True  # greedy speculation is lossless
        assert row["tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
        # the prefill is part of end-to-end time only; first token comes after the start
        assert 0 < row["ttft_s"] < 8 / row["tokens_per_s"]
    by = {(r["category"], r["cache_fraction"], r["policy"]): r for r in rows}
    # the draft equals the target, so trees are accepted deeply
    assert by[("math_reasoning", 0.25, "eagle3")]["mean_accepted"] > 1.5
    # with every expert resident nothing is loaded after the first touch; without a persistent cache
    # every verify reloads its union, so vanilla moves at least as much as the cached variant
    assert by[("math_reasoning", 1.0, "eagle3-vanilla")]["experts_loaded_per_token"] >= \
        by[("math_reasoning", 1.0, "eagle3")]["experts_loaded_per_token"]
    assert results["meta"]["gc_frozen_in_cells"] is True
    import gc

    assert gc.get_freeze_count() == 0  # the cells' freeze was lifted
    paths = write_report(results, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert len(data["runs"]) == len(rows)
    assert "| policy |" in paths["markdown"].read_text()
    assert paths["speedup_png"].stat().st_size > 1000


def test_frozen_heap_keeps_loaded_objects_out_of_full_collections_and_restores_them():
    import gc

    assert gc.get_freeze_count() == 0
    model = [{"layer": i} for i in range(1000)]  # objects alive on entry: frozen inside
    with frozen_heap():
        assert gc.get_freeze_count() >= len(model)
        garbage = []
        garbage.append(garbage)  # a cycle made inside is still collected
        del garbage
        assert gc.collect() >= 1
    assert gc.get_freeze_count() == 0  # collectable again after the cell
    gc.freeze()  # a caller's own freeze is left as it is
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_quality_metrics():
    scores = Rouge().compute(predictions=["the cat sat on the mat"], references=["the cat sat on the mat"])
    assert scores == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    partial = Rouge().compute(predictions=["a cat"], references=["the dog"])
    assert partial["rouge1"] == 0.0
    acc = FinalAnswerAccuracy().compute(predictions=["so 8\n#### 8", "about 3"], references=["#### 8", "#### 4"])
    assert acc["accuracy"] == 0.5
    assert gsm8k_final_answer("She has 1,250 apples") == "1250"
    assert gsm8k_final_answer("#### 12.50") == "12.5"
    assert gsm8k_final_answer("no digits") is None


def test_policies_filter_and_bad_policy_names(pair):
    target, draft = pair
    prompts = {"math_reasoning": ["Question: 2+2?"]}
    results = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                            policies=["autoregressive", "eagle3"], max_new_tokens=4, progress=False)
    assert [r["policy"] for r in results["runs"]] == ["autoregressive", "eagle3"]
    assert results["meta"]["link_timing"] == "virtual" and results["meta"]["commit"]
    with pytest.raises(ValueError, match="unknown policies"):
        run_benchmark(target, draft, CharTokenizer(), prompts, links=(FAST,), policies=["eagle4"], progress=False)
    with pytest.raises(ValueError, match="tune_prompts"):
        run_benchmark(target, draft, CharTokenizer(), prompts, links=(FAST,), policies=["eagle3-best"], progress=False)
    with pytest.raises(ValueError, match="tune_prompts"):
        run_benchmark(target, draft, CharTokenizer(), prompts, links=(FAST,), policies=["static-best"], progress=False)
    with pytest.raises(ValueError, match="bad static tree label"):
        run_benchmark(target, draft, CharTokenizer(), prompts, links=(FAST,), policies=["static:chain3"], progress=False)


def test_static_family_expansion_and_labels():
    labels = expand_policies(["autoregressive", "static", "specfit", "static:d2k2n3"])
    assert labels[0] == "autoregressive" and labels[-1] == "static:d2k2n3"
    for chain in (f"static:d{d}k1n{d}" for d in range(1, 8)):
        assert chain in labels
    assert "static:d3k2n4" in labels and "static:d4k3n8" in labels and "static:d7k10n60" in labels
    v = static_variant("static:d4k3n8")
    assert v.policy == "eagle3" and v.config == {"max_depth": 4, "tree_top_k": 3, "max_verify_nodes": 8}
    assert static_label(2, 1, 2) == "static:d2k1n2"
    assert len(static_family()) == len(STATIC_FAMILY)
    with pytest.raises(ValueError, match="unknown policies"):
        expand_policies(["statik"])
    # the adaptive tree alone: the specfit policy with its drafting gate off
    assert expand_policies(["specfit-tree"]) == ["specfit-tree"]
    tree = next(v for v in default_variants() if v.label == "specfit-tree")
    assert tree.policy == "specfit" and tree.config["policy_kwargs"] == {"adaptive_drafting": False}
    with pytest.raises(ValueError, match=">= 1"):
        static_variant("static:d0k1n1")


def test_lookup_family_expansion_and_labels():
    labels = expand_policies(["autoregressive", "lookup", "lookup:d3", "specfit", "specfit-eagle"])
    assert labels == ["autoregressive", *(f"lookup:d{h}" for h in LOOKUP_FAMILY), "lookup:d3", "specfit",
                      "specfit-eagle"]
    v = lookup_variant("lookup:d4")
    assert v.policy == "lookup" and v.config == {"max_depth": 4}
    eagle_only = next(v for v in default_variants() if v.label == "specfit-eagle")
    assert eagle_only.policy == "specfit" and eagle_only.config["policy_kwargs"] == {"lookup_tokens": 0}
    for bad in ("lookup:d0", "lookup:4", "lookup:dx"):
        with pytest.raises(ValueError, match="bad prompt lookup label"):
            expand_policies([bad])


def test_specfit_chain_cap_labels():
    from specfit_hf.bench import named_variant

    assert expand_policies(["specfit", "specfit:c10"]) == ["specfit", "specfit:c10"]
    v = named_variant("specfit:c10")
    assert v.policy == "specfit" and v.config["policy_kwargs"] == {"max_chain": 10}
    assert v.config["max_depth"] == 7  # the tree keeps EAGLE-3's depth
    for bad in ("specfit:c0", "specfit:c17", "specfit:10", "specfit:cx"):
        with pytest.raises(ValueError, match="chain cap label"):
            expand_policies([bad])


def test_static_best_is_tuned_on_other_prompts(pair):
    target, draft = pair
    prompts = {"math_reasoning": ["Question: 2+2?"]}
    tune = {"math_reasoning": ["Question: 3+3?"]}
    results = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                            policies=["autoregressive", "static:d1k1n1", "static:d2k1n2", "static-best"],
                            tune_prompts=tune, max_new_tokens=6, progress=False)
    by = {r["policy"]: r for r in results["runs"]}
    assert set(by) == {"autoregressive", "static:d1k1n1", "static:d2k1n2", "static-best"}
    tuning = results["meta"]["tuning"]["math_reasoning/0.5/fast-test"]
    assert set(tuning["static_decode_tokens_per_s"]) == {v.label for v in static_family()}
    assert by["static-best"]["static_best_shape"] == tuning["static_best"]
    assert by["static-best"]["outputs_identical_to_autoregressive"] is True
    assert "speedup_vs_static-best" in by["autoregressive"]


def test_merge_results_concatenates_cells_and_refuses_duplicates(tmp_path):
    from specfit_hf.cli import main

    def part(category, link, meta):
        rows = [{"category": category, "cache_fraction": 0.5, "link": link, "policy": p, "tokens_per_s": 1.0,
                 "mean_accepted": 1.0, "experts_loaded_per_token": 1.0, "outputs_identical_to_autoregressive": True,
                 "speedup_vs_autoregressive": 1.0} for p in ("autoregressive", "specfit")]
        return {"runs": rows, "meta": meta}

    a = part("summarization", "qwen3-pcie4", {"commit": "abc", "max_new_tokens": 32, "cached_step_seconds": 0.01})
    b = part("math_reasoning", "qwen3-pcie4", {"commit": "abc", "max_new_tokens": 32, "cached_step_seconds": 0.02})
    merged = merge_results([a, b])
    assert len(merged["runs"]) == 4
    assert merged["meta"]["commit"] == "abc" and "cached_step_seconds" not in merged["meta"]
    assert len(merged["meta"]["parts"]) == 2
    summary = speedup_summary(merged["runs"]).splitlines()
    assert len(summary) == 2 + 2  # header, rule, one line per cell
    assert "| `qwen3-pcie4` | CNN/DailyMail | 50% | 1.00 | – | – | – | – | 1.00x | – | – | – / – | nan / nan | 1.00 / nan | yes |" \
        in summary
    with pytest.raises(ValueError, match="more than one"):
        merge_results([a, a])
    for name, res in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"), "--out", str(tmp_path / "m")]) == 0
    assert len(json.loads((tmp_path / "m" / "results.json").read_text())["runs"]) == 4
    with pytest.raises(SystemExit, match="no results.json"):
        main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "m")])


def test_first_call_forgets_what_earlier_generations_measured(pair, monkeypatch):
    """``first_call`` runs every generation from nothing measured: the shared drafting and acceptance
    registries are empty when each one starts, and the rows say so."""
    import specfit_hf.bench as bench
    from specfit_hf.selection import acceptance, gate

    target, draft = pair
    seen = []
    original = bench.forget_measurements

    def spy():
        original()
        seen.append((len(gate._SHARED), len(acceptance._SHARED)))

    monkeypatch.setattr(bench, "forget_measurements", spy)
    variants = [Variant("autoregressive", None), Variant("specfit", "specfit", config={"max_depth": 3, "tree_top_k": 2})]
    prompts = {"math_reasoning": ["Question: 2+2?", "Question: why?"]}
    kept = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                         variants=variants, max_new_tokens=8, progress=False)
    assert not seen and kept["meta"]["first_call"] is False
    assert len(gate._SHARED) > 0 and len(acceptance._SHARED) > 0  # measurements carried between calls
    fresh = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                          variants=variants, max_new_tokens=8, progress=False, first_call=True)
    assert seen == [(0, 0)] * 4  # before each of the 2 prompts x 2 policies, nothing kept
    assert fresh["meta"]["first_call"] is True
    assert all(r["outputs_identical_to_autoregressive"] for r in fresh["runs"])


def test_warm_prompts_run_specfit_columns_first_unrecorded(pair, monkeypatch):
    """``warm_prompts``: each SpecFit column generates them before the evaluated prompts (other columns do not),
    so its first evaluated call starts from what they measured on the cell's runtime; they are not rows."""
    import specfit_hf.bench as bench
    from specfit_hf.offload import get_runtime
    from specfit_hf.selection.gate import shared_drafting

    target, draft = pair
    calls = []
    original = bench.run_variant

    def spy(target_, draft_, x, v, max_new_tokens, **kw):
        measured = bool(shared_drafting(get_runtime(target_).view(), draft_))
        calls.append((v.label, x.shape[1], measured))
        return original(target_, draft_, x, v, max_new_tokens, **kw)

    monkeypatch.setattr(bench, "run_variant", spy)
    variants = [Variant("autoregressive", None), Variant("specfit", "specfit", config={"max_depth": 3, "tree_top_k": 2})]
    prompts = {"math_reasoning": ["Question: 2+2?", "Question: why?"]}
    warm = {"math_reasoning": ["Question: what is three and four, in words?"]}
    res = run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                        variants=variants, max_new_tokens=8, progress=False, warm_prompts=warm)
    warm_len = CharTokenizer()(warm["math_reasoning"][0], return_tensors="pt").input_ids.shape[1]
    assert calls[0] == ("specfit", warm_len, False)  # the warm-up runs first, on a runtime nothing measured yet
    evaluated = calls[1:]
    assert len(evaluated) == 4 and all(n != warm_len for _, n, _ in evaluated)
    assert [m for label, _, m in evaluated if label == "specfit"] == [True, True]  # starts from the warm-up's figures
    assert res["meta"]["warm_prompts_per_category"] == {"math_reasoning": 1}
    assert all(r["generations"] == 2 and r["outputs_identical_to_autoregressive"] for r in res["runs"])
    with pytest.raises(ValueError, match="exclude each other"):
        run_benchmark(target, draft, CharTokenizer(), prompts, cache_fractions=(0.5,), links=(FAST,),
                      variants=variants, max_new_tokens=8, progress=False, warm_prompts=warm, first_call=True)
