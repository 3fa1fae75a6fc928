"""The drafting gate: which kind of cycle runs next -- plain, a fixed chain, or the adaptive tree?

The per-cycle search cannot see what a draft level costs before it is drafted, and its
estimates of acceptance and cost are noisy early in a call, so the gate ranks a few
*kinds* of cycle by what they deliver and runs the best one:

* ``plain``: no drafting, the root alone (plain decoding);
* ``chain:h``: draft a chain of ``h`` levels, one child each, and verify all of it (the
  fixed chains that are the strongest simple baselines);
* ``tree``: the throughput-optimal drafting plan and subtree search of the policy.

So the policy is never slower, for long, than plain decoding or than a short chain, and
it is the adaptive tree wherever the tree pays.

**One acceptance for every chain.**  Acceptance follows the text: a stretch of copied
numbers accepts nearly everything, a fresh sentence little.  Kinds measured in different
stretches cannot be compared by their own tokens per cycle, so a chain's tokens come from
one estimate of ``P(depth d accepted | depth d - 1 accepted)``, ``d = 1..16``, pooled over
every chain cycle (about the last ten weigh most; a depth not reached lately falls back to
its long-run rate, and a depth seldom reached at all to the depth above it):
``E(h) = 1 + p1 + p1 p2 + ...``.  Each kind keeps only its own cost per cycle: a chain run a
few times is priced by its own drafting and compute, one not run yet by fits of a draft
level's and a verified token's cost (linear in the levels: the guess that gets a deeper chain
tried, whose own cycles then correct it); beyond the deepest chain priced by its own cycles,
by that chain's price plus the fits' extra levels, since the fits' fixed part is what they get
wrong, verifying the share of its nodes that chain did.  Chains past ``open_depth`` levels (10)
are ranked only as a chain that leads climbs there, and only where one more level (its draft forward and
its verified token's compute) is cheap against a verify (:meth:`DraftingGate.chain_limit`).  The tree's
tokens are its own, scaled down (never
up) by how much the chains' acceptance fell since its cycles ran.

**Transfers at today's rate.**  Transfers are most of a step's variance and drift with
the cache: a plain step at half cache loads 0 to 5 experts by routing luck.  Every cycle
reports the experts its *root* alone loaded (in a drafting cycle: the root's routing
against the residents before the verify) and, per verified node, the distinct experts it
was the first of the block to compute and the loads among them.

**Each depth pays for the experts it adds.**  An MoE forward computes each distinct expert
once, and a chain's tokens share experts with the ones before them: on GSM8K's repetitive
answers the eighth token brings about a third of a root's experts, on fresh text more.  So
a chain is not priced per node but per *new* expert: ``N(h)``, the new experts of a chain
of ``h`` nodes in roots' worth, is learnt per depth from the chains' own blocks
(:func:`chain_novelty`); each new expert costs the verify's ``t_novel`` (reading it: most
of a small block's compute on a GPU) and loads with a chance that follows the cache state
as a root's does: ``a + b m`` per root's worth, with ``m`` the root loads mean when it ran,
fitted over the chains' and probes' cycles (non-negative least squares, ~50 cycles of
memory).  Every kind is charged ``t_expert * (m + (a + b m) N(nodes))`` per cycle with
``m`` the *current* mean: kinds measured in a cold phase and kinds measured in a warm one
compare as if measured now.  (Priced per node, deeper chains looked dearer than they are
where the text repeats: 4090 twin, host time frozen, 32 + 32 prompts, GSM8K at 25 / 50 / 75 %
cache: 1.11x / 1.74x / 2.28x plain decoding -> 1.22x / 1.78x / 2.31x; CNN/DM at 75 %: 1.42x -> 1.50x.)

The tree's nodes are not a chain's: its search verifies the nodes whose experts are resident, so its ``a + b m`` is
scaled by what its own nodes loaded against what the fit said they would (its own ratio,
decayed like the fit; the fit itself learns from the chains' and probes' nodes only).
Priced as a chain's, the tree's nodes made it look dearer than it is exactly where its
choice of nodes pays (4090 twin, host time frozen, GSM8K at half cache: 0.995 -> 1.024
of the best chain).

**Exploring only what could win, within a budget.**  A plain step and one chain run first
(they price every chain); the tree's first burst of two comes at the first exploration while
plain decoding leads, else once the deepest chain does.  After that only what could unseat the best is measured, and as
cheaply as it can be: the tree by a burst of its own cycles, a deeper chain's acceptance by a
*probe* (:func:`probe_kind`) -- a cycle of the running kind (plain or ``chain:h``) that
drafts :data:`PROBE_DEPTH` more levels and does not verify them.  Its extra tokens are
compared with the ones the target then commits (a match is exactly an acceptance, greedy
or sampled), so the acceptance of the next depths is measured for a draft level's cost
each, without a verified token's compute and expert loads.  (Shorter chains and plain
steps are known: a chain of ``h`` levels measures every depth up to ``h``.)  A chain past
``open_depth`` that the fits rank just ahead of the best, within the switching margin, runs
until its own cycles price it: else the fits' price of it would never be corrected.  For the
same reason, while plain decoding leads, the fastest chain not yet priced by its own cycles
runs until they price it, if its price from the priors is near plain decoding's.
Explorations come every ``interval`` cycles (doubling while the best holds, up to
``max_explore_every``) and only while their cost, in cycles of the best kind, stays within
:data:`_EXPLORE_BUDGET` of the cycles since the last one.  A kind within 5% of the running
one does not replace it.

These measurements belong to the host, link, cache and draft:
:func:`drafting_measurements` shares them between ``generate`` calls on the same
offload runtime with the same draft and policy settings.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .calibration import DecayedRidge, nonnegative_quadratic
from .lookup import AGREED, LOOKUP_CONTEXTS, LookupAcceptance
from .options import MAX_CHAIN

if TYPE_CHECKING:
    from .search import CostModel

__all__ = [
    "LOOKUP", "PROBE", "DraftCost", "DraftingGate", "DraftingMeasurements", "chain_kinds", "drafting_measurements",
    "forget_drafting", "kind_depth", "probe_kind", "shared_drafting",
]


@dataclass
class DraftCost:
    """Seconds of drafting a tree (draft steps + the search after each level).

    ``t_cycle + t_level * levels + t_node * nodes`` for a cycle that drafts at all.  The
    first level of a cycle costs more than the others: it reads the tokens the last verify
    committed (the accepted path and the bonus token), where a later level reads only the
    newest nodes, and the cycle's drafting has set-up of its own.  Without ``t_cycle`` that
    cost spreads over the levels and makes every extra level look dearer than it is (on
    this project's CPU host a chain's first level costs about 0.9 ms, each later one 0.4).
    Every drafting cycle adds to decayed sums; the non-negative least-squares fit is made
    when the figures are next read (:attr:`t_cycle`, :attr:`t_level`, :attr:`t_node`).  Small
    ridges keep ``t_cycle`` and ``t_node`` near 0 while the levels and the widths do not vary,
    when the split is not identifiable.  Nor is the split between ``t_cycle`` and ``t_level`` while
    the chains that run all draft about as many levels: :attr:`chain_level` is what a chain's
    level costs on average, its cycle's first level included.
    """

    # decayed [1, L, N, LL, LN, NN, S, LS, NS] (floats: updated every drafting cycle)
    sums: tuple[float, ...] = (0.0,) * 9
    chain_sums: tuple[float, float] = (0.0, 0.0)  # decayed (seconds, levels) of the cycles drafting a chain
    _fit: tuple[float, float, float] | None = field(default=None, repr=False)  # (t_cycle, t_level, t_node)

    def add(self, levels: int, nodes: int, seconds: float, decay: float) -> None:
        """Add one cycle's drafting: ``levels`` levels with ``nodes`` nodes in ``seconds``.

        The fit is made when next read: the gate reads it when it ranks, every few cycles.
        """
        lv, nd, sec = float(levels), float(nodes), float(seconds)
        w, sl, sn, ll, ln, nn, ss, ls, ns = self.sums
        self.sums = (decay * w + 1.0, decay * sl + lv, decay * sn + nd, decay * ll + lv * lv, decay * ln + lv * nd,
                     decay * nn + nd * nd, decay * ss + sec, decay * ls + lv * sec, decay * ns + nd * sec)
        if levels > 0 and nodes == levels:  # one node a level: a chain
            seconds_sum, levels_sum = self.chain_sums
            self.chain_sums = (decay * seconds_sum + sec, decay * levels_sum + lv)
        self._fit = None

    def _fitted(self) -> tuple[float, float, float]:
        if self._fit is None:
            w, sl, sn, ll, ln, nn, ss, ls, ns = self.sums
            m = ((w + 1e-3 * w + 1e-12, sl, sn), (sl, ll, ln), (sn, ln, nn + 1e-3 * nn + 1e-12))
            self._fit = tuple(nonnegative_quadratic(m, (ss, ls, ns)))
        return self._fit

    @property
    def t_cycle(self) -> float:
        """Seconds a drafting cycle pays once (0 before any data)."""
        return self._fitted()[0] if self.sums[0] > 0 else 0.0

    @property
    def t_level(self) -> float | None:
        """Seconds per draft level (``None`` before any data)."""
        return self._fitted()[1] if self.sums[0] > 0 else None

    @property
    def t_node(self) -> float:
        """Seconds per drafted node (0 before any data)."""
        return self._fitted()[2] if self.sums[0] > 0 else 0.0

    def predict(self, levels: int, nodes: int) -> float:
        """Seconds of a cycle drafting ``levels`` levels holding ``nodes`` nodes (0 before any data, or for none)."""
        if self.sums[0] <= 0 or levels <= 0:
            return 0.0
        t_cycle, t_level, t_node = self._fitted()
        return t_cycle + t_level * levels + t_node * nodes

    @property
    def chain_level(self) -> float | None:
        """Mean seconds per level of the cycles that drafted a chain, their first levels included (``None``
        before any)."""
        seconds, levels = self.chain_sums
        return seconds / levels if levels > 0 else None

    def marginal(self, levels: int, nodes: int) -> float:
        """Seconds of ``levels`` more levels holding ``nodes`` more nodes, in a cycle that drafts already."""
        if self.sums[0] <= 0:
            return 0.0
        _, t_level, t_node = self._fitted()
        return t_level * levels + t_node * nodes


@dataclass
class DraftingMeasurements:
    """Measured costs and pay-off of each kind of cycle (shared across calls on one runtime + draft).

    ``draft``: the fitted cost of drafting (:class:`DraftCost`); ``verify``: the online fit
    of verification cost, so a later call starts from what earlier calls measured instead
    of exploring again.  ``sums``: per kind, decayed (tokens, seconds without transfers,
    cycles, verified nodes, the reference chain's expected tokens when they ran);
    ``counts``: cycles run per kind;
    ``last_run``: the cycle each kind last ran; ``root_loads``: running mean of the
    experts a root alone loads; ``t_expert``: seconds per load the rates charge;
    ``own_node_sums``: per kind whose nodes are not a drafted chain's (the tree, lookup
    chains), decayed (extra loads, the chains' node fit's forecast of them) of its cycles.
    ``cycle``: cycles started; ``explored_at`` / ``interval``: the last exploration and
    the cycles until the next; ``exploring`` / ``explore_left``: the kind of the burst
    under way and its cycles left; ``best_before``: the best kind when it started;
    ``current``: the kind running as the best.
    """

    interval: int
    draft: DraftCost = field(default_factory=DraftCost)
    verify: object | None = None  # the OnlineCostModel of verification, once a call has made one
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    last_run: dict[str, int] = field(default_factory=dict)
    root_loads: float | None = None
    t_expert: float = 0.0
    cycle: int = 0
    explored_at: int = 0
    exploring: str | None = None
    explore_left: int = 0
    best_before: str | None = None
    current: str | None = None
    ranked_at: int = 0  # the cycle the kinds were last ranked
    explore_at: int = 0  # the first cycle an exploration may start (interval and budget, as last ranked)
    version: int = 0  # bumped on every change of the measurements (what derived figures are cached against)
    node_fit: DecayedRidge = field(default_factory=lambda: DecayedRidge(ridge=_NODE_RIDGE))  # loads ~ nodes (a + b m)
    own_node_sums: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (extra loads, forecast)
    lookup_root_sums: tuple[float, float] = (0.0, 0.0)  # a lookup chain's root: (loads, root mean when it ran)
    # fixed chains' cycles, decayed: (measured - forecast seconds, cycles) -- what the chain forecast misses
    chain_residual: tuple[float, float] = (0.0, 0.0)
    call_cycle: int = 0  # cycles observed in the current call
    deepest_led: int = 0  # the deepest chain that has led for _LEAD_CYCLES cycles (DraftingGate.chain_limit)
    led_since: int = 0  # the cycle the current best kind took the lead
    depth_fast: np.ndarray = field(default_factory=lambda: np.zeros((2, _MAX_CHAIN)))  # [accepted, tried] per depth
    depth_slow: np.ndarray = field(default_factory=lambda: np.zeros((2, _MAX_CHAIN)))
    # [new experts of depth d / the root's, chains measured] per depth d = 1.._MAX_CHAIN (decayed)
    novelty: np.ndarray = field(default_factory=lambda: np.zeros((2, _MAX_CHAIN)))
    lookup: LookupAcceptance = field(default_factory=LookupAcceptance)  # of prompt-lookup proposals
    # [context, accepted / tried, depth]: chain outcomes by the lookup proposal the cycle had (lookup_context)
    depth_context: np.ndarray = field(default_factory=lambda: np.zeros((LOOKUP_CONTEXTS, 2, _MAX_CHAIN)))
    # per lookup class, the chain cycles whose first token agreed with the proposal: (measured seconds, their
    # kind's ranked seconds) decayed like depth_context; what such a cycle costs against the kind's figure
    agreed_seconds: np.ndarray = field(default_factory=lambda: np.zeros((LOOKUP_CONTEXTS, 2)))
    # per lookup class, chains stopped after their first level to compare it with the proposal: (checks,
    # lookups verified instead) decayed per check, and the cycle of the last check (agreed_check_due)
    agreed_checks: np.ndarray = field(default_factory=lambda: np.zeros((LOOKUP_CONTEXTS, 3)))
    # [new experts of position d after a start / the start's, windows] of the calls' prompts (routing_novelty, decayed):
    # the text's own decay with depth, the shape unmeasured depths are priced by (chain_novelty)
    text_novelty: np.ndarray = field(default_factory=lambda: np.zeros((2, _MAX_CHAIN)))
    # (version, chain_novelty) as last computed: the gate and the cost tracker read it many times a cycle
    _novelty: tuple[int, np.ndarray] | None = field(default=None, repr=False)

    @property
    def verify_fit(self) -> CostModel | None:
        """The verification fit as last refitted (``None`` before a call has made one)."""
        return None if self.verify is None else self.verify.last_fit

    @property
    def node_loads(self) -> tuple[float, float]:
        """Fitted ``(a, b)``: a chain node's extra loads per root's worth of new experts, ``a + b m``."""
        return self.node_fit.fit()


# offload runtime view -> draft model -> policy and settings -> measurements
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_drafting(experts: object, draft: object) -> dict[str, DraftingMeasurements]:
    """The measurements kept for this runtime view and draft, by policy key (the live dict; made if missing)."""
    return _SHARED.setdefault(experts, weakref.WeakKeyDictionary()).setdefault(draft, {})


def drafting_measurements(experts: object, draft: object, key: str, interval: int, share: bool) -> DraftingMeasurements:
    """The measurements kept for this runtime, draft and ``key`` (policy + settings); new if none."""
    fresh = DraftingMeasurements(interval=interval)
    if not share or experts is None or draft is None:
        return fresh
    try:
        per_key = shared_drafting(experts, draft)
    except TypeError:  # not weak-referenceable: keep this call's own measurements
        return fresh
    return per_key.setdefault(key, fresh)


def forget_drafting() -> None:
    """Drop every runtime's shared drafting measurements (the next call on any runtime starts fresh)."""
    _SHARED.clear()


