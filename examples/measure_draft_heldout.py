#!/usr/bin/env python
"""Held-out quality of the shipped EAGLE-3 draft: token agreement and expert-predictor recall.

The EAGLE-3 trainer reports its figures on training batches; this script measures the
same quantities on GSM8K test and CNN/DailyMail test text (prompt + reference, never
trained on), with the trainer's own teacher and training-time-test unroll
(``specfit_hf.eagle3.train``), so the numbers are comparable:

* per draft step j: top-1 agreement of the draft with the target's argmax;
* expert-predictor recall@k (= precision@k, since k experts are predicted and k are
  routed) averaged over MoE layers and draft steps, next to two baselines: random
  (k/E) and a per-layer *static* predictor that always names the k experts most used in
  this very evaluation text (an optimistic frequency baseline).

Example::

    .venv/bin/python examples/measure_draft_heldout.py --n 50 --threads 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specfit_hf.cli import load_pair
from specfit_hf.data import default_model_paths, load_prompts
from specfit_hf.eagle3.train import TargetTeacher, eagle3_loss


def blocks_for(tokenizer, rows: list[dict], seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for row in rows:
        ids.extend(tokenizer(row["prompt"] + " " + row["reference"])["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = default_model_paths()
    p.add_argument("--target", type=Path, default=defaults.target)
    p.add_argument("--draft", type=Path, default=defaults.draft)
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/measure/draft_heldout.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target, draft, tokenizer = load_pair(args.target, args.draft, "cpu")
    draft.attach_target_embeddings(target)
    num_layers = target.config.num_hidden_layers
    teacher = TargetTeacher(target, draft.config.target_feature_indices(num_layers), draft.expert_moe_layers)
    E, k = target.config.num_experts, target.config.num_experts_per_tok

    result: dict = {"seq_len": args.seq_len, "ttt_steps": args.ttt_steps, "random_recall": k / E}
    for name, kwargs in (("gsm8k", {}), ("cnn_dailymail", {"max_source_chars": 2500})):
        rows = load_prompts(name, "test", n=args.n, **kwargs)
        blocks = blocks_for(tokenizer, rows, args.seq_len)
        acc_sum = torch.zeros(args.ttt_steps)
        recall_sum = 0.0
        n_batches = 0
        counts = torch.zeros(len(draft.expert_moe_layers), E)
        routed = []
        for start in range(0, blocks.shape[0], args.batch_size):
            x = blocks[start : start + args.batch_size]
            tb = teacher(x)
            out = eagle3_loss(draft, tb, x, args.ttt_steps)
            acc_sum += torch.tensor(out.step_accuracy)
            recall_sum += out.expert_recall
            n_batches += 1
            r = tb.routing  # [B, T, L, k]
            for layer in range(r.shape[2]):
                counts[layer] += torch.bincount(r[:, :, layer].flatten(), minlength=E).float()
            routed.append(r)
        # Static frequency baseline: always predict each layer's k busiest experts.
        top_static = counts.topk(k, dim=-1).indices  # [L, k]
        r = torch.cat([x.reshape(-1, x.shape[2], k) for x in routed])  # [N, L, k]
        hits = (r[..., :, None] == top_static[None, :, None, :]).any(-1).float().mean()
        result[name] = {
            "blocks": int(blocks.shape[0]),
            "tokens": int(blocks.numel()),
            "step_top1_agreement": [round(a, 3) for a in (acc_sum / n_batches).tolist()],
            "expert_recall_at_k": round(recall_sum / n_batches, 3),
            "static_top_k_baseline_recall": round(hits.item(), 3),
        }
        print(name, json.dumps(result[name]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
