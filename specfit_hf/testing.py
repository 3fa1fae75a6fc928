"""Tiny random models for tests, CPU examples and benchmarks: the one home of every builder.

Random weights, tiny dimensions, fp32 unless asked otherwise.  Builders:

* EAGLE-3: :func:`tiny_target` (8-layer Qwen3-MoE, peaked output), :func:`tiny_draft_config`,
  :func:`tiny_draft` (random draft), :func:`aligned_eagle3_draft` (a draft that predicts the
  target's next token at depth 1, so acceptance is real);
* generic: :func:`tiny_qwen3_moe`, :func:`tiny_llama`, :func:`noisy_copy` (a draft sharing
  the target's weights up to noise);
* offload: :data:`MOE_ARCHS`, :func:`moe_config`, :func:`build_moe` (one tiny model per
  supported MoE architecture, with random biases and sharp routers);
* kernels: :func:`tiny_kernel_moe`; benchmarks: :func:`tiny_moe_target`.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

__all__ = [
    "VOCAB", "HIDDEN", "tiny_target", "tiny_draft_config", "tiny_draft", "aligned_eagle3_draft",
    "GEN_VOCAB", "tiny_qwen3_moe", "tiny_llama", "noisy_copy",
    "MOE_ARCHS", "MOE_VOCAB", "MOE_EXPERTS", "MOE_TOP_K", "MOE_COMMON_KWARGS", "moe_config", "build_moe",
    "tiny_kernel_moe", "tiny_moe_target",
]

# --------------------------------------------------------------------------- EAGLE-3
VOCAB = 96
HIDDEN = 32


def tiny_target(seed: int = 0, num_layers: int = 8, peak: float = 30.0) -> Qwen3MoeForCausalLM:
    """8-layer Qwen3-MoE (vocab 96, hidden 32, 8 experts, top-2, eager) with a sharpened ``lm_head``."""
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


def tiny_draft_config(**overrides):
    """An :class:`~specfit_hf.eagle3.Eagle3Config` matching :func:`tiny_target` (draft vocab 64)."""
    from .eagle3.config import Eagle3Config

    kw = dict(
        vocab_size=VOCAB, draft_vocab_size=64, hidden_size=HIDDEN, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, target_hidden_size=HIDDEN,
        max_position_embeddings=256, rope_theta=10000.0,
    )
    kw.update(overrides)
    return Eagle3Config(**kw)


def tiny_draft(seed: int = 1, **overrides):
    """A random EAGLE-3 draft for :func:`tiny_target` (every third target id left out of its vocab)."""
    from .eagle3.modeling import Eagle3DraftModel

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


@torch.no_grad()
def aligned_eagle3_draft(target: nn.Module, seed: int = 1, **overrides):
    """An EAGLE-3 draft whose first step reproduces ``target``'s next-token logits.

    Its third feature is the target's last-layer output (HF index ``L``); ``fc`` passes it
    through, attention and MLP add nothing (``o_proj`` / ``down_proj`` zero), and ``norm`` /
    ``lm_head`` are the target's: at depth 1 the draft proposes the target's own argmax,
    so greedy speculation accepts tokens (deeper levels repeat the same guess).  Random
    otherwise; ``overrides`` go to :func:`tiny_draft_config`.
    """
    from .eagle3.modeling import Eagle3DraftModel

    cfg = target.config
    num_layers, hidden, vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    kw = dict(vocab_size=vocab, draft_vocab_size=vocab, hidden_size=hidden, target_hidden_size=hidden,
              rms_norm_eps=cfg.rms_norm_eps,
              eagle_config={"eagle_aux_hidden_state_layer_ids": [2, num_layers // 2, num_layers],
                            "aux_hidden_state_id_convention": "hf_index"})
    kw.update(overrides)
    torch.manual_seed(seed)
    draft = Eagle3DraftModel(tiny_draft_config(**kw)).eval()
    draft.fc.weight.zero_()
    draft.fc.weight[:, 2 * hidden:] = torch.eye(hidden)
    draft.midlayer.self_attn.o_proj.weight.zero_()
    draft.midlayer.mlp.down_proj.weight.zero_()
    draft.norm.weight.copy_(target.model.norm.weight)
    draft.lm_head.weight.copy_(target.lm_head.weight)
    draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return draft


# --------------------------------------------------------------------------- generic drafts / targets
GEN_VOCAB = 64


def tiny_qwen3_moe(seed: int = 0, vocab: int = GEN_VOCAB, peak: float | None = None) -> Qwen3MoeForCausalLM:
    """2-layer Qwen3-MoE (hidden 32, 8 experts, top-2); ``peak`` scales ``lm_head`` (peaked outputs)."""
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    if peak is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(peak)
    return model


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = GEN_VOCAB, hidden: int = 32) -> LlamaForCausalLM:
    """A tiny dense Llama (``layers`` layers, ``hidden`` wide)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


