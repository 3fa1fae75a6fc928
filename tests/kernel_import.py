"""Import a fresh copy of ``specfit_kernels.fused_moe``, compiled or interpreted.

``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted, from
``TRITON_INTERPRET``.  The copy is imported with the variable set (or unset) as asked, then the
environment, ``sys.modules`` and the package attribute are put back exactly as they were, so other
test modules keep whatever copy (or none) they had.
"""

from __future__ import annotations

import importlib
import os
import sys

import specfit_kernels


def import_fresh_kernels(interpret: bool):
    name = "specfit_kernels.fused_moe"
    saved_env = os.environ.pop("TRITON_INTERPRET", None)
    saved_module = sys.modules.pop(name, None)
    saved_attr = specfit_kernels.__dict__.get("fused_moe")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if saved_env is not None:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved_module
        if saved_attr is None:
            specfit_kernels.__dict__.pop("fused_moe", None)
        else:
            specfit_kernels.fused_moe = saved_attr
    return module
