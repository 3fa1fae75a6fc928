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
    --init-from DIR       warm start from an existing draft folder: its weights, vocabulary
                          mapping and expert heads (its draft vocabulary wins over
                          --draft-vocab); fresh optimizer, warmup and cosine schedule.
                          Ignored when --resume finds ``OUT/checkpoint``.
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

from transformers import HfArgumentParser

from specfit_hf.eagle3.train import TrainConfig, train_eagle3


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The :class:`TrainConfig` of these command-line flags (``--help`` lists them)."""
    parser = HfArgumentParser(TrainConfig, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    (cfg,) = parser.parse_args_into_dataclasses(args=argv)
    return cfg


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    summary = train_eagle3(cfg)
    keys = ("steps", "stopped_early", "first_token_loss", "final_token_loss", "final_step_accuracy",
            "final_expert_recall", "tokens_per_s", "train_seconds", "threads", "feature_indices")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2))
    print(f"saved to {cfg.out}")


if __name__ == "__main__":
    main()
