"""The ``specfit`` command line: ``generate``, ``bench``, ``report`` and ``calibrate``.

``generate``, ``bench`` and ``calibrate`` default to the tiny model pair shipped with the
package (:mod:`specfit_hf.embedded`) and, on a host without CUDA, to an emulated PCIe link
(see :mod:`specfit_hf.regimes`) or a device twin (``--twin``, :mod:`specfit_hf.twin`);
``report`` merges their results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pickle
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_parser", "load_pair", "read_prompts_file"]


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target folder (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder or a small causal LM (default: embedded)")
    p.add_argument("--device", default=None, help="'cuda' or 'cpu' (default: cuda when available)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1; the emulated link is scaled to the measured compute, "
                   "which an oversubscribed thread pool distorts)")


def _add_offload_args(p: argparse.ArgumentParser, default_fraction: float = 0.5) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--offload-slots", type=int, default=None, help="device expert slots per MoE layer")
    g.add_argument("--cache-fraction", type=float, default=None,
                   help=f"slots as a fraction of experts (default {default_fraction})")
    p.add_argument("--link-gbps", type=float, default=None, help="emulated link bandwidth in GB/s (CPU only)")
    p.add_argument("--link-latency-us", type=float, default=0.0, help="emulated link latency per transfer")
    p.add_argument(
        "--link",
        default="qwen3-pcie4",
        help="link regime for the emulated link when --link-gbps is not given (see specfit_hf.regimes)",
    )
    _add_link_timing_arg(p, default="wait")


def _add_link_timing_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--link-timing",
        choices=["wait", "virtual"],
        default=default,
        help=f"emulated link: really wait out each transfer, or add it to a virtual clock (default {default}; "
        "same timeline, see specfit_hf.offload.link)",
    )


def _add_twin_arg(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument(
        "--twin", default=None, metavar="MODEL@DEVICE-LINK[+graphs]", nargs="+" if many else None,
        action="extend" if many else "store",  # `--twin A --twin B` runs both, like `--twin A B`
        help="charge a device twin's MODELED GPU time for forwards and expert transfers instead of this CPU's "
        "(specfit_hf.twin; e.g. qwen3-30b-a3b@rtx4090-pcie4" + ("; several: one part each, merged" if many else "")
        + "); --link/--link-gbps are then ignored",
    )


def _check_twin(names: str | list[str] | None) -> None:
    from .twin import get_twin

    for name in [names] if isinstance(names, str) else names or []:
        try:
            get_twin(name)
        except KeyError as e:
            raise SystemExit(f"specfit: {e.args[0]}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with an offloaded target and a draft, streaming")
    _add_model_args(g)
    _add_offload_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--policy", default="specfit", help="specfit | eagle3 | autoregressive | oracle")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--measurements", default=None, metavar="FILE",
                   help="start SpecFit from the measurements saved in FILE (if it exists) and save them there "
                   "afterwards, so the next run starts where this one stopped (a pickle: load only files you wrote; "
                   "keep one per host, link, cache size and model pair)")
    _add_twin_arg(g)

    b = sub.add_parser("bench", help="side-by-side benchmark of decoding policies")
    _add_model_args(b)
    b.add_argument("--prompts", default=None,
                   help="jsonl with a `prompt` field or Spec-Bench rows (`turns`, `category`)")
    b.add_argument("--dataset", action="append", choices=["cnn_dailymail", "gsm8k"], default=None,
                   help="local dataset(s) from ../shared/data (repeatable; default both when --prompts is absent)")
    b.add_argument("--num-prompts", type=int, default=8, help="prompts per category")
    b.add_argument("--tune-prompts", type=int, default=2,
                   help="other prompts per category (disjoint from the evaluated ones) to tune eagle3-best's N and "
                   "static-best's shape on (0: skip both)")
    b.add_argument("--policies", nargs="+", default=None,
                   help="columns to run: autoregressive eagle3 eagle3-vanilla eagle3-best specfit specfit-eagle "
                   "specfit-tree oracle, 'static' (every static tree of the family: chains d1-d7 and d10, d3k2n4, "
                   "d4k3n8, d7k10n60), static:d<depth>k<top_k>n<nodes>, static-best, 'lookup' (prompt lookup decoding "
                   "with 2, 4, 7 and 10 tokens), lookup:d<tokens>, specfit:c<levels> (SpecFit whose fixed chains may "
                   "have up to that many levels) (default: all)")
    b.add_argument("--cache-fractions", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    b.add_argument("--link", nargs="+", default=["qwen3-pcie4"], help="link regimes")
    b.add_argument("--runs", type=int, default=1,
                   help="repeat every prompt of every policy this many times; rows report the median run (default 1)")
    b.add_argument("--max-new-tokens", type=int, default=128,
                   help="new tokens per generation (default 128; decode tok/s is timed after the first)")
    b.add_argument("--max-source-chars", type=int, default=1500, help="shorten articles/questions to this many chars")
    b.add_argument("--out", default="runs/bench", help="output folder for results.json, results.md and plots")
    _add_link_timing_arg(b, default="virtual")
    _add_twin_arg(b, many=True)
    b.add_argument("--host-pauses", nargs=2, type=float, default=None, metavar=("PER_S", "MEAN_MS"),
                   help="a busy host, reproducibly: emulated work is paused PER_S times a second on average, for "
                   "MEAN_MS ms on average (seeded per prompt: every policy meets the same pauses); with "
                   "--freeze-host-time the runs stay deterministic")
    b.add_argument("--freeze-host-time", action="store_true",
                   help="with --twin: real time stands still, so every duration is the twin's modeled forwards and "
                   "transfers and host Python costs nothing; runs are deterministic (the policies' decisions "
                   "compared without timing noise), and the rows are not what a user gets")
    b.add_argument("--warm-prompts", type=int, default=0,
                   help="other prompts per category (after the tune prompts) that every SpecFit column generates, "
                   "unrecorded, before the evaluated ones, as a process that has served a few requests (default 0)")
    b.add_argument("--first-call", action="store_true",
                   help="every generation starts from nothing SpecFit measured before (what a process's first "
                   "generate call gets; by default a cell's later prompts start from what earlier ones measured)")

    r = sub.add_parser("report", help="merge several bench results.json files into one report")
    r.add_argument("results", nargs="+", help="results.json files (or folders holding one)")
    r.add_argument("--out", required=True, help="output folder for the merged results.json, results.md and plots")

    c = sub.add_parser("calibrate", help="fit the SpecFit cost model (t0, t_tok, t_exp) on this host and link")
    _add_model_args(c)
    _add_offload_args(c)
    return parser


def load_pair(model: str | None, draft: str | None, device: str) -> tuple[Any, Any, Any]:
    """Target, draft and tokenizer; defaults to the embedded pair."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_pair

    defaults = embedded_pair()  # checkout, editable or plain install (specfit_hf/model_cards)
    model_path = Path(model) if model else defaults.target
    draft_path = Path(draft) if draft else defaults.draft
    for what, path in (("target", model_path), ("draft", draft_path)):
        if not path.is_dir():
            raise SystemExit(f"specfit: {what} folder {path} not found (give --model/--draft)")
    target = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if (draft_path / "config.json").is_file() and "eagle" in (draft_path / "config.json").read_text().lower():
        from .eagle3 import Eagle3DraftModel

        draft_model = Eagle3DraftModel.from_pretrained(draft_path).to(device=device, dtype=torch.float32).eval()
    else:
        draft_model = AutoModelForCausalLM.from_pretrained(draft_path, dtype=torch.float32).to(device).eval()
    return target, draft_model, tokenizer


