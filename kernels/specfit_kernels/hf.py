"""The kernels as a transformers experts implementation (``experts_implementation="specfit_triton"``).

transformers 5.23 dispatches every ``@use_experts_implementation`` experts module through
``ExpertsInterface`` keyed by ``config._experts_implementation``; the forward receives the module and
``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``. Here expert id == slot id: the
module's own ``gate_up_proj``/``down_proj`` parameters are the slot buffers.
"""

from __future__ import annotations

import logging

import torch

from .api import fused_experts
from .layout import ExpertLayout

EXPERTS_IMPLEMENTATION_NAME = "specfit_triton"

logger = logging.getLogger(__name__)
_warned_fallback: set[str] = set()


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
    layout = ExpertLayout.of(self)
    if layout is None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        name = type(self).__name__
        if name not in _warned_fallback:
            _warned_fallback.add(name)
            logger.warning("specfit_triton cannot express %s (activation/gating); using grouped_mm", name)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    w_gate_up = self.gate_up_proj
    out = fused_experts(
        hidden_states.to(w_gate_up.dtype),
        w_gate_up,
        self.down_proj,
        top_k_index,
        top_k_weights,
        gate_up_bias=self.gate_up_proj_bias if layout.has_bias else None,
        down_bias=self.down_proj_bias if layout.has_bias else None,
        **layout.kwargs(),
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