LOOKUP = "lookup"  # a cycle verifying a prompt-lookup chain (no draft forward; not ranked: chosen per cycle)
_MAX_CHAIN = MAX_CHAIN  # longest fixed chain a gate may rank (sizes the per-depth figures)
_DEEP_LEVEL_SHARE = 0.05  # chains climb past open_depth only where a draft level costs less (deep_levels_cheap)
PROBE_DEPTH = 2  # levels a probe drafts beyond the ones it verifies (see DraftingGate._worth_exploring)
_BURST = 2  # cycles of a kind per measurement burst
_KIND_EMA = 0.15  # weight of a kind's newest cycle in its decayed sums (~7 cycles of memory)
_NEAR = 0.8  # while plain leads, a chain priced by priors this near it runs until priced (_worth_exploring)
_SWITCH = 1.05  # another kind must be this much faster to replace the one running
_OWN_CYCLES = 4  # cycles after which a chain is priced by its own cycles rather than by the fits
_EXPLORE_BUDGET = 0.01  # explorations cost at most about this share of the best kind's cycles
_ROOT_EMA = 0.3  # weight of the newest cycle in the mean root loads
_START_CYCLES = 8  # a process's first call runs plain steps this many cycles before its first chain (cold cache)
_COLD_WAIT_LOADS = 8.0  # ... where a plain step costs less than this many expert loads (_cold_wait_pays)
_LEAD_CYCLES = 16  # cycles a chain leads before chains PROBE_DEPTH deeper are ranked (DraftingGate.chain_limit)
_RERANK = 4  # cycles plain decoding or a chain runs on without re-ranking the kinds
_NODE_DECAY = 0.98  # per drafting cycle: the fit of what verified nodes load (~50 cycles of memory)
_NODE_RIDGE = 1.0  # pseudo-observations pulling (a, b) toward (0, 1): a node loads what a root does
_DEPTH_FAST = 0.05  # per-cycle forgetting of the recent per-depth acceptance (~20 cycles: the text's phase)
_DEPTH_SLOW = 0.01  # ... of the long-run one, which stands in where recent cycles did not reach a depth
_DEPTH_PRIOR = 2.0  # pseudo-trials of the long-run acceptance added to the recent counts
_LONG_RUN_PRIOR = 4.0  # pseudo-trials of the depth above's long-run acceptance added to a depth's own
_OWN_NODE_PRIOR = 2.0  # pseudo-loads: before a tree's (or lookup chain's) cycles, its nodes load what a chain's do
_OWN_NODE_KINDS = ("tree", LOOKUP)  # kinds whose verified nodes are priced by their own loads against the chain fit
_REFERENCE = 2  # the chain whose expected tokens the tree's are measured against
_CONTEXT_DECAY = 0.005  # per-cycle forgetting of the chains' acceptance by lookup context (~200 cycles)
_CONTEXT_PRIOR = 4.0  # pseudo-trials of the overall per-depth acceptance added to a context's counts
_CHECK_TRIALS = 4.0  # (decayed) checks of a lookup class before they may be skipped (agreed_check_due) ...
_CHECK_SHARE = 0.05  # ... while fewer than this share of them verified the lookup instead ...
_CHECK_EVERY = 16  # ... but for one check in this many cycles
_CHECK_DECAY = 0.95  # per check of the class (~20 checks of memory)
_NOVELTY_PRIOR = 1.0  # pseudo-chains: before data, depth d brings what depth d - 1 does times the text's ratio
_TEXT_WINDOWS = 64  # runs of a prompt's positions its routing_novelty averages over
_TEXT_DECAY = 0.5  # per call: weight of the earlier prompts' routing_novelty against the newest's


