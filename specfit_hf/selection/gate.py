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
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DraftCost", "DraftingMeasurements", "DraftingGate", "drafting_measurements"]


@dataclass
class DraftCost:
    """Seconds of drafting a tree (draft steps + the search after each level) ~ ``t_level * levels + t_node * nodes``.

    Fitted on every drafting cycle by least squares on decayed sums (a small ridge keeps
    ``t_node`` near 0 while every level has the same width, when the split is not
    identifiable); both terms non-negative.
    """

    sums: np.ndarray = field(default_factory=lambda: np.zeros(5))  # decayed [LL, LN, NN, LS, NS]
    t_level: float | None = None
    t_node: float = 0.0

    def add(self, levels: int, nodes: int, seconds: float, decay: float) -> None:
        """Add one cycle's drafting: ``levels`` levels with ``nodes`` nodes in ``seconds``."""
        lv, nd = float(levels), float(nodes)
        self.sums = decay * self.sums + np.array([lv * lv, lv * nd, nd * nd, lv * seconds, nd * seconds])
        ll, ln, nn, ls, ns = self.sums
        ridge = 1e-3 * nn + 1e-12
        det = ll * (nn + ridge) - ln * ln
        t_level = (ls * (nn + ridge) - ln * ns) / det if det > 0 else -1.0
        t_node = (ll * ns - ln * ls) / det if det > 0 else -1.0
        if t_level < 0 or t_node < 0:  # one term alone
            t_level, t_node = (ls / ll, 0.0) if t_node < 0 or ls / ll >= ns / max(nn, 1e-12) else (0.0, ns / nn)
        self.t_level, self.t_node = max(float(t_level), 0.0), max(float(t_node), 0.0)

    def predict(self, levels: int, nodes: int) -> float:
        """Seconds of drafting ``levels`` levels holding ``nodes`` nodes (0 before any data)."""
        return 0.0 if self.t_level is None else self.t_level * levels + self.t_node * nodes


@dataclass
class DraftingMeasurements:
    """Measured cost and pay-off of drafting (shared across calls on one runtime + draft).

    ``draft``: the fitted cost of drafting (:class:`DraftCost`); ``verify``: the online fit
    of verification cost, so a later call starts from what earlier calls measured instead
    of exploring again.  ``drafted_sums`` /
    ``plain_sums``: decayed (tokens, seconds) of cycles that drafted / did not.
    ``cycle``: cycles started; ``explored_at`` / ``interval``: the last exploring cycle and
    the cycles until the next; ``exploring``: while an exploring cycle is in flight, the
    ranking (plain faster?) it was meant to test.
    """

    interval: int
    draft: DraftCost = field(default_factory=DraftCost)
    verify: object | None = None  # the OnlineCostModel of verification, once a call has made one
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
