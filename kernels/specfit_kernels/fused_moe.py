"""Triton kernels for the experts of one forward, reading weights from device-cache slot buffers.

Four launches per call, whatever T, k and the routing (no host sync, no Python loop over experts):

0. ``_align_kernel`` (one program): groups the (token, choice) pairs by slot and pads each group to
   ``BLOCK_M`` rows — the layout of :func:`specfit_kernels.align.align_pairs_by_slot` (its torch
   twin, kept as the readable reference), built with counting passes instead of a sort.
1. ``_gate_up_act_kernel``: for a block of ``BLOCK_M`` pairs that share a slot, computes the gate and
   up tiles of ``BLOCK_N`` intermediate features with two fp32 accumulators, applies the gated
   activation in registers and stores only the ``I``-wide intermediate (never the ``2I`` projection).
2. ``_down_kernel``: the down projection of those pairs, plus bias, scaled by the routing weight in
   fp32, stored as one fp32 row per (token, choice) pair.
3. ``_sum_choices_kernel``: ``out[t] = sum_j rows[t * k + j]`` in the fixed order ``j = 0 .. k-1``.

A slot id outside ``[0, S)`` is never placed by the align kernel, and the sum kernel turns that
token's output row into NaN: a loud failure instead of a silently wrong row (range-checking on the
host would cost a device sync per layer).

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

from .align import AlignedPairs, padded_capacity
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
def _add(a, b):
    return a + b


# Sums and prefix sums use the combine function of tl.sum / tl.cumsum: compiled it is the same
# addition as `_add`, and the interpreter recognizes it and runs numpy's sum/cumsum instead of
# calling the combine function once per element (seconds per call for the align kernel).
_sum_combine = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _align_kernel(
    slot_ids_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    num_pairs,
    num_slots,
    capacity,
    num_blocks,
    BLOCK_M: tl.constexpr,
    S_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Single-program align step (same layout as ``align_pairs_by_slot``).

    Pass 1 counts pairs per slot (one-hot [CHUNK, S_BLOCK] tiles), giving each slot's padded start;
    pass 2 places pair p at ``padded_start[s] + (# earlier pairs of slot s)``; pass 3 labels blocks.
    Pairs keep ascending order within a slot, so the layout is deterministic.
    """
    slot_range = tl.arange(0, S_BLOCK)
    slot_exists = slot_range < num_slots
    for r0 in range(0, capacity, CHUNK):  # padding sentinel everywhere first
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + rows, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=rows < capacity)

    counts = tl.full((S_BLOCK,), 0, tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        slots = tl.load(slot_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        onehot = ((slots[:, None] == slot_range[None, :]) & slot_exists[None, :]).to(tl.int32)
        counts += tl.reduce(onehot, 0, _sum_combine)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.associative_scan(padded, 0, _sum_combine)
    padded_start = padded_end - padded
    tl.debug_barrier()  # the sentinel fill above must land before the placement stores below

    placed = tl.full((S_BLOCK,), 0, tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        pairs = p0 + tl.arange(0, CHUNK)
        slots = tl.load(slot_ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
        onehot = ((slots[:, None] == slot_range[None, :]) & slot_exists[None, :]).to(tl.int32)
        rank = tl.associative_scan(onehot, 0, _sum_combine) - 1  # rank among this chunk's pairs of the slot
        dest = tl.reduce(onehot * (rank + (padded_start + placed)[None, :]), 1, _sum_combine)
        valid = (pairs < num_pairs) & (slots >= 0) & (slots < num_slots)
        tl.store(sorted_pairs_ptr + dest, pairs, mask=valid)
        placed += tl.reduce(onehot, 0, _sum_combine)

    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        first_row = (blocks * BLOCK_M)[:, None]
        inside = (first_row >= padded_start[None, :]) & (first_row < padded_end[None, :])
        hits = tl.reduce(inside.to(tl.int32), 1, _sum_combine)
        slot = tl.reduce(tl.where(inside, slot_range[None, :], 0), 1, _sum_combine)
        tl.store(block_slot_ptr + blocks, tl.where(hits > 0, slot, -1), mask=blocks < num_blocks)


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
    I,  # noqa: E741  (intermediate size, as in the papers' notation)
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
    I,  # noqa: E741  (intermediate size)
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
    slot_ids_ptr,
    num_slots,
    top_k,
    H,
    stride_rp,
    stride_rh,
    stride_ot,
    stride_oh,
    ROUND_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t, h] = sum_{j=0..k-1} rows[t*k + j, h], fp32, in fixed choice order (no atomics).

    A choice whose slot id is out of range was never computed: it contributes NaN.
    """
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    for j in range(0, top_k):
        pair = token * top_k + j
        slot = tl.load(slot_ids_ptr + pair)
        row = tl.load(rows_ptr + pair * stride_rp + offs * stride_rh, mask=ok, other=0.0)
        acc += tl.where((slot >= 0) & (slot < num_slots), row, float("nan"))
    if ROUND_BF16:
        acc = _round_fp32_to_bf16_grid(acc)
    tl.store(out_ptr + token * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=ok)


def align_chunk(num_slots: int) -> tuple[int, int]:
    """(S_BLOCK, CHUNK) of the align kernel: one-hot tiles of about 8K elements."""
    s_block = max(16, triton.next_power_of_2(num_slots))
    return s_block, max(16, min(128, 8192 // s_block))


def align_pairs_triton(slot_flat: torch.Tensor, num_slots: int, block_m: int) -> AlignedPairs:
    """The align step as one Triton launch; same result as :func:`align_pairs_by_slot`.

    Slot ids outside ``[0, num_slots)`` are left out of the layout (see the module docstring).
    """
    num_pairs = slot_flat.numel()
    capacity = padded_capacity(num_pairs, num_slots, block_m)
    num_blocks = capacity // block_m
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=slot_flat.device)
    block_slot = torch.empty(num_blocks, dtype=torch.int32, device=slot_flat.device)
    s_block, chunk = align_chunk(num_slots)
    _align_kernel[(1,)](
        slot_flat, sorted_pairs, block_slot, num_pairs, num_slots, capacity, num_blocks,
        BLOCK_M=block_m, S_BLOCK=s_block, CHUNK=chunk, num_warps=8,
    )  # fmt: skip
    return AlignedPairs(sorted_pairs, block_slot, num_pairs, block_m)


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

    slot_flat = slot_ids.reshape(-1).contiguous()
    aligned = align_pairs_triton(slot_flat, shapes.num_slots, cfg.block_m)
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
        rows, out, slot_flat, shapes.num_slots, top_k, hsz,
        rows.stride(0), rows.stride(1), out.stride(0), out.stride(1),
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
    num_slots: int = 128,
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
    pointer_types = {
        "sorted_pairs_ptr": "*i32", "block_slot_ptr": "*i32", "rows_ptr": "*fp32", "slot_ids_ptr": "*i64",
    }  # fmt: skip
    s_block, chunk = align_chunk(num_slots)
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
        "_align_kernel": dict(BLOCK_M=cfg.block_m, S_BLOCK=s_block, CHUNK=chunk),
    }  # fmt: skip
    target = GPUTarget("cuda", capability, 32)
    compiled = {}
    for kernel in (_align_kernel, _gate_up_act_kernel, _down_kernel, _sum_choices_kernel):
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
        if kernel is _align_kernel:
            num_warps = 8
        options = dict(num_warps=num_warps, num_stages=cfg.num_stages)
        compiled[kernel.__name__] = triton.compile(source, target=target, options=options)
    return compiled
