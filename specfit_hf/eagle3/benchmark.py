"""Speed figures of the EAGLE-3 draft: tree drafting and training throughput.

    python -m specfit_hf.eagle3.benchmark [--target PATH] [--threads 2] [--device cpu]

Without ``--target`` it builds a random Qwen3-MoE shaped like the repository's tiny
target (hidden 128, 6 layers, 64 experts top-4, vocabulary 8192) and a draft shaped by
:func:`~specfit_hf.eagle3.train.draft_config_for_target`.  Prints, per tree branching
factor, the draft forward time per level (level 1 includes the prompt prefill, so it
is reported apart) and drafted nodes per second; then training tokens per second.
Weights are random: speed does not depend on them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ..features import capture_hidden_states, decoder_layers
from ..testing import tiny_moe_target
from ..tree import DraftTree
from .modeling import Eagle3DraftModel
from .train import TargetTeacher, draft_config_for_target, eagle3_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def bench_drafting(target, draft: Eagle3DraftModel, top_k: int, depth: int, prompt_len: int, cycles: int) -> dict:
    """Time ``draft_level`` calls over ``cycles`` trees of ``depth`` levels."""
    device = next(target.parameters()).device
    drafter = draft.make_tree_drafter(target, type("Cfg", (), {"tree_top_k": top_k})())
    idx = drafter.target_feature_indices
    prompt = torch.randint(0, target.config.vocab_size, (1, prompt_len), device=device)
    with capture_hidden_states(target, idx) as cap:
        target(prompt)
    feats = torch.cat([cap[i] for i in idx], -1)
    first, later, nodes_later, nodes_total, total = [], [], 0, 0, 0.0
    for c in range(cycles):
        drafter.start(prompt, feats)  # every cycle starts from the prompt: same cache length
        tree = DraftTree(int(prompt[0, -1]))
        for level in range(depth):
            _sync(device)
            t0 = time.perf_counter()
            n0 = len(tree)
            drafter.draft_level(tree)
            _sync(device)
            dt = time.perf_counter() - t0
            if c == 0:
                continue  # warm-up
            total += dt
            nodes_total += len(tree) - n0
            if level == 0:
                first.append(dt)
            else:
                later.append(dt)
                nodes_later += len(tree) - n0
    return {
        "tree_top_k": top_k,
        "depth": depth,
        "prompt_len": prompt_len,
        "nodes_per_tree": len(tree),
        "level1_ms (incl. prompt prefill)": 1e3 * sum(first) / max(1, len(first)),
        "later_level_ms": 1e3 * sum(later) / max(1, len(later)),
        "nodes_per_later_level": nodes_later / max(1, len(later)),
        "drafted_nodes_per_s": nodes_total / total if total else float("nan"),
    }


def bench_training(target, draft: Eagle3DraftModel, seq_len: int, batch: int, ttt_steps: int, steps: int) -> dict:
    device = next(target.parameters()).device
    draft.embeddings_from_target = True
    draft.attach_target_embeddings(target)
    draft.train()
    teacher = TargetTeacher(target, draft.config.target_feature_indices(len(decoder_layers(target))),
                            draft.expert_moe_layers if draft.expert_heads is not None else None)
    params = [p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=1e-4)
    times = []
    for s in range(steps + 1):
        ids = torch.randint(0, target.config.vocab_size, (batch, seq_len), device=device)
        _sync(device)
        t0 = time.perf_counter()
        loss = eagle3_loss(draft, teacher(ids), ids, ttt_steps)
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
        _sync(device)
        if s:
            times.append(time.perf_counter() - t0)
    draft.eval()
    return {
        "seq_len": seq_len, "batch": batch, "ttt_steps": ttt_steps,
        "expert_heads": draft.expert_heads is not None,
        "step_s": sum(times) / len(times),
        "tokens_per_s": batch * seq_len * len(times) / sum(times),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target folder (default: random tiny-target shape)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--top-k", type=int, nargs="+", default=[4, 8, 10])
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--cycles", type=int, default=6)
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ttt-steps", type=int, default=7)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if a.target:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    else:
        target = tiny_moe_target()
    target.to(device).requires_grad_(False)
    from .train import find_moe_routers

    routers = find_moe_routers(target)
    ep = None
    if routers:
        ep = {"moe_layers": [i for i, _ in routers], "num_experts": int(routers[0][1].weight.shape[0]),
              "top_k": int(getattr(routers[0][1], "top_k", 1))}
    torch.manual_seed(0)
    draft_config = draft_config_for_target(target.config, a.draft_vocab, expert_predictor=ep)
    draft = Eagle3DraftModel(draft_config).to(device).eval()
    draft.embeddings_from_target = True
    print(json.dumps({"device": str(device), "threads": torch.get_num_threads(),
                      "draft_params_M": sum(p.numel() for n, p in draft.named_parameters()
                                            if not n.startswith("embed")) / 1e6,
                      "target_hidden": target.config.hidden_size, "draft_vocab": draft.config.draft_vocab_size}))
    for k in a.top_k:
        print(json.dumps(bench_drafting(target, draft, k, a.depth, a.prompt_len, a.cycles)))
    if a.train_steps:
        print(json.dumps(bench_training(target, draft, a.seq_len, a.batch_size, a.ttt_steps, a.train_steps)))


if __name__ == "__main__":
    main()
