"""The drafting gate: draft this cycle, or take a plain decode step?

The per-cycle search cannot see what a draft level costs before it is drafted, so a
draft that is too slow or too inaccurate for the link would be drafted every cycle.
The gate compares measured tokens/s of cycles that drafted with those that did not and
skips drafting while plain cycles are faster.  The first measured cycle drafts, the next
does not (to measure both); afterwards the faster kind runs, and every ``interval``
cycles one exploring cycle runs the other kind so both estimates follow the text
(acceptance changes with content).  An exploration that confirms the ranking doubles
``interval`` (up to ``max_explore_every``), one that flips it resets it to
``explore_every``, so a losing kind costs ever less.

Rates are decayed sums of tokens over decayed sums of seconds (draft + search +
verify).  These measurements belong to the host, link, cache and draft:
:func:`drafting_measurements` shares them between ``generate`` calls on the same
offload runtime with the same draft and policy settings.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

__all__ = ["DraftingMeasurements", "DraftingGate", "drafting_measurements"]


@dataclass
class DraftingMeasurements:
    """Measured cost and pay-off of drafting (shared across calls on one runtime + draft).

    ``level_seconds``: EMA of draft + search seconds per level.  ``drafted_sums`` /
    ``plain_sums``: decayed (tokens, seconds) of cycles that drafted / did not.
    ``cycle``: cycles started; ``explored_at`` / ``interval``: the last exploring cycle and
    the cycles until the next; ``exploring``: while an exploring cycle is in flight, the
    ranking (plain faster?) it was meant to test.
    """

    interval: int
    level_seconds: float | None = None
    drafted_sums: tuple[float, float] | None = None
    plain_sums: tuple[float, float] | None = None
    cycle: int = 0
    explored_at: int = 0
    exploring: bool | None = None


# offload runtime view -> draft model -> policy and settings -> measurements
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drafting_measurements(experts: object, draft: object, key: str, interval: int, share: bool) -> DraftingMeasurements:
    """The measurements kept for this runtime, draft and ``key`` (policy + settings); new if none."""
    fresh = DraftingMeasurements(interval=interval)
    if not share or experts is None or draft is None:
        return fresh
    try:
        per_draft = _SHARED.setdefault(experts, weakref.WeakKeyDictionary())
        per_key = per_draft.setdefault(draft, {})
    except TypeError:  # not weak-referenceable: keep this call's own measurements
        return fresh
    return per_key.setdefault(key, fresh)


def _decayed_add(sums: tuple[float, float] | None, tokens: float, seconds: float, a: float) -> tuple[float, float]:
    """(tokens, seconds) sums where each older cycle's weight shrinks by ``1 - a``."""
    if sums is None:
        return float(tokens), float(seconds)
    return (1 - a) * sums[0] + tokens, (1 - a) * sums[1] + seconds


class DraftingGate:
    """Adaptive drafting with exploration that backs off (see the module docstring).

    Args:
        state: the (possibly shared) measurements.
        enabled: ``False`` always drafts.
        explore_every / max_explore_every: the exploration interval and its cap.
        ema: weight of the newest cycle in the decayed sums.
    """

    def __init__(self, state: DraftingMeasurements, enabled: bool, explore_every: int, max_explore_every: int,
                 ema: float) -> None:
        self.state = state
        self.enabled = enabled
        self.explore_every = explore_every
        self.max_explore_every = max(explore_every, max_explore_every)
        self.ema = ema
        state.exploring = None

    @property
    def drafted_rate(self) -> float | None:
        """Measured tokens per second (draft, search and verify) of cycles that drafted."""
        sums = self.state.drafted_sums
        return None if sums is None else sums[0] / sums[1]

    @property
    def plain_rate(self) -> float | None:
        """Measured tokens per second of cycles that verified the root alone without drafting."""
        sums = self.state.plain_sums
        return None if sums is None else sums[0] / sums[1]

    def skip_drafting(self) -> bool:
        """Called once per cycle before drafting: whether this cycle should draft nothing."""
        state = self.state
        state.cycle += 1
        if not self.enabled or self.drafted_rate is None:
            return False
        if self.plain_rate is None:
            return True
        plain_is_faster = self.plain_rate > self.drafted_rate
        explore = state.cycle - state.explored_at >= state.interval
        if explore:
            state.explored_at = state.cycle
            state.exploring = plain_is_faster
        return plain_is_faster != explore

    def observe(self, drafted: bool, tokens: int, seconds: float) -> None:
        """Add a measured cycle; after an exploring cycle, back off if the ranking held, else reset."""
        state = self.state
        if drafted:
            state.drafted_sums = _decayed_add(state.drafted_sums, tokens, seconds, self.ema)
        else:
            state.plain_sums = _decayed_add(state.plain_sums, tokens, seconds, self.ema)
        if state.exploring is None or self.drafted_rate is None or self.plain_rate is None:
            return
        held = (self.plain_rate > self.drafted_rate) == state.exploring
        state.interval = min(2 * state.interval, self.max_explore_every) if held else self.explore_every
        state.exploring = None
