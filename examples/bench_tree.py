"""Mechanics benchmark: tree speculative decoding vs plain ``generate`` on tiny random models.

Random weights, so the figures say nothing about real speed-ups; they show that the
loop works and what it costs: mean accepted length tau (tokens committed per cycle),
tokens/s of tree decoding vs plain greedy ``generate``, and where a cycle's time goes.

Three drafts bracket acceptance: ``random`` (an unrelated tiny LM: tau ~ 1),
``noisy`` (the target's weights plus noise: partial acceptance) and ``self`` (the
target itself: every greedy path is accepted, tau ~ depth + 1).

    .venv/bin/python examples/bench_tree.py --prompts 8 --max-new-tokens 64
    .venv/bin/python examples/bench_tree.py --device cuda --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from specfit_hf.generation import SpecFitConfig


def build_models(args):
    torch.manual_seed(0)
    tcfg = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, num_experts=16, num_experts_per_tok=4,
        max_position_embeddings=4096,
    )
    target = Qwen3MoeForCausalLM(tcfg).eval().to(args.device)
    dcfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden // 2, intermediate_size=args.hidden,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 8,
        max_position_embeddings=4096,
    )
    drafts = {"random": LlamaForCausalLM(dcfg).eval().to(args.device)}
    noisy = copy.deepcopy(target)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    drafts["noisy"] = noisy
    drafts["self"] = target
    return target, drafts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--top-k", type=int, default=10, help="tree branching factor (SpecFitConfig.tree_top_k)")
    ap.add_argument("--nodes", type=int, default=60, help="max verified nodes per cycle")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sample (lossless rejection sampling) instead of greedy; 'lossless' then reads n/a")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target, drafts = build_models(args)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (1, args.prompt_len), generator=g).to(args.device) for _ in range(args.prompts)]
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    cfg = SpecFitConfig(
        policy="eagle3", max_new_tokens=args.max_new_tokens, max_depth=args.depth, tree_top_k=args.top_k,
        max_verify_nodes=args.nodes, return_dict_in_generate=True, **sampling,
    )
    # Warm-up (allocator, lazy init).
    target.generate(prompts[0], do_sample=False, max_new_tokens=4)
    target.generate(prompts[0], assistant_model=drafts["random"], generation_config=cfg)

    refs, plain_s, plain_tokens = [], 0.0, 0
    for ids in tqdm(prompts, desc="plain generate"):
        sync(args.device)
        t = time.perf_counter()
        out = target.generate(ids, max_new_tokens=args.max_new_tokens, **sampling)
        sync(args.device)
        plain_s += time.perf_counter() - t
        plain_tokens += out.shape[1] - ids.shape[1]
        refs.append(out)
    plain_tps = plain_tokens / plain_s

    print(f"\ndevice={args.device} threads={args.threads} target=Qwen3-MoE(random, {args.layers} layers, "
          f"H={args.hidden}, V={args.vocab}) prompts={args.prompts}x{args.prompt_len} new={args.max_new_tokens} "
          f"tree: depth={args.depth} top_k={args.top_k} N={args.nodes}")
    print(f"plain generate: {plain_tps:8.1f} tok/s ({'T=%g sampling' % args.temperature if args.temperature > 0 else 'greedy'})")
    header = f"{'draft':8s} {'tau':>5s} {'tok/s':>8s} {'vs plain':>8s} {'lossless':>8s} " \
             f"{'drafted':>7s} {'verified':>8s} {'draft%':>6s} {'select%':>7s} {'verify%':>7s} {'other%':>6s}"
    print(header)
    for name, draft in drafts.items():
        total_s, tokens, cycles, same = 0.0, 0, [], True
        for ids, ref in tqdm(list(zip(prompts, refs)), desc=f"tree ({name})", leave=False):
            sync(args.device)
            t = time.perf_counter()
            out = target.generate(ids, assistant_model=draft, generation_config=cfg)
            sync(args.device)
            total_s += time.perf_counter() - t
            tokens += out.sequences.shape[1] - ids.shape[1]
            cycles += out.cycles
            same &= torch.equal(out.sequences, ref)  # meaningful for greedy only
        cyc_s = sum(c.cycle_seconds for c in cycles)
        share = lambda x: 100.0 * x / cyc_s  # noqa: E731
        draft_s = sum(c.draft_seconds for c in cycles)
        select_s = sum(c.policy_seconds for c in cycles)  # the policy: selection and learning
        verify_s = sum(c.verify_seconds for c in cycles)
        print(
            f"{name:8s} {statistics.mean(c.tokens_committed for c in cycles):5.2f} {tokens / total_s:8.1f} "
            f"{tokens / total_s / plain_tps:7.2f}x {str(same) if args.temperature <= 0 else 'n/a':>8s} "
            f"{statistics.mean(c.nodes_drafted for c in cycles):7.1f} "
            f"{statistics.mean(c.nodes_verified for c in cycles):8.1f} {share(draft_s):6.1f} {share(select_s):7.1f} "
            f"{share(verify_s):7.1f} {share(cyc_s - draft_s - select_s - verify_s):6.1f}"
        )


if __name__ == "__main__":
    main()