def _interp_unit(values: Sequence[float], x: float) -> float:
    """``np.interp(x, range(len(values)), values)`` for one finite ``x``, in Python floats (bit-identical: numpy's
    formula, ``slope * (x - x_j) + y_j``; a numpy call per scalar was most of a lookup cycle's pricing)."""
    last = len(values) - 1
    if x <= 0.0:
        return float(values[0])
    if x >= last:
        return float(values[last])
    j = int(x)
    if x == j:
        return float(values[j])
    y = float(values[j])
    return (float(values[j + 1]) - y) * (x - j) + y


def novel_at(novelty: np.ndarray, nodes: float | np.ndarray) -> float | np.ndarray:
    """:func:`chain_novelty` at ``nodes`` (a count or an array of them; interpolated, and past the deepest
    depth each more node adds what that depth did)."""
    last = novelty.size - 1
    if isinstance(nodes, (int, float)) and math.isfinite(nodes):
        x = float(nodes)
        return _interp_unit(novelty, min(x, last)) + max(x - last, 0.0) * float(novelty[last] - novelty[last - 1])
    x = np.asarray(nodes, dtype=np.float64)
    out = np.interp(np.minimum(x, last), np.arange(novelty.size), novelty)
    out = out + np.maximum(x - last, 0.0) * (novelty[last] - novelty[last - 1])
    return float(out) if out.ndim == 0 else out


def chain_novelty(state: DraftingMeasurements) -> np.ndarray:
    """``N[h]``: the new experts a chain of ``h`` nodes brings beyond its root's, in roots' worth (``N[0] = 0``).

    An MoE forward computes (and, if absent, loads) each distinct expert once, and the tokens
    of a chain share experts with the ones before them: on GSM8K's repetitive answers depth 8
    brings a third of a root's experts, on fresh text more.  Each depth's measured share
    (:attr:`DraftingMeasurements.novelty`) is shrunk toward the estimate of the depth above it
    times the ratio between those depths in the text the calls were given
    (:attr:`DraftingMeasurements.text_novelty`, :func:`routing_novelty`): a depth not measured yet
    is priced like the deepest one that was, decayed as the prompts' own routing decays with depth.

    Why the text's decay: the union of the experts a run of tokens names grows ever more slowly
    (each token can only add experts the ones before it did not name), and a chain's depths are
    measured only as deep as its chains ran.  Priced flat past the deepest measured depth, a
    process's first calls (which ran 1- and 2-token chains) priced a 5-token chain's nodes at twice
    the loads they then had (Mixtral 4090 twin, GSM8K at a quarter cache: depths 3-5 brought 0.40,
    0.28 and 0.25 of a root's experts once measured, against 0.79 each priced) and sat on plain steps.
    Without prompts' routing the text's ratio is 1 (flat).
    """
    sums, counts = state.novelty
    ratios = text_ratios(state.text_novelty)
    sums, counts = sums.tolist(), counts.tolist()  # host floats: the recurrence runs once a cycle
    out, previous = [0.0], 1.0
    for d in range(_MAX_CHAIN):
        guess = previous * ratios[d]
        previous = (sums[d] + _NOVELTY_PRIOR * guess) / (counts[d] + _NOVELTY_PRIOR)
        out.append(out[d] + previous)
    return np.array(out)


def text_ratios(text: np.ndarray) -> list[float]:
    """Per depth ``d``, the text's new experts at ``d`` over those at ``d - 1`` (the root's own: 1), at most 1;
    1 where the text has no windows that deep (:attr:`DraftingMeasurements.text_novelty` sums)."""
    sums, windows = text.tolist()
    out, previous = [], 1.0
    for s, w in zip(sums, windows):
        if w <= 0.0 or previous <= 0.0:
            out.append(1.0)
            continue
        share = s / w
        out.append(min(share / previous, 1.0))
        previous = share
    return out


def routing_novelty(routing: np.ndarray | None, depths: int = _MAX_CHAIN,
                    windows: int = _TEXT_WINDOWS) -> tuple[np.ndarray, int] | None:
    """Over up to ``windows`` runs of ``depths + 1`` consecutive positions of ``routing`` (``[T, L, k]`` expert
    ids, -1: none; evenly spaced), the mean new experts of each run's position ``d = 1 .. depths``: those no
    position before it in the run named, in the run's first position's worth (:func:`node_novelty`'s unit);
    ``(shares [depths], runs)``.  Runs shorter than ``depths + 1`` positions fill only the depths they reach
    (the rest are NaN).  ``None`` without two positions."""
    if routing is None or routing.ndim != 3 or routing.shape[0] < 2:
        return None
    length, layers = routing.shape[:2]
    span = min(depths, length - 1)
    starts = np.unique(np.linspace(0, length - 1 - span, num=min(windows, length - span)).astype(np.int64))
    experts = int(routing.max()) + 1
    valid = (routing >= 0).reshape(length, -1)
    # flat (layer, expert) ids; an empty slot names a spare column no run counts
    ids = np.where(routing >= 0, routing + (np.arange(layers) * experts)[None, :, None], layers * experts)
    ids = ids.reshape(length, -1)
    seen = np.zeros((starts.size, layers * experts + 1), dtype=bool)
    run = np.arange(starts.size)[:, None]
    seen[run, ids[starts]] = True
    root = valid[starts].sum(axis=1)
    keep = root > 0
    if not keep.any():
        return None
    out = np.full(depths, np.nan)
    for d in range(1, span + 1):
        rows = ids[starts + d]
        new = (valid[starts + d] & ~seen[run, rows]).sum(axis=1)
        seen[run, rows] = True
        out[d - 1] = float(np.mean(new[keep] / root[keep]))
    return out, int(keep.sum())


