"""First calls with and without the measurements of an earlier process, on the embedded pair.

SpecFit learns drafting rates, costs and acceptance as it runs, and a process's first ``generate``
starts from nothing.  This script measures what carrying the measurements over buys:

1. ``--warm-prompts`` other test prompts run with SpecFit, then ``export_measurements`` (pickled and
   unpickled, as a file between two processes would be);
2. for each of ``--num-prompts`` test prompts: the reference chain, SpecFit as a first call
   (``forget_measurements`` first), and SpecFit with the export imported (``import_measurements``).

It prints the geometric mean over prompts of SpecFit's decode tok/s against the reference's, for
both.  The clock is the twin's (``--twin``, the default) or this CPU's with the emulated
``qwen3-pcie4`` link (``--twin none``); ``--freeze-host-time`` (twin only) makes it deterministic.

    python examples/bench_carried_measurements.py --dataset gsm8k --cache-fraction 0.5 --num-prompts 24
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pickle
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "cnn_dailymail"])
    parser.add_argument("--cache-fraction", type=float, default=0.5)
    parser.add_argument("--num-prompts", type=int, default=24, help="test prompts evaluated (from the first)")
    parser.add_argument("--warm-prompts", type=int, default=8, help="other test prompts the export is measured on")
    parser.add_argument("--reference", default="static:d7k1n7", help="the static row SpecFit is compared with")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--twin", default="qwen3-30b-a3b@rtx4090-pcie4",
                        help="device twin whose modeled clock is used; 'none': this CPU + emulated qwen3-pcie4")
    parser.add_argument("--freeze-host-time", action="store_true", help="with a twin: host Python costs nothing")
    args = parser.parse_args(argv)
    if args.freeze_host_time and args.twin == "none":
        parser.error("--freeze-host-time needs a twin")
    if args.num_prompts < 1 or args.warm_prompts < 1:
        parser.error("--num-prompts and --warm-prompts must be >= 1")

    import torch

    torch.set_num_threads(1)
    from specfit_hf.bench import Variant, link_for_regime, measure_cached_step, named_variant, run_variant
    from specfit_hf.cli import load_pair
    from specfit_hf.clock import simulated
    from specfit_hf.data import load_prompts
    from specfit_hf.offload import offload_experts
    from specfit_hf.regimes import REGIMES
    from specfit_hf.selection import export_measurements, forget_measurements, import_measurements
    from specfit_hf.twin import TwinTimeline

    target, draft, tok = load_pair(None, None, "cpu")
    # the warm-up prompts come from far down the test split, disjoint from the evaluated ones
    offset = max(100, args.num_prompts)
    rows = load_prompts(args.dataset, "test", n=offset + args.warm_prompts, max_source_chars=1500)
    if len(rows) < offset + args.warm_prompts:
        parser.error(f"the {args.dataset} test split has only {len(rows)} prompts")
    encode = [tok(r["prompt"], return_tensors="pt").input_ids for r in rows]
    evaluated, warm = encode[: args.num_prompts], encode[offset:offset + args.warm_prompts]
    specfit, reference = Variant("specfit", "specfit"), named_variant(args.reference)
    twin = None if args.twin == "none" else args.twin
    cached_step = None if twin else measure_cached_step(target, evaluated[0])
    rates: dict[str, list[float]] = {"reference": [], "first call": [], "imported": []}

    def rate(variant: Variant, ids: torch.Tensor, first_call: bool = False) -> float:
        r = run_variant(target, draft, ids, variant, args.max_new_tokens, first_call=first_call)
        return r.decode_tokens / max(r.decode_seconds, 1e-12)

    clock = simulated() if args.freeze_host_time else contextlib.nullcontext()
    with clock:
        runtime = offload_experts(target, device="cpu", cache_fraction=args.cache_fraction)
        timeline = TwinTimeline(twin, target, draft).attach() if twin else None
        if twin is None:
            runtime.link = link_for_regime(REGIMES["qwen3-pcie4"], runtime, cached_step, virtual=True)
        try:
            forget_measurements()
            for ids in warm:
                rate(specfit, ids)
            saved = pickle.loads(pickle.dumps(export_measurements(target, draft)))  # as a file would carry it
            for ids in evaluated:
                rates["reference"].append(rate(reference, ids))
                rates["first call"].append(rate(specfit, ids, first_call=True))
                forget_measurements()
                import_measurements(target, draft, saved)
                rates["imported"].append(rate(specfit, ids))
        finally:
            if timeline is not None:
                timeline.detach()
            runtime.detach()
            forget_measurements()

    def geomean_ratio(values: list[float]) -> float:
        return math.exp(sum(math.log(v / r) for v, r in zip(values, rates["reference"])) / len(values))

    clock_name = (f"modeled {twin}" + (", host time frozen" if args.freeze_host_time else ", real host time")
                  if twin else "CPU + emulated qwen3-pcie4, real host time")
    print(f"{args.dataset}, cache {args.cache_fraction:.0%}, {clock_name}; {args.num_prompts} prompts, "
          f"export from {args.warm_prompts} other prompts. SpecFit / {args.reference} (geometric mean over prompts):")
    print(f"  first call {geomean_ratio(rates['first call']):.3f}   imported {geomean_ratio(rates['imported']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
