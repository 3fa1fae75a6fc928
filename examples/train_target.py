#!/usr/bin/env python
"""Train the tiny Qwen3-MoE target of the shipped SpecFit model pair, from scratch, on CPU.

Shape: a Qwen3-30B-A3B-like routing layout shrunk to a few MB — many small experts
with top-k/E = 4/64 = 1/16 in every layer, normalised top-k weights and the
Switch-style load-balancing auxiliary loss (``router_aux_loss_coef``) so routing does
not collapse onto a few experts. Everything else is a plain Qwen3 decoder.

Data: ``specfit_hf.data.load_training_text`` (GSM8K train, CNN/DailyMail validation,
public-domain corpus; GSM8K test and CNN/DM test are never seen). Documents are
tokenised as ``<|bos|> text <|eos|>``, concatenated and cut into ``--seq-len`` blocks.

Schedule: linear warm-up, then cosine decay to ``--min-lr-ratio``; progress is the
further along of ``step/--steps`` and ``elapsed/--time-budget-min`` so the decay
finishes inside the time budget whatever the machine's speed. Validation perplexity
is measured every ``--eval-every`` steps; the best weights are exported, and training
stops early after ``--patience`` evaluations without improvement.

Checkpoints (model, optimiser, step, elapsed time, RNG) go to ``--run-dir`` (keep it
out of git, e.g. ``runs/``); ``--resume`` continues from the latest one.

Example::

    .venv/bin/python examples/train_target.py --tokenizer runs/tokenizer \\
        --out model_cards/specfit-tiny-qwen3moe --run-dir runs/target \\
        --threads 1 --time-budget-min 40
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from specfit_hf.data import load_training_text


def build_config(args: argparse.Namespace, tokenizer) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,  # unused: every layer is MoE (mlp_only_layers=[])
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,  # turned on per call while training
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def pack(docs: list[str], tokenizer, seq_len: int, desc: str) -> torch.Tensor:
    """Tokenise ``<|bos|> doc <|eos|>`` per document, concatenate, cut into blocks."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for start in tqdm(range(0, len(docs), 256), desc=f"tokenise {desc}", unit="batch"):
        for seq in tokenizer(docs[start : start + 256])["input_ids"]:
            ids.extend(seq)
            ids.append(eos)
    n_blocks = len(ids) // seq_len
    return torch.tensor(ids[: n_blocks * seq_len], dtype=torch.int32).view(n_blocks, seq_len)


def lr_at(step: int, elapsed_s: float, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = max(
        (step - args.warmup) / max(args.steps - args.warmup, 1),
        elapsed_s / (args.time_budget_min * 60.0),
    )
    progress = min(progress, 1.0)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int) -> float:
    """Token-level perplexity over ``blocks`` (no aux loss)."""
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for start in range(0, blocks.shape[0], batch_size):
        x = blocks[start : start + batch_size].long()
        out = model(input_ids=x, labels=x, output_router_logits=False)
        n = x.numel() - x.shape[0]  # labels are shifted inside the loss
        total_nll += out.loss.item() * n
        total_tokens += n
    model.train()
    return math.exp(total_nll / total_tokens)


