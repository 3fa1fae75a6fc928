#!/usr/bin/env python
"""Measure the shipped tiny target (and draft, when present) for its model card.

Prints and saves (``--out`` JSON):

* perplexity of the reference continuation on GSM8K test and CNN/DailyMail test
  prompts (both never seen in training), next to the uniform baseline (= vocab size);
* greedy samples for the first three GSM8K test and CNN/DM test prompts;
* per-layer expert load over GSM8K + CNN/DM test prompts (prompt + reference,
  teacher-forced): normalised entropy, max expert share, share of the 16 busiest
  experts (uniform routing: 1.0 / 1/64 / 0.25), and routing locality — mean overlap of
  consecutive tokens' top-k sets (|A_t ∩ A_t+1| / k; random routing: k/E) and distinct
  experts touched per prompt.

Example::

    .venv/bin/python examples/measure_default_models.py --threads 1 \\
        --out runs/measure/target_eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfit_hf.data import default_model_paths, load_prompts

CNN_MAX_SOURCE_CHARS = 2500  # keeps CNN/DM prompts inside the 1024-token training length


def load_eval_rows(n: int, data_dir) -> dict[str, list[dict]]:
    return {
        "gsm8k": load_prompts("gsm8k", "test", n=n, data_dir=data_dir),
        "cnn_dailymail": load_prompts(
            "cnn_dailymail", "test", n=n, data_dir=data_dir, max_source_chars=CNN_MAX_SOURCE_CHARS
        ),
    }


@torch.no_grad()
def continuation_stats(model, tokenizer, rows: list[dict], max_len: int) -> dict:
    """Reference-continuation perplexity and per-layer routing of prompt+reference tokens."""
    nll, n_tok = 0.0, 0
    n_layers = model.config.num_hidden_layers
    n_experts = model.config.num_experts
    top_k = model.config.num_experts_per_tok
    counts = torch.zeros(n_layers, n_experts, dtype=torch.float64)
    overlap_sum = torch.zeros(n_layers, dtype=torch.float64)
    overlap_n = 0
    distinct = torch.zeros(n_layers, dtype=torch.float64)
    seq_tokens = 0
    for row in tqdm(rows, desc="teacher-forced eval", unit="prompt", leave=False):
        prompt_ids = tokenizer(row["prompt"])["input_ids"]
        full = tokenizer(row["prompt"] + " " + row["reference"])["input_ids"][:max_len]
        ids = torch.tensor([full])
        out = model(input_ids=ids, output_router_logits=True)
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        start = len(prompt_ids) - 1  # first predicted reference token
        token_nll = -logp[torch.arange(len(targets)), targets][start:]
        nll += token_nll.sum().item()
        n_tok += token_nll.numel()
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(top_k, dim=-1).indices  # [T, k]; softmax is monotone
            counts[layer] += torch.bincount(chosen.flatten(), minlength=n_experts).double()
            hot = torch.zeros(chosen.shape[0], n_experts, dtype=torch.bool)
            hot.scatter_(1, chosen, True)
            overlap_sum[layer] += (hot[1:] & hot[:-1]).sum().double() / top_k
            distinct[layer] += hot.any(0).sum().double()
        overlap_n += ids.shape[1] - 1
        seq_tokens += ids.shape[1]
    share = counts / counts.sum(dim=1, keepdim=True)
    entropy = -(share * share.clamp_min(1e-12).log()).sum(1) / math.log(n_experts)
    top16 = share.sort(dim=1, descending=True).values[:, :16].sum(1)
    return {
        "reference_ppl": math.exp(nll / n_tok),
        "reference_tokens": n_tok,
        "routed_tokens": seq_tokens,
        "counts": counts,
        "per_layer": [
            {
                "layer": layer,
                "entropy_norm": round(entropy[layer].item(), 4),
                "max_share": round(share[layer].max().item(), 4),
                "min_share": round(share[layer].min().item(), 5),
                "top16_share": round(top16[layer].item(), 4),
                "consecutive_overlap": round((overlap_sum[layer] / overlap_n).item(), 4),
                "distinct_experts_per_prompt": round((distinct[layer] / len(rows)).item(), 2),
            }
            for layer in range(n_layers)
        ],
    }


def routing_summary(counts: torch.Tensor) -> list[dict]:
    share = counts / counts.sum(dim=1, keepdim=True)
    n_experts = counts.shape[1]
    entropy = -(share * share.clamp_min(1e-12).log()).sum(1) / math.log(n_experts)
    top16 = share.sort(dim=1, descending=True).values[:, :16].sum(1)
    return [
        {
            "layer": layer,
            "entropy_norm": round(entropy[layer].item(), 4),
            "max_share": round(share[layer].max().item(), 4),
            "top16_share": round(top16[layer].item(), 4),
        }
        for layer in range(counts.shape[0])
    ]


@torch.no_grad()
def greedy_samples(model, tokenizer, rows: list[dict], max_new_tokens: int) -> list[dict]:
    samples = []
    for row in rows:
        enc = tokenizer(row["prompt"], return_tensors="pt")
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        dt = time.perf_counter() - t0
        new = out[0, enc["input_ids"].shape[1] :]
        samples.append(
            {
                "prompt_tail": row["prompt"][-160:],
                "completion": tokenizer.decode(new, skip_special_tokens=True),
                "reference": row["reference"][:300],
                "new_tokens": int(new.numel()),
                "tokens_per_s": round(new.numel() / dt, 1),
            }
        )
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = default_model_paths()
    p.add_argument("--target", type=Path, default=defaults.target)
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--n", type=int, default=50, help="prompts per dataset for perplexity and routing")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/measure/target_eval.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target).eval()
    rows = load_eval_rows(args.n, args.data_dir)
    result: dict = {
        "target": str(args.target),
        "dtype": str(model.dtype),
        "threads": args.threads,
        "uniform_ppl": len(tokenizer),
        "n_prompts_per_dataset": args.n,
    }
    total_counts = None
    for name, ds_rows in rows.items():
        stats = continuation_stats(model, tokenizer, ds_rows, args.max_len)
        counts = stats.pop("counts")
        total_counts = counts if total_counts is None else total_counts + counts
        result[name] = stats
        result[name]["greedy_samples"] = greedy_samples(model, tokenizer, ds_rows[:3], args.max_new_tokens)
        print(f"{name}: reference ppl {stats['reference_ppl']:.2f} over {stats['reference_tokens']} tokens")
    result["routing_combined"] = routing_summary(total_counts)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
