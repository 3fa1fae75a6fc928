#!/usr/bin/env python
"""Mean accepted length of the shipped draft on the shipped target (greedy, one policy).

For each GSM8K test and CNN/DailyMail test prompt, runs

    target.generate(..., assistant_model=draft,
                    generation_config=SpecFitConfig(policy=..., max_new_tokens=N, do_sample=False))

and reports the mean accepted length tau (tokens committed per cycle: accepted draft
tokens + the bonus token) per dataset, plus wall time. For the first
``--check-lossless`` prompts of each dataset the output is compared with the target's
own greedy ``generate`` (SpecFit must be token-identical).

Example::

    .venv/bin/python examples/measure_acceptance.py --n 50 --max-new-tokens 48 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specfit_hf.cli import load_pair
from specfit_hf.data import default_model_paths, load_prompts
from specfit_hf.generation import SpecFitConfig

CNN_MAX_SOURCE_CHARS = 2500  # keeps CNN/DM prompts inside the 1024-token training length


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = default_model_paths()
    p.add_argument("--target", type=Path, default=defaults.target)
    p.add_argument("--draft", type=Path, default=defaults.draft)
    p.add_argument("--policy", default="eagle3")
    p.add_argument("--n", type=int, default=50, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--check-lossless", type=int, default=3, help="prompts per dataset compared with plain greedy")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/measure/acceptance.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    datasets = {
        "gsm8k": load_prompts("gsm8k", "test", n=args.n, data_dir=args.data_dir),
        "cnn_dailymail": load_prompts(
            "cnn_dailymail", "test", n=args.n, data_dir=args.data_dir, max_source_chars=CNN_MAX_SOURCE_CHARS
        ),
    }
    result: dict = {"policy": args.policy, "max_new_tokens": args.max_new_tokens, "threads": args.threads}
    for name, rows in datasets.items():
        taus: list[int] = []
        new_tokens = 0
        mismatches = 0
        t0 = time.perf_counter()
        for i, row in enumerate(tqdm(rows, desc=f"{name} ({args.policy})", unit="prompt")):
            enc = tokenizer(row["prompt"], return_tensors="pt")
            config = SpecFitConfig(
                policy=args.policy,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
            )
            with torch.no_grad():
                out = target.generate(**enc, assistant_model=draft, generation_config=config)
            taus.extend(c.tokens_committed for c in out.cycles)
            new_tokens += out.sequences.shape[1] - enc["input_ids"].shape[1]
            if i < args.check_lossless:
                with torch.no_grad():
                    ref = target.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)
                mismatches += int(not torch.equal(ref, out.sequences))
        wall = time.perf_counter() - t0
        result[name] = {
            "prompts": len(rows),
            "cycles": len(taus),
            "mean_accepted_length": round(sum(taus) / max(len(taus), 1), 3),
            "new_tokens": int(new_tokens),
            "wall_s": round(wall, 1),
            "lossless_checked": min(args.check_lossless, len(rows)),
            "lossless_mismatches": mismatches,
        }
        print(name, json.dumps(result[name]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