def current_novelty(state: DraftingMeasurements) -> np.ndarray:
    """:func:`chain_novelty` of ``state``, computed once per change of the measurements (``state.version``):
    the gate's ranking and the cost tracker's models read it many times a cycle."""
    cached = state._novelty
    if cached is None or cached[0] != state.version:
        cached = state._novelty = (state.version, chain_novelty(state))
    return cached[1]


def _decayed_add(sums: np.ndarray | None, cycle: np.ndarray, a: float) -> np.ndarray:
    """Sums where each older cycle's weight shrinks by ``1 - a``."""
    return cycle.copy() if sums is None else (1 - a) * sums + cycle


def probe_kind(depth: int) -> str:
    """The probe of a chain of ``depth`` levels (0: a plain step): it drafts :data:`PROBE_DEPTH` more, unverified."""
    return f"probe:{depth}"


@functools.lru_cache(maxsize=256)
def kind_depth(kind: str) -> int:
    """Levels a kind verifies: ``h`` for ``chain:h`` and ``probe:h``, 0 for ``plain``.

    Cached: a cycle asks a dozen times, over a handful of kinds."""
    return int(kind.split(":")[1]) if ":" in kind else 0


PROBE = probe_kind(0)  # a plain step that drafts a chain it does not verify


def chain_kinds(max_chain: int) -> list[str]:
    """The kinds of cycle the gate ranks: plain, chains of 1..min(16, max_chain) levels, the adaptive tree."""
    return ["plain", *(f"chain:{h}" for h in range(1, min(_MAX_CHAIN, max_chain) + 1)), "tree"]


