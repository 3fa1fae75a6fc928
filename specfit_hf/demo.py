"""The main job: SpecFit next to plain decoding, the best static tree, prompt lookup and EAGLE-3 on the embedded pair.

    bash scripts/demo.sh            # or: python -m specfit_hf.demo [--prompts 2] [--max-new-tokens 128]
    python -m specfit_hf.demo --twin qwen3-30b-a3b@rtx4090-pcie4   # also on a modeled GPU timeline

Loads the tiny Qwen3-MoE target and its EAGLE-3 draft from ``model_cards/``, keeps the
target's experts in host memory with a device cache of half the experts behind an
emulated PCIe 4.0 link (Qwen3-30B-A3B's transfer/compute ratio, see
:mod:`specfit_hf.regimes`), generates greedily for a few CNN/DailyMail and GSM8K test
prompts with each policy, checks the outputs are identical, and prints decode-phase
tokens/s (after the first token) and the time to the first token per policy, then one
generated answer.

The "best static tree" is tuned like ``specfit bench``'s ``static-best``: every shape of
the static family (chains of depth 1-7 and 10, two small trees, EAGLE-3's 60/7/10) runs on
``--tune-prompts`` other prompts of the dataset and the fastest in decode tok/s is kept.
With ``--tune-prompts 0`` it is a fixed depth-2 chain (the best fixed chain measured on this
host in issue 13).  SpecFit first generates the same tune prompts, unrecorded: it learns its
drafting rates and acceptance online and keeps them from one ``generate`` call to the next,
so its evaluated calls start as those of a process that has served a request already (a
process's very first call is ``specfit bench --first-call``'s column).  "prompt lookup" is prompt
lookup decoding (transformers' ``prompt_lookup_num_tokens``) with 2-token proposals, its best
length on this pair.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

from .cli import _add_link_timing_arg

__all__ = ["main"]

DEMO_POLICIES = ("autoregressive", "static-best", "lookup:d2", "eagle3", "specfit")
FIXED_STATIC = "static:d2k1n2"
_NAMES = {"autoregressive": "plain decoding", "eagle3": "EAGLE-3 tree 60/7/10", "specfit": "SpecFit"}


def _policy_name(row: dict[str, Any]) -> str:
    if row["policy"] == "static-best":
        return f"best static {row['static_best_shape'][7:]}"
    if row["policy"].startswith("static:"):
        return f"static tree {row['policy'][7:]}"
    if row["policy"].startswith("lookup:"):
        return f"prompt lookup, {row['policy'][8:]} tokens"
    return _NAMES.get(row["policy"], row["policy"])


def _print_table(title: str, rows: list[dict[str, Any]]) -> bool:
    """Print one link's rows for a reader; returns whether every output matched plain decoding."""
    print(f"\n{title}")
    header = (f"  {'dataset':<14} {'policy':<24} {'decode tok/s':>12} {'x plain':>8} {'first token':>12} "
              f"{'tokens/cycle':>12} {'same text':>9}")
    print(header + "\n  " + "-" * (len(header) - 2))
    ok = True
    for r in rows:
        ok &= bool(r["outputs_identical_to_autoregressive"])
        print(
            f"  {r['category']:<14} {_policy_name(r):<24} {r['decode_tokens_per_s']:>12.1f} "
            f"{r.get('speedup_vs_autoregressive', 1.0):>7.2f}x {r['ttft_s'] * 1e3:>9.0f} ms "
            f"{r['mean_accepted']:>12.2f} {'yes' if r['outputs_identical_to_autoregressive'] else 'NO':>9}"
        )
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 1 if a policy's greedy output differs from plain decoding."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per dataset")
    parser.add_argument("--tune-prompts", type=int, default=1,
                        help=f"other prompts per dataset to pick the best static tree on (0: fixed {FIXED_STATIC})")
    # 128 new tokens, as `specfit bench`: in 64-token answers a generation's opening (its first ~24 tokens,
    # where every policy is slowest and runs most unevenly) was a third of what two prompts time (README)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--link", default="qwen3-pcie4", help="link regime (specfit_hf.regimes.REGIMES)")
    parser.add_argument("--twin", default=None,
                        help="also run on this device twin's modeled GPU timeline (specfit_hf.twin.TWINS)")
    parser.add_argument("--max-source-chars", type=int, default=600)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (default 1: the tiny model's small matmuls gain nothing from more, and an "
        "oversubscribed OpenMP pool distorts the measured compute the emulated link is scaled to)",
    )
    _add_link_timing_arg(parser, default="virtual")
    args = parser.parse_args(argv)
    if args.twin is not None:
        from .twin import get_twin

        try:
            get_twin(args.twin)
        except KeyError as e:
            parser.error(str(e.args[0]))

    import torch

    torch.set_num_threads(args.threads)
    from .bench import run_benchmark
    from .cli import load_pair
    from .data import load_prompts
    from .regimes import REGIMES

    started = time.perf_counter()
    target, draft, tok = load_pair(None, None, "cpu")
    prompts, tune = {}, {}
    for name in ("cnn_dailymail", "gsm8k"):
        rows = load_prompts(name, "test", n=args.prompts + args.tune_prompts, max_source_chars=args.max_source_chars)
        prompts[name] = [r["prompt"] for r in rows[: args.prompts]]
        tune[name] = [r["prompt"] for r in rows[args.prompts:]]
    policies = [p if p != "static-best" or args.tune_prompts else FIXED_STATIC for p in DEMO_POLICIES]
    num_params = sum(p.numel() for p in target.parameters())
    print(f"target: tiny Qwen3-MoE, {num_params / 1e6:.1f}M parameters; draft: its EAGLE-3 head; "
          f"{args.prompts} prompts per dataset, {args.max_new_tokens} new tokens each, greedy; "
          f"device expert cache: {args.cache_fraction:.0%} of experts")
    if args.tune_prompts:
        print(f"the best static tree is tuned, and SpecFit learns its rates, on {args.tune_prompts} other prompt(s) "
              "per dataset first")
    common = dict(cache_fractions=(args.cache_fraction,), policies=policies, max_new_tokens=args.max_new_tokens,
                  tune_prompts=tune if args.tune_prompts else None, warm_prompts=tune if args.tune_prompts else None,
                  virtual_link=args.link_timing == "virtual")
    emulated = run_benchmark(target, draft, tok, prompts, links=(args.link,), **common)
    regime = REGIMES[args.link]
    timing = "transfers on the virtual clock" if args.link_timing == "virtual" else "transfers waited out"
    ok = _print_table(
        f"Emulated link on this CPU ({regime.description}; {timing}); compute is this CPU's:", emulated["runs"]
    )
    if args.twin is not None:
        twinned = run_benchmark(target, draft, tok, prompts, twin=args.twin, **common)
        spec = twinned["meta"]["twin"]
        ok &= _print_table(
            f"Modeled GPU timeline '{args.twin}' ({spec['description']}; MODELED, not measured: forwards and "
            "transfers charged by the twin's roofline, host-side Python measured):",
            twinned["runs"],
        )
    sample = next(r for r in emulated["runs"] if r["category"] == "gsm8k" and r["policy"] == "specfit")
    question = prompts["gsm8k"][0].strip()
    print("\nOne answer (GSM8K, SpecFit, identical to plain decoding):")
    print("  prompt: " + (question if len(question) < 300 else "..." + question[-300:]).replace("\n", "\n          "))
    print("  answer: " + tok.decode(sample["first_output_tokens"], skip_special_tokens=True).strip()
          .replace("\n", "\n          "))
    print(f"\n(decode tok/s = tokens after the first / seconds after the first token; 'first token' = time to the "
          f"first token, prefill from an empty expert cache; {time.perf_counter() - started:.0f} s in all)")
    if not ok:
        print("ERROR: a policy's output differs from plain decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
