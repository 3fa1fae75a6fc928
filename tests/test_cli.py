"""The `specfit` command line: argument parsing and prompt files."""

import json

import pytest

from specfit_hf.cli import build_parser, read_prompts_file


def test_prompt_file_formats(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "hello"}) + "\n\n" + json.dumps({"prompt": "bye", "category": "x"}) + "\n")
    assert read_prompts_file(plain) == {"prompts": ["hello"], "x": ["bye"]}
    specbench = tmp_path / "sb.jsonl"
    specbench.write_text(json.dumps({"question_id": 1, "category": "math_reasoning", "turns": ["2+2?", "and 3?"]}) + "\n")
    assert read_prompts_file(specbench) == {"math_reasoning": ["2+2?"]}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "?"}) + "\n")
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        read_prompts_file(bad)


def test_parser_defaults_and_exclusive_cache_options():
    p = build_parser()
    args = p.parse_args(["generate", "--prompt", "hi"])
    assert args.policy == "specfit" and args.max_new_tokens == 64 and args.temperature == 0.0
    args = p.parse_args(["bench", "--cache-fractions", "0.25", "0.5", "--link", "qwen3-pcie4", "qwen3-pcie5"])
    assert args.cache_fractions == [0.25, 0.5] and args.link == ["qwen3-pcie4", "qwen3-pcie5"]
    assert args.first_call is False and p.parse_args(["bench", "--first-call"]).first_call is True
    assert args.warm_prompts == 0 and p.parse_args(["bench", "--warm-prompts", "2"]).warm_prompts == 2
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "x", "--offload-slots", "4", "--cache-fraction", "0.5"])


def test_spec_bench_file_in_shared_data_parses():
    from specfit_hf.data import default_data_dir

    try:
        path = default_data_dir() / "spec_bench" / "question.jsonl"
    except FileNotFoundError:
        pytest.skip("shared data not present")
    prompts = read_prompts_file(path)
    assert sum(len(v) for v in prompts.values()) == 480
    assert "summarization" in prompts and "math_reasoning" in prompts


def _need_embedded_pair() -> None:
    """Skip unless the embedded model pair is present (a source checkout without model_cards/ has none)."""
    from specfit_hf.data import default_model_paths

    try:
        paths = default_model_paths()
    except FileNotFoundError:
        pytest.skip("embedded model pair not present")
    if not paths.target.is_dir():
        pytest.skip("embedded model pair not present")


def test_demo_prints_decode_rate_ttft_and_an_answer(capsys):
    _need_embedded_pair()
    from specfit_hf.demo import main

    try:
        rc = main(["--prompts", "1", "--tune-prompts", "0", "--max-new-tokens", "8"])
    except FileNotFoundError:
        pytest.skip("shared data not present")
    out = capsys.readouterr().out
    assert rc == 0
    for words in ("decode tok/s", "first token", "plain decoding", "static tree d2k1n2", "prompt lookup, 2 tokens",
                  "EAGLE-3", "SpecFit", "One answer", "answer:"):
        assert words in out
    assert "EmulatedLink(" not in out and "OffloadRuntime(" not in out  # no raw reprs


def test_demo_and_generate_reject_unknown_twin():
    from specfit_hf.cli import main
    from specfit_hf.demo import main as demo

    with pytest.raises(SystemExit):
        demo(["--twin", "nope@nowhere"])
    with pytest.raises(SystemExit, match="unknown twin"):
        main(["generate", "--prompt", "x", "--twin", "nope@nowhere"])
    args = build_parser().parse_args(["bench", "--twin", "qwen3-30b-a3b@rtx4090-pcie4", "mixtral-8x7b@rtx4090-pcie4"])
    assert args.twin == ["qwen3-30b-a3b@rtx4090-pcie4", "mixtral-8x7b@rtx4090-pcie4"] and args.max_new_tokens == 128
    repeated = build_parser().parse_args(["bench", "--twin", "qwen3-30b-a3b@rtx4090-pcie4",
                                          "--twin", "mixtral-8x7b@rtx4090-pcie4"])
    assert repeated.twin == args.twin  # a repeated --twin adds a part, it does not replace the first
    with pytest.raises(SystemExit, match="unknown twin"):
        main(["bench", "--twin", "qwen3-30b-a3b@rtx4090-pcie4", "nope@nowhere"])
    assert build_parser().parse_args(["generate", "--prompt", "x", "--twin", "qwen3-30b-a3b@h100-pcie5"]).twin == \
        "qwen3-30b-a3b@h100-pcie5"


