"""Triton kernels for the experts of one forward, reading weights from device-cache slot buffers.

Three launches per call (after the torch align step in :mod:`specfit_kernels.align`):

1. ``_gate_up_act_kernel``: for a block of ``BLOCK_M`` pairs that share a slot, computes the gate and
   up tiles of ``BLOCK_N`` intermediate features with two fp32 accumulators, applies the gated
   activation in registers and stores only the ``I``-wide intermediate (never the ``2I`` projection).
2. ``_down_kernel``: the down projection of those pairs, plus bias, scaled by the routing weight in
   fp32, stored as one fp32 row per (token, choice) pair.
3. ``_sum_choices_kernel``: ``out[t] = sum_j rows[t * k + j]`` in the fixed order ``j = 0 .. k-1``.

No atomics anywhere, so a result is reproducible bit for bit run to run. The block sizes are fixed
per dtype (never chosen from T), and every output row is computed from its own input row only, so a
token's result does not depend on which other tokens share the call (verification == plain decoding).

The module reads ``TRITON_INTERPRET`` when it is imported (``triton.jit`` decides then whether a
kernel is compiled or interpreted); ``INTERPRETED`` records the choice. Under the interpreter the
kernels run on CPU tensors; the interpreter's ``tl.dot`` is wrong on bf16 operands, so bf16 tiles
are upcast to fp32 before the dot there (``UPCAST``), which gives the same fp32-accumulated result,
and its fp32 -> bf16 cast truncates, so bf16 stores are pre-rounded to nearest-even there.
The kernels use only triton builtins (no ``tl.sigmoid``/``tl.cdiv``/``tl.zeros``: those are themselves
``@jit`` functions, compiled-or-interpreted when *triton* was imported), so a copy of this module
imported under ``TRITON_INTERPRET=1`` interprets correctly even if triton was imported without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .align import AlignedPairs, align_pairs_by_slot
from .reference import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_inputs

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

_ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1}


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters (BLOCK_* must be powers of two, BLOCK_M/N/K >= 16 for tl.dot)."""

    block_m: int = 16  # pairs per program: decode/verify batches are small, so the minimum MMA M
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_reduce: int = 256  # H elements per program of the choice-sum kernel


