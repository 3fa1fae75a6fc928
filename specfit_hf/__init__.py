"""specfit_hf: throughput-optimal tree speculative decoding for offloaded MoE models.

Importing this package changes nothing in transformers until a ``SpecFitConfig`` is
passed to ``generate``.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `specfit_hf.fused_experts` pulls in specfit_kernels on first use (the Triton kernel
    # module itself only on the first Triton call), so importing specfit_hf stays cheap.
    if name == "fused_experts":
        from .fused_experts import fused_experts

        return fused_experts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# The stages, re-exported: offload (1), EAGLE-3 draft (2), selection (3), and tree speculative
# decoding inside generate (the loop).  Importing the generation package installs the
# SpecFitConfig routing on GenerationMixin; every other config takes the stock path unchanged.
from .eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3TreeDrafter  # noqa: E402
from .generation import (  # noqa: E402
    CausalLMTreeDrafter,
    CycleRecord,
    Drafter,
    SpecFitCache,
    SpecFitConfig,
    SpecFitGenerateOutput,
)
from .offload import EmulatedLink, OffloadRuntime, get_runtime, offload_experts  # noqa: E402
from .selection import CostModel, calibrate, select_subtree  # noqa: E402

__all__ = [
    "CausalLMTreeDrafter",
    "CostModel",
    "CycleRecord",
    "Drafter",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3TreeDrafter",
    "EmulatedLink",
    "OffloadRuntime",
    "SpecFitCache",
    "SpecFitConfig",
    "SpecFitGenerateOutput",
    "calibrate",
    "fused_experts",
    "get_runtime",
    "offload_experts",
    "select_subtree",
]
