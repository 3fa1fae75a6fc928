"""The drafting gate: draft this cycle, or take a plain decode step?

The per-cycle search cannot see what a draft level costs before it is drafted, so a
draft that is too slow or too inaccurate for the link would be drafted every cycle.
The gate compares measured tokens/s of cycles that drafted with those that did not and
skips drafting while plain cycles are faster.  The first three cycles draft, the next
three do not (to measure both over more than one cycle's luck); afterwards the faster
kind runs, and every ``interval`` cycles an exploring burst of three cycles runs the
other kind so both estimates follow the text (acceptance changes with content).  An
exploration that confirms the ranking doubles ``interval`` (up to
``max_explore_every``), one that flips it resets it to ``explore_every``, so a losing
kind costs ever less.

Rates are decayed sums of tokens over decayed sums of seconds (draft + search +
verify), with the expert transfers taken out of each cycle and charged back at a
common rate.  Transfers are most of a step's variance and drift with the cache: a
plain step at half cache loads 0 to 5 experts by routing luck, and the first cycles of
a call load more than later ones, so raw rates of a few cycles of each kind compare
routing luck and generation phase rather than drafting.  Instead every cycle reports
the experts its *root* alone loaded (in a drafting cycle: the root's routing against
the residents before the verify) and the extra loads of the drafted nodes; both kinds
are charged ``t_expert`` times the running mean of root loads, plus their own extra.

These measurements belong to the host, link, cache and draft:
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
    of exploring again.  ``drafted_sums`` / ``plain_sums``: decayed (tokens, seconds
    without transfers, cycles, extra loads beyond the root's) of cycles that drafted / did
    not; ``root_loads``: running mean of the experts a root alone loads; ``t_expert``:
    seconds per load the rates charge.
    ``cycle``: cycles started; ``explored_at`` / ``interval``: the last exploring cycle and
    the cycles until the next; ``exploring``: while an exploring cycle is in flight, the
    ranking (plain faster?) it was meant to test.
    """

    interval: int
    draft: DraftCost = field(default_factory=DraftCost)
    verify: object | None = None  # the OnlineCostModel of verification, once a call has made one
    drafted_sums: np.ndarray | None = None
    plain_sums: np.ndarray | None = None
    root_loads: float | None = None
    t_expert: float = 0.0
    cycle: int = 0
    explored_at: int = 0
    exploring: bool | None = None
    explore_left: int = 0
    drafted_count: int = 0
    plain_count: int = 0


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


_BURST = 3  # cycles of a kind measured before its rate is trusted, and per exploration


def _decayed_add(sums: np.ndarray | None, cycle: np.ndarray, a: float) -> np.ndarray:
    """Sums where each older cycle's weight shrinks by ``1 - a``."""
    return cycle.copy() if sums is None else (1 - a) * sums + cycle


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
        self.burst = _BURST
        state.exploring = None

    def _rate(self, sums: np.ndarray | None) -> float | None:
        if sums is None:
            return None
        tokens, seconds, cycles, extra = sums
        state = self.state
        transfers = state.t_expert * ((state.root_loads or 0.0) * cycles + extra)
        return tokens / max(seconds + transfers, 1e-12)

    @property
    def drafted_rate(self) -> float | None:
        """Tokens per second (draft, search and verify) of cycles that drafted, transfers at the common rate."""
        return self._rate(self.state.drafted_sums)

    @property
    def plain_rate(self) -> float | None:
        """Tokens per second of cycles that verified the root alone without drafting, transfers likewise."""
        return self._rate(self.state.plain_sums)

    def skip_drafting(self) -> bool:
        """Called once per cycle before drafting: whether this cycle should draft nothing."""
        state = self.state
        state.cycle += 1
        if not self.enabled:
            return False
        # measure each kind over a burst first: one cycle of either kind says little
        if state.drafted_count < self.burst:
            return False
        if state.plain_count < self.burst:
            return True
        plain_is_faster = self.plain_rate > self.drafted_rate
        if state.exploring is not None:  # a burst of the slower kind is under way
            state.explore_left -= 1
            return not state.exploring
        if state.cycle - state.explored_at >= state.interval:
            state.explored_at = state.cycle
            state.exploring = plain_is_faster
            state.explore_left = self.burst - 1
            return not plain_is_faster
        return plain_is_faster

    def observe(self, drafted: bool, tokens: int, seconds: float, loads: int | None = None,
                root_loads: int | None = None, t_expert: float = 0.0) -> None:
        """Add a measured cycle; after an exploring cycle, back off if the ranking held, else reset.

        ``loads``: experts the cycle loaded, ``root_loads``: of those, the ones the root
        alone needed (plain cycles: all); ``t_expert``: seconds per load (the cost model's).
        Without ``loads`` the cycle counts with its transfers in its seconds.
        """
        state = self.state
        extra = 0.0
        if loads is not None:
            root = loads if root_loads is None or not drafted else min(root_loads, loads)
            seconds = max(seconds - t_expert * loads, 0.0)
            extra = float(loads - root)
            state.root_loads = root if state.root_loads is None else (1 - self.ema) * state.root_loads + self.ema * root
            state.t_expert = t_expert
        cycle = np.array([tokens, seconds, 1.0, extra], dtype=np.float64)
        if drafted:
            state.drafted_sums = _decayed_add(state.drafted_sums, cycle, self.ema)
            state.drafted_count += 1
        else:
            state.plain_sums = _decayed_add(state.plain_sums, cycle, self.ema)
            state.plain_count += 1
        if state.exploring is None or state.explore_left > 0 or self.drafted_rate is None or self.plain_rate is None:
            return
        held = (self.plain_rate > self.drafted_rate) == state.exploring
        state.interval = min(2 * state.interval, self.max_explore_every) if held else self.explore_every
        state.exploring = None
