"""Benchmark the fused expert kernels against transformers' `grouped_mm` and `batched_mm` experts.

For each model shape and token count T, one MoE layer's experts run with random top-k routing over
a slot buffer holding all E experts (expert id == slot id, as in a fully resident cache). Printed per
implementation: median µs per call, and achieved GB/s of weight reads, counting each *distinct* slot
touched once (3 * H * I weights per expert) — the bytes a weight-bound kernel cannot avoid reading.
Also printed: max |kernel - grouped_mm| and whether two kernel runs are bit-identical.

    python examples/bench_kernels.py                  # CUDA host; ~1-2 minutes
    python examples/bench_kernels.py --dry-run        # any host: tiny shapes through the Triton interpreter

Shapes: Qwen3-30B-A3B experts (H 2048, I 768, k 8, E 128) and Mixtral-8x7B experts
(H 4096, I 14336, k 2, E 8), bf16, T in {1, 8, 32, 64, 128}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int  # H
    intermediate: int  # I
    top_k: int  # k
    num_experts: int  # E
    arch: str  # transformers model type whose experts module runs grouped_mm / batched_mm


SHAPES = {
    "qwen3-30b-a3b": MoeShape("Qwen3-30B-A3B", 2048, 768, 8, 128, "qwen3_moe"),
    "mixtral-8x7b": MoeShape("Mixtral-8x7B", 4096, 14336, 2, 8, "mixtral"),
}
DRY_RUN_SHAPE = MoeShape("tiny (dry run)", 64, 48, 2, 8, "qwen3_moe")
TOKEN_COUNTS = (1, 8, 32, 64, 128)
# batched_mm gathers a private copy of the expert weights for every (token, choice) pair; skip
# it where that copy alone would exceed this many bytes (Mixtral at T=128 would gather ~90 GB).
BATCHED_MM_GATHER_LIMIT = 8 * 2**30


def expert_bytes(shape: MoeShape, element_size: int) -> int:
    """Bytes of one expert's weights: gate_up [2I, H] + down [H, I]."""
    return 3 * shape.hidden * shape.intermediate * element_size


def weight_bytes_touched(slot_ids, shape: MoeShape, element_size: int) -> int:
    """Weight bytes a call must read at least once: distinct slots used x bytes per expert."""
    return int(slot_ids.unique().numel()) * expert_bytes(shape, element_size)


def random_routing(num_tokens: int, shape: MoeShape, device, dtype, generator):
    """Distinct top-k experts per token (like a router's top-k) and softmax routing weights."""
    import torch

    scores = torch.rand(num_tokens, shape.num_experts, generator=generator, device=device)
    slot_ids = scores.topk(shape.top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, shape.top_k, generator=generator, device=device), -1)
    return slot_ids, weights.to(dtype)


def make_experts_module(shape: MoeShape, w_gate_up, w_down, implementation: str):
    """A transformers experts module of `shape.arch` whose parameters are the given slot buffers."""
    import torch
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    if shape.arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            hidden_size=shape.hidden,
            moe_intermediate_size=shape.intermediate,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k,
        )
        cls = Qwen3MoeExperts
    else:
        cfg = MixtralConfig(
            hidden_size=shape.hidden,
            intermediate_size=shape.intermediate,
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k,
        )
        cls = MixtralExperts
    cfg._experts_implementation = implementation
    with torch.device("meta"):  # no host allocation of the full expert set
        module = cls(cfg)
    module.gate_up_proj = torch.nn.Parameter(w_gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(w_down, requires_grad=False)
    return module.eval()


def time_call(fn, device_type: str, warmup: int, iters: int) -> float:
    """Median microseconds per call (CUDA events on GPU, perf_counter elsewhere)."""
    import torch

    for _ in range(warmup):
        fn()
    samples = []
    if device_type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def bench_shape(shape, token_counts, dtype, device, warmup, iters, kernel_fn, progress):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    w_gate_up = torch.randn(shape.num_experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device)
    w_gate_up = (w_gate_up / shape.hidden**0.5).to(dtype)
    w_down = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, generator=gen, device=device)
    w_down = (w_down / shape.intermediate**0.5).to(dtype)
    modules = {impl: make_experts_module(shape, w_gate_up, w_down, impl) for impl in ("grouped_mm", "batched_mm")}
    elem = w_gate_up.element_size()
    rows = []
    for num_tokens in token_counts:
        hidden = torch.randn(num_tokens, shape.hidden, generator=gen, device=device).to(dtype)
        slot_ids, weights = random_routing(num_tokens, shape, device, dtype, gen)
        touched = weight_bytes_touched(slot_ids, shape, elem)
        calls = {"specfit_triton": lambda: kernel_fn(hidden, w_gate_up, w_down, slot_ids, weights)}
        for impl, module in modules.items():
            calls[impl] = lambda m=module: m(hidden, slot_ids, weights)
        gathered = num_tokens * shape.top_k * expert_bytes(shape, elem)
        with torch.no_grad():
            ours = kernel_fn(hidden, w_gate_up, w_down, slot_ids, weights)
            deterministic = torch.equal(ours, kernel_fn(hidden, w_gate_up, w_down, slot_ids, weights))
            # The last token computed alone must equal its row of the batch (verify == plain decode).
            alone = kernel_fn(hidden[-1:], w_gate_up, w_down, slot_ids[-1:], weights[-1:])
            batch_invariant = torch.equal(alone[0], ours[-1])
            baseline = modules["grouped_mm"](hidden, slot_ids, weights)
            max_diff = (ours.float() - baseline.float()).abs().max().item()
            for impl, fn in calls.items():
                if impl == "batched_mm" and gathered > BATCHED_MM_GATHER_LIMIT:
                    rows.append((num_tokens, impl, None, touched, f"skipped: gathers {gathered / 2**30:.0f} GiB"))
                    continue
                us = time_call(fn, device.type, warmup, iters)
                note = (
                    f"max|diff vs grouped_mm| {max_diff:.2e}, batch-invariant {batch_invariant}, "
                    f"bitwise repeatable {deterministic}"
                )
                rows.append((num_tokens, impl, us, touched, note if impl == "specfit_triton" else ""))
        progress.update(1)
    return rows


