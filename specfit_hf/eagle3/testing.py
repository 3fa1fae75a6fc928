"""Tiny random EAGLE-3 drafts and MoE targets for tests and CPU examples (fp32)."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from .config import Eagle3Config
from .modeling import Eagle3DraftModel

VOCAB = 96
HIDDEN = 32


def tiny_target(seed: int = 0, num_layers: int = 8, peak: float = 30.0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    # Sharpen the output layer so the target's next-token distributions are peaked, as a
    # trained model's are (a random target is nearly uniform: nothing to learn from).
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    return model


def tiny_draft_config(**overrides) -> Eagle3Config:
    kw = dict(
        vocab_size=VOCAB, draft_vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_hidden_size=HIDDEN,
        max_position_embeddings=256, rope_theta=10000.0,
    )
    kw.update(overrides)
    return Eagle3Config(**kw)


def tiny_draft(seed: int = 1, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(tiny_draft_config(**overrides)).eval()
    # a non-trivial vocabulary mapping: every third target id is left out
    ids = torch.tensor([i for i in range(VOCAB) if i % 3 != 1])[: model.config.draft_vocab_size]
    model.set_vocab_mapping(ids)
    # spread the weights so that draft distributions are not flat
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return model
