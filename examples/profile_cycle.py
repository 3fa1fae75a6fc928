"""Where one SpecFit cycle's time goes: draft / policy / verify per cycle, on a twin or the emulated link.

A fresh process (nothing measured before), the embedded pair, the first ``--num-prompts`` test prompts of each
dataset, each generation from a flushed expert cache; medians over the ``CycleRecord`` s that
``generate(..., return_dict_in_generate=True)`` returns in ``.cycles``:

    python examples/profile_cycle.py --twin qwen3-30b-a3b@rtx4090-pcie4 --cache-fraction 0.5 --num-prompts 4
    python examples/profile_cycle.py --link qwen3-pcie4            # CPU compute, emulated link (virtual clock)

The policy column is its selection after every draft level plus its learning from the previous cycle
(``CycleRecord.policy_seconds``); "policy share" is its median share of a cycle.

A second table splits the time by the kind of cycle the drafting gate chose (``CycleRecord.kind``: plain,
``chain:h``, ``probe:h``, tree, lookup), over each generation's first ``--first-tokens`` committed tokens and over
the rest: where a fixed chain is faster, it shows which cycles cost the difference (a generation's first cycles
run against the prefill's experts, and accept less).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from specfit_hf.bench import WARMUP_TOKENS, link_for_regime, measure_cached_step, time_by_kind
from specfit_hf.cli import load_pair
from specfit_hf.data import load_prompts
from specfit_hf.generation import EAGLE3_DEFAULTS, SpecFitConfig
from specfit_hf.offload import offload_experts
from specfit_hf.twin import TwinTimeline


def profile(records: list[Any]) -> dict[str, float]:
    """Medians over ``records`` (``CycleRecord`` s): ms per phase, policy share, drafted / verified nodes."""
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    drafting = [c for c in records if c.levels_drafted > 0]
    return {
        "cycles": len(records),
        "cycle_ms": med([1e3 * c.cycle_seconds for c in records]),
        "draft_ms": med([1e3 * c.draft_seconds for c in records]),
        "policy_ms": med([1e3 * c.policy_seconds for c in records]),
        "verify_ms": med([1e3 * c.verify_seconds for c in records]),
        "policy_share": med([c.policy_seconds / c.cycle_seconds for c in records if c.cycle_seconds > 0]),
        "drafting_share": len(drafting) / max(1, len(records)),
        "nodes_drafted": med([c.nodes_drafted for c in drafting]),
        "nodes_verified": med([c.nodes_verified for c in drafting]),
        "lookup_share": sum(c.source == "lookup" for c in records) / max(1, len(records)),
        "tokens_per_cycle": statistics.fmean(c.tokens_committed for c in records) if records else float("nan"),
    }


def by_kind(generations: list[list[Any]], first_tokens: int = WARMUP_TOKENS) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`specfit_hf.bench.time_by_kind` of ``generations``: one list of ``CycleRecord`` s per ``generate`` call."""
    return time_by_kind([[(c.kind, c.tokens_committed, c.cycle_seconds) for c in g] for g in generations], first_tokens)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--twin", default=None, help="a device twin (default: the emulated link --link)")
    p.add_argument("--link", default="qwen3-pcie4", help="emulated link regime when no --twin is given")
    p.add_argument("--dataset", nargs="+", default=["gsm8k", "cnn_dailymail"])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--cache-fraction", type=float, default=0.5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-source-chars", type=int, default=1500)
    p.add_argument("--first-tokens", type=int, default=WARMUP_TOKENS,
                   help="committed tokens of each generation counted as its first phase (the kinds table)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, draft, tok = load_pair(None, None, "cpu")
    prompts = {ds: [tok(r["prompt"], return_tensors="pt").input_ids
                    for r in load_prompts(ds, "test", n=args.num_prompts, max_source_chars=args.max_source_chars)]
               for ds in args.dataset}
    cached = None if args.twin else measure_cached_step(target, next(iter(prompts.values()))[0])
    out, kinds = {}, {}
    for ds, ids in prompts.items():
        runtime = offload_experts(target, device="cpu", cache_fraction=args.cache_fraction)
        timeline = None
        try:
            if args.twin:
                timeline = TwinTimeline(args.twin, target, draft).attach()
            else:
                runtime.link = link_for_regime(args.link, runtime, cached, virtual=True)
            generations = []
            for x in ids:
                runtime.flush()
                cfg = SpecFitConfig(policy="specfit", do_sample=False, max_new_tokens=args.max_new_tokens,
                                    return_dict_in_generate=True, **EAGLE3_DEFAULTS)
                generations.append(list(target.generate(x, assistant_model=draft, generation_config=cfg).cycles))
        finally:
            if timeline is not None:
                timeline.detach()
            runtime.detach()
        out[ds] = profile([c for g in generations for c in g])
        kinds[ds] = by_kind(generations, args.first_tokens)
    clock_name = f"modeled twin {args.twin}" if args.twin else f"CPU + emulated {args.link}"
    print(f"one SpecFit cycle, {clock_name}, cache {args.cache_fraction:.0%}, medians over cycles")
    print("| dataset | cycles | cycle ms | draft ms | policy ms | verify ms | policy share | drafting cycles: "
          "nodes drafted / verified | lookup cycles | tokens / cycle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ds, f in out.items():
        print(f"| {ds} | {f['cycles']} | {f['cycle_ms']:.2f} | {f['draft_ms']:.2f} | {f['policy_ms']:.3f} | "
              f"{f['verify_ms']:.2f} | {f['policy_share']:.1%} | {f['drafting_share']:.0%}: "
              f"{f['nodes_drafted']:g} / {f['nodes_verified']:g} | {f['lookup_share']:.0%} | "
              f"{f['tokens_per_cycle']:.2f} |")
    print(f"\ntime by cycle kind: each generation's first {args.first_tokens} tokens, then the rest")
    print("| dataset | phase | kind | cycles | tokens | ms / token | share of the phase's time |")
    print("|---|---|---|---|---|---|---|")
    for ds, phases in kinds.items():
        for phase, rows in phases.items():
            for kind, r in sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]):
                print(f"| {ds} | {phase} | {kind} | {r['cycles']} | {r['tokens']} | {r['ms_per_token']:.2f} | "
                      f"{r['share']:.1%} |")
    return out


if __name__ == "__main__":
    main()