def read_prompts_file(path: str | Path) -> dict[str, list[str]]:
    """category -> prompts from a jsonl with ``prompt`` rows or Spec-Bench rows (``turns``, ``category``)."""
    out: dict[str, list[str]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" in row:
                text = row["prompt"]
            elif "turns" in row and row["turns"]:
                text = row["turns"][0]
            else:
                raise SystemExit(f"specfit: {path}:{n} has neither `prompt` nor `turns`")
            out.setdefault(str(row.get("category", "prompts")), []).append(text)
    return out


def _device(name: str | None) -> str:
    import torch

    if name:
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("specfit: --device cuda given but CUDA is not available")
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def _attach_offload(target: Any, args: argparse.Namespace, device: str, cached_step: float | None = None) -> Any:
    from .bench import link_for_regime
    from .offload import EmulatedLink, offload_experts

    kwargs: dict[str, Any] = {}
    if args.offload_slots is not None:
        kwargs["slots_per_layer"] = args.offload_slots
    else:
        kwargs["cache_fraction"] = args.cache_fraction if args.cache_fraction is not None else 0.5
    runtime = offload_experts(target, device=device, **kwargs)
    if device == "cpu":
        if args.link_gbps is not None:
            runtime.link = EmulatedLink(
                gbps=args.link_gbps, latency_us=args.link_latency_us, virtual=args.link_timing == "virtual"
            )
        elif cached_step is not None:
            runtime.link = link_for_regime(args.link, runtime, cached_step, virtual=args.link_timing == "virtual")
    return runtime


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from .bench import frozen_heap, measure_cached_step
    from .clock import clock
    from .generation import SpecFitConfig

    _check_twin(args.twin)
    device = _device(args.device)
    if args.twin is not None and device != "cpu":
        raise SystemExit("specfit: --twin models a GPU timeline on a CPU host; use --device cpu")
    target, draft, tok = load_pair(args.model, args.draft, device)
    ids = tok(args.prompt, return_tensors="pt").input_ids.to(device)
    emulate = device == "cpu" and args.link_gbps is None and args.twin is None
    cached_step = measure_cached_step(target, ids, new_tokens=8, repeats=1) if emulate else None
    runtime = _attach_offload(target, args, device, cached_step)
    timeline = None
    if args.twin is not None:
        from .twin import TwinTimeline

        timeline = TwinTimeline(args.twin, target, draft).attach()
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    config = SpecFitConfig(policy=args.policy, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True,
                           **sampling)
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tok, skip_prompt=True)
    saved = Path(args.measurements) if args.measurements else None
    if saved is not None and saved.is_file():
        from .selection import import_measurements

        with saved.open("rb") as f:
            import_measurements(target, draft, pickle.load(f))
    runtime.reset_stats()
    with frozen_heap():  # no full garbage collection (a pause over the whole model's objects) while decoding
        t = clock()
        out = target.generate(ids, assistant_model=draft, generation_config=config, streamer=streamer)
        seconds = clock() - t
    if saved is not None:
        from .selection import export_measurements

        saved.parent.mkdir(parents=True, exist_ok=True)
        with saved.open("wb") as f:
            pickle.dump(export_measurements(target, draft), f)
    new = out.sequences.shape[1] - ids.shape[1]
    cycles = out.cycles or []
    tau = statistics.fmean(c.tokens_committed for c in cycles) if cycles else float("nan")
    if timeline is not None:
        timing = f"MODELED on device twin {timeline.twin.name} ({timeline.twin.description})"
        timeline.detach()
    elif runtime.link is not None:
        timing = f"emulated link {runtime.link.gbps:.4g} GB/s + {runtime.link.latency_us:.3g} us per expert"
    else:
        timing = f"real {device} link"
    print(
        f"\n[{args.policy}] {new} tokens in {seconds:.2f}s = {new / seconds:.2f} tok/s | "
        f"mean accepted length {tau:.2f} | experts loaded/token {runtime.stats.total.misses / max(1, new):.2f} | "
        f"{timing}"
    )
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import expand_policies, merge_results, write_report
    from .clock import host_pauses, simulated
    from .data import load_prompts

    _check_twin(args.twin)
    if args.freeze_host_time and not args.twin:
        raise SystemExit("specfit: --freeze-host-time needs --twin (the emulated link times real CPU forwards)")
    if args.host_pauses is not None and not all(math.isfinite(v) and v >= 0 for v in args.host_pauses):
        raise SystemExit("specfit: --host-pauses takes a rate per second and a mean in ms, both >= 0")
    if args.warm_prompts < 0:
        raise SystemExit("specfit: --warm-prompts must be >= 0")
    if args.warm_prompts and args.first_call:
        raise SystemExit("specfit: --warm-prompts and --first-call exclude each other")
    if args.policies:  # before loading anything: a typo fails at once
        try:
            args.policies = expand_policies(args.policies)
        except ValueError as e:
            raise SystemExit(f"specfit: {e}") from e
    device = _device(args.device)
    if device != "cpu":
        raise SystemExit("specfit bench runs the emulated-link CPU benchmark; use examples/bench_gpu.py on CUDA hosts")
    target, draft, tok = load_pair(args.model, args.draft, device)
    n, t = args.num_prompts, args.tune_prompts  # the evaluated prompts, then the tune and the warm-up ones
    if args.prompts:
        by_category = read_prompts_file(args.prompts)
    else:
        by_category = {}
        for ds in args.dataset or ["cnn_dailymail", "gsm8k"]:
            rows = load_prompts(ds, "test", n=n + t + args.warm_prompts, max_source_chars=args.max_source_chars)
            by_category[rows[0]["category"]] = [r["prompt"] for r in rows]
    prompts = {c: ps[:n] for c, ps in by_category.items()}
    tune = {c: ps[n: n + t] for c, ps in by_category.items() if ps[n: n + t]}
    w = args.warm_prompts
    warm = {c: ps[n + t: n + t + w] for c, ps in by_category.items() if ps[n + t: n + t + w]}
    if args.policies:
        for tuned in ("eagle3-best", "static-best"):
            if tuned in args.policies and not tune:
                raise SystemExit(f"specfit: {tuned} needs --tune-prompts > 0")
    frozen = simulated() if args.freeze_host_time else contextlib.nullcontext()
    busy = contextlib.nullcontext() if args.host_pauses is None else host_pauses(
        args.host_pauses[0], args.host_pauses[1] / 1e3)
    with frozen, busy:
        parts = [_bench_part(args, target, draft, tok, prompts, tune, warm, twin) for twin in (args.twin or [None])]
    for part in parts:
        part["meta"]["host_time"] = "frozen" if args.freeze_host_time else "measured"
        if args.host_pauses is not None:
            part["meta"]["host_pauses"] = {"per_second": args.host_pauses[0], "mean_ms": args.host_pauses[1]}
    results = parts[0] if len(parts) == 1 else merge_results(parts)
    paths = write_report(results, args.out)
    print(paths["markdown"].read_text())
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


