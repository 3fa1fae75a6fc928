"""Offloaded-expert MoE runtime: routed experts in host memory, a per-layer device cache.

    runtime = offload_experts(model, device="cuda", slots_per_layer=32, policy="lru")
    model.generate(...)            # unchanged; misses are copied host->device on demand
    runtime.stats.total.misses     # counters; runtime.cached_experts(layer) for the cost model
    runtime.detach()               # the model as it was

On a CPU-only machine ``EmulatedLink(gbps, latency_us)`` emulates a PCIe link's timing;
time anything that may contain emulated transfers with ``clock()``.
"""

from ..clock import clock
from .adapters import SUPPORTED_MODEL_TYPES, MoEAdapter
from .cache import POLICIES, ExpertCache
from .link import EmulatedLink
from .runtime import OffloadRuntime, get_runtime, offload_experts
from .stats import OffloadStats, TransferStats
from .view import ExpertCacheView

__all__ = [
    "offload_experts",
    "get_runtime",
    "OffloadRuntime",
    "ExpertCacheView",
    "EmulatedLink",
    "clock",
    "OffloadStats",
    "TransferStats",
    "ExpertCache",
    "MoEAdapter",
    "SUPPORTED_MODEL_TYPES",
    "POLICIES",
]
