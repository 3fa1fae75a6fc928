"""Plain-torch reference for the fused expert computation, plus the shared input checks.

This module never imports triton: it is the CPU fallback of :func:`specfit_kernels.fused_experts`
and the ground truth the kernel tests compare against.

Weight layouts (``ExpertLayout``)
---------------------------------
The slot buffers hold one expert per slot, in the layout of the architecture's expert parameters:

* default (Qwen3-MoE, Mixtral, ...): ``w_gate_up [S, 2I, H]`` with rows ``[0, I)`` the gate and
  ``[I, 2I)`` the up projection; ``w_down [S, H, I]``.
* ``transposed=True`` (GPT-OSS): ``w_gate_up [S, H, 2I]``, ``w_down [S, I, H]``
  (``x @ W`` instead of ``W @ x``).
* ``interleaved=True`` (GPT-OSS): gate and up features alternate along the 2I axis
  (``gate = [..., 0::2]``, ``up = [..., 1::2]``) instead of being concatenated.
* biases (GPT-OSS): ``gate_up_bias [S, 2I]`` (same feature order as the weights), ``down_bias [S, H]``.

Activations
-----------
* ``"silu"``: ``silu(gate) * up``.
* ``"swiglu_oai"`` (GPT-OSS, transformers' ``GptOssExperts._apply_gate``):
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``(up + 1) * gate * sigmoid(alpha * gate)``.

Rounding points (shared with the Triton kernels so their results differ only by summation order):
both projections accumulate in fp32, the activation is computed in fp32 and rounded once to the
activation dtype (the intermediate the down projection reads), the down projection accumulates in
fp32, the routing weight is applied in fp32, the k contributions of a token are summed in fp32 in
choice order ``j = 0 .. k-1``, and the sum is rounded once to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("silu", "swiglu_oai")

# transformers' GPT-OSS config defaults (`swiglu_alpha`, `swiglu_limit`).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


@dataclass(frozen=True)
class ExpertShapes:
    """Sizes of one fused-experts call, derived (and checked) from its inputs."""

    num_tokens: int  # T
    top_k: int  # k
    hidden: int  # H
    intermediate: int  # I
    num_slots: int  # S


def check_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    transposed: bool,
    activation: str,
) -> ExpertShapes:
    """Check shapes, dtypes and devices (host-side only: no device sync); return the sizes.

    Slot ids are *not* range-checked here (that would cost a device sync per layer); out-of-range
    ids raise inside the align step instead (an index error on CPU, a device-side assert on CUDA).
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"w_gate_up and w_down must be 3-D slot buffers, got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}"
        )
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported activation dtype {hidden.dtype}; expected one of {SUPPORTED_DTYPES}")
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise TypeError(
            f"weights ({w_gate_up.dtype}, {w_down.dtype}) must have the activation dtype {hidden.dtype}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    num_tokens, hidden_size = hidden.shape
    num_slots = w_gate_up.shape[0]
    if transposed:
        gu_in, gu_out = w_gate_up.shape[1], w_gate_up.shape[2]
        dn_in, dn_out = w_down.shape[1], w_down.shape[2]
    else:
        gu_out, gu_in = w_gate_up.shape[1], w_gate_up.shape[2]
        dn_out, dn_in = w_down.shape[1], w_down.shape[2]
    if gu_in != hidden_size or gu_out % 2:
        layout = "[S, H, 2I]" if transposed else "[S, 2I, H]"
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} does not match {layout} with H={hidden_size}")
    inter = gu_out // 2
    if w_down.shape[0] != num_slots or dn_out != hidden_size or dn_in != inter:
        layout = "[S, I, H]" if transposed else "[S, H, I]"
        raise ValueError(
            f"w_down {tuple(w_down.shape)} does not match {layout} with S={num_slots}, H={hidden_size}, I={inter}"
        )
    if slot_ids.dim() != 2 or slot_ids.shape[0] != num_tokens:
        raise ValueError(f"slot_ids must be [T={num_tokens}, k], got {tuple(slot_ids.shape)}")
    if slot_ids.dtype.is_floating_point or slot_ids.dtype == torch.bool:
        raise TypeError(f"slot_ids must be an integer tensor, got {slot_ids.dtype}")
    if not weights.dtype.is_floating_point:
        raise TypeError(f"weights must be floating point, got {weights.dtype}")
    if weights.shape != slot_ids.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must match slot_ids {tuple(slot_ids.shape)}")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (num_slots, 2 * inter):
        raise ValueError(f"gate_up_bias must be [S, 2I]=({num_slots}, {2 * inter}), got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (num_slots, hidden_size):
        raise ValueError(f"down_bias must be [S, H]=({num_slots}, {hidden_size}), got {tuple(down_bias.shape)}")
    tensors = [hidden, w_gate_up, w_down, slot_ids, weights]
    tensors += [b for b in (gate_up_bias, down_bias) if b is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    return ExpertShapes(num_tokens, slot_ids.shape[1], hidden_size, inter, num_slots)


def apply_activation(
    gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = GPT_OSS_ALPHA, limit: float = GPT_OSS_LIMIT
) -> torch.Tensor:
    """The gated activation on fp32 ``gate``/``up`` (see the module docstring)."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def fused_experts_reference(
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
) -> torch.Tensor:
    """Pure-torch fused experts: ``out[t] = sum_j weights[t, j] * expert_{slot_ids[t, j]}(hidden[t])``.

    Loops over the distinct slots used (not over pairs), computing in fp32 with the kernel's rounding
    points. Works on any device; used as the CPU path and as the kernels' test oracle.

    Args:
        hidden: ``[T, H]`` activations (fp32, fp16 or bf16).
        w_gate_up: ``[S, 2I, H]`` gate/up slot buffer (``[S, H, 2I]`` when ``transposed``).
        w_down: ``[S, H, I]`` down slot buffer (``[S, I, H]`` when ``transposed``).
        slot_ids: integer ``[T, k]``, the slot holding each routed expert.
        weights: ``[T, k]`` routing weights.
        gate_up_bias, down_bias: optional ``[S, 2I]`` / ``[S, H]`` biases.
        transposed, interleaved, activation, swiglu_alpha, swiglu_limit: layout and activation flags
            (see the module docstring).

    Returns:
        ``[T, H]`` tensor in ``hidden.dtype``.
    """
    shapes = check_inputs(
        hidden, w_gate_up, w_down, slot_ids, weights, gate_up_bias, down_bias, transposed, activation
    )
    num_tokens, top_k, inter = shapes.num_tokens, shapes.top_k, shapes.intermediate
    flat_slots = slot_ids.reshape(-1).long()
    if flat_slots.numel() and (int(flat_slots.min()) < 0 or int(flat_slots.max()) >= shapes.num_slots):
        raise IndexError(
            f"slot_ids must lie in [0, {shapes.num_slots}), got range "
            f"[{int(flat_slots.min())}, {int(flat_slots.max())}]"
        )
    flat_weights = weights.reshape(-1).float()
    pair_out = torch.zeros(num_tokens * top_k, shapes.hidden, dtype=torch.float32, device=hidden.device)
    for slot in torch.unique(flat_slots).tolist():
        pairs = torch.nonzero(flat_slots == slot).squeeze(1)
        x = hidden[pairs // top_k].float()
        w_gu = w_gate_up[slot].float()
        gate_up = x @ w_gu if transposed else x @ w_gu.T  # [n, 2I]
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[slot].float()
        if interleaved:
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        act = apply_activation(gate, up, activation, swiglu_alpha, swiglu_limit)
        act = act.to(hidden.dtype).float()  # the kernel's intermediate is stored in the activation dtype
        w_dn = w_down[slot].float()
        down = act @ w_dn if transposed else act @ w_dn.T  # [n, H]
        if down_bias is not None:
            down = down + down_bias[slot].float()
        pair_out[pairs] = down * flat_weights[pairs, None]
    out = torch.zeros(num_tokens, shapes.hidden, dtype=torch.float32, device=hidden.device)
    per_choice = pair_out.view(num_tokens, top_k, shapes.hidden)
    for j in range(top_k):  # fixed choice order, as in the kernel's reduction
        out += per_choice[:, j]
    return out.to(hidden.dtype)
