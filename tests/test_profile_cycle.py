"""examples/profile_cycle.py: the per-phase medians of SpecFit's cycles."""

from __future__ import annotations

import pytest

from specfit_hf.tree import CycleRecord


def _record(cycle, draft, select, observe, verify, levels=0, drafted=0, verified=0, committed=1, source="draft",
            kind=""):
    return CycleRecord(nodes_drafted=drafted, nodes_verified=verified, tokens_accepted=committed - 1,
                       tokens_committed=committed, cycle_seconds=cycle, draft_seconds=draft, select_seconds=select,
                       verify_seconds=verify, levels_drafted=levels, observe_seconds=observe, source=source, kind=kind)


def test_profile_medians_count_learning_as_policy_time(example_module):
    module = example_module("profile_cycle")
    records = [
        _record(0.010, 0.0, 0.0005, 0.0005, 0.009),  # a plain step
        _record(0.030, 0.004, 0.001, 0.001, 0.024, levels=3, drafted=3, verified=3, committed=4),
        _record(0.020, 0.002, 0.002, 0.0, 0.016, levels=2, drafted=5, verified=1, committed=2),
        _record(0.012, 0.0, 0.0002, 0.0008, 0.011, verified=4, committed=3, source="lookup"),
    ]
    f = module.profile(records)
    assert f["cycles"] == 4
    assert f["cycle_ms"] == pytest.approx(16.0)  # median of 10, 30, 20, 12
    assert f["policy_ms"] == pytest.approx(1.5)  # select + observe: 1, 2, 2, 1
    assert f["policy_share"] == pytest.approx((0.1 + 1 / 12) / 2)  # median of 0.1, 0.0667, 0.1, 0.0833
    assert f["drafting_share"] == pytest.approx(0.5)
    assert (f["nodes_drafted"], f["nodes_verified"]) == (4, 2)  # over the two drafting cycles
    assert f["lookup_share"] == pytest.approx(0.25)
    assert f["tokens_per_cycle"] == pytest.approx(2.5)


def test_time_by_kind_splits_each_generations_first_tokens_from_the_rest(example_module):
    module = example_module("profile_cycle")
    plain = dict(draft=0.0, select=0.0, observe=0.0, verify=0.01, kind="plain")
    chain = dict(draft=0.002, select=0.0, observe=0.0, verify=0.01, levels=2, drafted=2, verified=2, kind="chain:2")
    first = [_record(0.010, **plain), _record(0.012, committed=3, **chain), _record(0.012, committed=2, **chain)]
    second = [_record(0.012, committed=3, **chain), _record(0.010, **plain), _record(0.020, committed=3, **chain)]
    out = module.by_kind([first, second], first_tokens=4)
    # the first generation reaches 4 tokens after its second cycle, the second after its second
    assert out["first"]["plain"]["cycles"] == 2 and out["first"]["chain:2"]["cycles"] == 2
    assert out["first"]["chain:2"]["tokens"] == 6
    assert out["first"]["chain:2"]["ms_per_token"] == pytest.approx(24 / 6)
    assert out["first"]["plain"]["share"] == pytest.approx(0.020 / 0.044)
    assert set(out["rest"]) == {"chain:2"} and out["rest"]["chain:2"]["cycles"] == 2
    assert out["rest"]["chain:2"]["tokens"] == 5 and out["rest"]["chain:2"]["share"] == pytest.approx(1.0)


def test_profile_cycle_runs_on_a_twin(example_module, capsys):
    module = example_module("profile_cycle")
    out = module.main(["--twin", "qwen3-30b-a3b@rtx4090-pcie4", "--dataset", "gsm8k", "--num-prompts", "1",
                       "--max-new-tokens", "12"])
    f = out["gsm8k"]
    assert f["cycles"] >= 1 and f["cycle_ms"] > 0 and 0 <= f["policy_share"] < 1
    printed = capsys.readouterr().out
    assert "modeled twin qwen3-30b-a3b@rtx4090-pcie4" in printed and "time by cycle kind" in printed
