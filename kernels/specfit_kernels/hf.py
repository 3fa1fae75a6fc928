"""The kernels as a transformers experts implementation (``experts_implementation="specfit_triton"``).

transformers 5.23 dispatches every ``@use_experts_implementation`` experts module through
``ExpertsInterface`` keyed by ``config._experts_implementation``; the forward receives the module and
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``. Here expert id == slot id: the
module's own ``gate_up_proj``/``down_proj`` parameters are the slot buffers.
"""

from __future__ import annotations

import logging
import sys

import torch

from .api import fused_experts

EXPERTS_IMPLEMENTATION_NAME = "specfit_triton"

logger = logging.getLogger(__name__)
_warned_fallback: set[str] = set()


def experts_activation(module: torch.nn.Module) -> tuple[str, float, float] | None:
    """``(activation, alpha, limit)`` the kernels must use for ``module``, or None if they cannot express it."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    gpt_oss = sys.modules.get("transformers.models.gpt_oss.modeling_gpt_oss")
    if gpt_oss is not None and isinstance(module, gpt_oss.GptOssExperts):
        return "swiglu_oai", float(module.alpha), float(module.limit)
    if type(module)._apply_gate is _default_apply_gate and isinstance(
        getattr(module, "act_fn", None), (SiLUActivation, torch.nn.SiLU)
    ):
        return "silu", 0.0, 0.0
    return None


def specfit_triton_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts forward backed by :func:`specfit_kernels.fused_experts`.

    Falls back to transformers' ``grouped_mm`` forward (with a one-time warning) for experts the
    kernels do not express: non-gated experts, post-expert norms, other activations.
    Expert parallelism is rejected (its sentinel ids are not slots).
    """
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError("experts_implementation='specfit_triton' does not support expert parallelism")
    activation = experts_activation(self)
    if activation is None or not getattr(self, "has_gate", True) or getattr(self, "has_post_expert_norm", False):
        from transformers.integrations.moe import grouped_mm_experts_forward

        name = type(self).__name__
        if name not in _warned_fallback:
            _warned_fallback.add(name)
            logger.warning("specfit_triton cannot express %s (activation/gating); using grouped_mm", name)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    act, alpha, limit = activation
    has_bias = getattr(self, "has_bias", False)
    w_gate_up = self.gate_up_proj
    out = fused_experts(
        hidden_states.to(w_gate_up.dtype),
        w_gate_up,
        self.down_proj,
        top_k_index,
        top_k_weights,
        gate_up_bias=self.gate_up_proj_bias if has_bias else None,
        down_bias=self.down_proj_bias if has_bias else None,
        transposed=getattr(self, "is_transposed", False),
        interleaved=not getattr(self, "is_concatenated", True),
        activation=act,
        swiglu_alpha=alpha if act == "swiglu_oai" else 0.0,
        swiglu_limit=limit if act == "swiglu_oai" else 0.0,
    )
    return out.to(hidden_states.dtype)


def register_experts_implementation(name: str = EXPERTS_IMPLEMENTATION_NAME) -> str:
    """Register the kernels in transformers' ``ExpertsInterface`` (idempotent); return the name.

    Afterwards ``from_pretrained(..., experts_implementation="specfit_triton")`` or
    ``model.set_experts_implementation("specfit_triton")`` routes MoE experts through the kernels
    (CUDA) or the torch reference (elsewhere).
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, specfit_triton_experts_forward)
    return name