def mark_float32_runtime(folder: Path) -> None:
    """Record float32 as the model's runtime dtype in ``config.json``.

    The weights are stored in bf16 to keep the shipped folder small, but the CPU
    runtime computes in fp32: with ``"dtype": "float32"`` in the config a plain
    ``AutoModelForCausalLM.from_pretrained(path)`` upcasts on load (transformers'
    default ``dtype="auto"`` follows the config, not the checkpoint).
    """
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["dtype"] = "float32"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer"))
    p.add_argument("--out", type=Path, default=Path("model_cards/specfit-tiny-qwen3moe"))
    p.add_argument("--run-dir", type=Path, default=Path("runs/target"))
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="continue from --run-dir/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--time-budget-min", type=float, default=40.0)
    p.add_argument("--steps", type=int, default=100_000, help="upper bound; the time budget usually ends first")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--eval-blocks", type=int, default=64, help="validation blocks per evaluation")
    p.add_argument("--patience", type=int, default=4, help="evaluations without improvement before stopping")
    # Model shape.
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=80)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    wall0 = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    cache = args.run_dir / f"blocks_seq{args.seq_len}_seed{args.seed}.pt"
    if cache.exists():
        data = torch.load(cache)
    else:
        text = load_training_text(args.data_dir, seed=args.seed)
        data = {
            "train": pack(text.train, tokenizer, args.seq_len, "train"),
            "validation": pack(text.validation, tokenizer, args.seq_len, "validation"),
        }
        torch.save(data, cache)
    train_blocks, val_all = data["train"], data["validation"]
    # Fixed, seeded validation subset so every evaluation measures the same tokens.
    g = torch.Generator().manual_seed(args.seed)
    val_blocks = val_all[torch.randperm(val_all.shape[0], generator=g)[: args.eval_blocks]]
    print(
        f"train blocks {train_blocks.shape[0]} x {args.seq_len} = {train_blocks.numel() / 1e6:.2f}M tokens; "
        f"validation {val_blocks.numel() / 1e3:.0f}k tokens"
    )

    config = build_config(args, tokenizer)
    # grouped_mm runs all experts of a layer in one call; several times faster on CPU
    # than the per-expert Python loop of the eager implementation.
    model = Qwen3MoeForCausalLM._from_config(config, attn_implementation="sdpa", experts_implementation="grouped_mm")
    n_params = sum(t.numel() for t in model.parameters())
    print(f"target parameters: {n_params / 1e6:.2f}M")
    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    no_decay = [t for n, t in model.named_parameters() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    ckpt_path = args.run_dir / "checkpoint.pt"
    best_path = args.run_dir / "best_model.pt"
    state = {"step": 0, "elapsed_s": 0.0, "best_val_ppl": float("inf"), "bad_evals": 0, "log": []}
    if args.resume and ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        torch.set_rng_state(ckpt["torch_rng"])
        print(f"resumed at step {state['step']} ({state['elapsed_s'] / 60:.1f} min trained)")

    def save_checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state, "torch_rng": torch.get_rng_state()},
            tmp,
        )
        tmp.replace(ckpt_path)

    n_train = train_blocks.shape[0]
    per_epoch = n_train // args.batch_size

    def batch_for(step: int) -> torch.Tensor:
        # Deterministic data order from (seed, epoch): resuming replays the same stream.
        epoch, pos = divmod(step, per_epoch)
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        idx = perm[pos * args.batch_size : (pos + 1) * args.batch_size]
        return train_blocks[idx].long()

    budget_s = args.time_budget_min * 60.0
    model.train()
    bar = tqdm(total=args.steps, initial=state["step"], desc="train target", unit="step", dynamic_ncols=True)
    stop_reason = "steps"
    t_seg = time.perf_counter()
    elapsed0 = state["elapsed_s"]
    while state["step"] < args.steps:
        elapsed = elapsed0 + (time.perf_counter() - t_seg)
        if elapsed >= budget_s:
            stop_reason = "time budget"
            break
        lr = lr_at(state["step"], elapsed, args)
        for group in opt.param_groups:
            group["lr"] = lr
        x = batch_for(state["step"])
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        bar.update(1)
        lm_loss = out.loss.item() - args.aux_coef * out.aux_loss.item()
        bar.set_postfix(loss=f"{lm_loss:.3f}", aux=f"{out.aux_loss.item():.3f}", lr=f"{lr:.2e}")

        if state["step"] % args.eval_every == 0:
            state["elapsed_s"] = elapsed0 + (time.perf_counter() - t_seg)
            val_ppl = evaluate(model, val_blocks, args.batch_size)
            improved = val_ppl < state["best_val_ppl"] * 0.998
            record = {
                "step": state["step"],
                "train_loss": round(lm_loss, 4),
                "aux_loss": round(out.aux_loss.item(), 4),
                "val_ppl": round(val_ppl, 3),
                "lr": lr,
                "elapsed_min": round(state["elapsed_s"] / 60, 2),
                "tokens_seen": state["step"] * args.batch_size * args.seq_len,
            }
            state["log"].append(record)
            tqdm.write(json.dumps(record))
            if val_ppl < state["best_val_ppl"]:
                state["best_val_ppl"] = val_ppl
                torch.save(model.state_dict(), best_path)
            state["bad_evals"] = 0 if improved else state["bad_evals"] + 1
            save_checkpoint()
            if state["bad_evals"] >= args.patience:
                stop_reason = f"validation perplexity flat for {args.patience} evaluations"
                break
    bar.close()
    state["elapsed_s"] = elapsed0 + (time.perf_counter() - t_seg)

    # Final evaluation of the current weights, then export the best ones.
    val_ppl = evaluate(model, val_blocks, args.batch_size)
    if val_ppl < state["best_val_ppl"]:
        state["best_val_ppl"] = val_ppl
        torch.save(model.state_dict(), best_path)
    save_checkpoint()
    model.load_state_dict(torch.load(best_path))
    full_val_ppl = evaluate(model, val_all, args.batch_size)

    export = Qwen3MoeForCausalLM(config)
    export.load_state_dict(model.state_dict())
    export = export.to(getattr(torch, args.save_dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    export.save_pretrained(args.out)
    mark_float32_runtime(args.out)
    tokenizer.save_pretrained(args.out)
    summary = {
        "stop_reason": stop_reason,
        "steps": state["step"],
        "tokens_seen": state["step"] * args.batch_size * args.seq_len,
        "train_tokens_per_epoch": int(train_blocks.numel()),
        "train_minutes": round(state["elapsed_s"] / 60, 2),
        "wall_minutes_this_run": round((time.perf_counter() - wall0) / 60, 2),
        "threads": args.threads,
        "best_val_ppl_subset": round(state["best_val_ppl"], 3),
        "val_ppl_full_heldout": round(full_val_ppl, 3),
        "val_tokens_full_heldout": int(val_all.numel()),
        "parameters": n_params,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "log": state["log"],
    }
    (args.run_dir / "training_summary.json").write_text(json.dumps(summary, indent=2))
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("log", "args")}, indent=2))


if __name__ == "__main__":
    main()
