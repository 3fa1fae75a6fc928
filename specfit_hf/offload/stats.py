"""Counters of the expert cache: hits, misses, bytes moved host→device, time spent moving."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["TransferStats", "OffloadStats"]


@dataclass
class TransferStats:
    """Counters for one MoE layer, or summed over all of them.

    A hit / miss is counted once per distinct expert routed in one forward of a layer
    (a forward over many tokens that all use expert 5 counts expert 5 once).
    """

    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    transfer_seconds: float = 0.0
    forwards: int = 0
    multi_wave_forwards: int = 0  # forwards that routed to more distinct experts than slots
    first_row_misses: int = 0  # of the misses, those the forward's first row routed to (its root)
    prefetches: int = 0  # experts copied ahead of use (``OffloadRuntime.prefetch``): not misses, in bytes_h2d
    prefetches_used: int = 0  # of those, the ones a forward routed to before they were evicted
    first_row_prefetches_used: int = 0  # of those, the ones the forward's first row (its root) routed to first
    wait_seconds: float = 0.0  # forwards and loads waiting for prefetches still on the link

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any lookup."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def copy(self) -> "TransferStats":
        return TransferStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __sub__(self, other: "TransferStats") -> "TransferStats":
        """Difference of two snapshots (e.g. the counters of one decoding cycle)."""
        return TransferStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def _reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())


@dataclass
class OffloadStats:
    """Per-layer counters (keyed by decoder-layer index) and their running total.

    ``total`` is kept up to date on every event, so reading ``stats.total.misses`` is a plain
    attribute read.
    """

    layers: dict[int, TransferStats] = field(default_factory=dict)
    total: TransferStats = field(default_factory=TransferStats)

    def reset(self) -> None:
        for s in self.layers.values():
            s._reset()
        self.total._reset()

    def __str__(self) -> str:
        t = self.total
        return (
            f"OffloadStats(hits={t.hits}, misses={t.misses}, hit_rate={t.hit_rate:.3f}, "
            f"bytes_h2d={t.bytes_h2d}, transfer_seconds={t.transfer_seconds:.4f}, layers={len(self.layers)})"
        )