def _bench_part(args: argparse.Namespace, target: Any, draft: Any, tok: Any, prompts: dict[str, list[str]],
                tune: dict[str, list[str]], warm: dict[str, list[str]], twin: str | None) -> dict[str, Any]:
    """One twin's (or the emulated link's) grid of ``specfit bench``."""
    from .bench import run_benchmark

    return run_benchmark(
        target,
        draft,
        tok,
        prompts,
        cache_fractions=args.cache_fractions,
        links=args.link,
        policies=args.policies,
        runs=args.runs,
        max_new_tokens=args.max_new_tokens,
        tune_prompts=tune or None,
        virtual_link=args.link_timing == "virtual",
        twin=twin,
        first_call=args.first_call,
        warm_prompts=warm or None,
    )


def _cmd_report(args: argparse.Namespace) -> int:
    from .bench import merge_results, write_report

    parts = []
    for path in args.results:
        p = Path(path)
        p = p / "results.json" if p.is_dir() else p
        if not p.is_file():
            raise SystemExit(f"specfit: no results.json at {path}")
        parts.append(json.loads(p.read_text()))
    try:
        merged = merge_results(parts)
    except ValueError as e:
        raise SystemExit(f"specfit: {e}") from e
    paths = write_report(merged, args.out)
    print(paths["markdown"].read_text())
    print(paths["summary"].read_text())
    print("wrote", ", ".join(str(p) for p in paths.values()))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .bench import measure_cached_step
    from .selection import calibrate

    device = _device(args.device)
    target, draft, tok = load_pair(args.model, args.draft, device)
    ids = tok("Question: A farmer has 12 cows and buys 5 more. How many cows?\nAnswer:", return_tensors="pt").input_ids
    cached_step = measure_cached_step(target, ids.to(device), new_tokens=8, repeats=1) if device == "cpu" else None
    runtime = _attach_offload(target, args, device, cached_step)
    cost = calibrate(target, draft, runtime)
    print(cost)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    handler = {"generate": _cmd_generate, "bench": _cmd_bench, "report": _cmd_report, "calibrate": _cmd_calibrate}[
        args.command
    ]
    return handler(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
