"""Training an EAGLE-3 draft (and optional expert-predictor heads) against a target.

The recipe (EAGLE-3, "training-time test"):

* the target runs online on packed text blocks; we capture its three feature hidden
  states (:func:`specfit_hf.features.capture_hidden_states`), its logits (the
  teacher) and, for expert heads, its real top-k routing at every position;
* the draft is unrolled for ``ttt_steps`` steps.  Step 0 consumes the target features;
  step ``j`` feeds the draft its own previous output.  Slot ``i`` of step ``j`` is the
  depth-``j`` node of the tree rooted at slot ``i`` (token ``x_{i+1+j}``, position
  ``i + j``), and its attention mask is exactly that node's tree path at inference:
  the committed slots ``0..i`` (step 0) plus its own ancestors ``(i, 1..j)``;
* loss ``sum_j 0.8^j * CE(teacher over the draft vocabulary, draft)``, the teacher
  being the target's next-token distribution renormalised over the draft vocabulary;
  positions whose teacher argmax is outside the draft vocabulary are skipped (the
  draft cannot propose that token anyway);
* draft vocabulary = the ``draft_vocab_size`` most frequent target tokens of the data.

Expert heads (``Eagle3Config.expert_predictor``) learn, from the draft hidden state
after consuming a token, which experts the target routes that token to (multi-label
BCE against the target's top-k).  They read a detached hidden state, so they never
change the draft's token predictions.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from ..features import capture_hidden_states, decoder_layers
from ..offload.adapters import ADAPTERS
from .config import Eagle3Config, default_feature_indices
from .modeling import Eagle3DraftModel, repeat_kv

__all__ = [
    "TrainConfig",
    "TeacherBatch",
    "TargetTeacher",
    "build_draft_vocab",
    "find_moe_routers",
    "draft_config_for_target",
    "ttt_forward",
    "eagle3_loss",
    "load_text_dataset",
    "pack_blocks",
    "train_eagle3",
    "write_model_card",
]

LOSS_DECAY = 0.8


# --------------------------------------------------------------------------- vocabulary


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary: the most frequent tokens, sorted by id.

    Ties (and never-seen tokens, used to fill up a small corpus) go to lower ids.
    """
    counts = torch.as_tensor(token_counts, dtype=torch.float64).reshape(-1)
    if not 0 < draft_vocab_size <= counts.numel():
        raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}], got {draft_vocab_size}")
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


# --------------------------------------------------------------------------- target side


