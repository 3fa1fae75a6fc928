"""``fused_experts``: one entry point that picks the Triton kernels on CUDA and the torch path elsewhere."""

from __future__ import annotations

import torch

from .reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, fused_experts_reference

BACKENDS = ("auto", "triton", "torch")


def fused_experts(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    transposed: bool = False,
    interleaved: bool = False,
    activation: str = "silu",
    swiglu_alpha: float = GPT_OSS_ALPHA,
    swiglu_limit: float = GPT_OSS_LIMIT,
    backend: str = "auto",
    config=None,
) -> torch.Tensor:
    """Experts of one forward from slot buffers: ``out[t] = sum_j weights[t, j] * expert_{slot_ids[t, j]}(hidden[t])``.

    ``expert_s(x) = w_down[s] @ act(w_gate_up[s, :I] @ x, w_gate_up[s, I:] @ x)`` in the default layout;
    see :mod:`specfit_kernels.reference` for the GPT-OSS layout flags (``transposed``, ``interleaved``,
    biases) and activations (``"silu"``, ``"swiglu_oai"``).

    Args:
        hidden: ``[T, H]`` activations, fp32 / fp16 / bf16 (weights must share the dtype).
        w_gate_up: ``[S, 2I, H]`` slot buffer (``[S, H, 2I]`` if ``transposed``).
        w_down: ``[S, H, I]`` slot buffer (``[S, I, H]`` if ``transposed``).
        slot_ids: integer ``[T, k]``: slot holding each routed expert (must already be resident).
        weights: ``[T, k]`` routing weights.
        backend: ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"triton"`` (CUDA, or CPU when
            the kernel module was imported under ``TRITON_INTERPRET=1``) or ``"torch"``.
        config: optional :class:`specfit_kernels.fused_moe.KernelConfig` (Triton backend only).

    Returns:
        ``[T, H]`` in ``hidden.dtype``. Deterministic run to run on both backends.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    kwargs = dict(
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        transposed=transposed,
        interleaved=interleaved,
        activation=activation,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
    )
    if backend == "torch" or (backend == "auto" and not hidden.is_cuda):
        return fused_experts_reference(hidden, w_gate_up, w_down, slot_ids, weights, **kwargs)
    from .fused_moe import fused_experts_triton  # imports triton: only when the kernels are used

    return fused_experts_triton(hidden, w_gate_up, w_down, slot_ids, weights, config=config, **kwargs)
