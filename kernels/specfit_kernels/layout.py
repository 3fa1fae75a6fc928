"""How an experts module lays out and activates its weights: the one home of the kernels' layout flags.

transformers 5.23 marks every experts module with ``@use_experts_implementation`` flags
(``is_transposed``, ``is_concatenated``, ``has_bias``) and its activation; :meth:`ExpertLayout.of`
reads them once, and both the transformers experts implementation (:mod:`specfit_kernels.hf`)
and the offload runtime pass ``layout.kwargs()`` to :func:`specfit_kernels.fused_experts`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import torch

from .reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT

__all__ = ["ExpertLayout"]


@dataclass(frozen=True)
class ExpertLayout:
    """Layout and activation of fused expert weights (see :mod:`specfit_kernels.reference`).

    Attributes:
        transposed: ``w_gate_up [E, H, 2I]`` / ``w_down [E, I, H]`` (GPT-OSS) instead of
            ``[E, 2I, H]`` / ``[E, H, I]``.
        interleaved: gate and up features alternate along the 2I axis (GPT-OSS) instead of halves.
        activation: ``"silu"`` (SwiGLU) or ``"swiglu_oai"`` (GPT-OSS clamped SwiGLU).
        swiglu_alpha / swiglu_limit: the clamped SwiGLU's constants (``swiglu_oai`` only).
        has_bias: the module has ``gate_up_proj_bias`` / ``down_proj_bias``.
    """

    transposed: bool = False
    interleaved: bool = False
    activation: str = "silu"
    swiglu_alpha: float = GPT_OSS_ALPHA
    swiglu_limit: float = GPT_OSS_LIMIT
    has_bias: bool = False

    @classmethod
    def of(cls, experts: torch.nn.Module) -> ExpertLayout | None:
        """The layout of a transformers experts module, or ``None`` when the kernels cannot run it
        (another activation, non-gated experts, post-expert norms)."""
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate

        if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
            return None
        flags = dict(transposed=bool(getattr(experts, "is_transposed", False)),
                     interleaved=not getattr(experts, "is_concatenated", True),
                     has_bias=bool(getattr(experts, "has_bias", False)))
        gpt_oss = sys.modules.get("transformers.models.gpt_oss.modeling_gpt_oss")
        if gpt_oss is not None and isinstance(experts, gpt_oss.GptOssExperts):
            return cls(activation="swiglu_oai", swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit),
                       **flags)
        if type(experts)._apply_gate is _default_apply_gate and isinstance(
            getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU)
        ):
            return cls(**flags)
        return None

    def kwargs(self) -> dict:
        """The layout keywords of :func:`specfit_kernels.fused_experts` (biases excluded)."""
        out = asdict(self)
        del out["has_bias"]
        return out
