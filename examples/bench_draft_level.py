"""Host cost of one chain draft level of the embedded EAGLE-3 draft (CPU time, no twin, no offload).

A draft level is a few dozen small ops; on a CPU each costs microseconds of dispatch, so the
level's time is mostly host work.  This times ``draft_level`` growing 1-child chains below a
random prompt (levels 2..depth of each tree; level 1 also reads the prompt's root pair) and
prints the minimum over repetitions of the mean per level: the minimum filters out a noisy
host's slow spells, which on this project's 2-core VM move single figures by 30 %.

    .venv/bin/python examples/bench_draft_level.py --reps 80
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from specfit_hf import Eagle3DraftModel
from specfit_hf.data import default_model_paths
from specfit_hf.features import capture_hidden_states
from specfit_hf.tree import DraftTree


def chain_level_seconds(target, draft, prompt_len: int, depth: int, reps: int, trees_per_rep: int) -> float:
    """Minimum over ``reps`` of the mean seconds per chain level (levels 2..``depth``)."""
    drafter = draft.make_tree_drafter(target, type("Cfg", (), {"tree_top_k": 10})())
    idx = drafter.target_feature_indices
    prompt = torch.randint(0, target.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), capture_hidden_states(target, idx) as cap:
        target(prompt)
    feats = torch.cat([cap[i] for i in idx], -1)
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps):
            total = 0.0
            for _ in range(trees_per_rep):
                drafter.start(prompt, feats)
                tree = DraftTree(int(prompt[0, -1]))
                drafter.draft_level(tree, children=1)
                t0 = time.perf_counter()
                for _ in range(depth - 1):
                    drafter.draft_level(tree, expand=torch.tensor([len(tree) - 1]), children=1)
                total += time.perf_counter() - t0
                if tree.parents.tolist() != list(range(-1, depth - 1)):
                    raise RuntimeError(f"the drafter grew {tree.parents.tolist()}, not a chain of {depth}")
            best = min(best, total / trees_per_rep / (depth - 1))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--reps", type=int, default=80)
    parser.add_argument("--trees-per-rep", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.depth < 2:
        parser.error("--depth must be at least 2 (level 1 is not timed)")
    torch.set_num_threads(args.threads)
    paths = default_model_paths()
    target = AutoModelForCausalLM.from_pretrained(paths.target)
    draft = Eagle3DraftModel.from_pretrained(paths.draft)
    seconds = chain_level_seconds(target, draft, args.prompt_len, args.depth, args.reps, args.trees_per_rep)
    print(f"one chain draft level: {1e6 * seconds:.1f} us (min over {args.reps} reps of {args.trees_per_rep} "
          f"trees x {args.depth - 1} levels, prompt {args.prompt_len} tokens, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
