"""Latency of the exact subtree search (``select_subtree``) on Qwen3-30B-A3B-shaped inputs.

Trees are EAGLE-style (each level expands the most likely nodes), path probabilities
are products of random per-node acceptances, and each node's experts are drawn per
layer (uniformly, or correlated with its parent's with ``--correlated``); half the
experts of every layer are cached.  The cost model uses the Qwen3-30B-A3B regime at
PCIe 4.0 (0.38 ms per expert, reference-facts.md).

    python examples/bench_selection.py                 # N in {16, 32, 64, 128}
    python examples/bench_selection.py --sizes 64 --reps 200 --correlated

``--e2e`` instead runs generation on a tiny random Qwen3-MoE target with its experts
offloaded behind an emulated link, drafted by a noisy copy of the target (mechanics
only: no trained pair), and prints tokens/s of "specfit" vs fixed-N "eagle3" vs
"autoregressive", the calibrated cost model, the MAPE of specfit's predicted cycle
time, and the recall / precision of each expert predictor's per-layer union:

    python examples/bench_selection.py --e2e
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


def run_e2e(args) -> None:
    import torch

    from specfit_hf.selection import MeasuredSpecFitPolicy, register_policy

    captured: list[MeasuredSpecFitPolicy] = []

    @register_policy("specfit-bench")
    class _Captured(MeasuredSpecFitPolicy):  # the specfit policy (+ predictor reports), kept to read its figures
        def __init__(self, config):
            super().__init__(config)
            captured.append(self)

    if args.eagle3_draft:
        from specfit_hf.eagle3 import Eagle3DraftModel
        from specfit_hf.testing import tiny_target

        target = tiny_target(seed=args.seed, num_layers=4)  # the target examples/measure_expert_predictors.py trains on
        draft = Eagle3DraftModel.from_pretrained(args.eagle3_draft, dtype=torch.float32).eval()
        draft.attach_target_embeddings(target)
        cfg = target.config
    else:
        target, draft, cfg = _noisy_pair(args)
    measure = ["router", "history", "history+router"] + (["heads"] if args.eagle3_draft else [])
    _run_policies(args, target, draft, cfg, measure, captured)


def _noisy_pair(args):
    import copy

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=2,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    target = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaked distributions, as a trained model's
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(args.draft_noise * p.std() * torch.randn_like(p))
    return target, draft, cfg


def _run_policies(args, target, draft, cfg, measure, captured):
    import torch

    from specfit_hf import EmulatedLink, offload_experts
    from specfit_hf.generation import SpecFitConfig
    from specfit_hf.selection import calibrate, mape

    runtime = offload_experts(target, device="cpu", slots_per_layer=args.slots,
                              link=EmulatedLink(gbps=args.gbps, latency_us=args.latency_us))
    print(runtime)
    print(f"emulated seconds per expert: {runtime.link.transfer_seconds(runtime.expert_bytes) * 1e3:.3f} ms")
    cost, samples = calibrate(target, None, runtime, return_samples=True)
    fit_err = mape([cost.predict(n, m) for n, m, _ in samples], [sec for _, _, sec in samples])
    print(f"calibrated: {cost}; MAPE on its {len(samples)} profiling forwards {fit_err:.1f} %")
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, cfg.vocab_size, (1, 8), generator=g) for _ in range(args.prompts)]
    refs = [target.generate(p, max_new_tokens=args.new_tokens, do_sample=False) for p in prompts]
    runs = [("autoregressive", "autoregressive", {}, 8)]
    runs += [(f"eagle3 N={n}", "eagle3", {}, n) for n in args.eagle_n]
    runs += [("specfit", "specfit-bench", {"cost": cost, "measure_predictors": measure}, 64)]
    runs += [("specfit (always draft)", "specfit-bench", {"cost": cost, "adaptive_drafting": False}, 64)]
    runs += [("oracle (upper bound)", "oracle", {"cost": cost}, 64)]
    print("tok/s*: tokens / (cycle seconds - policy seconds), which leaves out the oracle's probe forwards")
    print(f"{'policy':<24} {'tok/s':>7} {'tok/s*':>7} {'tau':>5} {'verified/cyc':>12} {'experts/tok':>11} {'lossless':>8}")
    for label, policy, kwargs, n in runs:
        tokens = seconds = cycles = verified = loaded = 0
        no_policy_seconds = 0.0
        lossless = True
        for p, ref in zip(prompts, refs):
            gc = SpecFitConfig(max_new_tokens=args.new_tokens, do_sample=False, policy=policy, max_depth=args.depth,
                               tree_top_k=args.tree_top_k, max_verify_nodes=n, policy_kwargs=kwargs,
                               return_dict_in_generate=True)
            runtime.reset_stats()
            start = time.perf_counter()
            out = target.generate(p, assistant_model=draft, generation_config=gc)
            seconds += time.perf_counter() - start
            lossless &= bool(torch.equal(out.sequences, ref))
            tokens += out.sequences.shape[1] - p.shape[1]
            cycles += len(out.cycles)
            no_policy_seconds += sum(c.cycle_seconds - c.policy_seconds for c in out.cycles)
            verified += sum(c.nodes_verified for c in out.cycles)
            loaded += runtime.stats.total.misses
        print(f"{label:<24} {tokens / seconds:>7.2f} {tokens / no_policy_seconds:>7.2f} {tokens / cycles:>5.2f}"
              f" {verified / cycles:>12.2f}"
              f" {loaded / tokens:>11.2f} {str(lossless):>8}")
        if captured and policy == "specfit-bench":
            rep = captured[-1].report()
            print(f"    last prompt: online cost {rep['cost_model']}, cycle-time MAPE {rep['cycle_time_mape_percent']:.1f} %")
            for name, q in rep["expert_union"].items():
                if q["blocks"]:
                    print(f"    expert predictor {name:<15} recall {q['recall']:.3f} precision {q['precision']:.3f}"
                          f" over {q['blocks']} verified blocks")


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
    ap.add_argument("--e2e", action="store_true", help="generation benchmark on a tiny offloaded target")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--tree-top-k", type=int, default=4)
    ap.add_argument("--eagle-n", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--slots", type=int, default=6, help="device expert slots per layer (of 16)")
    ap.add_argument("--gbps", type=float, default=0.05, help="emulated link bandwidth, GB/s")
    ap.add_argument("--latency-us", type=float, default=100.0)
    ap.add_argument("--draft-noise", type=float, default=0.3)
    ap.add_argument("--eagle3-draft", default=None,
                    help="a draft saved by examples/measure_expert_predictors.py --save (its tiny target is rebuilt)")
    args = ap.parse_args()
    if args.e2e:
        run_e2e(args)
        return
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