def default_config(dtype: torch.dtype) -> KernelConfig:
    """Fixed per dtype — deliberately independent of T (see the module docstring)."""
    if dtype == torch.float32:
        return KernelConfig(block_k=32)  # fp32 tiles are twice the bytes; keep shared memory in check
    return KernelConfig()


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _round_fp32_to_bf16_grid(x):
    """Round fp32 to the nearest bf16 value (ties to even), still as fp32.

    Only used under the interpreter, whose fp32 -> bf16 cast truncates (the GPU cast rounds to
    nearest even); after this the truncating cast is exact. NaN/inf inputs are not expected here.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gated_activation(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu(gate) * up
        out = gate * _sigmoid(gate) * up
    else:  # GPT-OSS clamped swiglu: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * (gate * _sigmoid(gate * alpha))
    return out


@triton.jit
def _gate_up_act_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    inter_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    num_pairs,
    top_k,
    H,
    I,
    stride_xt,
    stride_xh,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_bs,
    stride_bn,
    stride_ip,
    stride_in,
    feature_mult,
    up_offset,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """inter[p, n] = act(gate_n . x_t, up_n . x_t) for the pairs p of one block, n in one N tile.

    Gate feature n is row ``n * feature_mult`` of the slot's [2I, H] matrix (strides wn/wk, which
    also express the transposed layout), up feature n is ``n * feature_mult + up_offset``:
    concatenated = (1, I), interleaved = (2, 1).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:  # block past the end of the padded layout
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    gate_rows = (offs_n * feature_mult).to(tl.int64)
    g_ptrs = w_slot + gate_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + up_offset * stride_wn

    acc_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, (H + BLOCK_K - 1) // BLOCK_K):
        k_ok = offs_k < H - k0 * BLOCK_K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        if IEEE_FP32:
            acc_gate = tl.dot(x, wg, acc_gate, input_precision="ieee")
            acc_up = tl.dot(x, wu, acc_up, input_precision="ieee")
        else:
            acc_gate = tl.dot(x, wg, acc_gate)
            acc_up = tl.dot(x, wu, acc_up)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b_slot = bias_ptr + slot.to(tl.int64) * stride_bs
        b_gate = tl.load(b_slot + gate_rows * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_slot + (gate_rows + up_offset) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        acc_gate += b_gate[None, :]
        acc_up += b_up[None, :]

    act = _gated_activation(acc_gate, acc_up, alpha, limit, ACTIVATION)
    if UPCAST:  # interpreted bf16: make the truncating store round to nearest like the GPU
        act = _round_fp32_to_bf16_grid(act)
    out_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * stride_ip + offs_n[None, :] * stride_in
    tl.store(out_ptrs, act.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,
    w_ptr,
    bias_ptr,
    route_w_ptr,
    rows_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    num_pairs,
    H,
    I,
    stride_ip,
    stride_in,
    stride_ws,
    stride_wn,
    stride_wk,
    stride_bs,
    stride_bn,
    stride_rp,
    stride_rh,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """rows[p, h] = route_w[p] * (down_h . inter[p] + bias_h), fp32, for one block and one H tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    row_ok = pairs < num_pairs
    pairs64 = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = inter_ptr + pairs64[:, None] * stride_ip + offs_k[None, :] * stride_in
    w_slot = w_ptr + slot.to(tl.int64) * stride_ws
    w_ptrs = w_slot + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, (I + BLOCK_K - 1) // BLOCK_K):
        k_ok = offs_k < I - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE_FP32:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_in
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:
        b = tl.load(bias_ptr + slot.to(tl.int64) * stride_bs + offs_n * stride_bn, mask=n_ok, other=0.0)
        acc += b.to(tl.float32)[None, :]
    route_w = tl.load(route_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    out_ptrs = rows_ptr + pairs64[:, None] * stride_rp + offs_n[None, :] * stride_rh
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_choices_kernel(
    rows_ptr,
    out_ptr,
    top_k,
    H,
    stride_rp,
    stride_rh,
    stride_ot,
    stride_oh,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t, h] = sum_{j=0..k-1} rows[t*k + j, h], fp32, in fixed choice order (no atomics)."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for j in range(0, top_k):
        acc += tl.load(rows_ptr + (token * top_k + j) * stride_rp + offs * stride_rh, mask=ok, other=0.0)
    if ROUND_BF16:
        acc = _round_fp32_to_bf16_grid(acc)
    tl.store(out_ptr + token * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_experts_triton(
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
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run the fused expert kernels; same contract as :func:`specfit_kernels.fused_experts_reference`.

    Requires CUDA tensors, or CPU tensors when this module was imported with ``TRITON_INTERPRET=1``.
    """
    shapes = check_inputs(
        hidden, w_gate_up, w_down, slot_ids, weights, gate_up_bias, down_bias, transposed, activation
    )
    if hidden.is_cuda == INTERPRETED:
        where = "CPU tensors" if INTERPRETED else "CUDA tensors"
        mode = "imported with TRITON_INTERPRET=1" if INTERPRETED else "compiled"
        raise RuntimeError(f"the Triton experts kernels were {mode}; they need {where}, got {hidden.device}")
    cfg = config or default_config(hidden.dtype)
    num_tokens, top_k, hsz, inter = shapes.num_tokens, shapes.top_k, shapes.hidden, shapes.intermediate
    out = torch.empty(num_tokens, hsz, dtype=hidden.dtype, device=hidden.device)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out.zero_()

    aligned: AlignedPairs = align_pairs_by_slot(slot_ids, shapes.num_slots, cfg.block_m)
    route_w = weights.reshape(-1).contiguous()
    inter_buf = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    rows = torch.empty(num_pairs, hsz, dtype=torch.float32, device=hidden.device)

    # Strides as (slot, output feature, input feature): the transposed layout is just swapped strides.
    if transposed:
        gu_s, gu_n, gu_k = w_gate_up.stride(0), w_gate_up.stride(2), w_gate_up.stride(1)
        dn_s, dn_n, dn_k = w_down.stride(0), w_down.stride(2), w_down.stride(1)
    else:
        gu_s, gu_n, gu_k = w_gate_up.stride()
        dn_s, dn_n, dn_k = w_down.stride()
    feature_mult, up_offset = (2, 1) if interleaved else (1, inter)
    gu_bias = gate_up_bias if gate_up_bias is not None else w_gate_up  # dummy pointer when absent
    dn_bias = down_bias if down_bias is not None else w_down
    upcast = INTERPRETED and hidden.dtype == torch.bfloat16
    ieee = hidden.dtype == torch.float32
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    grid = (aligned.num_blocks, triton.cdiv(inter, cfg.block_n))
    _gate_up_act_kernel[grid](
        hidden, w_gate_up, gu_bias, inter_buf, aligned.sorted_pairs, aligned.block_slot,
        num_pairs, top_k, hsz, inter,
        hidden.stride(0), hidden.stride(1),
        gu_s, gu_n, gu_k,
        gu_bias.stride(0), gu_bias.stride(1),
        inter_buf.stride(0), inter_buf.stride(1),
        feature_mult, up_offset, float(swiglu_alpha), float(swiglu_limit),
        HAS_BIAS=gate_up_bias is not None, ACTIVATION=_ACTIVATION_CODES[activation],
        UPCAST=upcast, IEEE_FP32=ieee,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
    )  # fmt: skip
    grid = (aligned.num_blocks, triton.cdiv(hsz, cfg.block_n))
    _down_kernel[grid](
        inter_buf, w_down, dn_bias, route_w, rows, aligned.sorted_pairs, aligned.block_slot,
        num_pairs, hsz, inter,
        inter_buf.stride(0), inter_buf.stride(1),
        dn_s, dn_n, dn_k,
        dn_bias.stride(0), dn_bias.stride(1),
        rows.stride(0), rows.stride(1),
        HAS_BIAS=down_bias is not None, UPCAST=upcast, IEEE_FP32=ieee,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
    )  # fmt: skip
    grid = (num_tokens, triton.cdiv(hsz, cfg.block_reduce))
    _sum_choices_kernel[grid](
        rows, out, top_k, hsz, rows.stride(0), rows.stride(1), out.stride(0), out.stride(1),
        ROUND_BF16=upcast, BLOCK=cfg.block_reduce, num_warps=4,
    )  # fmt: skip
    return out


_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def compile_kernels(
    dtype: torch.dtype,
    capability: int = 90,
    *,
    activation: str = "silu",
    has_bias: bool = False,
    config: KernelConfig | None = None,
) -> dict[str, object]:
    """Compile the three kernels ahead of time for ``sm_<capability>`` — no GPU needed.

    Runs triton's full CUDA pipeline (TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the bundled
    ptxas) on the host, which catches lowering errors the interpreter cannot (dot shapes, layouts,
    shared memory). Returns ``{kernel name: CompiledKernel}`` (``.asm["ptx"]``, ``.metadata.shared``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        raise RuntimeError("compile_kernels needs the compiled (non-TRITON_INTERPRET) copy of this module")
    cfg = config or default_config(dtype)
    act_ty = "*" + _TRITON_DTYPES[dtype]
    pointer_types = {"sorted_pairs_ptr": "*i32", "block_slot_ptr": "*i32", "rows_ptr": "*fp32"}
    scalar_types = {"alpha": "fp32", "limit": "fp32"}
    upcast, ieee = False, dtype == torch.float32
    constexprs = {
        "_gate_up_act_kernel": dict(
            HAS_BIAS=has_bias, ACTIVATION=_ACTIVATION_CODES[activation], UPCAST=upcast, IEEE_FP32=ieee,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ),
        "_down_kernel": dict(
            HAS_BIAS=has_bias, UPCAST=upcast, IEEE_FP32=ieee,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ),
        "_sum_choices_kernel": dict(ROUND_BF16=False, BLOCK=cfg.block_reduce),
    }  # fmt: skip
    target = GPUTarget("cuda", capability, 32)
    compiled = {}
    for kernel in (_gate_up_act_kernel, _down_kernel, _sum_choices_kernel):
        consts = constexprs[kernel.__name__]
        signature = {}
        for name in kernel.arg_names:
            if name in consts:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = pointer_types.get(name, act_ty)
            else:
                signature[name] = scalar_types.get(name, "i32")
        source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        num_warps = 4
        options = dict(num_warps=num_warps, num_stages=cfg.num_stages)
        compiled[kernel.__name__] = triton.compile(source, target=target, options=options)
    return compiled
