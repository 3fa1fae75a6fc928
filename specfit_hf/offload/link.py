"""An emulated host→device link, so CPU-only runs can model PCIe expert transfers.

This is an **emulation**: on a CPU-only machine the "device" expert cache is just another
buffer in host memory, so copying an expert into it costs almost nothing.  ``EmulatedLink``
performs the real copy and then *waits* until the transfer has taken as long as it would
over a link of ``gbps`` gigabytes per second with ``latency_us`` fixed cost per transfer::

    t(transfer of n bytes) = n / (gbps * 1e9) + latency_us * 1e-6

Each expert is one transfer (all of its matrices), issued one after another, the way a
single copy engine serialises them.  Two ways to make the transfer take its time:

* ``virtual=False`` (default): the call really waits — sleeps most of the way, then spins
  the last stretch on ``time.perf_counter`` (accurate to a few microseconds).
* ``virtual=True``: the call returns as soon as the copy is done and adds the rest of the
  emulated duration to the process-wide offset of :func:`specfit_hf.clock.clock`
  (``time.perf_counter() + offset``).  Every timer in this package reads :func:`clock`, so
  measured cycle times, tokens/s and calibration see the same durations as with real
  waiting, without the machine idling through them (benchmarks run several times faster,
  and parallel benchmark processes do not disturb each other's waits).  Copies are on the
  critical path either way (the runtime waits for a load before computing with it), so
  the two modes model the same serial timeline.

``specfit_hf.regimes`` says how to choose ``gbps`` / ``latency_us`` so a tiny CPU model
sees the transfer-to-compute balance of a real GPU + PCIe deployment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..clock import advance, clock

__all__ = ["EmulatedLink", "wait_until"]

# Sleeping is imprecise (scheduler granularity ~0.1-1 ms); sleep only when the wait is long
# and leave this much to spin through.
_SPIN_SECONDS = 1.0e-3


@dataclass(frozen=True)
class EmulatedLink:
    """A host→device link of ``gbps`` GB/s (10^9 bytes/s) and ``latency_us`` per transfer.

    Used on CPU (or on a GPU to emulate a slower link than the real one): the copy is
    done for real, then the call blocks until the emulated transfer time has elapsed —
    or, with ``virtual=True``, advances :func:`clock` by the remaining time instead.
    """

    gbps: float
    latency_us: float = 0.0
    virtual: bool = False

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"EmulatedLink needs gbps > 0, got {self.gbps}")
        if self.latency_us < 0:
            raise ValueError(f"EmulatedLink needs latency_us >= 0, got {self.latency_us}")

    def transfer_seconds(self, nbytes: int) -> float:
        """Emulated duration of one transfer of ``nbytes`` bytes."""
        return nbytes / (self.gbps * 1e9) + self.latency_us * 1e-6

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], nbytes: int) -> float:
        """Copy each ``(dst, src)`` pair as one transfer of ``nbytes``; returns seconds taken."""
        start = time.perf_counter()
        virtual_start = clock()
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        if pairs and pairs[0][0].is_cuda:
            torch.cuda.current_stream(pairs[0][0].device).synchronize()
        duration = self.transfer_seconds(nbytes)
        if not self.virtual:
            wait_until(start + duration)
            return time.perf_counter() - start
        # what the copy took on the package clock (nothing inside clock.simulated())
        advance(max(0.0, duration - (clock() - virtual_start)))
        return max(duration, clock() - virtual_start)


def wait_until(deadline: float) -> None:
    """Block until ``time.perf_counter() >= deadline`` (sleep, then spin the last ms)."""
    remaining = deadline - time.perf_counter()
    if remaining > 2 * _SPIN_SECONDS:
        time.sleep(remaining - _SPIN_SECONDS)
    while time.perf_counter() < deadline:
        pass