def noisy_copy(model: nn.Module, scale: float = 0.3, seed: int = 1) -> nn.Module:
    """A draft sharing the target's weights up to noise: accepts long paths, but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * p.std() * torch.randn_like(p))
    return draft


# --------------------------------------------------------------------------- one model per MoE architecture
MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
MOE_EXPERTS = 16
MOE_TOP_K = 2
MOE_VOCAB = 96
MOE_COMMON_KWARGS = dict(
    vocab_size=MOE_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, pad_token_id=None, bos_token_id=None,
)


def moe_config(arch: str, top_k: int = MOE_TOP_K):
    """Tiny config of ``arch`` (one of :data:`MOE_ARCHS`) with 16 experts, ``top_k`` per token.

    gpt-oss alternates sliding-window (window 8) and full-attention layers.
    """
    c, e = MOE_COMMON_KWARGS, MOE_EXPERTS
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**c, head_dim=8, moe_intermediate_size=24, num_experts=e,
                              num_experts_per_tok=top_k, norm_topk_prob=True)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**c, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                              num_experts=e, num_experts_per_tok=top_k)
    if arch == "mixtral":
        return MixtralConfig(**{**c, "intermediate_size": 24}, num_local_experts=e, num_experts_per_tok=top_k)
    if arch == "olmoe":
        return OlmoeConfig(**{**c, "intermediate_size": 24}, num_experts=e, num_experts_per_tok=top_k)
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            **{**c, "num_hidden_layers": 3, "num_key_value_heads": 4}, moe_intermediate_size=24,
            n_routed_experts=e, n_group=4, topk_group=2, num_experts_per_tok=top_k, first_k_dense_replace=1,
            n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "gpt_oss":
        return GptOssConfig(**{**c, "intermediate_size": 24}, head_dim=8, num_local_experts=e,
                            num_experts_per_tok=top_k, sliding_window=8)
    raise KeyError(f"unknown MoE architecture {arch!r}; expected one of {MOE_ARCHS}")


def build_moe(arch: str, seed: int = 0, top_k: int = MOE_TOP_K) -> nn.Module:
    """The tiny ``arch`` model (eager attention, fp32) with random biases and sharp routers."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, top_k), attn_implementation="eager",
                                             dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        # Zero-initialised extras would hide layout bugs: make biases and DeepSeek's score
        # correction bias random, and routers sharper so routing is decisive.
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_proj_bias", "router.bias")):
                tensor.normal_(0, 0.05)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(0, 0.2)
            elif (name.endswith(("gate.weight", "router.weight")) and tensor.dim() == 2
                  and tensor.shape[0] == MOE_EXPERTS):
                tensor.normal_(0, 0.5)
    return model


# --------------------------------------------------------------------------- kernels, benchmarks
def tiny_kernel_moe(arch: str, seed: int = 8) -> nn.Module:
    """2-layer Qwen3-MoE or gpt-oss with 6 experts, hidden 40 (odd tile sizes for the kernel tests)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=40, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_experts=6,
                             num_experts_per_tok=2)
        return Qwen3MoeForCausalLM(cfg).eval()
    cfg = GptOssConfig(**common, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():  # the init leaves GPT-OSS expert biases at zero; make them matter
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    return model.eval()


def tiny_moe_target(vocab: int = 8192, hidden: int = 128, layers: int = 6, experts: int = 64, top_k: int = 4):
    """A random Qwen3-MoE shaped like the repository's tiny target (for drafting / training benchmarks)."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, moe_intermediate_size=80,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=2048,
    )
    return Qwen3MoeForCausalLM(cfg).eval()
