"""ROUGE on CNN/DailyMail and final-answer accuracy on GSM8K: autoregressive vs SpecFit (greedy).

    python examples/quality_check.py --prompts 20 --max-new-tokens 64

Asserts that SpecFit's outputs are token-identical to autoregressive decoding (it is
lossless) and prints both sets of metrics, computed with ``evaluate`` metric modules
(``specfit_hf.quality``) on the test splits in ``../shared/data``.
"""

from __future__ import annotations

import argparse
import json

import torch

from specfit_hf.cli import load_pair
from specfit_hf.quality import quality_check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--policy", default="specfit")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair(None, None, "cpu")
    report = quality_check(target, draft, tok, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                           policy=args.policy)
    print(json.dumps({"identical": report.identical, "prompts": report.prompts, "metrics": report.metrics}, indent=2))


if __name__ == "__main__":
    main()
