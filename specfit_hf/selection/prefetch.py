"""Which predicted experts to copy in ahead of the verify that needs them, while the link is idle.

A chain cycle drafts its levels, then verifies them in one target forward, and every expert
that forward needs and the device cache lacks is copied over the host link on its critical
path.  Drafting leaves the link idle.  Once the first level is drafted the draft's expert
heads guess the root's experts (and the first node's), so those that are not resident can
be copied while the other levels are drafted (``Selection.prefetch``, carried out by
:meth:`~specfit_hf.offload.OffloadRuntime.prefetch`), where that stop pays for its host time
(:class:`DraftingStops`).

When the chain is drafted, the guesses of all its nodes are known, and the verify itself needs
layer ``l``'s experts only after computing the layers before it: the experts guessed for the
verified prefix that are still missing are copied as the verify starts, while its first layers
compute.  A copy started ``x`` seconds before its layer needs it hides ``min(x, d)`` of its
duration ``d`` if the verify needs that expert (probability ``p``) and, if it does not, makes the
verify's own loads wait ``max(0, d - x)`` behind it on the link: :func:`prefetch_plan` takes the
predicted experts while ``p min(x, d) > (1 - p) max(0, d - x)``.

A copy into a full layer evicts a resident.  Where that resident is one the verify is predicted to
use, the verify copies it back on its path: the copy hid one load and made another, and took the
link.  So the residents the verify is predicted to use are kept (:func:`predicted_residents`, the
runtime's ``keep``), and a layer takes at most as many copies as its other slots hold.  Without
this, on the CPU at a quarter cache (emulated ``qwen3-pcie4``, GSM8K, 8 prompts, every cycle a
10-token chain) the copies that were used saved 128 loads for 402 copies, and the chain cycles ran
at 72.0 ms against 69.5 ms copying nothing; keeping them, 67.8 ms.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DraftingStops", "NamedExperts", "PrefetchHits", "any_missing", "named_experts", "predicted_residents",
           "prefetch_plan"]

#: ``(row, layer, expert, missing)``: every expert some row names, in (row, layer, rank) order, and whether the
#: cache lacks it (:func:`named_experts`; the three functions below share it, read once per plan)
NamedExperts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def named_experts(rows: np.ndarray, cached: np.ndarray) -> NamedExperts:
    """The experts ``rows`` (``[R, L, k]`` predicted experts, -1: none) name, and which of them ``cached``
    (``[L, E]``) lacks."""
    valid = rows >= 0
    row, layer, _ = np.nonzero(valid)  # (row, layer, rank) order: the order the rows name their experts
    expert = rows[valid]
    return row, layer, expert, ~cached[layer, expert]


def any_missing(rows: np.ndarray, cached: np.ndarray, named: NamedExperts | None = None) -> bool:
    """Whether ``rows`` (``[R, L, k]`` predicted experts, -1: none) name an expert ``cached`` (``[L, E]``) lacks."""
    return bool((named or named_experts(rows, cached))[3].any())


def predicted_residents(rows: np.ndarray, cached: np.ndarray, named: NamedExperts | None = None) -> np.ndarray:
    """``[L, E]`` bool: the residents (``cached``) that ``rows`` (``[R, L, k]`` predicted experts, -1: none) name."""
    _, layer, expert, _ = named or named_experts(rows, cached)
    out = np.zeros_like(cached)
    out[layer, expert] = True
    return out & cached


def prefetch_plan(rows: np.ndarray, needed: Sequence[float], cached: np.ndarray, window: Sequence[float], busy: float,
                  each: float, layer_by_layer: bool = False,
                  room: np.ndarray | None = None, named: NamedExperts | None = None) -> tuple[np.ndarray, float]:
    """The ``[P, 2]`` (layer position, expert) pairs worth copying now, in copy order, and the seconds of
    transfers they are expected to take off the verify's path.

    The link copies in order, layer by layer (:meth:`~specfit_hf.offload.OffloadRuntime.prefetch`):
    each layer's candidates, most likely first, are taken while their copy is predicted to hide more
    than it delays (``p min(x, d) > (1 - p) max(0, d - x)``, ``x`` the seconds between the copy's
    start and its layer's need).

    Args:
        rows: ``[R, L, k]`` predicted experts of the verify block's rows (the root first; -1: none).
        needed: ``[R]`` the probability that each row's predicted experts are used by the verify.
        cached: ``[L, E]`` residents (their experts are never copied).
        window: ``[L]`` seconds from now until the verify needs each layer's experts.
        busy: seconds until the link has finished what is already queued on it.
        each: seconds one expert's copy takes.
        layer_by_layer: each layer's copies start when its ``window`` opens, on an idle link
            (:meth:`~specfit_hf.offload.OffloadRuntime.prefetch_ahead`): ``window`` is then each
            layer's time from the start of its copies to its need.
        room: ``[L]`` the most copies each layer may take (its slots that hold no resident the verify
            is predicted to use); ``None``: no limit.
        named: :func:`named_experts` of ``rows`` and ``cached``, when the caller has it.
    """
    taken: list[tuple[int, int]] = []
    hidden, start = 0.0, busy  # start: when the next copy would start, from now
    row, layer, expert, missing = named or named_experts(rows, cached)
    if each <= 0 or not missing.any():
        return np.zeros((0, 2), dtype=np.int64), hidden
    # each missing (layer, expert) once, with the probability of the likeliest row naming it; candidates of
    # a layer are taken most likely first, ties in the order the rows first name them.  A few dozen
    # candidates: host loops cost less than array calls here (this runs every chain cycle)
    probability = _floats(needed)
    candidates: dict[tuple[int, int], list] = {}  # (layer, expert) -> [layer, -p, first naming, expert]
    for first, (row_, layer_, expert_) in enumerate(zip(row[missing].tolist(), layer[missing].tolist(),
                                                         expert[missing].tolist())):
        seen = candidates.get((layer_, expert_))
        if seen is None:
            candidates[(layer_, expert_)] = [layer_, -probability[row_], first, expert_]
        elif -probability[row_] < seen[1]:
            seen[1] = -probability[row_]
    limits = _floats(window)
    left = [np.inf] * cached.shape[0] if room is None else room.tolist()  # copies each layer may still take
    current = -1
    for layer_, p_, _, expert_ in sorted(candidates.values()):
        p_ = -p_
        if layer_by_layer and layer_ != current:
            current, start = layer_, 0.0
        ahead = limits[layer_] - start
        if left[layer_] > 0 and p_ * min(ahead, each) > (1.0 - p_) * max(0.0, each - ahead):
            taken.append((layer_, expert_))
            hidden += p_ * min(ahead, each)
            start += each
            left[layer_] -= 1
    return np.array(taken, dtype=np.int64).reshape(-1, 2), hidden


def _floats(values: Sequence[float]) -> list[float]:
    """``values`` as a list of host floats (an array's ``tolist``)."""
    return values.tolist() if isinstance(values, np.ndarray) else [float(v) for v in values]


class PrefetchHits:
    """The share of prefetched experts a forward used, decayed over cycles (a prior of ``prior`` worth
    ``weight`` copies).  The heads' guess of a row's experts is the ``p`` of :func:`prefetch_plan`."""

    def __init__(self, prior: float = 0.7, weight: float = 8.0, decay: float = 0.98) -> None:
        self.copies, self.used, self.decay = float(weight), float(prior * weight), float(decay)

    @property
    def rate(self) -> float:
        """Used prefetches per prefetch."""
        return min(1.0, self.used / self.copies)

    def observe(self, copies: int, used: int) -> None:
        """A cycle's new prefetches and the prefetched experts its forward used."""
        if copies or used:
            self.copies = self.decay * self.copies + copies
            self.used = self.decay * self.used + used


class DraftingStops:
    """Whether a chain drafts its first level alone, to start copying the experts the heads then guess.

    The stop costs host time every chain cycle (the heads' guess of the root and the first node, the
    plan: ~0.4 ms on this project's CPU host) and is worth the transfer seconds its copies are expected
    to hide (the plan's own figure), which is nothing where the guessed experts are resident (CPU +
    emulated ``qwen3-pcie4``, CNN/DM at 75 % cache: 29 of 141 stops copied anything).  Both are decayed
    means over the stops made; a chain stops while the worth is at least the cost, and where it is not,
    one chain cycle in ``retry`` still stops, so the figures follow the cache and the host.  With host
    time frozen a stop costs nothing and every chain stops.
    """

    def __init__(self, decay: float = 0.9, retry: int = 8) -> None:
        self.decay, self.retry = float(decay), int(retry)
        self.worth = self.cost = 0.0  # decayed sums over the stops made (alike weighted: compared as means)
        self._skipped = 0

    def wanted(self) -> bool:
        """Whether this chain cycle stops (called once per chain cycle that could)."""
        if self.worth >= self.cost or self._skipped + 1 >= self.retry:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def observe(self, hidden: float, seconds: float) -> None:
        """A stop expected to hide ``hidden`` seconds of transfers took ``seconds`` of host time."""
        d = self.decay
        self.worth = d * self.worth + float(hidden)
        self.cost = d * self.cost + max(float(seconds), 0.0)
