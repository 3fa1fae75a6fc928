"""A read-only view of an offload runtime: what selection may know about the expert cache.

The selection stage plans around the device expert cache (which experts are resident,
which experts the last forward routed to, what the target's routers would pick) but
must never change it.  :class:`ExpertCacheView` is the whole interface it gets; it
copies what it returns, so nothing the caller does reaches the runtime.

Arrays are over the runtime's MoE layers in order (``moe_layers``: decoder-layer
indices) and its expert ids: ``[L, E]`` masks and ``[T, L, k]`` routings.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from .runtime import OffloadRuntime

__all__ = ["ExpertCacheView"]


class ExpertCacheView:
    """Read-only view of an :class:`~specfit_hf.offload.OffloadRuntime` (``runtime.view()``).

    Attributes:
        moe_layers: decoder-layer indices with routed experts, in order.
        num_experts / top_k: experts per MoE layer and experts per token.
        expert_bytes: bytes of one expert (what one miss moves).
    """

    def __init__(self, runtime: OffloadRuntime) -> None:
        self._runtime = runtime
        self.moe_layers: tuple[int, ...] = tuple(runtime.moe_layers)
        self.num_experts = int(runtime.num_experts)
        self.top_k = int(runtime.top_k)
        self.expert_bytes = int(runtime.expert_bytes)

    @property
    def num_layers(self) -> int:
        """MoE layers."""
        return len(self.moe_layers)

    def resident(self) -> np.ndarray:
        """``[L, E]`` bool: experts resident in the device cache now."""
        return self._runtime.resident_masks()

    def slots(self) -> np.ndarray:
        """``[L]`` int: device slots of each MoE layer's cache."""
        return self._runtime.slot_counts()

    def last_routing(self, rows: int | None = None) -> np.ndarray | None:
        """``[T, L, k]`` experts the last target forward routed each row to.

        ``None`` before any forward, or when ``rows`` is given and the last forward had
        another number of rows (then it is not the forward the caller means).
        """
        per_layer = self._one_forward(rows)
        return None if per_layer is None else _stack_routing(per_layer)

    def last_routing_later(self, rows: int | None = None) -> Callable[[], np.ndarray] | None:
        """:meth:`last_routing`, read when the returned function is called, however many forwards later.

        Each forward's routing ids are tensors of their own, never written after the forward, so keeping
        them costs nothing; copying them costs host time every cycle (and a device sync on a GPU), which
        a caller that may never read them (the context's routing, read by prompt-lookup proposals only)
        need not pay.  ``None`` as :meth:`last_routing` would be.
        """
        per_layer = self._one_forward(rows)
        return None if per_layer is None else functools.partial(_stack_routing, per_layer)

    def _one_forward(self, rows: int | None) -> list[torch.Tensor] | None:
        """The last forward's per-layer routing ids, if every layer has ``rows`` rows (any, when ``None``)."""
        per_layer = self._runtime.last_routings()
        if not per_layer or any(t is None for t in per_layer):
            return None
        shape = per_layer[0].shape
        if (rows is not None and shape[0] != rows) or any(t.shape != shape for t in per_layer):
            return None  # another forward's rows, or layers of another row count: not one forward's
        return per_layer

    def route(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids ``[T, k]`` that decoder layer ``layer``'s own router picks for ``hidden``."""
        return self._runtime.route(layer, hidden)

    def loads(self) -> int:
        """Expert loads (cache misses) so far, all layers: cycles difference it."""
        return int(self._runtime.stats.total.misses)

    def root_loads(self) -> int:
        """Of :meth:`loads`, those a forward's first row routed to (a verify block's root; all of a one-row forward's).

        What each forward would have loaded for its first token alone: a drafting cycle's
        difference is what a plain decode step would have loaded in its place.
        """
        return int(self._runtime.stats.total.first_row_misses)

    def first_uses(self) -> tuple[np.ndarray, np.ndarray]:
        """Per forward row (``FIRST_USE_ROWS`` of them), all layers so far: the distinct experts that row
        was the first to route to, and the loads among them (copies: cycles difference them).

        A verify block's rows are its root and then its nodes, so in a chain the difference at
        row ``j`` is what depth ``j`` brought that the tokens before it had not: the experts
        the target computed for it alone (an MoE forward reads each distinct expert once)
        and the loads only it caused.
        """
        runtime = self._runtime
        return runtime.first_uses.copy(), runtime.first_use_loads.copy()

    def can_prefetch(self) -> bool:
        """Whether a prefetch overlaps other work: an emulated link (its own clock) or a CUDA copy stream."""
        return self._runtime.copies_overlap

    def link_busy_seconds(self) -> float:
        """Seconds until the emulated link has finished the prefetches queued on it (0 when idle or unknown)."""
        return self._runtime.link_busy_seconds()

    def prefetches(self) -> tuple[int, int, int]:
        """Experts prefetched so far, of those the ones a forward used, and of these the ones a forward's first
        row (its root) was the first to use: cycles difference them."""
        total = self._runtime.stats.total
        return int(total.prefetches), int(total.prefetches_used), int(total.first_row_prefetches_used)

    def transfer_seconds(self) -> float | None:
        """Seconds one expert load takes on the emulated link, or ``None`` without one."""
        link = self._runtime.link
        return None if link is None else float(link.transfer_seconds(self.expert_bytes))


def _stack_routing(per_layer: list[torch.Tensor]) -> np.ndarray:
    """``[T, L, k]`` int64 host array of one forward's per-layer ``[T, k]`` routing ids."""
    if per_layer[0].dim() != 2:
        per_layer = [t.reshape(t.shape[0], -1) for t in per_layer]
    if per_layer[0].device.type == "cpu":  # (integer ids: never part of autograd)
        # already on the host: one numpy stack (a copy) costs less host time than torch's stack and cast
        return np.stack([t.numpy() for t in per_layer], axis=1).astype(np.int64, copy=False)
    # one stack and one copy to the host (a copy per layer is a device sync each)
    return torch.stack(per_layer, dim=1).detach().to(device="cpu", dtype=torch.int64).numpy()
