"""examples/bench_kernels.py runs end to end on this GPU-less host (its --dry-run) and refuses clearly without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_dry_run_benchmarks_the_interpreted_kernel_against_transformers():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0] in {"1", "8"}]
    assert {(r[0], r[1]) for r in rows} == {
        (t, impl) for t in ("1", "8") for impl in ("specfit_triton", "grouped_mm", "batched_mm")
    }
    ours = [line for line in lines if "specfit_triton" in line]
    for line in ours:  # bf16 kernel vs transformers' grouped_mm on the same routing
        diff = float(line.split("max|diff vs grouped_mm|")[1].split(",")[0])
        assert diff < 0.1
        assert "batch-invariant True" in line
        assert line.rstrip().endswith("bitwise repeatable True")


def test_weight_bytes_count_distinct_slots_once():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_kernels
    finally:
        sys.path.pop(0)
    shape = bench_kernels.SHAPES["qwen3-30b-a3b"]
    slot_ids = torch.tensor([[3, 7], [7, 3], [3, 9]])
    per_expert = 3 * 2048 * 768 * 2
    assert bench_kernels.expert_bytes(shape, 2) == per_expert
    assert bench_kernels.weight_bytes_touched(slot_ids, shape, 2) == 3 * per_expert


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_without_cuda_the_benchmark_exits_with_a_message():
    proc = _run("--models", "mixtral-8x7b")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
