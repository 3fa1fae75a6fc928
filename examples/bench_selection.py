"""Latency of the exact subtree search (``select_subtree``) on Qwen3-30B-A3B-shaped inputs.

Trees are EAGLE-style (each level expands the most likely nodes), path probabilities
are products of random per-node acceptances, and each node's experts are drawn per
layer (uniformly, or correlated with its parent's with ``--correlated``); half the
experts of every layer are cached.  The cost model uses the Qwen3-30B-A3B regime at
PCIe 4.0 (0.38 ms per expert, reference-facts.md).

    python examples/bench_selection.py                 # N in {16, 32, 64, 128}
    python examples/bench_selection.py --sizes 64 --reps 200 --correlated
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specfit_hf.selection import CostModel, select_subtree


def make_tree(rng: np.random.Generator, n: int, branch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """An EAGLE-like tree of ``n`` nodes: expand the best frontier nodes level by level."""
    parents: list[int] = []
    path: list[float] = []
    frontier = [(-1, 1.0)]
    while len(parents) < n:
        children = []
        for parent, parent_p in frontier:
            probs = np.sort(rng.dirichlet(np.full(branch + 1, 0.4)))[::-1][:branch]
            for q in probs:
                children.append((parent, parent_p * float(q)))
        children.sort(key=lambda c: -c[1])
        take = children[: min(branch * 2, n - len(parents))]
        new_frontier = []
        for parent, p in take:
            parents.append(parent)
            path.append(p)
            new_frontier.append((len(parents) - 1, p))
        frontier = new_frontier
    return np.array(parents), np.array(path)


def make_experts(rng, parents, layers, experts, top_k, correlated):
    n = len(parents)
    out = np.empty((n, layers, top_k), dtype=np.int64)
    root = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
    for v in range(n):
        base = root if parents[v] < 0 else out[parents[v]]
        for layer in range(layers):
            if correlated:
                keep = base[layer][rng.random(top_k) < 0.5]
                fresh = rng.permutation(np.setdiff1d(np.arange(experts), keep))[: top_k - keep.size]
                out[v, layer] = np.concatenate([keep, fresh])
            else:
                out[v, layer] = rng.choice(experts, top_k, replace=False)
    return out, root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--reps", type=int, default=100, help="random instances per size")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--cached-fraction", type=float, default=0.5)
    ap.add_argument("--t0", type=float, default=0.020)
    ap.add_argument("--t-token", type=float, default=0.001)
    ap.add_argument("--t-expert", type=float, default=0.00038)
    ap.add_argument("--correlated", action="store_true", help="children reuse half their parent's experts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cost = CostModel(args.t0, args.t_token, args.t_expert)
    rng = np.random.default_rng(args.seed)
    print(f"cost {cost}; experts {'correlated' if args.correlated else 'uniform'}; {args.reps} instances per size")
    print(f"{'N':>5} {'median ms':>10} {'p90 ms':>8} {'max ms':>8} {'|S| med':>8} {'E(S) med':>9} {'tok/s med':>10}")
    for n in args.sizes:
        times, sizes, exp_tokens, thr = [], [], [], []
        for _ in range(args.reps):
            parents, path = make_tree(rng, n)
            ne, root = make_experts(rng, parents, args.layers, args.experts, args.top_k, args.correlated)
            cached = rng.random((args.layers, args.experts)) < args.cached_fraction
            t = time.perf_counter()
            sel = select_subtree(parents, path, ne, root, cached, cost)
            times.append(time.perf_counter() - t)
            sizes.append(len(sel))
            exp_tokens.append(sel.expected_tokens)
            thr.append(sel.throughput)
        ms = sorted(1e3 * x for x in times)
        print(
            f"{n:>5} {statistics.median(ms):>10.3f} {ms[int(0.9 * len(ms)) - 1]:>8.3f} {ms[-1]:>8.3f}"
            f" {statistics.median(sizes):>8.1f} {statistics.median(exp_tokens):>9.3f} {statistics.median(thr):>10.2f}"
        )


if __name__ == "__main__":
    main()