class DraftingGate:
    """Runs the kind of cycle measured fastest, re-measuring the others in backed-off bursts.

    Args:
        state: the (possibly shared) measurements.
        enabled: ``False`` always runs the adaptive ``tree``.
        kinds: the kinds ranked (:func:`chain_kinds`); ``tree`` must be one of them.
        explore_every / max_explore_every: the exploration interval and its cap.
        open_depth: chains up to this many levels are ranked from the start; a deeper one only once a
            chain at most :data:`PROBE_DEPTH` shorter has led for :data:`_LEAD_CYCLES` cycles
            (:meth:`chain_limit`).
            ``None``: every chain of ``kinds``.
    """

    def __init__(self, state: DraftingMeasurements, enabled: bool, kinds: list[str], explore_every: int,
                 max_explore_every: int, open_depth: int | None = None) -> None:
        if "tree" not in kinds:
            raise ValueError(f"the drafting gate needs the 'tree' kind among {kinds}")
        self.state = state
        if state.depth_context.shape[0] < LOOKUP_CONTEXTS:  # measurements carried over from fewer classes
            state.depth_context = np.concatenate(
                [state.depth_context, np.zeros((LOOKUP_CONTEXTS - state.depth_context.shape[0], 2, _MAX_CHAIN))])
        if getattr(state, "agreed_seconds", None) is None:
            state.agreed_seconds = np.zeros((LOOKUP_CONTEXTS, 2))
        if getattr(state, "agreed_checks", None) is None:
            state.agreed_checks = np.zeros((LOOKUP_CONTEXTS, 3))
        self.enabled = enabled
        self.kinds = list(kinds)
        self.explore_every = explore_every
        self.max_explore_every = max(explore_every, max_explore_every)
        self.burst = _BURST
        self._chains = [k for k in self.kinds if k.startswith("chain:")]
        self._chain_depths = [(k, kind_depth(k)) for k in self._chains]
        self.open_depth = _MAX_CHAIN if open_depth is None else int(open_depth)
        self._probes = [(k, probe_kind(kind_depth(k))) for k in self.kinds if k == "plain" or k in self._chains]
        chains = self._chains
        first = "chain:2" if "chain:2" in chains else chains[0] if chains else None
        self._first = [k for k in self.kinds if k == "plain"] + [first] if chains else list(self.kinds)
        # derived figures, computed once per change of the measurements: (state.version, value)
        self._figures: tuple[int, dict[str, tuple[float, float]]] | None = None
        self._chain_tokens: tuple[int, np.ndarray | None] | None = None
        self._acceptance: tuple[int, np.ndarray] | None = None
        state.exploring, state.explore_left = None, 0

    @property
    def chain_depths(self) -> list[tuple[str, int]]:
        """``(kind, levels)`` of every fixed chain the gate ranks now (:meth:`chain_limit`)."""
        limit = self.chain_limit()
        return [(k, h) for k, h in self._chain_depths if h <= limit]

    def chain_limit(self) -> int:
        """The deepest chain ranked now: :attr:`open_depth`, or :data:`PROBE_DEPTH` beyond the deepest chain
        that has led for :data:`_LEAD_CYCLES` cycles, whichever is more (the latter only where draft levels
        are cheap: :meth:`deep_levels_cheap`).

        A chain's tokens come from the acceptance of each of its depths; past the depths that chains
        and their probes reach, that is the deepest measured depth's rate carried on, a guess.  Up to
        ``open_depth`` the guess is what gets a deep chain tried at all (its own cycles then correct
        it); beyond it a chain is ranked only once a chain that can probe its depths (a probe drafts
        ``PROBE_DEPTH`` levels more) has led for a while, so the limit follows the text: on GSM8K,
        where a 10-level chain is often accepted whole, it climbs to 16 levels; on CNN/DM it stays.
        (Every chain to 16 ranked from the start: host-bound twins, host time frozen, 16 prompts,
        GSM8K 1.02-1.10x, but CNN/DM 0.93-0.98x: early cycles' acceptance priced 16-level chains that
        then verified what a 10-level chain does, drafting 6 levels more.  Deeper chains opened by any
        chain that led at all: Mixtral 4090 twin, GSM8K at 25 % cache, 0.92x: a lucky stretch of
        accepted chains climbed to 15 levels, then the text changed.)
        """
        deeper = self.state.deepest_led + PROBE_DEPTH
        if deeper <= self.open_depth or not self.deep_levels_cheap():  # the check only where it can matter
            return self.open_depth
        return deeper

    def deep_levels_cheap(self) -> bool:
        """Whether chains may climb past :attr:`open_depth`: one more level's compute (its draft forward and
        node, and the verify's share for one more token: the fit's per-token seconds and the distinct experts
        the chain's next depth adds, :func:`chain_novelty`) costs under :data:`_DEEP_LEVEL_SHARE` of a
        one-token verify's compute, as fitted (``True`` before both fits).

        A level past ten adds a quarter of a token a cycle (GSM8K, fixed 10-, 12- and 14-token chains in one
        job: 0.25-0.28), where a 10-level chain commits about six for ``1 + 10 r`` one-token verifies' worth of
        compute (``r`` this share): the extra level pays while ``0.25 / r > 6 / (1 + 10 r)``, ``r`` under ~0.07,
        before the experts its node loads.  On the eager twins a level costs 0.015-0.03 of a verify and the
        16-level chain leads GSM8K; on this project's CPU 0.09-0.12 and on the 4090 ``+graphs`` twin 0.08, where
        the 10-level chain leads and the gate's per-depth acceptance, which overstates what deeper levels add
        (rejections cluster), climbed to 13-16 levels (CPU GSM8K, SpecFit ÷ the best fixed chain, old / new / new /
        old on one core, 8 cells: new ÷ old 0.951-1.117, geo-mean 1.045; twins with host time frozen unchanged but
        the ``+graphs`` twin, GSM8K 1.008, CNN/DM 0.995; docs/acceptance).

        A level's cost is the chains' mean seconds per level (:attr:`DraftCost.chain_level`), not the fit's
        slope: while the chains that run draft about as many levels the slope is not identifiable, and on
        the CPU (GSM8K, 75 % cache) it read 0.00-0.43 ms a level against ~0.4 ms measured, so 12- to 16-level
        chains opened in 29 % of the checks.  The mean carries the cycle's first level: where the fit is sound
        it reads ~10 % above the slope (the eager twins 0.016-0.027 of a verify against 0.015-0.025, the
        ``+graphs`` twin 0.065 against 0.057), and no check on the twins changes.

        The verify's share of the level (``0a90283`` priced the draft's alone): where each token routes to
        experts of its own, an MoE verify reads each distinct expert once, and one more token costs what its
        new experts take to read.  On the Mixtral 4090 ``+graphs`` twin that is 0.045 of a verify for the
        token and 0.43 per root's worth of new experts against 0.035 for the draft level, and its 12- to
        16-token chains ran at 0.92-0.96 of the 10-token one; on the eager Qwen3 twins, where a verify is
        host overhead, the token adds 0.003 and the level stays under the share (host time frozen, GSM8K at
        half cache, 16 prompts, SpecFit ÷ the best of the 10- and 16-token chains: Mixtral ``+graphs``
        0.946 -> 0.991, Mixtral 0.990 -> 1.024, the 4090, 5090, H100 and GH200 twins unchanged; the Mixtral twin
        at 75 % cache, where the 16-token chain runs at 0.99 of the 10-token one, 1.043 -> 1.020).
        """
        draft, verify = self.state.draft, self.state.verify
        if draft.t_level is None or verify is None:
            return True
        fit = verify.last_fit
        step = fit.t0 + fit.t_token
        level = draft.chain_level
        if level is None:  # no chain drafted yet: the fit's
            level = draft.t_level + draft.t_node
        if step <= 0.0:
            return True
        novelty = self.novelty()
        added = novel_at(novelty, self.open_depth + 1) - novel_at(novelty, self.open_depth)
        return level + fit.t_token + fit.t_novel * added < _DEEP_LEVEL_SHARE * step

    def observe_text(self, routing: np.ndarray | None) -> None:
        """A call's prompt routed as ``routing`` (``[T, L, k]``, ``None``: unknown): how its new experts decay with
        depth (:func:`routing_novelty`) joins the earlier prompts', the shape :func:`chain_novelty` prices depths
        no chain has measured by."""
        found = routing_novelty(routing)
        if found is None:
            return
        shares, _ = found
        text = self.state.text_novelty
        text *= _TEXT_DECAY
        reached = np.isfinite(shares)
        text[0, reached] += shares[reached]
        text[1, reached] += 1.0
        self.state.version += 1

    def start_call(self) -> None:
        """A ``generate`` call starts: its cycles are counted from 0 (:meth:`choose`'s cold-cache wait).

        The root loads mean runs on from the previous call.  A prefill leaves the cache cold, so a
        call's first decode steps load more than the previous call's last ones, and the gate used to
        start each call at the mean of earlier calls' first cycles: it then opened every call with
        plain steps, where GSM8K's chains pay even in the cold cycles (CPU + emulated ``qwen3-pcie5``,
        quarter cache: the fixed 5-token chain 1.13x plain decoding over generations' first 24
        tokens).  Without that start, CPU pairs 0.98-1.07x (9 of 10 at or above, geo-mean 1.026), twins
        with host time frozen 0.998-1.010 geo-mean (docs/acceptance).  The running mean (weight 0.3 a cycle)
        reaches a cold call's loads within a few cycles anyway.
        """
        self.state.call_cycle = 0

    def _cold_wait_pays(self) -> bool:
        """Whether a process's first chain waits out the prefill's cold cache (:data:`_START_CYCLES` plain steps):
        where a plain step, its transfers aside, costs less than :data:`_COLD_WAIT_LOADS` expert loads.

        Right after a prefill a chain's nodes load the most, and the first chain measured there prices the
        chains that follow: on the CPU (emulated links, a plain step 1-3 loads' worth) a first 2-token chain
        without the wait left a first call on 1-token chains and climbing (``qwen3-pcie4`` and ``mixtral-pcie4``,
        GSM8K at 75 % cache, 16 prompts: 0.955 of the best chain against 0.969 with the wait), and the Mixtral 4090 twin
        (2.2 loads) keeps it as well.  Where a step is mostly fixed cost the wait is 8 cycles of one token at
        a chain's price: the eager Qwen3 twins' plain step costs 16-160 loads and what a 10-token chain does,
        and a process's first call on GSM8K was 0.70-0.88 of the 10-token chain with the wait (host time
        frozen, 16 prompts) and 0.87-0.99 without.  ``True`` before a plain step or a transfer time is measured.
        """
        v = self.state.sums.get("plain")
        if v is None or self.state.t_expert <= 0:
            return True
        return float(v[1] / v[2]) < _COLD_WAIT_LOADS * self.state.t_expert

    def rate(self, kind: str) -> float | None:
        """Tokens per second of ``kind``'s cycles (draft, search and verify), transfers at the common rate."""
        return self.rates().get(kind)

    def rates(self) -> dict[str, float]:
        """:meth:`rate` of every kind measured so far."""
        return {kind: tokens / max(seconds, 1e-12) for kind, (tokens, seconds) in self.cycle_figures().items()}

    def cycle_figures(self) -> dict[str, tuple[float, float]]:
        """Expected (tokens, seconds) of one cycle of every kind measured so far, as now ranked."""
        state = self.state
        if self._figures is not None and self._figures[0] == state.version:
            return self._figures[1]  # asked twice a cycle (choosing, forecasting): one computation
        sums = state.sums
        m = state.root_loads or 0.0
        per_new = self._node_extra_loads(m)  # the loads a root's worth of new experts brings now
        novelty = self.novelty()
        tree_factor = self.node_factor("tree")  # the tree picks cheaper nodes
        chain_tokens = self.chain_tokens()
        ct = None if chain_tokens is None else chain_tokens.tolist()
        t_expert = state.t_expert
        out = {}
        for kind, v in sums.items():
            tokens, seconds, cycles, nodes, reference = v.tolist()
            new = cycles * novel_at(novelty, nodes / cycles)  # new experts of the kind's nodes, at today's novelty
            transfers = t_expert * (m * cycles + per_new * new * (tree_factor if kind == "tree" else 1.0))
            if ct is not None and kind.startswith("chain:"):
                # the same acceptance for every chain: each kind's own cycles ran in other
                # stretches of the text, whose acceptance differs far more than the kinds do
                tokens = self._chain_tokens_at(ct, kind_depth(kind), nodes / cycles) * cycles
            elif ct is not None and kind == "tree" and reference > 0:
                # the tree's tokens relative to the reference chain's when its cycles ran, at today's
                # acceptance where that is lower (never higher: the tree is a costly bet to make on a guess)
                tokens *= min(ct[_REFERENCE] * cycles / reference, 1.0)
            out[kind] = (tokens / cycles, (seconds + transfers) / cycles)
        if ct is not None and "plain" in sums:
            # A chain not measured yet costs the plain step plus h levels, each a draft step (with
            # the search after it) and a verified token, from the fits every drafting cycle feeds
            # (probes included); without those fits, what a level cost in the chains that ran.
            # Its transfers are priced at today's root loads either way: a chain's own loads
            # would price it by the stretch of text and cache it last ran in.
            plain = float(sums["plain"][1] / sums["plain"][2])
            verify = state.verify_fit
            draft = state.draft
            drafting = 0.0  # what drafting at all costs a cycle (its first level reads the committed tokens)
            t_novel = 0.0  # seconds a root's worth of new experts costs the verify beyond its loads
            if draft.t_level is not None and verify is not None:
                per_level, drafting = draft.t_level + draft.t_node + verify.t_token, draft.t_cycle
                t_novel = verify.t_novel
            else:
                levels = [(h, sums[k]) for k, h in self._chain_depths if k in sums]
                per_level = float(np.mean([max(v[1] / v[2] - plain, 0.0) / h for h, v in levels])) if levels else None
            if per_level is not None:
                root = plain + t_expert * m + drafting
                per_novel = t_novel + t_expert * per_new
                # (levels, seconds, share of its nodes verified): the deepest chain priced by its own cycles
                anchor: tuple[int, float, float] | None = None
                for kind, h in self.chain_depths:
                    if state.counts.get(kind, 0) >= _OWN_CYCLES:
                        # measured often enough: its own drafting and compute, its transfers at today's
                        # rate (the fits are linear in levels, and on a CPU host a deep chain's draft and
                        # verify cost more than that: mixtral-pcie4, GSM8K, a 10-level chain forecast at
                        # 71 ms ran at 83 ms, and the gate chose it over the faster 7-level one)
                        verified = float(sums[kind][3] / sums[kind][2])
                        out[kind] = (self._chain_tokens_at(ct, h, verified), out[kind][1])
                        anchor = (h, out[kind][1], verified / h)
                        continue
                    # deeper tokens share more of the experts before them: each depth pays for what it adds
                    seconds, tokens = root + h * per_level + float(novelty[h]) * per_novel, ct[h]
                    if anchor is not None:
                        # beyond a measured chain, only the extra levels come from the fits: their fixed
                        # part is what the fits get wrong (a cycle's root), and the measured chain has it.
                        # Its tokens are those of the share of its nodes the measured chain verified: its
                        # seconds were measured at that share (the verify stops before costly nodes that
                        # are unlikely to be reached), and a deeper chain stops there too (priced whole,
                        # on CNN/DM a 16-level chain looked a 10-level one's tokens for 6 levels' drafting)
                        ah, a_seconds, share = anchor
                        seconds = a_seconds + (h - ah) * per_level + float(novelty[h] - novelty[ah]) * per_novel
                        tokens = self._chain_tokens_at(ct, h, share * h)
                    out[kind] = (tokens, seconds)
        if state.draft.t_level is not None:
            # a probe: the cycle it stands in for, plus the levels it drafts and does not verify.  A
            # probe of plain decoding drafts at all (a cycle's first level), and costs what its own
            # cycles did if that is more: its first level also reads every token the plain steps
            # before it committed (the draft skipped them), which no drafting fit sees
            extra = state.draft.marginal(PROBE_DEPTH, PROBE_DEPTH)
            for base, probe in self._probes:
                if base in out:
                    tokens, seconds = out[base]
                    if base == "plain":
                        own = out[probe][1] if probe in out else 0.0
                        out[probe] = (tokens, max(seconds + state.draft.predict(PROBE_DEPTH, PROBE_DEPTH), own))
                    else:
                        out[probe] = (tokens, seconds + extra)
        self._figures = (state.version, out)
        return out

    @staticmethod
    def _chain_tokens_at(ct: list[float], depth: int, nodes: float) -> float:
        """Expected tokens of a ``depth``-level chain whose cycles verified ``nodes`` nodes on average
        (a drafted chain verifies the prefix its forecast says pays: :meth:`SpecFitPolicy._best_prefix`)."""
        x = min(max(float(nodes), 0.0), float(depth))
        return _interp_unit(ct, x) if math.isfinite(x) else float(np.interp(x, np.arange(len(ct)), ct))

    def _node_extra_loads(self, m: float) -> float:
        """Loads per root's worth of new experts in a chain's nodes at root-loads mean ``m`` (the fit ``a + b m``)."""
        a, b = self.state.node_loads
        return float(a + b * m)

    def novelty(self) -> np.ndarray:
        """:func:`chain_novelty` of the measurements (cached until they change)."""
        return current_novelty(self.state)

    def node_factor(self, kind: str) -> float:
        """What ``kind``'s verified nodes load against a drafted chain's (1 for the chains themselves)."""
        if kind not in _OWN_NODE_KINDS:
            return 1.0
        loaded, forecast = self.state.own_node_sums.get(kind, (0.0, 0.0))
        return (loaded + _OWN_NODE_PRIOR) / (forecast + _OWN_NODE_PRIOR)

    def node_seconds(self, depth: int, kind: str = LOOKUP) -> np.ndarray | None:
        """Seconds each of ``depth`` more verified tokens of ``kind`` in a chain costs now: its compute and
        the loads of the experts it adds (``None`` before the verification fit exists)."""
        verify = self.state.verify_fit
        if verify is None:
            return None
        loads = self._node_extra_loads(self.state.root_loads or 0.0) * self.node_factor(kind)
        per_new = verify.t_novel + self.state.t_expert * loads
        added = np.diff(novel_at(self.novelty(), np.arange(depth + 1)))
        return verify.t_token + per_new * added

    def ranked_figures(self) -> dict[str, tuple[float, float]]:
        """:meth:`cycle_figures` as of the last ranking (a running kind's forecast between rankings)."""
        return self._figures[1] if self._figures is not None else self.cycle_figures()

    def own_seconds(self, kind: str) -> float | None:
        """Seconds a cycle of ``kind`` takes beside its transfers, from its own cycles (``None`` before
        :data:`_OWN_CYCLES` of them)."""
        v = self.state.sums.get(kind)
        if v is None or self.state.counts.get(kind, 0) < _OWN_CYCLES:
            return None
        return float(v[1] / v[2])

    def plain_figures(self, load_factor: float = 1.0) -> tuple[float, float]:
        """``cycle_figures()["plain"]`` without ranking every kind (a plain step's forecast, every step);
        ``load_factor`` scales the root's expected loads."""
        tokens, seconds, cycles = self.state.sums["plain"][:3].tolist()
        return tokens / cycles, seconds / cycles + self.state.t_expert * (self.state.root_loads or 0.0) * load_factor

    def plain_seconds(self, loads: float) -> float:
        """Seconds of a plain step that loads ``loads`` experts: its compute as measured, its transfers at
        the current rate."""
        tokens, seconds, cycles = self.state.sums["plain"][:3].tolist()
        return seconds / cycles + self.state.t_expert * loads

    def lookup_root_seconds(self) -> float:
        """A lookup chain's root: a plain step whose loads are what lookup roots loaded against the root mean.

        Where the text repeats, the root's experts are mostly resident (Mixtral 4090 twin, CNN/DM at
        half cache, host time frozen, 16 prompts: 0.5 loads against a root mean of 1.6).
        """
        loaded, mean = self.state.lookup_root_sums
        return self.plain_figures((loaded + _OWN_NODE_PRIOR) / (mean + _OWN_NODE_PRIOR))[1]

    def depth_acceptance(self) -> np.ndarray | None:
        """Estimated ``P(draft token d accepted | tokens before it accepted)`` for chain depths ``1..16``.

        Recent chain cycles and probes (about the last twenty) weigh most; where they did not reach a
        depth, the long-run rate of that depth stands in (``None`` before any chain cycle).
        """
        version = self.state.version
        if self._acceptance is not None and self._acceptance[0] == version:
            return self._acceptance[1]  # read by chain_tokens and, in a lookup cycle, chain_tokens_in
        fast, slow = self.state.depth_fast, self.state.depth_slow
        if slow[1, 0] <= 0:
            return None
        # The recent counts are shrunk toward the long-run rate of the *older* outcomes (the slow
        # counts hold the recent ones too: counting them twice made one unlucky outcome weigh as
        # two), and that toward the estimate of the depth above: given the tokens before it were
        # accepted, a draft is about as likely to go on being right (measured: flat or rising with
        # depth).  So one unlucky probe of a depth does not price every deeper chain out for
        # hundreds of cycles (GSM8K, 4090 twin, half cache: a first call sat on 2-token chains).
        prior = float(slow[0, 0] + 1.0) / float(slow[1, 0] + 2.0)  # depth 1, Laplace: one lucky cycle is not certainty
        (old_hits, old_tries), (hits, tries) = np.maximum(slow - fast, 0.0).tolist(), fast.tolist()
        out = []
        for d in range(_MAX_CHAIN):  # a recurrence over the depths, on host floats
            long_run = (old_hits[d] + _LONG_RUN_PRIOR * prior) / (old_tries[d] + _LONG_RUN_PRIOR)
            prior = (hits[d] + _DEPTH_PRIOR * long_run) / (tries[d] + _DEPTH_PRIOR)
            out.append(prior)
        acceptance = np.array(out)
        self._acceptance = (version, acceptance)
        return acceptance

    def chain_tokens(self) -> np.ndarray | None:
        """Expected tokens per cycle of a chain of ``h`` levels, index ``h`` (0: plain).

        From :meth:`depth_acceptance`; ``None`` before any chain cycle.
        """
        version = self.state.version
        if self._chain_tokens is None or self._chain_tokens[0] != version:
            p = self.depth_acceptance()
            tokens = None
            if p is not None:
                out, reach = [1.0], 1.0
                for p_d in p.tolist():
                    reach *= p_d  # the chance every depth up to this one is accepted
                    out.append(out[-1] + reach)
                tokens = np.array(out)
            self._chain_tokens = (version, tokens)
        return self._chain_tokens[1]

    def best(self, rates: dict[str, float] | None = None) -> str:
        """The measured fastest kind (kinds not measured yet rank last); ``rates``: :meth:`rates` if at hand.

        The tree competes with plain decoding as well as with the chains: it verifies only the
        nodes that pay, whose experts are mostly resident, so it can pay where a fixed chain
        does not (4090 twin, host time frozen, CNN/DM at half cache: the tree alone 1.05x the
        best chain).
        """
        rates = self.rates() if rates is None else rates
        limit = self.chain_limit()
        simple = max((k for k in self.kinds if k != "tree" and kind_depth(k) <= limit),
                     key=lambda k: (k in rates, rates.get(k, 0.0)))
        if "tree" not in rates or rates["tree"] <= rates.get(simple, 0.0):
            return simple
        return "tree"

    def choose(self) -> str:
        """Called once per cycle before drafting: the kind of cycle to run."""
        state = self.state
        state.cycle += 1
        if not self.enabled:
            return "tree"
        for kind in self._first:  # a plain step and one chain price every chain (the tree is explored later)
            if state.counts.get(kind, 0) < 1:
                if (kind != "plain" and state.root_loads is not None and state.call_cycle < _START_CYCLES
                        and self._cold_wait_pays()):
                    return "plain"  # the prefill left the cache cold: the chain's nodes would load the most now
                return kind
        if state.exploring is not None and state.explore_left > 0:
            state.explore_left -= 1
            return state.exploring
        if (state.current not in (None, "tree") and state.exploring is None and state.cycle - state.ranked_at < _RERANK
                and (state.current == "plain" or state.cycle < state.explore_at)):
            # plain decoding or a chain runs: one cycle moves the ranking little (a plain step only
            # the costs and the root loads, a chain one outcome per depth); ranking every cycle would
            # cost host time every cycle.  A chain still explores on schedule (plain decoding weighs
            # its probe when it ranks); the tree is a costly bet, re-weighed after each of its cycles.
            return state.current
        state.ranked_at = state.cycle
        rates = self.rates()
        best = self.best(rates)
        if state.current in rates and rates[best] < _SWITCH * rates[state.current]:
            best = state.current  # hysteresis: a kind within a few percent does not unseat the one running
        if best != state.current:
            state.led_since = state.cycle
        state.current = best
        if (best.startswith("chain:") and kind_depth(best) > state.deepest_led
                and state.cycle - state.led_since >= _LEAD_CYCLES):
            state.deepest_led = kind_depth(best)  # deeper chains may be ranked now (chain_limit)
            state.version += 1
        if state.cycle - state.explored_at >= state.interval:
            # the kind measured longest ago, discounted by how far behind it was: a kind at half
            # the best rate is re-measured a quarter as often (it would take a big change to win).
            # While plain decoding leads, a kind never measured (the tree) is due first: no chain
            # pays there, and the tree, verifying only nodes whose experts are resident, may (it
            # never ran otherwise: Mixtral twin, CNN/DM, 75 % cache, 0.98x plain decoding where the
            # tree alone is 1.2x).  While a chain leads the tree waits until it is measured (as
            # unmeasured it would run in the cold cycles after the prefill, where its cheap nodes
            # rate it above the chains whose depths it then never measures: GSM8K on the H100 twin
            # sat on the tree, plain steps and lookup chains at 0.82 of the 10-token chain)
            def due(k: str) -> float:
                if k not in rates:
                    return math.inf if best == "plain" else 0.0
                ratio = rates[k] / max(rates[best], 1e-12)
                return (state.cycle - state.last_run.get(k, -1)) * ratio * ratio

            kind = max(self._worth_exploring(best, rates), key=due)
            burst = 1 if kind.startswith("probe:") else self.burst  # a probe measures in one cycle
            if kind.startswith("chain:"):
                burst = max(burst, self._unpriced(kind))  # a chain runs until its own cycles price it
            # a chain explored while plain decoding leads is priced by priors only: its regret is the
            # unknown being measured, not a cost to budget (budgeted, it waited hundreds of cycles)
            regret = 0.0 if best == "plain" and kind.startswith("chain:") else self._regret(kind, best)
            wait = burst * regret / _EXPLORE_BUDGET  # cycles of the best kind it costs
            if state.cycle - state.explored_at >= wait:
                state.explored_at, state.exploring, state.explore_left = state.cycle, kind, burst - 1
                state.best_before = best
                return kind
            state.explore_at = state.explored_at + math.ceil(wait)  # within budget then, as ranked now
        else:
            state.explore_at = state.explored_at + state.interval
        if state.exploring is not None:  # a burst ended: back off if the best kind held
            held = best == state.best_before
            state.interval = min(2 * state.interval, self.max_explore_every) if held else self.explore_every
            state.exploring = None
        return best

    def record_depth(self, depth: int, accepted: bool, context: int | None = None) -> None:
        """One outcome of a chain's ``depth``-th token whose predecessors were accepted (verified or probed);
        ``context``: the lookup context of the cycle the chain started in (:func:`~.lookup.lookup_context`)."""
        if 1 <= depth <= _MAX_CHAIN:
            self._record_depths(depth - 1, depth, depth if accepted else depth - 1, context)

    def _record_depths(self, first: int, tried: int, accepted: int, context: int | None,
                       agreed: bool = False) -> None:
        """Outcomes of chain depths ``first + 1 .. tried`` (0-based slots ``first:tried``): the ones up to
        ``accepted`` were accepted.  One slice per count (a cycle's depths at once, not one call each).
        ``agreed``: the chain's first token was the lookup proposal's, and class ``context + AGREED`` counts
        them too."""
        sums = [self.state.depth_fast, self.state.depth_slow]
        if context is not None:
            sums.append(self.state.depth_context[context])
            if agreed:
                sums.append(self.state.depth_context[context + AGREED])
        for s in sums:
            s[0, first:accepted] += 1.0
            s[1, first:tried] += 1.0
        self.state.version += 1

    def agreed_check_due(self, context: int) -> bool:
        """Whether a chain in lookup class ``context`` stops after its first level to compare it with the proposal:
        while the class has few checks, where at least :data:`_CHECK_SHARE` of them verified the lookup instead,
        and every :data:`_CHECK_EVERY` cycles otherwise.  A check costs a policy call and the lookup's pricing
        (~0.1 ms a chain cycle on the GH200 ``+graphs`` twin, GSM8K, where the chains nearly always stay)."""
        checks, switched, at = self.state.agreed_checks[context].tolist()
        return checks < _CHECK_TRIALS or switched >= _CHECK_SHARE * checks or self.state.cycle - at >= _CHECK_EVERY

    def agreed_checked(self, context: int, switched: bool) -> None:
        """A chain in lookup class ``context`` was compared with the proposal after its first level."""
        row = self.state.agreed_checks[context]
        row[:2] *= _CHECK_DECAY
        row[0] += 1.0
        row[1] += float(switched)
        row[2] = self.state.cycle

    def agreed_cost(self, context: int) -> float:
        """What a chain cycle whose first token agreed with a lookup proposal of class ``context`` costs against its
        kind's ranked seconds (shrunk toward 1 by :data:`_CONTEXT_PRIOR` cycles' worth of the kind's figure)."""
        measured, figure = self.state.agreed_seconds[context].tolist()
        cycles = self.context_trials(context + AGREED)
        prior = _CONTEXT_PRIOR * figure / cycles if cycles > 0 else 0.0
        return (measured + prior) / (figure + prior) if figure > 0 else 1.0

    def context_trials(self, context: int) -> float:
        """Decayed count of chain cycles whose first token was tried in lookup context ``context``."""
        return float(self.state.depth_context[context, 1, 0])

    def chain_tokens_in(self, context: int) -> list[float] | None:
        """:meth:`chain_tokens` where the cycle's lookup proposal is of ``context``.

        A chain's acceptance follows the text, and so does a lookup proposal's: where the context
        repeats a long span, a draft model accepts more too (GSM8K, 4090 twin: ~5.7 tokens per
        chain cycle after an 8-gram repeat of the answer, ~3.6 where nothing repeats).  Each
        context's counts are shrunk toward the overall acceptance of each depth.  A list of host floats:
        the lookup's hurdle reads it depth by depth, every lookup cycle.
        """
        p = self.depth_acceptance()
        if p is None:
            return None
        hits, tries = self.state.depth_context[context].tolist()
        # on host floats, in numpy's order (elementwise, then the running product and sum): every lookup cycle
        out, reach, total = [1.0], 1.0, 0.0
        for h, t, p_d in zip(hits, tries, p.tolist()):
            reach *= (h + _CONTEXT_PRIOR * p_d) / (t + _CONTEXT_PRIOR)
            total += reach
            out.append(1.0 + total)
        return out

    def _regret(self, kind: str, best: str) -> float:
        """Cycles of ``best`` whose tokens one cycle of ``kind`` costs (0 for a kind not measured yet)."""
        figures = self.cycle_figures()
        if kind not in figures or best not in figures:
            return 0.0
        (tokens, seconds), (best_tokens, best_seconds) = figures[kind], figures[best]
        return max(0.0, seconds / max(best_seconds, 1e-12) - tokens / max(best_tokens, 1e-12))

    def _unpriced(self, kind: str) -> int:
        """Cycles ``kind`` still needs before it is priced by its own cycles (0 for a kind that is not a chain)."""
        if not kind.startswith("chain:"):
            return 0
        return max(_OWN_CYCLES - self.state.counts.get(kind, 0), 0)

    def _worth_exploring(self, best: str, rates: dict[str, float] | None = None) -> list[str]:
        """The kinds whose measurement could unseat ``best``.

        A chain's tokens come from the acceptance of each depth and the plain step's are 1,
        so a chain of ``h`` levels teaches everything about plain cycles and shorter chains:
        only the deeper depths and the tree are unknowns.  The deeper depths are measured by
        a probe of ``best`` (:func:`probe_kind`): the same cycle drafting
        :data:`PROBE_DEPTH` more levels it does not verify, whose tokens are compared with
        the ones the target then commits -- the acceptance of each depth for a draft
        level's cost, without the compute and expert loads of verifying it.  A probe measures
        acceptance, not cost: a chain past ``open_depth`` that the fits rank ahead of the best
        by less than :data:`_SWITCH` (given ``rates``) is run until priced by its own cycles
        (:data:`_OWN_CYCLES`); while plain decoding leads, so is the fastest chain not priced by its
        own cycles yet that the priors put within :data:`_NEAR` of it.  The tree is re-measured in
        bursts of its own cycles, whatever runs.
        """
        if best == "plain" and self._chains:
            out = [PROBE, *(k for k in self.kinds if k == "tree")]
            if rates is not None and "plain" in rates:
                # While plain decoding leads no chain runs, so nothing corrects the priors a chain is
                # priced by (a call's first chain, run in the cold cycles after a prefill, and the
                # depths below it guessed at the ones above): CPU + emulated qwen3-pcie5, GSM8K at a
                # quarter cache, a process's first six calls ran plain steps and lookups while the
                # fixed 5-token chain was 1.1-1.5x plain decoding at every cache temperature.  The
                # fastest chain not yet priced by its own cycles is measured, if the priors put it
                # near plain decoding
                near = [k for k, _ in self.chain_depths if self._unpriced(k) and k in rates
                        and rates[k] >= _NEAR * rates["plain"]]
                if near:
                    out.append(max(near, key=lambda k: rates[k]))
            return out
        if best.startswith("chain:"):
            h = kind_depth(best)
            deeper = [probe_kind(h)] if f"chain:{h + 1}" in self.kinds else []
            if rates is not None and best in rates:
                # past the open depth, a chain the fits put ahead of the best by less than the switching
                # margin never runs on their word, so their price of it is never corrected (H100 twin,
                # GSM8K, half cache: 12-token chains where the fits priced each deeper level 5.5 ms and
                # 16-token chains measured 3.3 ms a level): it runs until its own cycles price it
                deeper += [k for k, d in self.chain_depths if d > max(h, self.open_depth) and self._unpriced(k)
                           and rates.get(k, 0.0) > rates[best]]
            return deeper + [k for k in self.kinds if k == "tree"]
        return [k for k in self.kinds if k != best]

    def observe(self, kind: str, tokens: int, seconds: float, loads: int | None = None,
                root_loads: int | None = None, t_expert: float = 0.0, nodes: int = 0,
                accepted: int | None = None, context: int | None = None,
                novelty: list[float] | None = None, path: bool = False, agreed: bool = False) -> None:
        """Add a measured cycle of ``kind``.

        ``loads``: experts the cycle loaded, ``root_loads``: of those, the ones the root
        alone needed (plain cycles: all; ``None`` when unknown: a drafting cycle's
        loads then teach neither the root mean nor the node fit);
        ``t_expert``: seconds per load (the cost model's);
        ``nodes``: draft nodes verified; ``accepted``: of those, the ones accepted (a chain
        cycle's acceptance feeds :meth:`depth_acceptance`, and :meth:`chain_tokens_in` its
        lookup ``context``); ``novelty``: per verified node, the new experts it was the first
        of the block to compute, in roots' worth (``None``: unknown, every node counts as new);
        ``path``: a tree cycle that counts as a chain's.  Without the gate (``enabled`` false) no
        chain runs, and a tree cycle that verified a path teaches the depths' novelty instead
        (else every node of the tree stays priced as all new: 4090 twin, GSM8K, half cache, a
        7-node path forecast at 61 ms against 38 ms measured).  With the gate the caller passes it
        only for the draft's top-1 path, which is exactly a chain's nodes: it teaches novelty, the
        node loads and the depths' acceptance like a chain cycle (any other tree path is nodes
        chosen for their resident experts, not a chain's).  ``agreed``: a chain cycle whose first
        drafted token was its lookup proposal's first (its depths count in ``context + AGREED`` too).
        Without ``loads`` the cycle counts with its transfers in its seconds.
        """
        state = self.state
        if agreed and context is not None and kind.startswith("chain:"):
            figure = None if self._figures is None else self._figures[1].get(kind)  # as the cycle was ranked
            if figure is not None and math.isfinite(seconds):
                state.agreed_seconds[context] += (seconds, figure[1])
        chain_like = kind not in _OWN_NODE_KINDS or (kind == "tree" and path)
        as_chain = chain_like and (kind not in _OWN_NODE_KINDS or self.enabled)  # loads and depths too
        if novelty is not None and nodes and chain_like:  # a chain's depths (a probe's verified)
            depths = min(len(novelty), _MAX_CHAIN)
            state.novelty *= _NODE_DECAY
            state.novelty[0, :depths] += novelty[:depths]
            state.novelty[1, :depths] += 1.0
        new = float(nodes) if novelty is None else float(sum(novelty))
        if loads is not None:
            seconds = max(seconds - t_expert * loads, 0.0)
            state.t_expert = t_expert
            state.call_cycle += 1
            if not nodes or root_loads is not None:  # the root's own loads are known
                root = loads if not nodes else min(root_loads, loads)
                if nodes and not as_chain:
                    # the tree verifies the nodes whose experts are cached, and a lookup chain repeats
                    # text whose experts were used lately: their nodes load less than a drafted chain's;
                    # what they loaded against what the chains' fit says a node loads
                    loaded, forecast = state.own_node_sums.get(kind, (0.0, 0.0))
                    expected = novel_at(self.novelty(), nodes) * self._node_extra_loads(state.root_loads or 0.0)
                    state.own_node_sums[kind] = (_NODE_DECAY * loaded + float(loads - root),
                                                 _NODE_DECAY * forecast + expected)
                elif nodes:
                    # the nodes' loads beyond the root's, against the root mean when they ran
                    state.node_fit.add(new, new * (state.root_loads or 0.0), float(loads - root), _NODE_DECAY)
                # a lookup chain runs where the text repeats and its root's experts are resident: its
                # root's loads are not what the ranked kinds' roots load, and are kept apart
                if kind == LOOKUP:
                    loaded, mean = state.lookup_root_sums
                    state.lookup_root_sums = (_NODE_DECAY * loaded + float(root),
                                              _NODE_DECAY * mean + (state.root_loads or 0.0))
                else:
                    state.root_loads = root if state.root_loads is None else (
                        (1 - _ROOT_EMA) * state.root_loads + _ROOT_EMA * root)
        # the tree's cycles keep the reference chain's tokens at the acceptance they were chosen under
        chain_tokens = self.chain_tokens() if kind == "tree" else None
        reference = 0.0 if chain_tokens is None else float(chain_tokens[_REFERENCE])
        cycle = np.array([tokens, seconds, 1.0, float(nodes), reference], dtype=np.float64)
        state.sums[kind] = _decayed_add(state.sums.get(kind), cycle, _KIND_EMA)
        state.depth_fast *= 1 - _DEPTH_FAST
        state.depth_slow *= 1 - _DEPTH_SLOW
        state.depth_context *= 1 - _CONTEXT_DECAY
        state.agreed_seconds *= 1 - _CONTEXT_DECAY
        if as_chain and accepted is not None and nodes:  # a chain, a probe's verified chain, a tree's top-1 path
            # depth d was tried when the d - 1 before it were accepted, and accepted if d <= accepted
            tried = min(accepted + 1, nodes, _MAX_CHAIN)
            self._record_depths(0, tried, min(accepted, tried), context, agreed)
        state.counts[kind] = state.counts.get(kind, 0) + 1
        state.version += 1
        state.last_run[kind] = state.cycle
