"""The fused expert kernels compile through triton's CUDA pipeline (to cubin) on this GPU-less host.

The interpreter tests (test_kernels.py) check the kernels' arithmetic; this checks that the same
source also lowers for real GPUs (sm_80 and sm_90), which the interpreter never exercises.
"""

from __future__ import annotations

import pytest
import torch

import specfit_kernels  # noqa: F401

from kernel_import import import_fresh_kernels

triton = pytest.importorskip("triton")


fm = import_fresh_kernels(interpret=False)

if "nvidia" not in getattr(triton.backends, "backends", {}):
    pytest.skip("triton has no CUDA backend on this platform", allow_module_level=True)


@pytest.mark.parametrize(
    "dtype, capability, activation, has_bias, num_slots",
    [
        (torch.bfloat16, 90, "silu", False, 128),
        (torch.float16, 80, "silu", False, 8),
        (torch.bfloat16, 80, "swiglu_oai", True, 32),
        (torch.float32, 90, "silu", False, 300),
    ],
    ids=["bf16-sm90", "fp16-sm80", "bf16-sm80-gptoss", "fp32-sm90"],
)
def test_kernels_lower_to_cubin(dtype, capability, activation, has_bias, num_slots):
    compiled = fm.compile_kernels(dtype, capability, activation=activation, has_bias=has_bias, num_slots=num_slots)
    assert set(compiled) == {"_align_kernel", "_gate_up_act_kernel", "_down_kernel", "_sum_choices_kernel"}
    for name, kernel in compiled.items():
        assert kernel.asm["cubin"], name
        assert kernel.metadata.shared <= 160 * 1024, name  # fits an A100/H100 SM's shared memory
    # The GEMM kernels must lower their tl.dot to tensor-core MMA instructions for half types
    # (fp32 uses the exact "ieee" dot, which is FMA-based).
    ptx = compiled["_gate_up_act_kernel"].asm["ptx"]
    if dtype != torch.float32:
        assert "mma" in ptx
