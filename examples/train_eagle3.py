#!/usr/bin/env python
"""Train an EAGLE-3 draft (and optionally expert-predictor heads) for a target model.

The target runs online (CPU is fine for tiny targets): its three feature hidden states
and its next-token distribution are produced on the fly for every batch; the draft is
trained with EAGLE-3's training-time test.  The result is a Hub-style folder in the
public EAGLE-3 layout (``config.json`` with ``LlamaForCausalLMEagle3``,
``model.safetensors``, ``README.md`` model card, ``training_summary.json``) that loads
with ``specfit_hf.Eagle3DraftModel.from_pretrained(out)``.

Example (the tiny Qwen3-MoE target of this repository)::

    python examples/train_eagle3.py \\
        --target model_cards/specfit-tiny-qwen3moe \\
        --data ../shared/data/gsm8k/train.jsonl ../shared/data/cnn_dailymail/validation.jsonl \\
        --out model_cards/specfit-tiny-qwen3moe-eagle3 \\
        --steps 3000 --seq-len 256 --batch-size 4 --ttt-steps 7 --draft-vocab 4096 \\
        --expert-heads --layers 1 3 5 --threads 2 --time-budget-min 120

(``--layers 1 3 5``: with 6 target layers the default ``2, L//2, L-3`` = ``2, 3, 3`` would
feed the same layer twice.)

Flags:
    --target PATH         target model folder (AutoModelForCausalLM + AutoTokenizer).
    --data FILE [FILE..]  training data: ``.jsonl`` / ``.json`` (rows with "text", or GSM8K
                          question/answer, or CNN/DM article/highlights, formatted like the
                          target's own training text) or plain ``.txt`` files; loaded with
                          ``datasets.load_dataset("json" | "text", data_files=...)``.
    --text-field NAME     JSON field holding the text (default: detected, see above).
    --out DIR             output folder; ``DIR/checkpoint`` holds the resumable state.
    --steps N             optimizer steps (default 1000).
    --seq-len T           tokens per packed training block (default 256).
    --batch-size B        blocks per step (default 4).
    --ttt-steps S         unrolled training-time-test steps, >= 1; EAGLE-3 uses 7 (default 7).
    --draft-vocab V       draft vocabulary size: the V most frequent target tokens of the
                          data (default 8192, capped at the target's vocabulary).
    --expert-heads        also train one linear routing head per target MoE layer, with a
                          multi-label BCE loss against the target's real top-k routing.
    --expert-loss-weight  weight of that loss (default 1.0).
    --lr, --warmup-steps  AdamW peak learning rate (1e-3) and linear warmup (50 steps),
                          then cosine decay to 10 %.
    --threads N           torch CPU threads (default: torch's choice).
    --seed N              seed for initialisation and data order (default 0).
    --resume              continue from ``DIR/checkpoint`` (weights, optimizer, scheduler,
                          step, RNG; the data order is a function of seed and step).
    --time-budget-min M   stop cleanly (and save) after M minutes of wall time.
    --max-steps-per-run N stop cleanly (and save) after N steps in this invocation; with
                          --resume, a long run can be done in deterministic chunks.
    --save-every N        checkpoint interval in steps (default 200).
    --max-tokens N        read at most N training tokens (default 2,000,000).
    --layers A B C        explicit target feature layers as HF ``hidden_states`` indices
                          (default 2, L//2, L-3).
"""

from __future__ import annotations

import argparse
import json

from specfit_hf.eagle3.train import TrainConfig, train_eagle3


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, nargs="+")
    p.add_argument("--text-field", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--expert-heads", action="store_true")
    p.add_argument("--expert-loss-weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--time-budget-min", type=float, default=0.0)
    p.add_argument("--max-steps-per-run", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=2_000_000)
    p.add_argument("--layers", type=int, nargs=3, default=None)
    a = p.parse_args(argv)
    if a.ttt_steps < 1:
        p.error("--ttt-steps must be >= 1")
    return TrainConfig(
        target=a.target, data=a.data, out=a.out, steps=a.steps, seq_len=a.seq_len, batch_size=a.batch_size,
        ttt_steps=a.ttt_steps, draft_vocab=a.draft_vocab, expert_heads=a.expert_heads,
        expert_loss_weight=a.expert_loss_weight, lr=a.lr, warmup_steps=a.warmup_steps, threads=a.threads,
        seed=a.seed, resume=a.resume, time_budget_min=a.time_budget_min,
        max_steps_per_run=a.max_steps_per_run, save_every=a.save_every,
        max_tokens=a.max_tokens, text_field=a.text_field, feature_indices=a.layers,
    )


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    summary = train_eagle3(cfg)
    keys = ("steps", "stopped_early", "first_token_loss", "final_token_loss", "final_step_accuracy",
            "final_expert_recall", "tokens_per_s", "train_seconds", "threads", "feature_indices")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))
    print(f"saved to {cfg.out}")


if __name__ == "__main__":
    main()
