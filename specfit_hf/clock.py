"""The package's one clock: wall time plus the time that emulation added or replaced.

Every timer of the decoding cycle (draft, select, verify, whole cycle), of calibration and
of the benchmarks reads :func:`clock`.  It is ``time.perf_counter()`` plus a process-wide
offset that emulation moves with :func:`advance`:

* an ``EmulatedLink(virtual=True)`` adds the part of a transfer's duration that it did
  not wait through (the copy itself is real);
* a modeled device timeline may replace the CPU's time of a piece of work by the
  modeled time of the same work (``advance(modeled - measured)``, possibly negative).

Offload, selection, generation and benchmarks all import it from here, so none of them
depends on another stage's internals to tell the time.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from typing import Callable, Iterator

__all__ = ["HostPauses", "advance", "clock", "host_pauses", "offset", "paused", "simulated"]

# Seconds that emulation has added to (or, when negative, taken from) the source.
_offset = 0.0
# Where real time comes from: perf_counter, or a frozen value inside ``simulated()``.
_source: Callable[[], float] = time.perf_counter


def clock() -> float:
    """``time.perf_counter()`` plus the emulated offset (seconds).

    Identical to ``time.perf_counter`` unless emulation is in use; time every interval that
    may contain emulated work with this.
    """
    return _source() + _offset


def advance(seconds: float) -> None:
    """Move :func:`clock` by ``seconds`` (emulated time added, or real time replaced when negative).

    Inside :func:`host_pauses` emulated work may also be paused (:class:`HostPauses`).
    """
    global _offset
    _offset += float(seconds)
    if _pauses is not None and seconds > 0:
        _offset += _pauses.draw(float(seconds))


def offset() -> float:
    """The total emulated offset so far (seconds)."""
    return _offset


@contextlib.contextmanager
def simulated() -> Iterator[None]:
    """Inside, real time stands still: :func:`clock` moves only by :func:`advance`.

    Every duration is then what emulation charged (emulated transfers, modeled forwards),
    so a run is deterministic: the same decisions, whatever the machine is doing.  Used to
    replay policy decisions exactly (tests) and to check a timing model.
    """
    global _source, _offset
    # The clock restarts at exactly 0 inside: durations are then differences of the same
    # small numbers on every run (a clock at the process's uptime plus the offset emulation
    # built up earlier would round them differently from one run to the next).
    previous, before = _source, _offset
    _source, _offset = (lambda: 0.0), 0.0
    try:
        yield
    finally:
        _source, _offset = previous, before + _offset


class HostPauses:
    """Seeded pauses of a busy host, added to the emulated clock: a loaded machine, reproducibly.

    A host that runs other work takes the core away now and then, and the cycle that runs then
    is that much longer.  Here pauses arrive at ``rate`` per second of emulated work (a Poisson
    process: how the work is split into calls does not matter), each for an exponentially
    distributed time of mean ``mean`` seconds.  With host time frozen
    (:func:`simulated`) a run is then deterministic and still meets a busy host's noise, so
    policies can be compared under the same pauses: :meth:`reseed` before each generation makes
    its pauses depend on a key, not on what ran before (``specfit bench`` keys them by the prompt,
    so every policy's generation of a prompt starts from the same pauses).
    """

    def __init__(self, rate: float, mean: float, seed: int = 0) -> None:
        if not (rate >= 0 and mean >= 0 and math.isfinite(rate) and math.isfinite(mean)):
            raise ValueError(f"host pauses need a rate >= 0 per second and a mean >= 0 seconds, got {rate}, {mean}")
        self.rate, self.mean, self.seed = float(rate), float(mean), int(seed)
        self.total = 0.0  # seconds of pauses drawn so far
        self._rng = random.Random(self.seed)

    def reseed(self, key: str) -> None:
        """Draw the next pauses from ``(seed, key)``: the same key meets the same pauses."""
        self._rng.seed(f"{self.seed}:{key}")

    def draw(self, seconds: float) -> float:
        """The pauses (seconds, often 0) that befall ``seconds`` of emulated work: a Poisson number of them
        (``rate * seconds`` on average, however the work is split into calls), each exponential."""
        if self.rate <= 0 or self.mean <= 0:
            return 0.0
        pause, at = 0.0, self._rng.expovariate(self.rate)
        while at < seconds:
            pause += self._rng.expovariate(1.0 / self.mean)
            at += self._rng.expovariate(self.rate)
        self.total += pause
        return pause


_pauses: HostPauses | None = None


def paused() -> HostPauses | None:
    """The :class:`HostPauses` in force (``None`` outside :func:`host_pauses`)."""
    return _pauses


@contextlib.contextmanager
def host_pauses(rate: float, mean: float, seed: int = 0) -> Iterator[HostPauses]:
    """Inside, emulated work meets a busy host's pauses (:class:`HostPauses`)."""
    global _pauses
    previous, _pauses = _pauses, HostPauses(rate, mean, seed)
    try:
        yield _pauses
    finally:
        _pauses = previous