def find_moe_routers(target: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router module)`` of each MoE layer (none for an unsupported architecture)."""
    adapter = ADAPTERS.get(getattr(target.config, "model_type", None))
    if adapter is None:
        return []
    blocks = ((i, adapter.moe_block(layer)) for i, layer in enumerate(decoder_layers(target)))
    return [(i, adapter.router(block)) for i, block in blocks if block is not None]


def _routing_top_k(target: nn.Module, router: nn.Module) -> int:
    k = getattr(router, "top_k", None) or getattr(target.config, "num_experts_per_tok", None)
    if k is None:
        raise ValueError("cannot tell the target's experts-per-token (num_experts_per_tok)")
    return int(k)


@dataclass
class TeacherBatch:
    """What the target provides for one batch.

    Attributes:
        features: ``[B, T, 3·H_t]`` low / mid / high hidden states.
        logits: ``[B, T, V]`` target logits (position t predicts token t + 1).
        routing: ``[B, T, L_moe, k]`` experts the target routed each position to, or None.
    """

    features: torch.Tensor
    logits: torch.Tensor
    routing: torch.Tensor | None = None


class TargetTeacher:
    """Runs the frozen target and collects features, logits and (optionally) routing."""

    def __init__(self, target: nn.Module, feature_indices: Sequence[int], moe_layers: Sequence[int] | None = None):
        self.target = target.eval()
        self.feature_indices = tuple(int(i) for i in feature_indices)
        self.routers: list[tuple[int, nn.Module]] = []
        self.top_k = 0
        if moe_layers:
            by_layer = dict(find_moe_routers(target))
            missing = [i for i in moe_layers if i not in by_layer]
            if missing:
                raise ValueError(f"target layers {missing} have no MoE router")
            self.routers = [(int(i), by_layer[int(i)]) for i in moe_layers]
            self.top_k = _routing_top_k(target, self.routers[0][1])

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor) -> TeacherBatch:
        router_logits: dict[int, torch.Tensor] = {}
        handles = []
        for layer, router in self.routers:
            def hook(module, args, output, layer=layer):
                logits = output[0] if isinstance(output, tuple) else output
                router_logits[layer] = logits.detach()
            handles.append(router.register_forward_hook(hook))
        try:
            with capture_hidden_states(self.target, self.feature_indices) as captured:
                out = self.target(input_ids=input_ids, use_cache=False)
            features = torch.cat([captured[i] for i in self.feature_indices], dim=-1)
        finally:
            for h in handles:
                h.remove()
        routing = None
        if self.routers:
            b, t = input_ids.shape
            routing = torch.stack(
                [router_logits[layer].reshape(b, t, -1).topk(self.top_k, dim=-1).indices for layer, _ in self.routers],
                dim=2,
            )
        return TeacherBatch(features=features, logits=out.logits, routing=routing)


def draft_config_for_target(
    target_config: Any,
    draft_vocab_size: int,
    feature_indices: Sequence[int] | None = None,
    expert_predictor: dict | None = None,
) -> Eagle3Config:
    """A draft config shaped like one decoder layer of the target."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_layers = int(tc.num_hidden_layers)
    heads = int(tc.num_attention_heads)
    cfg = Eagle3Config(
        vocab_size=int(tc.vocab_size),
        draft_vocab_size=int(min(draft_vocab_size, tc.vocab_size)),
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(tc.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
        hidden_act=str(getattr(tc, "hidden_act", "silu")),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
        target_hidden_size=int(tc.hidden_size),
        expert_predictor=expert_predictor,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    cfg.set_target_feature_indices(feature_indices or default_feature_indices(num_layers), num_layers)
    return cfg


# --------------------------------------------------------------------------- training-time test


def _shift_left(x: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """``out[:, i] = x[:, i + n]`` (``fill`` past the end)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_forward(
    model: Eagle3DraftModel, features: torch.Tensor, input_ids: torch.LongTensor, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Unroll the draft for ``steps`` steps on a block; returns ``(next_hidden, logits)`` per step.

    Step ``j``, slot ``i``: the depth-``j`` tree node under the root pair ``(f_i, x_{i+1})``,
    consuming token ``x_{i+1+j}`` at position ``i + j`` and predicting ``x_{i+2+j}``.
    Its keys are the step-0 slots ``0..i`` and its own ancestors (slot ``i`` of steps
    ``1..j``), so attention matches :class:`~specfit_hf.eagle3.drafter.Eagle3TreeDrafter`.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    b, t = input_ids.shape
    attn = model.midlayer.self_attn
    n_rep = attn.num_kv_groups
    hidden = model.project_features(features)
    base_pos = torch.arange(t, device=input_ids.device)
    neg = torch.finfo(hidden.dtype).min
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).triu(1)
    step0_kv: list[torch.Tensor] = []
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    outputs = []
    for j in range(steps):
        tokens = _shift_left(input_ids, 1 + j)

        def attend(q, k, v, j=j):
            if j == 0:
                step0_kv[:] = [repeat_kv(k, n_rep), repeat_kv(v, n_rep)]
                return attn.attend(q, k, v, None)
            k0, v0 = step0_kv
            diag_k.append(repeat_kv(k, n_rep))
            diag_v.append(repeat_kv(v, n_rep))
            scores0 = (q @ k0.transpose(-1, -2)) * attn.scaling
            scores0 = scores0.masked_fill(causal, neg)
            diag = torch.stack([(q * kd).sum(-1) for kd in diag_k], dim=-1) * attn.scaling  # [B, nh, T, j]
            weights = torch.softmax(torch.cat([scores0, diag], dim=-1).float(), dim=-1).to(q.dtype)
            out = weights[..., :t] @ v0
            for s, vd in enumerate(diag_v):
                out = out + weights[..., t + s, None] * vd
            return out

        layer_out = model.step(tokens, hidden, base_pos + j, attend)
        logits = model.compute_logits(layer_out)
        hidden = model.next_hidden(layer_out)
        outputs.append((hidden, logits))
    return outputs


@dataclass
class LossOutput:
    loss: torch.Tensor
    token_loss: float
    step_losses: list[float]
    step_accuracy: list[float]
    expert_loss: float = float("nan")
    expert_recall: float = float("nan")


def eagle3_loss(
    model: Eagle3DraftModel,
    teacher: TeacherBatch,
    input_ids: torch.LongTensor,
    steps: int,
    decay: float = LOSS_DECAY,
    expert_weight: float = 1.0,
) -> LossOutput:
    """The EAGLE-3 objective on one batch (plus the expert-head loss when present)."""
    b, t = input_ids.shape
    if t < steps + 2:
        raise ValueError(f"sequence length {t} too short for {steps} training-time-test steps")
    outputs = ttt_forward(model, teacher.features, input_ids, steps)
    t2d = model.t2d.to(teacher.logits.device)
    teacher_logits = teacher.logits.float()
    in_vocab = t2d[teacher_logits.argmax(-1)]  # [B, T]
    teacher_logp = torch.log_softmax(teacher_logits[..., t2d], dim=-1)  # draft-vocab order
    teacher_p = teacher_logp.exp()
    teacher_top = teacher_logp.argmax(-1)
    total = teacher_logits.new_zeros(())
    step_losses, step_acc = [], []
    expert_total = teacher_logits.new_zeros(())
    recall_hits = recall_count = 0.0
    for j, (hidden, logits) in enumerate(outputs):
        # slot i predicts x_{i+2+j} (teacher row i+1+j): slots 0 .. T-2-j are valid
        rows = j + 1
        n = t - rows
        valid = in_vocab[:, rows:]
        logp = torch.log_softmax(logits[:, :n].float(), dim=-1)
        ce = -(teacher_p[:, rows:] * logp).sum(-1)
        denom = valid.sum().clamp(min=1)
        step_loss = (ce * valid).sum() / denom
        total = total + (decay**j) * step_loss
        step_losses.append(float(step_loss.detach()))
        with torch.no_grad():
            hit = (logits[:, :n].argmax(-1) == teacher_top[:, rows:]) & valid
            step_acc.append(float(hit.sum() / denom))
        if teacher.routing is not None and model.expert_heads is not None:
            # the node consumed x_{i+1+j}: the target routed that token at position i+1+j
            routing = teacher.routing[:, rows:]  # [B, n, L, k]
            pred = model.expert_logits(hidden[:, :n].detach())  # [B, n, L, E]
            target_hot = torch.zeros_like(pred).scatter_(-1, routing, 1.0)
            bce = F.binary_cross_entropy_with_logits(pred.float(), target_hot.float())
            expert_total = expert_total + (decay**j) * bce
            with torch.no_grad():
                k = routing.shape[-1]
                top = pred.topk(k, dim=-1).indices
                hits = (top[..., :, None] == routing[..., None, :]).any(-1).sum(-1).float()  # [B, n, L]
                recall_hits += float(hits.mean(-1).sum()) / k
                recall_count += float(hits.shape[0] * hits.shape[1])
    loss = total
    expert_loss = float("nan")
    if teacher.routing is not None and model.expert_heads is not None:
        loss = loss + expert_weight * expert_total
        expert_loss = float(expert_total.detach())
    return LossOutput(
        loss=loss,
        token_loss=float(total.detach()),
        step_losses=step_losses,
        step_accuracy=step_acc,
        expert_loss=expert_loss,
        expert_recall=recall_hits / recall_count if recall_count else float("nan"),
    )


# --------------------------------------------------------------------------- data


def _row_text(row: dict, text_field: str | None) -> str:
    """One training document from a dataset row (same prompt format as the target's training)."""
    if text_field:
        value = row[text_field]
        return "\n".join(value) if isinstance(value, list) else str(value)
    # datasets unifies the columns of all rows: a field missing from a row reads None
    row = {k: v for k, v in row.items() if v is not None}
    if "text" in row:
        return str(row["text"])
    from ..data import format_example

    if "question" in row and "answer" in row:
        prompt, ref = format_example("gsm8k", row)
        return f"{prompt} {ref}"
    if "article" in row and "highlights" in row:
        prompt, ref = format_example("cnn_dailymail", row)
        return f"{prompt} {ref}"
    if "turns" in row:
        return "\n".join(str(x) for x in row["turns"])
    parts = [str(v) for v in row.values() if isinstance(v, str)]
    if not parts:
        raise ValueError(f"cannot find text in dataset row with keys {sorted(row)}; pass --text-field")
    return "\n".join(parts)


def load_text_dataset(paths: Sequence[str], text_field: str | None = None):
    """Documents from text files (one per blank-line-separated paragraph) or JSON-lines rows.

    Loaded with ``datasets.load_dataset("text", sample_by="paragraph")`` or
    ``datasets.load_dataset("json")``.
    """
    from datasets import load_dataset

    paths = [str(p) for p in paths]
    kinds = {"json" if p.endswith((".json", ".jsonl")) else "text" for p in paths}
    if len(kinds) != 1:
        raise ValueError("mix of JSON and text files; pass one kind per run")
    kind = kinds.pop()
    if kind == "text":
        ds = load_dataset("text", data_files=paths, split="train", sample_by="paragraph")
        return [r["text"].strip() for r in ds if r["text"].strip()]
    # One load per file: files of different datasets have different columns, which a
    # single load_dataset call over all of them refuses to merge.
    docs: list[str] = []
    for path in paths:
        docs.extend(_row_text(r, text_field) for r in load_dataset("json", data_files=path, split="train"))
    return docs


def pack_blocks(tokenizer: Any, docs: Iterable[str], seq_len: int, max_tokens: int) -> torch.LongTensor:
    """Tokenize documents (separated by EOS) and cut them into ``[N, seq_len]`` blocks.

    Each document is tokenized with the tokenizer's special tokens (e.g. a leading BOS),
    as the target sees its prompts at inference.
    """
    sep = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in docs:
        if not doc.strip():
            continue
        ids.extend(tokenizer(doc)["input_ids"])
        if sep is not None:
            ids.append(int(sep))
        if len(ids) >= max_tokens:
            break
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the data holds {len(ids)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


# --------------------------------------------------------------------------- trainer


def _flag(default: Any, help: str, **metadata: Any) -> Any:
    """A dataclass field with its command-line help (``HfArgumentParser`` reads the metadata)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class TrainConfig:
    """Settings of :func:`train_eagle3`; ``examples/train_eagle3.py`` parses them from flags."""

    target: str = _flag(None, "target model folder (HF layout)", required=True)
    data: list[str] = _flag([], "training files (.txt paragraphs, .jsonl rows)", required=True)
    out: str = _flag(None, "output folder of the trained draft", required=True)
    steps: int = _flag(1000, "optimizer steps")
    seq_len: int = _flag(256, "tokens per training block")
    batch_size: int = _flag(4, "blocks per step")
    ttt_steps: int = _flag(7, "training-time-test unrolling steps (>= 1)")
    draft_vocab: int = _flag(8192, "draft vocabulary size (most frequent target tokens)")
    expert_heads: bool = _flag(False, "also train expert-predictor heads for the target's MoE layers")
    expert_loss_weight: float = _flag(1.0, "weight of the expert-prediction loss")
    lr: float = _flag(1e-3, "AdamW peak learning rate")
    warmup_steps: int = _flag(50, "linear warmup steps, then cosine decay to min_lr_ratio")
    min_lr_ratio: float = _flag(0.1, "final learning rate as a fraction of lr")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    grad_clip: float = _flag(0.5, "gradient norm clip")
    threads: int = _flag(0, "torch CPU threads (0: torch's default)")
    seed: int = _flag(0, "random seed")
    resume: bool = _flag(False, "continue from OUT/checkpoint (weights, optimizer, scheduler, data order)")
    init_from: str | None = _flag(None, "warm start: initial weights and vocabulary mapping from this draft folder "
                                        "(fresh optimizer and schedule; --resume of OUT/checkpoint wins)")
    time_budget_min: float = _flag(0.0, "stop after this many minutes (0: no budget)")
    max_steps_per_run: int = _flag(0, "stop this run after that many steps (0: no limit); resume later")
    save_every: int = _flag(200, "checkpoint every N steps")
    max_tokens: int = _flag(2_000_000, "most training tokens read from the data")
    text_field: str | None = _flag(None, "jsonl field holding the text (default: auto-detected)")
    feature_indices: list[int] | None = _flag(None, "the three target hidden_states indices fed to the draft",
                                              aliases=["--layers"], nargs=3)
    log_every: int = _flag(10, "log every N steps")

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.feature_indices is not None and len(self.feature_indices) != 3:
            raise ValueError(f"feature_indices needs 3 hidden_states indices, got {self.feature_indices}")


def _batch_indices(num_blocks: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Blocks of ``step``: a seeded permutation per epoch, so a resumed run sees the same data."""
    per_epoch = max(1, num_blocks // batch_size)
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_blocks, generator=g)
    return perm[k * batch_size : (k + 1) * batch_size]


def _warm_start_draft(cfg: TrainConfig, target: nn.Module, num_layers: int) -> Eagle3DraftModel:
    """The draft of ``cfg.init_from`` (weights, vocabulary mapping, expert heads), checked against the target.

    Its own config wins over ``draft_vocab``; feature layers and expert heads must agree
    with the flags when these are given explicitly.
    """
    draft = Eagle3DraftModel.from_pretrained(cfg.init_from, dtype=torch.float32)
    dcfg = draft.config
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    if int(dcfg.vocab_size) != int(tc.vocab_size) or int(dcfg.target_hidden_size) != int(tc.hidden_size):
        raise ValueError(
            f"--init-from {cfg.init_from}: draft was built for vocab {dcfg.vocab_size} / hidden "
            f"{dcfg.target_hidden_size}, the target has {tc.vocab_size} / {tc.hidden_size}"
        )
    if cfg.feature_indices is not None:
        have = list(dcfg.target_feature_indices(num_layers))
        if have != list(cfg.feature_indices):
            raise ValueError(f"--init-from draft reads target layers {have}, not --layers {cfg.feature_indices}")
    if cfg.expert_heads and draft.expert_heads is None:
        raise ValueError(f"--expert-heads: the --init-from draft {cfg.init_from} has no expert-predictor heads")
    if int(dcfg.draft_vocab_size) != int(min(cfg.draft_vocab, dcfg.vocab_size)):
        warnings.warn(
            f"--init-from draft has a {dcfg.draft_vocab_size}-token draft vocabulary; keeping it "
            f"(--draft-vocab {cfg.draft_vocab} ignored)",
            stacklevel=3,
        )
    return draft


def write_model_card(out_dir: str | os.PathLike, cfg: TrainConfig, summary: dict) -> None:
    """README.md with Hub metadata for a trained draft folder."""
    # A local folder is not a Hub id: the card names the folder.
    base = Path(cfg.target).name if Path(cfg.target).exists() else cfg.target
    meta = [
        "---",
        "library_name: transformers",
        f"base_model: {base}",
        "license: apache-2.0",
        "pipeline_tag: text-generation",
        "tags:",
        "- eagle3",
        "- speculative-decoding",
        "- specfit",
        "- draft-model",
        "---",
    ]
    ep = summary.get("expert_predictor")
    accuracy = f"{summary['final_step_accuracy'][0]:.3f} / {summary['final_step_accuracy'][-1]:.3f}"
    heads = "none" if not ep else (
        f"{len(ep['moe_layers'])} layers, {ep['num_experts']} experts, top-{ep['top_k']}; "
        f"recall {summary.get('final_expert_recall', float('nan')):.3f}"
    )
    body = f"""
# EAGLE-3 draft for `{base}`

An EAGLE-3 draft head (one Llama decoder layer fed by three target hidden states), in the
public checkpoint layout (`LlamaForCausalLMEagle3`, `midlayer.*`, `d2t` / `t2d`).  It has no
`embed_tokens`: it shares the target's input embeddings.

Trained with `examples/train_eagle3.py` (training-time test, {cfg.ttt_steps} unrolled steps,
loss `sum_j 0.8^j CE(target || draft)` over a {summary['draft_vocab_size']}-token draft vocabulary).

| | |
|---|---|
| target feature layers (HF `hidden_states` indices) | {summary['feature_indices']} |
| training data | {', '.join(Path(p).name for p in cfg.data)} |
| steps x batch x sequence | {summary['steps']} x {cfg.batch_size} x {cfg.seq_len} |
| final token loss | {summary['final_token_loss']:.4f} |
| step-0 / last-step top-1 agreement with the target | {accuracy} |
| training throughput | {summary['tokens_per_s']:.0f} tokens/s ({summary['threads']} CPU threads) |
| expert-predictor heads | {heads} |

## Use

```python
from transformers import AutoModelForCausalLM
from specfit_hf import Eagle3DraftModel
from specfit_hf.generation import SpecFitConfig

target = AutoModelForCausalLM.from_pretrained("{base}")
draft = Eagle3DraftModel.from_pretrained("<this folder>")
out = target.generate(input_ids, assistant_model=draft,
                      generation_config=SpecFitConfig(max_new_tokens=128, do_sample=False))
```
"""
    Path(out_dir, "README.md").write_text("\n".join(meta) + "\n" + body, encoding="utf-8")


def train_eagle3(cfg: TrainConfig, target: nn.Module | None = None, tokenizer: Any = None,
                 blocks: torch.LongTensor | None = None, progress: bool = True) -> dict:
    """Train (or resume) a draft; saves a Hub-style folder in ``cfg.out``; returns a summary.

    ``target`` / ``tokenizer`` / ``blocks`` may be passed in directly (tests); otherwise
    they are loaded from ``cfg.target`` and ``cfg.data``.
    """
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out)
    ckpt_dir = out_dir / "checkpoint"
    out_dir.mkdir(parents=True, exist_ok=True)

    if target is None:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32)
    target.eval().requires_grad_(False)
    if blocks is None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        docs = load_text_dataset(cfg.data, cfg.text_field)
        random.Random(cfg.seed).shuffle(docs)
        blocks = pack_blocks(tokenizer, docs, cfg.seq_len, cfg.max_tokens)
    if blocks.shape[1] < cfg.ttt_steps + 2:
        raise ValueError("seq_len must exceed ttt_steps + 1")
    num_layers = len(decoder_layers(target))

    # ---- the draft: resumed, or new with a frequency-based vocabulary
    state = None
    if cfg.resume and (ckpt_dir / "config.json").is_file():
        draft = Eagle3DraftModel.from_pretrained(ckpt_dir, dtype=torch.float32)
        state = torch.load(ckpt_dir / "trainer_state.pt", weights_only=True)
    elif cfg.init_from:
        draft = _warm_start_draft(cfg, target, num_layers)
    else:
        expert_predictor = None
        if cfg.expert_heads:
            routers = find_moe_routers(target)
            if not routers:
                raise ValueError("--expert-heads: the target has no MoE routers (supported MoE architectures only)")
            expert_predictor = {
                "moe_layers": [i for i, _ in routers],
                "num_experts": int(routers[0][1].weight.shape[0]),
                "top_k": _routing_top_k(target, routers[0][1]),
            }
        dcfg = draft_config_for_target(target.config, cfg.draft_vocab, cfg.feature_indices, expert_predictor)
        draft = Eagle3DraftModel(dcfg)
        counts = torch.bincount(blocks.reshape(-1), minlength=dcfg.vocab_size)[: dcfg.vocab_size]
        draft.set_vocab_mapping(build_draft_vocab(counts, dcfg.draft_vocab_size))
    # The embeddings are the target's, frozen, and not saved.
    draft.embeddings_from_target = True
    draft.attach_target_embeddings(target)
    draft.train()
    feature_indices = draft.config.target_feature_indices(num_layers)
    if len(set(feature_indices)) < len(feature_indices):
        # e.g. L = 6 gives (2, 3, 3): legal (the engines' default) but one feature is wasted.
        warnings.warn(
            f"target feature layers {feature_indices} repeat a layer for this {num_layers}-layer target; "
            "consider explicit --layers (HF hidden_states indices)",
            stacklevel=2,
        )
    moe_layers = draft.expert_moe_layers if draft.expert_heads is not None else None
    teacher = TargetTeacher(target, feature_indices, moe_layers)

    params = [p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("embed_tokens")]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio)
    step = 0
    history: list[dict] = []
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        torch.set_rng_state(state["rng"])
        history = json.loads(state.get("history", "[]"))

    def save_checkpoint() -> None:
        draft.save_pretrained(ckpt_dir)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": torch.get_rng_state(),
                "history": json.dumps(history[-200:]),
            },
            ckpt_dir / "trainer_state.pt",
        )

    budget_s = cfg.time_budget_min * 60 if cfg.time_budget_min > 0 else float("inf")
    start = time.perf_counter()
    train_time = 0.0
    tokens_done = 0
    last: LossOutput | None = None
    stopped_early = False
    bar = tqdm(total=cfg.steps, initial=step, desc="eagle3", disable=not progress, dynamic_ncols=True)
    first_step = step
    while step < cfg.steps:
        run_done = bool(cfg.max_steps_per_run) and step - first_step >= cfg.max_steps_per_run
        if time.perf_counter() - start > budget_s or run_done:
            stopped_early = True
            break
        t0 = time.perf_counter()
        ids = blocks[_batch_indices(blocks.shape[0], cfg.batch_size, step, cfg.seed)]
        batch = teacher(ids)
        last = eagle3_loss(draft, batch, ids, cfg.ttt_steps, expert_weight=cfg.expert_loss_weight)
        optimizer.zero_grad(set_to_none=True)
        last.loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        train_time += time.perf_counter() - t0
        tokens_done += ids.numel()
        record = {
            "step": step,
            "loss": float(last.loss.detach()),
            "token_loss": last.token_loss,
            "acc0": last.step_accuracy[0],
            "acc_last": last.step_accuracy[-1],
            "lr": scheduler.get_last_lr()[0],
        }
        if not math.isnan(last.expert_loss):
            record.update(expert_loss=last.expert_loss, expert_recall=last.expert_recall)
        history.append(record)
        postfix = {"loss": f"{record['token_loss']:.3f}", "acc0": f"{record['acc0']:.2f}",
                   "tok/s": f"{tokens_done / train_time:.0f}"}
        if "expert_recall" in record:
            postfix["exp_rec"] = f"{record['expert_recall']:.2f}"
        bar.set_postfix(postfix)
        bar.update(1)
        if cfg.save_every and step % cfg.save_every == 0:
            save_checkpoint()
    bar.close()
    save_checkpoint()

    draft.eval()
    draft.save_pretrained(out_dir)
    recent = history[-max(1, cfg.log_every):]
    summary = {
        "steps": step,
        "stopped_early": stopped_early,
        "feature_indices": list(feature_indices),
        "draft_vocab_size": draft.config.draft_vocab_size,
        "expert_predictor": draft.config.expert_predictor,
        "final_loss": sum(r["loss"] for r in recent) / len(recent) if recent else float("nan"),
        "final_token_loss": sum(r["token_loss"] for r in recent) / len(recent) if recent else float("nan"),
        "first_token_loss": history[0]["token_loss"] if history else float("nan"),
        "final_step_accuracy": last.step_accuracy if last else [float("nan")],
        "tokens_per_s": tokens_done / train_time if train_time else float("nan"),
        "train_seconds": train_time,
        "threads": torch.get_num_threads(),
        "config": asdict(cfg),
    }
    if recent and "expert_recall" in recent[-1]:
        summary["final_expert_recall"] = sum(r["expert_recall"] for r in recent) / len(recent)
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    write_model_card(out_dir, cfg, summary)
    return summary