def print_table(shape, dtype, rows):
    print(f"\n{shape.name}: H={shape.hidden} I={shape.intermediate} k={shape.top_k} E={shape.num_experts} {dtype}")
    print(f"{'T':>5} {'impl':>15} {'us':>10} {'GB/s':>9} {'slots MB':>9}  note")
    for num_tokens, impl, us, touched, note in rows:
        us_s = f"{us:10.1f}" if us is not None else f"{'-':>10}"
        gbs = f"{touched / (us * 1e-6) / 1e9:9.1f}" if us is not None else f"{'-':>9}"
        print(f"{num_tokens:>5} {impl:>15} {us_s} {gbs} {touched / 1e6:9.1f}  {note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on CPU through the Triton interpreter")
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKEN_COUNTS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block-n", type=int, help="override KernelConfig.block_n (power of two >= 16)")
    parser.add_argument("--block-k", type=int, help="override KernelConfig.block_k (power of two >= 16)")
    parser.add_argument("--num-warps", type=int, help="override KernelConfig.num_warps")
    parser.add_argument("--num-stages", type=int, help="override KernelConfig.num_stages")
    args = parser.parse_args(argv)

    if args.dry_run:
        # Must be set before the kernel module is imported: triton.jit reads it at decoration time.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from tqdm import tqdm

    if args.dry_run:
        device, shapes, token_counts = torch.device("cpu"), [DRY_RUN_SHAPE], [t for t in (1, 8) if t]
        warmup, iters = 1, 2
    else:
        if not torch.cuda.is_available():
            print(
                "bench_kernels.py needs a CUDA GPU (none found: torch.cuda.is_available() is False).\n"
                "Run with --dry-run to exercise the script on CPU through the Triton interpreter.",
                file=sys.stderr,
            )
            return 2
        device, shapes, token_counts = torch.device("cuda"), [SHAPES[m] for m in args.models], args.tokens
        warmup, iters = args.warmup, args.iters
        print(f"device: {torch.cuda.get_device_name()}")
    import dataclasses
    import functools

    from specfit_kernels.fused_moe import INTERPRETED, default_config, fused_experts_triton

    if args.dry_run and not INTERPRETED:
        raise RuntimeError("dry run: the kernel module was imported before TRITON_INTERPRET was set")
    dtype = getattr(torch, args.dtype)
    overrides = {
        field: value
        for field, value in (
            ("block_n", args.block_n),
            ("block_k", args.block_k),
            ("num_warps", args.num_warps),
            ("num_stages", args.num_stages),
        )
        if value is not None
    }
    config = dataclasses.replace(default_config(dtype), **overrides)
    print(f"kernel config: {config}")
    kernel_fn = functools.partial(fused_experts_triton, config=config)
    progress = tqdm(total=len(shapes) * len(token_counts), desc="bench", unit="case", file=sys.stderr)
    for shape in shapes:
        rows = bench_shape(shape, token_counts, dtype, device, warmup, iters, kernel_fn, progress)
        print_table(shape, dtype, rows)
    progress.close()
    if args.dry_run:
        print("\n(dry run: CPU interpreter timings, not kernel performance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
