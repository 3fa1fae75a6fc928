"""One small adapter per supported MoE architecture (transformers 5.23 layouts).

In transformers 5.23 every supported model keeps a layer's routed experts as fused 3D
parameters on one ``experts`` module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
GPT-OSS transposed, interleaved gate/up, with biases) called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``, and a router module
whose forward returns ``(logits, top_k_weights, top_k_index)``.  An adapter only says where
those modules are and which parameters are per-expert; the offload runtime does the rest.

Shared experts (Qwen2-MoE ``shared_expert``, DeepSeek-V3 ``shared_experts``) and dense
MLP layers (DeepSeek-V3's first layers, Qwen MoE ``mlp_only_layers``) are ordinary modules:
they stay on the device with the other non-expert weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MoEAdapter", "ADAPTERS", "SUPPORTED_MODEL_TYPES", "adapter_for"]


@dataclass(frozen=True)
class MoEAdapter:
    model_type: str
    router_attr: str  # attribute of the MoE block holding the router
    expert_params: tuple[str, ...]  # per-expert parameters of the experts module (leading dim E)

    def moe_block(self, decoder_layer: nn.Module) -> nn.Module | None:
        """The layer's sparse MoE block, or None for a dense layer."""
        mlp = getattr(decoder_layer, "mlp", None)
        if mlp is None or not isinstance(getattr(mlp, "experts", None), nn.Module):
            return None
        if not hasattr(mlp, self.router_attr):
            return None
        return mlp

    def experts(self, block: nn.Module) -> nn.Module:
        return block.experts

    def router(self, block: nn.Module) -> nn.Module:
        return getattr(block, self.router_attr)

    def fused_kwargs(self, experts: nn.Module, slots: dict[str, torch.Tensor | None]) -> dict | None:
        """Keywords for ``specfit_hf.fused_experts`` on these slots; None if the kernels cannot run them."""
        from specfit_kernels import ExpertLayout

        layout = ExpertLayout.of(experts)
        if layout is None:
            return None
        out = layout.kwargs()
        if layout.has_bias:
            out.update(gate_up_bias=slots["gate_up_proj_bias"], down_bias=slots["down_proj_bias"])
        return out


_STANDARD = ("gate_up_proj", "down_proj")

ADAPTERS: dict[str, MoEAdapter] = {
    a.model_type: a
    for a in (
        MoEAdapter("qwen3_moe", "gate", _STANDARD),
        MoEAdapter("qwen2_moe", "gate", _STANDARD),  # + shared_expert (stays on device)
        MoEAdapter("mixtral", "gate", _STANDARD),
        MoEAdapter("olmoe", "gate", _STANDARD),
        # Dense first layers, shared experts, sigmoid scores with e_score_correction_bias and
        # group-limited top-k: all inside the router / block, untouched by offloading.
        MoEAdapter("deepseek_v3", "gate", _STANDARD),
        # gate_up_proj [E, H, 2I] transposed, interleaved gate/up, clamped SwiGLU, biases.
        MoEAdapter(
            "gpt_oss",
            "router",
            ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        ),
    )
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(ADAPTERS)


def adapter_for(model: nn.Module) -> MoEAdapter:
    """The adapter for ``model``'s architecture; ``ValueError`` for anything unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    adapter = ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(
            f"offload_experts supports only MoE causal LMs of model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type={model_type!r})"
        )
    return adapter
