"""The main job: SpecFit next to autoregressive decoding and EAGLE-3 on the embedded pair.

    bash scripts/demo.sh            # or: python -m specfit_hf.demo [--prompts 2] [--max-new-tokens 32]

Loads the tiny Qwen3-MoE target and its EAGLE-3 draft from ``model_cards/``, keeps the
target's experts in host memory with a device cache of half the experts behind an
emulated PCIe 4.0 link (Qwen3-30B-A3B's transfer/compute ratio, see
:mod:`specfit_hf.regimes`), generates greedily for a few CNN/DailyMail and GSM8K test
prompts with each policy, checks the outputs are identical, and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from .cli import _add_link_timing_arg

__all__ = ["main"]

DEMO_VARIANTS = ("autoregressive", "eagle3", "specfit")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--link", default="qwen3-pcie4", help="link regime (specfit_hf.regimes.REGIMES)")
    parser.add_argument("--max-source-chars", type=int, default=600)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (default 1: the tiny model's small matmuls gain nothing from more, and an "
        "oversubscribed OpenMP pool distorts the measured compute the emulated link is scaled to)",
    )
    _add_link_timing_arg(parser, default="virtual")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    from .bench import default_variants, link_for_regime, measure_cached_step, run_variant, summarize
    from .cli import load_pair
    from .data import load_prompts
    from .offload import offload_experts
    from .regimes import REGIMES

    started = time.perf_counter()
    target, draft, tok = load_pair(None, None, "cpu")
    datasets = {}
    for name in ("cnn_dailymail", "gsm8k"):
        rows = load_prompts(name, "test", n=args.prompts, max_source_chars=args.max_source_chars)
        datasets[name] = [tok(r["prompt"], return_tensors="pt").input_ids for r in rows]
    num_params = sum(p.numel() for p in target.parameters())  # before the experts move to host slots
    cached_step = measure_cached_step(target, datasets["gsm8k"][0], new_tokens=8, repeats=2)
    runtime = offload_experts(target, device="cpu", cache_fraction=args.cache_fraction)
    runtime.link = link_for_regime(args.link, runtime, cached_step, virtual=args.link_timing == "virtual")
    variants = [v for v in default_variants() if v.label in DEMO_VARIANTS]
    print(
        f"target: {num_params / 1e6:.1f}M params, "
        f"{len(runtime.moe_layers)} MoE layers x {runtime.num_experts} experts (top-{runtime.top_k}); "
        f"device cache {args.cache_fraction:.0%} of experts; emulated link: {REGIMES[args.link].description} "
        f"-> {runtime.link} (cached decode step here {cached_step * 1e3:.1f} ms)"
    )
    all_rows = {}
    try:
        with tqdm(total=len(variants) * sum(len(v) for v in datasets.values()), desc="demo") as bar:
            for name, prompt_ids in datasets.items():
                runs, reference = [], {}
                for v in variants:
                    for i, ids in enumerate(prompt_ids):
                        r = run_variant(target, draft, ids, v, args.max_new_tokens, prompt_index=i)
                        if v.policy is None:
                            reference[i] = r.new_tokens
                        runs.append(r)
                        bar.update()
                all_rows[name] = summarize(runs, reference, baselines=("autoregressive", "eagle3"))
    finally:
        runtime.detach()
    torch.set_printoptions(precision=2)
    header = f"{'dataset':<14} {'policy':<15} {'tok/s':>7} {'x AR':>6} {'x EAGLE-3':>9} {'accepted':>8} {'experts/tok':>11} {'identical':>9}"
    print("\n" + header + "\n" + "-" * len(header))
    ok = True
    for name, rows in all_rows.items():
        for label, row in rows.items():
            ok &= bool(row["outputs_identical_to_autoregressive"])
            print(
                f"{name:<14} {label:<15} {row['tokens_per_s']:>7.2f} {row.get('speedup_vs_autoregressive', 1.0):>6.2f} "
                f"{row.get('speedup_vs_eagle3', 1.0):>9.2f} {row['mean_accepted']:>8.2f} "
                f"{row['experts_loaded_per_token']:>11.2f} {str(row['outputs_identical_to_autoregressive']):>9}"
            )
    timing = "transfers on the virtual clock" if args.link_timing == "virtual" else "transfers waited out"
    print(f"\n(emulated link on CPU, {timing}; {time.perf_counter() - started:.0f} s total)")
    if not ok:
        print("ERROR: a policy's output differs from autoregressive decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
