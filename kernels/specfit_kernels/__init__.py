"""specfit_kernels: Triton kernels for Mixture-of-Experts layers whose experts live in device-cache slots.

Importing this package does not import the kernel module :mod:`specfit_kernels.fused_moe` (it is
loaded on the first Triton call). It registers the ``"specfit_triton"`` experts implementation with
transformers (adding a key changes no existing behaviour); that imports
``transformers.integrations.moe``, which itself imports triton where it is installed.

Public API:
    fused_experts             -- Triton on CUDA, torch elsewhere (``backend=`` to force one)
    fused_experts_reference   -- the pure-torch implementation (CPU path, test oracle)
    align_pairs_by_slot       -- the align step (pairs grouped by slot, padded per block)
    ExpertLayout              -- layout / activation flags of an experts module (ExpertLayout.of)
    register_experts_implementation, EXPERTS_IMPLEMENTATION_NAME -- transformers integration
"""

from .align import AlignedPairs, align_pairs_by_slot
from .api import fused_experts
from .hf import EXPERTS_IMPLEMENTATION_NAME, register_experts_implementation, specfit_triton_experts_forward
from .layout import ExpertLayout
from .reference import fused_experts_reference

register_experts_implementation()

__all__ = [
    "AlignedPairs",
    "EXPERTS_IMPLEMENTATION_NAME",
    "ExpertLayout",
    "align_pairs_by_slot",
    "fused_experts",
    "fused_experts_reference",
    "register_experts_implementation",
    "specfit_triton_experts_forward",
]
