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
import time
from typing import Callable, Iterator

__all__ = ["clock", "advance", "offset", "simulated"]

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
    """Move :func:`clock` by ``seconds`` (emulated time added, or real time replaced when negative)."""
    global _offset
    _offset += float(seconds)


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
