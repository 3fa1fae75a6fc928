"""Fused expert kernels, re-exported from :mod:`specfit_kernels` for the offload runtime.

``specfit_hf.fused_experts(hidden, w_gate_up, w_down, slot_ids, weights, ...)`` runs the experts of
one forward from device-cache slot buffers: the Triton kernels for CUDA tensors, the torch reference
elsewhere (see :func:`specfit_kernels.fused_experts`). Importing this module does not import triton.

This module is itself callable (forwarding to :func:`fused_experts`): Python binds a package
attribute to a submodule of the same name once the submodule is imported, so after
``import specfit_hf.fused_experts`` the name ``specfit_hf.fused_experts`` is this module, and it must
still behave as the function.
"""

from __future__ import annotations

import sys
import types

from specfit_kernels import (
    EXPERTS_IMPLEMENTATION_NAME,
    align_pairs_by_slot,
    fused_experts,
    fused_experts_reference,
    register_experts_implementation,
)

__all__ = [
    "EXPERTS_IMPLEMENTATION_NAME",
    "align_pairs_by_slot",
    "fused_experts",
    "fused_experts_reference",
    "register_experts_implementation",
]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return fused_experts(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