def test_bench_with_host_time_frozen_is_deterministic_and_needs_a_twin(tmp_path):
    from specfit_hf.cli import main

    with pytest.raises(SystemExit, match="needs --twin"):
        main(["bench", "--freeze-host-time"])
    with pytest.raises(SystemExit, match="exclude each other"):
        main(["bench", "--warm-prompts", "1", "--first-call"])
    with pytest.raises(SystemExit, match=">= 0"):
        main(["bench", "--warm-prompts", "-1"])
    _need_embedded_pair()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
                                   "category": "math"}) + "\n")
    rows = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        assert main(["bench", "--twin", "qwen3-30b-a3b@rtx4090-pcie4", "--freeze-host-time", "--prompts", str(prompts),
                     "--num-prompts", "1", "--tune-prompts", "0", "--cache-fractions", "0.5", "--policies",
                     "autoregressive", "specfit", "--max-new-tokens", "12", "--out", str(out)]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["meta"]["host_time"] == "frozen"
        rows.append({r["policy"]: r["decode_tokens_per_s"] for r in results["runs"]})
    assert rows[0] == rows[1]  # every duration is modeled: the same figures to the last bit
    assert set(rows[0]) == {"autoregressive", "specfit"} and all(v > 0 for v in rows[0].values())


def test_host_pauses_are_seeded_per_key_and_slow_the_emulated_clock():
    from specfit_hf.clock import HostPauses, advance, clock, host_pauses, paused, simulated

    with pytest.raises(ValueError, match="rate"):
        HostPauses(-1.0, 0.005)
    pauses = HostPauses(rate=50.0, mean=0.004, seed=3)
    pauses.reseed("prompt 0")
    first = [pauses.draw(0.010) for _ in range(400)]
    pauses.reseed("prompt 0")
    assert [pauses.draw(0.010) for _ in range(400)] == first  # the same key meets the same pauses
    # 0.5 pauses per 10 ms stretch on average, 4 ms each: 2 ms a stretch
    assert 0.0015 < sum(first) / len(first) < 0.0025 and 0.3 < sum(p > 0 for p in first) / len(first) < 0.5
    # a Poisson process: one call of 4 s meets what 400 calls of 10 ms meet, 200 pauses of 4 ms on average
    pauses.reseed("one call")
    assert 180 < sum(pauses.draw(4.0) for _ in range(20)) / 20 / 0.004 < 220
    assert HostPauses(0.0, 0.004).draw(1.0) == 0.0
    with simulated():
        t0 = clock()
        for _ in range(100):
            advance(0.010)
        assert clock() - t0 == pytest.approx(1.0)  # no pauses outside host_pauses
        with host_pauses(50.0, 0.004, seed=3) as busy:
            assert paused() is busy
            t1 = clock()
            for _ in range(100):
                advance(0.010)
            advance(-0.5)  # time a model replaces is never paused
            assert clock() - t1 == pytest.approx(0.5 + busy.total) and busy.total > 0.05
        assert paused() is None


def test_bench_with_host_pauses_is_slower_and_still_deterministic(tmp_path):
    from specfit_hf.cli import main

    with pytest.raises(SystemExit, match="host-pauses"):
        main(["bench", "--host-pauses", "30", "-1"])
    _need_embedded_pair()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
                                   "category": "math"}) + "\n")
    rows = []
    for i, pauses in enumerate([[], ["--host-pauses", "200", "5"], ["--host-pauses", "200", "5"]]):
        out = tmp_path / f"run{i}"
        assert main(["bench", "--twin", "qwen3-30b-a3b@rtx4090-pcie4", "--freeze-host-time", "--prompts", str(prompts),
                     "--num-prompts", "1", "--tune-prompts", "0", "--cache-fractions", "0.5", "--policies",
                     "autoregressive", "static:d2k1n2", "--max-new-tokens", "12", "--out", str(out), *pauses]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["meta"].get("host_pauses") == ({"per_second": 200.0, "mean_ms": 5.0} if pauses else None)
        rows.append({r["policy"]: r["decode_tokens_per_s"] for r in results["runs"]})
    assert rows[1] == rows[2]  # seeded: the same pauses again
    assert all(rows[1][k] < rows[0][k] for k in rows[0])  # a busy host is slower for every policy


def test_generate_saves_and_reuses_measurements(tmp_path, capsys):
    """``--measurements FILE``: the first run writes what SpecFit measured, the next starts from it."""
    import pickle

    from specfit_hf.cli import main

    saved = tmp_path / "m" / "specfit.pkl"
    args = ["generate", "--prompt", "Question: Tom has 3 apples and buys 4 more. How many?\nAnswer:",
            "--max-new-tokens", "10", "--twin", "qwen3-30b-a3b@rtx4090-pcie4", "--measurements", str(saved)]
    assert main(args) == 0
    first = pickle.loads(saved.read_bytes())
    assert set(first) == {"drafting", "acceptance"} and first["drafting"] and first["acceptance"]
    cycles = sum(int(m.cycle) for m in first["drafting"].values())
    assert main(args) == 0
    second = pickle.loads(saved.read_bytes())
    assert sum(int(m.cycle) for m in second["drafting"].values()) > cycles  # the second run went on counting
    assert capsys.readouterr().out.count("[specfit]") == 2
