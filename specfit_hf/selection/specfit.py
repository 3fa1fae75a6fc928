"""The ``specfit`` and ``oracle`` selection policies.

``specfit`` (after every draft level):

1. per-node acceptance = calibrated draft probability (:class:`AcceptanceCalibrator`),
   path acceptance ``P(v)`` = product along the path;
2. predicted experts of every node and of the root per target MoE layer (an
   :mod:`~specfit_hf.selection.experts` predictor), and the device cache's residents;
3. the exact throughput-optimal ancestor-closed subtree (:func:`select_subtree`), warm
   started from the previous level's optimum;
4. **stop rule**: stop drafting when ``max_depth`` levels exist, or when the optimal
   subtree holds no node of the newest level *and* a look-ahead finds no gain: under each
   frontier node ``v`` a chain of not-yet-drafted children with path acceptance
   ``P(v) a^j`` (``a`` = learnt acceptance of a parent's most confident child), each
   adding the misses ``v`` adds and costing one more draft level (draft + search seconds
   per level, measured), cannot beat the current optimum (it matters where a frontier
   node's ancestors are not in the optimum yet: a chain below can amortise them).
5. **adaptive drafting** (on the empty tree): a cycle drafts nothing (verifies the root
   alone) while measured tokens/s of drafting cycles trail those of plain cycles, with
   one exploring cycle of the other kind every ``explore_every`` cycles; each exploration
   that confirms the ranking doubles that interval (up to ``max_explore_every``), a
   flipped ranking resets it, so a losing kind costs ever less.  This is how
   the policy degrades to plain decoding when the draft is too slow or too inaccurate
   for the link (the per-cycle search cannot see the cost of a draft level it has not
   drafted yet).  Drafting time per level is tracked separately (EMA) and added to the
   search's ``t0`` for the levels already drafted.  Rates are decayed sums of tokens over
   decayed sums of wall seconds (draft + search + verify); a drafter reads the prompt
   before the first cycle, so no cycle carries that one-off cost.  These measurements belong to the
   host, link, cache and draft, so later ``generate`` calls on the same offload runtime
   with the same draft carry them on (``share_drafting``).

Before each search, nodes whose path acceptance is at most ``t_token / T(root alone)``
are dropped with their subtrees (:func:`~specfit_hf.selection.search.useful_nodes`, exact);
their experts are then never predicted either.

After verification (``observe``) it learns online: the acceptance calibrator (bins per
depth group and per sibling rank: a parent's most confident child vs the others) from
the outcome of every node whose parent's choice was observed -- under greedy decoding
unverified nodes too (the committed token says whether they would have been accepted),
so an under-confident draft is corrected even when the policy verifies little.  These
acceptance estimates are shared by later ``generate`` calls with the same draft model.
Also the expert history
from ``runtime.last_routing``, and the cost model from the measured cycle
(:class:`OnlineCostModel`, fitted on *measured* loads); the search's ``t_expert`` is
scaled by measured loads per predicted miss of the verified sets (``miss_scale``), since
the predictor's misses undercount what a large block really loads.  Without an offload runtime there is no expert term.

``policy_kwargs`` (all optional): ``cost`` (a :class:`CostModel` or its fields as a
dict), ``calibrate`` (bool: profile the host in ``reset``), ``expert_predictor``
(``auto`` | ``router`` | ``history`` | ``history+router`` | ``heads`` | ``none``),
``measure_predictors`` (list of predictor names also scored each cycle, for reports),
``max_nodes`` (only the ``max_nodes`` most likely nodes are candidates), ``online_cost``
(bool, default True), ``acceptance`` (dict of :class:`AcceptanceCalibrator` args),
``adaptive_drafting`` (bool, default True), ``explore_every`` (int, default 8),
``max_explore_every`` (int, default 64), ``lookahead`` (bool, default True: the stop
rule's look-ahead), ``share_acceptance`` (bool, default True: keep acceptance estimates
across calls with the same draft), ``share_drafting`` (bool, default True: keep drafting
rates across calls with the same offload runtime and draft).
``max_verify_nodes`` of the config is not used: the cost model sizes the subtree.
Give ``cost`` as a dict if the config is to be saved (``save_pretrained`` writes JSON).

``oracle`` (benchmarks only) knows the true acceptance and the true experts: see
:class:`OraclePolicy` for what it needs from the loop.
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..tree import DraftTree, Selection, VerifyResult
from .acceptance import AcceptanceCalibrator, acceptance_outcomes, path_acceptance, sibling_ranks
from .calibration import OnlineCostModel, calibrate
from .experts import (
    DraftHeadPredictor,
    UnionQuality,
    actual_routing,
    cached_mask,
    make_predictor,
)
from .policy import CycleContext, SelectionPolicy, register_policy, top_n_by_path_prob
from .search import CostModel, select_subtree, useful_nodes

__all__ = ["SpecFitPolicy", "OraclePolicy", "OracleProbe", "default_cost_model"]

_EMPTY = torch.empty(0, dtype=torch.long)


def default_cost_model(runtime: Any = None) -> CostModel:
    """A starting point before calibration / online refinement.

    ``t_expert`` comes from the runtime's emulated link when it has one.
    """
    t_expert = 0.0
    if runtime is not None:
        t_expert = 1e-4
        link = getattr(runtime, "link", None)
        nbytes = getattr(runtime, "expert_bytes", None)
        if link is not None and nbytes:
            t_expert = float(link.transfer_seconds(int(nbytes)))
    return CostModel(t0=5e-3, t_token=5e-4, t_expert=t_expert)


def _cost_from_kwargs(value: Any) -> CostModel | None:
    if value is None:
        return None
    if isinstance(value, CostModel):
        return value
    if isinstance(value, dict):
        return CostModel(**value)
    raise ValueError("policy_kwargs['cost'] must be a CostModel or a dict with t0, t_token, t_expert")


def _draft_model(ctx: CycleContext) -> Any:
    drafter = ctx.extras.get("drafter")
    return getattr(drafter, "model", None)


@dataclass
class _AcceptanceState:
    """What the policy has learnt about the draft's acceptance (shared across ``generate`` calls).

    ``calibrator``: per-node acceptance from draft confidence.  ``child_accepted`` /
    ``child_trials``: decayed counts of "the most confident child of an observed
    parent (or of the root) was accepted" -- the acceptance the stop rule's look-ahead assumes
    for the not yet drafted next level (prior 1 of 2).
    """

    calibrator: AcceptanceCalibrator
    child_accepted: float = 1.0
    child_trials: float = 2.0

    def child_acceptance(self) -> float:
        return self.child_accepted / self.child_trials


# draft model -> {acceptance settings: state}; the estimates carry over from one
# generate call to the next with the same draft (acceptance is a property of the pair)
_SHARED_ACCEPTANCE: "weakref.WeakKeyDictionary[Any, dict[str, _AcceptanceState]]" = weakref.WeakKeyDictionary()


@dataclass
class _DraftingState:
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


# offload runtime -> draft model -> policy and settings -> drafting state
_SHARED_DRAFTING: "weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, dict[str, _DraftingState]]]" = (
    weakref.WeakKeyDictionary()
)
_CHILD_DECAY = 0.98  # per observed parent: follows the text over a few hundred tokens
_MISS_DECAY = 0.9  # per cycle: the loads-per-predicted-miss ratio follows the cache state
_MISS_PRIOR = 4.0  # pseudo-misses on both sides: the ratio starts at 1


class _TreePredictions:
    """Predicted experts of one cycle's tree, extended level by level (never recomputed)."""

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree
        self.nodes: np.ndarray | None = None
        self.root: np.ndarray | None = None
        self.done: np.ndarray | None = None  # which node rows hold predictions


@register_policy("specfit")
class SpecFitPolicy(SelectionPolicy):
    """Throughput-optimal subtree selection (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        kw = dict(getattr(config, "policy_kwargs", {}) or {})
        self.kwargs = kw
        self.max_depth = int(getattr(config, "max_depth", 7))
        self.max_nodes = kw.get("max_nodes")
        self.predictor_name = str(kw.get("expert_predictor", "auto"))
        self.measure_names = list(kw.get("measure_predictors", []))
        self.acceptance = _AcceptanceState(AcceptanceCalibrator(**dict(kw.get("acceptance", {}))))
        self.lookahead = bool(kw.get("lookahead", True))
        self.share_acceptance = bool(kw.get("share_acceptance", True))
        self.greedy = not bool(getattr(config, "do_sample", False))
        self.cost: OnlineCostModel | None = None
        self.runtime = None
        self.predictor = None
        self.measured: dict[str, Any] = {}
        self.quality: dict[str, UnionQuality] = {}
        self._pred: _TreePredictions | None = None
        self._cached: np.ndarray | None = None
        self._last: Selection | None = None
        # drafting cost and whether drafting pays off (see select on the empty tree)
        self.explore_every = int(kw.get("explore_every", 8))
        self.max_explore_every = max(self.explore_every, int(kw.get("max_explore_every", 64)))
        self.share_drafting = bool(kw.get("share_drafting", True))
        self.drafting = _DraftingState(interval=self.explore_every)
        self.ema = float(kw.get("ema", 0.3))
        self._miss_sums = (0.0, 0.0)  # decayed (measured loads, predicted misses) of verified sets

    # -------------------------------------------------------------- lifecycle
    def reset(self, ctx: CycleContext) -> None:
        self.runtime = ctx.runtime
        initial = _cost_from_kwargs(self.kwargs.get("cost"))
        if initial is None and self.kwargs.get("calibrate"):
            initial = calibrate(ctx.target, _draft_model(ctx), ctx.runtime)
        if initial is None:
            initial = default_cost_model(ctx.runtime)
        if ctx.runtime is None and initial.t_expert:
            initial = CostModel(initial.t0, initial.t_token, 0.0)
        self.cost = OnlineCostModel(initial)
        draft = _draft_model(ctx)
        if self.share_acceptance and draft is not None:
            try:
                per_draft = _SHARED_ACCEPTANCE.setdefault(draft, {})
            except TypeError:  # not weak-referenceable: keep this call's own estimates
                per_draft = None
            if per_draft is not None:
                key = repr(sorted(dict(self.kwargs.get("acceptance", {})).items()))
                self.acceptance = per_draft.setdefault(key, self.acceptance)
        self.predictor = make_predictor(self.predictor_name, ctx.runtime, ctx.target, draft)
        self.measured = {}
        for name in self.measure_names:
            if ctx.runtime is None or (name == "heads" and not DraftHeadPredictor.supported(draft)):
                continue
            self.measured[name] = make_predictor(name, ctx.runtime, ctx.target, draft)
        self.quality = {name: UnionQuality() for name in ["policy", *self.measured]}
        self._pred = None
        self.drafting = self._drafting_state(ctx.runtime, draft)
        self.drafting.exploring = None
        self._miss_sums = (0.0, 0.0)

    def _drafting_state(self, runtime: Any, draft: Any) -> _DraftingState:
        fresh = _DraftingState(interval=self.explore_every)
        if not self.share_drafting or runtime is None or draft is None:
            return fresh
        try:
            per_draft = _SHARED_DRAFTING.setdefault(runtime, weakref.WeakKeyDictionary())
            per_policy = per_draft.setdefault(draft, {})
        except TypeError:  # not weak-referenceable: keep this call's own measurements
            return fresh
        # cycle costs depend on the policy and its settings (the oracle's include its probe)
        key = f"{type(self).__name__}:{sorted(self.kwargs.items())!r}:{self.max_depth}"
        return per_policy.setdefault(key, fresh)

    @property
    def calibrator(self) -> AcceptanceCalibrator:
        """The acceptance calibrator in use (shared with earlier calls on the same draft)."""
        return self.acceptance.calibrator

    @property
    def cost_model(self) -> CostModel:
        """The current verification cost model (drafting excluded)."""
        if self.cost is None:
            raise RuntimeError("the specfit policy is used before reset()")
        return self.cost.model

    def cycle_cost_model(self, levels: int) -> CostModel:
        """The cost model of a whole cycle that drafted ``levels`` levels (drafting is in t0)."""
        c = self.cost_model
        return CostModel(c.t0 + (self.level_seconds or 0.0) * levels, c.t_token, c.t_expert * self.miss_scale)

    @property
    def miss_scale(self) -> float:
        """Measured expert loads per *predicted* miss of the verified set (1 before data).

        The cost model's ``t_expert`` is fitted on measured loads, but the search counts
        predicted misses; a predictor with imperfect recall predicts fewer distinct
        experts than a large block really routes to, so big selections looked cheaper
        than they are.  The search's ``t_expert`` is scaled by this ratio.
        """
        loaded, predicted = self._miss_sums
        return float(np.clip((loaded + _MISS_PRIOR) / (predicted + _MISS_PRIOR), 0.25, 4.0))

    @property
    def level_seconds(self) -> float | None:
        """Measured draft + search seconds per draft level (EMA)."""
        return self.drafting.level_seconds

    @property
    def drafted_rate(self) -> float | None:
        """Measured tokens per wall second (draft, search and verify) of cycles that drafted."""
        sums = self.drafting.drafted_sums
        return None if sums is None else sums[0] / sums[1]

    @property
    def plain_rate(self) -> float | None:
        """Measured tokens per wall second of cycles that verified the root alone without drafting."""
        sums = self.drafting.plain_sums
        return None if sums is None else sums[0] / sums[1]

    def _skip_drafting(self) -> bool:
        """Draft nothing this cycle when cycles that draft have been slower than plain ones.

        The first measured cycle drafts, the next does not (to measure both); afterwards
        the faster kind runs, and after ``interval`` cycles one runs the other kind so both
        estimates follow the text (acceptance changes with content).  An exploration that
        confirms the ranking doubles ``interval`` (up to ``max_explore_every``); one that
        flips it resets it to ``explore_every``.  Off with
        ``policy_kwargs={"adaptive_drafting": False}``.
        """
        state = self.drafting
        state.cycle += 1
        if not self.kwargs.get("adaptive_drafting", True):
            return False
        if self.drafted_rate is None:
            return False
        if self.plain_rate is None:
            return True
        plain_is_faster = self.plain_rate > self.drafted_rate
        explore = state.cycle - state.explored_at >= state.interval
        if explore:
            state.explored_at = state.cycle
            state.exploring = plain_is_faster
        return plain_is_faster != explore

    def _end_exploration(self) -> None:
        """After an exploring cycle's rate is in: back off if the ranking held, else reset."""
        state = self.drafting
        if state.exploring is None or self.drafted_rate is None or self.plain_rate is None:
            return
        held = (self.plain_rate > self.drafted_rate) == state.exploring
        state.interval = min(2 * state.interval, self.max_explore_every) if held else self.explore_every
        state.exploring = None

    # -------------------------------------------------------------- selection
    def _root_experts(self, tree: DraftTree, ctx: CycleContext) -> np.ndarray | None:
        """Predicted experts of the root (this cycle's predictions start here)."""
        if self.predictor is None:
            return None
        pred = self._pred
        if pred is None or pred.tree is not tree:
            pred = self._pred = _TreePredictions(tree)
            pred.root = self.predictor.predict_root(tree, ctx)
            pred.nodes = np.zeros((0, *pred.root.shape), dtype=np.int64)
            pred.done = np.zeros(0, dtype=bool)
            self._cached = cached_mask(self.runtime)  # the draft does not touch the target's cache
        return pred.root

    def _experts(self, tree: DraftTree, ctx: CycleContext, need: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(node experts, root experts); rows of nodes not in ``need`` and never predicted are -1."""
        if self._root_experts(tree, ctx) is None:
            return None
        pred = self._pred
        grow = len(tree) - pred.nodes.shape[0]
        if grow > 0:
            pred.nodes = np.concatenate([pred.nodes, np.full((grow, *pred.root.shape), -1, dtype=np.int64)])
            pred.done = np.concatenate([pred.done, np.zeros(grow, dtype=bool)])
        todo = need[~pred.done[need]]
        if todo.size:
            pred.nodes[todo] = self.predictor.predict(tree, ctx, todo)
            pred.done[todo] = True
        return pred.nodes, pred.root

    def _root_only_time(self, tree: DraftTree, ctx: CycleContext) -> float:
        """Predicted seconds of verifying the root alone (no drafting)."""
        misses = 0
        if self.predictor is not None:
            root = self.predictor.predict_root(tree, ctx)  # history knows tokens; others need a hidden
            misses = _root_missing(root, cached_mask(self.runtime))
        return self.cycle_cost_model(0).predict(1, misses)

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        if self.cost is None:
            self.reset(ctx)
        if len(tree) == 0:
            self._last = None
            return Selection(nodes=_EMPTY, expected_tokens=1.0, predicted_time=self._root_only_time(tree, ctx),
                             stop=self.max_depth < 1 or self._skip_drafting())
        node_acc = self.calibrator(tree.draft_probs, tree.depths, sibling_ranks(tree))
        path = path_acceptance(tree, node_acc)
        cost = self.cycle_cost_model(tree.num_levels)
        root = self._root_experts(tree, ctx)
        root_missing = 0 if root is None else _root_missing(root, self._cached)
        keep = useful_nodes(path, cost, root_missing)  # exact pruning
        if self.max_nodes is not None and int(keep.sum()) > int(self.max_nodes):
            top = top_n_by_path_prob(_with_path(tree, np.where(keep, path, -1.0)), int(self.max_nodes)).numpy()
            keep = np.zeros(len(tree), dtype=bool)
            keep[top] = True
        candidates = np.nonzero(keep)[0]
        newest = np.nonzero(tree.depths.numpy() == tree.num_levels)[0]
        experts = self._experts(tree, ctx, np.union1d(candidates, newest))  # the look-ahead reads the frontier
        parents = tree.parents.numpy()
        remap = np.full(len(tree), -1, dtype=np.int64)
        remap[candidates] = np.arange(candidates.size)
        sub_parents = np.where(parents[candidates] >= 0, remap[np.maximum(parents[candidates], 0)], -1)
        warm = None
        if self._last is not None and self._last.nodes.numel() and int(self._last.nodes.max()) < len(tree):
            warm = remap[self._last.nodes.numpy()]
            warm = warm[warm >= 0]
        sel = select_subtree(
            sub_parents, path[candidates],
            None if experts is None else experts[0][candidates],
            None if experts is None else experts[1],
            None if experts is None else self._cached,
            cost,
            warm_start=warm,
        )
        chosen = candidates[sel.nodes.numpy()]
        if not _ancestor_closed(parents, chosen):
            # Never expected (the search returns closed sets); keep generation lossless by
            # verifying the closed part, and leave the instance behind for a bug report.
            dump = _save_instance(
                parents=sub_parents, path=path[candidates], cached=self._cached, warm=warm,
                node_experts=None if experts is None else experts[0][candidates],
                root_experts=None if experts is None else experts[1],
                cost=np.array([cost.t0, cost.t_token, cost.t_expert]), chosen=sel.nodes.numpy(),
            )
            warnings.warn(f"specfit: the search returned a subtree that is not ancestor-closed; verifying its "
                          f"closed part (instance saved to {dump})", RuntimeWarning, stacklevel=2)
            chosen = chosen[_closed_part(parents, chosen)]
        sel.nodes = torch.from_numpy(chosen)
        sel.stop = tree.num_levels >= self.max_depth or not self._worth_drafting_deeper(tree, sel, path, experts)
        self._last = sel
        return sel

    def _worth_drafting_deeper(self, tree: DraftTree, sel: Selection, path: np.ndarray,
                               experts: tuple[np.ndarray, np.ndarray] | None) -> bool:
        """Stop rule: could drafting more levels beat the current optimum's throughput?

        The search only sees drafted nodes, and the next level's value shows only after
        it is drafted and paid for.  Look-ahead: under each frontier node ``v`` (the
        newest level's nodes the drafter expands next) imagine a chain of ``h`` children
        (``h`` up to the remaining depth) with path acceptance ``P(v) a^j`` (``a``: the
        learnt acceptance of a node's most confident child), each adding as many
        predicted misses as ``v`` adds to the rest of the set, and costing
        ``h`` more draft levels.  Continue when any such set ``S* + ancestors(v) +
        chain`` has a higher predicted throughput than ``S*``.  Drafting also continues
        whenever ``S*`` holds a node of the newest level (the only rule with
        ``lookahead=False``).
        """
        level = tree.num_levels
        depths = tree.depths.numpy()
        newest = np.nonzero(depths == level)[0]
        if bool(np.isin(sel.nodes.numpy(), newest).any()):
            return True  # the newest level already pays: its children may too
        if not self.lookahead:
            return False
        top_k = int(getattr(self.config, "tree_top_k", newest.size) or newest.size)
        frontier = newest[np.argsort(-tree.path_probs.numpy()[newest], kind="stable")[:top_k]]
        a = self.acceptance.child_acceptance()
        base = sel.throughput
        chosen = np.zeros(len(tree), dtype=bool)
        chosen[sel.nodes.numpy()] = True
        missing = _MissingCounter(experts, self._cached) if experts is not None else None
        remaining = self.max_depth - level
        gains = np.cumsum(a ** np.arange(1, remaining + 1))
        costs = [self.cycle_cost_model(level + h) for h in range(1, remaining + 1)]
        for v in frontier:
            mask = chosen.copy()
            mask[tree.ancestors(int(v))] = True
            e = 1.0 + float(path[mask].sum())
            size = int(mask.sum())
            miss = child_misses = 0
            if missing is not None:
                # a child is assumed to add what v adds to the rest of the set
                miss = missing.count(mask)
                without = mask.copy()
                without[v] = False
                child_misses = miss - missing.count(without)
            for h in range(1, remaining + 1):
                t = costs[h - 1].predict(size + h + 1, miss + h * child_misses)
                if (e + path[v] * gains[h - 1]) / t > base:
                    return True
        return False

    # -------------------------------------------------------------- learning
    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, record: Any) -> None:
        # greedy: every drafted node whose parent's choice was seen is an outcome
        seen, accepted = acceptance_outcomes(tree, selection, result, include_unverified=self.greedy)
        if seen.size:
            probs = tree.draft_probs.numpy()[seen]
            depths = tree.depths.numpy()[seen]
            self.calibrator.update(probs, accepted, depths, sibling_ranks(tree)[seen])
            self._observe_child_acceptance(tree.parents.numpy()[seen], probs, accepted, depths)
        if self.cost is not None and record is not None:
            self._observe_cost(tree, selection, record)
        if self.runtime is None:
            return
        self._observe_miss_scale(tree, selection, record)
        nodes = selection.nodes.numpy()
        routing = actual_routing(self.runtime, rows=1 + nodes.size)
        if routing is None:
            return
        tokens = np.concatenate([[int(tree.root_token)], tree.tokens.numpy()[nodes]])
        # score the predictions (policy's own, then the measured alternatives) on this block
        if self._pred is not None and self._pred.tree is tree and self._pred.nodes is not None:
            predicted = np.concatenate([self._pred.root[None], self._pred.nodes[nodes]])
            self.quality["policy"].add(predicted, routing)
        ctx = None
        for name, predictor in self.measured.items():
            if predictor.available(tree, ctx):
                predicted = np.concatenate([predictor.predict_root(tree, ctx)[None], predictor.predict(tree, ctx, nodes)])
                self.quality[name].add(predicted, routing)
            predictor.observe(tokens, routing)
        if self.predictor is not None:
            self.predictor.observe(tokens, routing)

    def _observe_miss_scale(self, tree: DraftTree, selection: Selection, record: Any) -> None:
        """Add this cycle's (measured loads, predicted misses of root + selection) to :attr:`miss_scale`."""
        loaded = getattr(record, "experts_loaded", None)
        pred = self._pred
        if loaded is None or pred is None or pred.tree is not tree or pred.nodes is None or self._cached is None:
            return
        if pred.nodes.shape[0] != len(tree):
            return
        mask = np.zeros(len(tree), dtype=bool)
        mask[selection.nodes.numpy()] = True
        predicted = _MissingCounter((pred.nodes, pred.root), self._cached).count(mask)
        a, p = self._miss_sums
        self._miss_sums = (_MISS_DECAY * a + float(loaded), _MISS_DECAY * p + float(predicted))

    def _observe_child_acceptance(self, parents: np.ndarray, probs: np.ndarray, accepted: np.ndarray,
                                  depths: np.ndarray) -> None:
        """Update the look-ahead's ``a``: was each observed parent's most confident child accepted?"""
        state = self.acceptance
        deep = depths >= 1  # depth-1 outcomes too: a chain that stops at level 1 must still learn
        for parent in np.unique(parents[deep]):
            among = np.nonzero(deep & (parents == parent))[0]
            best = among[np.argmax(probs[among])]
            state.child_accepted = _CHILD_DECAY * state.child_accepted + float(accepted[best])
            state.child_trials = _CHILD_DECAY * state.child_trials + 1.0

    def _observe_cost(self, tree: DraftTree, selection: Selection, record: Any) -> None:
        """Refit the verification cost on (cycle - draft - select) seconds; track drafting per level."""
        seconds = float(getattr(record, "cycle_seconds", math.nan))
        draft_s = float(getattr(record, "draft_seconds", 0.0) or 0.0)
        select_s = float(getattr(record, "select_seconds", 0.0) or 0.0)
        committed = int(getattr(record, "tokens_committed", 1))
        if not math.isfinite(seconds) or seconds <= 0:
            return
        a = self.ema
        state = self.drafting
        if tree.num_levels > 0:
            # a level costs its draft step and the search after it
            per_level = (draft_s + select_s) / tree.num_levels
            state.level_seconds = (
                per_level if state.level_seconds is None else (1 - a) * state.level_seconds + a * per_level
            )
            state.drafted_sums = _decayed_add(state.drafted_sums, committed, seconds, a)
            self._end_exploration()
        elif tree.num_levels == 0:
            state.plain_sums = _decayed_add(state.plain_sums, committed, seconds, a)
            self._end_exploration()
        loaded = getattr(record, "experts_loaded", None)
        if not self.kwargs.get("online_cost", True):
            self.cost.predicted.append(float(selection.predicted_time))
            self.cost.measured.append(seconds)
            return
        self.cost.add(
            tokens=int(getattr(record, "nodes_verified", len(selection))) + 1,
            misses=0 if loaded is None else loaded,
            seconds=max(seconds - draft_s - select_s, 1e-9),
            predicted=None,
        )
        # forecast vs measurement of the whole cycle, for the MAPE report
        if math.isfinite(selection.predicted_time):
            self.cost.predicted.append(float(selection.predicted_time))
            self.cost.measured.append(seconds)

    def report(self) -> dict[str, Any]:
        """Online figures: cost model, its MAPE, acceptance data, predictor quality."""
        out: dict[str, Any] = {"acceptance_observations": self.calibrator.observations}
        if self.cost is not None:
            out["cost_model"] = self.cost.model
            out["cycle_time_mape_percent"] = self.cost.mape
        out["expert_union"] = {name: q.as_dict() for name, q in self.quality.items()}
        return out


def _ancestor_closed(parents: np.ndarray, nodes: np.ndarray) -> bool:
    """Whether every node's parent is the root or in ``nodes``."""
    inside = np.zeros(parents.size + 1, dtype=bool)
    inside[nodes] = True
    par = parents[nodes]
    return bool(np.all((par < 0) | inside[np.maximum(par, 0)]))


def _closed_part(parents: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Mask over ``nodes`` (sorted, parents first) of those whose ancestors are all in ``nodes``."""
    ok = np.zeros(parents.size, dtype=bool)
    inside = np.zeros(parents.size, dtype=bool)
    inside[nodes] = True
    for v in np.sort(nodes):
        par = parents[v]
        ok[v] = par < 0 or (inside[par] and ok[par])
    return ok[nodes]


def _save_instance(**arrays: Any) -> str:
    import os
    import tempfile

    fd, path = tempfile.mkstemp(prefix="specfit_unclosed_", suffix=".npz")
    os.close(fd)
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items() if v is not None})
    return path


def _root_missing(root: np.ndarray, cached: np.ndarray | None) -> int:
    """Distinct (layer, expert) pairs of ``root`` ``[L, k]`` (-1 = none) not resident in ``cached`` ``[L, E]``."""
    layer = np.broadcast_to(np.arange(root.shape[0])[:, None], root.shape)
    valid = root >= 0
    pairs = np.unique(np.stack([layer[valid], root[valid]]), axis=1)
    if cached is None:
        return int(pairs.shape[1])
    return int((~cached[pairs[0], pairs[1]]).sum())


def _decayed_add(sums: tuple[float, float] | None, tokens: float, seconds: float, a: float) -> tuple[float, float]:
    """(tokens, seconds) sums where each older cycle's weight shrinks by ``1 - a``."""
    if sums is None:
        return float(tokens), float(seconds)
    return (1 - a) * sums[0] + tokens, (1 - a) * sums[1] + seconds


class _MissingCounter:
    """Predicted missing experts of node sets (the search's expert term, for the look-ahead)."""

    def __init__(self, experts: tuple[np.ndarray, np.ndarray], cached: np.ndarray | None) -> None:
        nodes, root = experts
        num_layers = root.shape[0]
        num_experts = cached.shape[1] if cached is not None else int(max(nodes.max(initial=0), root.max(initial=0))) + 1
        off = (np.arange(num_layers) * num_experts)[:, None]
        self.ids = np.where(nodes >= 0, nodes + off[None], -1).reshape(nodes.shape[0], -1)
        resident = np.zeros(num_layers * num_experts, dtype=bool) if cached is None else cached.reshape(-1)
        root_ids = np.unique((root + off)[root >= 0])
        self.root_missing = int((~resident[root_ids]).sum())
        costly = ~resident
        costly[root_ids] = False  # the root pays for these anyway
        self.costly = costly

    def count(self, mask: np.ndarray) -> int:
        """Misses of verifying the root and the nodes in ``mask``."""
        ids = self.ids[mask].reshape(-1)
        ids = np.unique(ids[ids >= 0])
        return self.root_missing + int(self.costly[ids].sum())


def _with_path(tree: DraftTree, path: np.ndarray) -> DraftTree:
    """A shallow copy of ``tree`` whose ``path_probs`` are ``path`` (for ranking)."""
    return DraftTree(root_token=tree.root_token, tokens=tree.tokens, parents=tree.parents, depths=tree.depths,
                     draft_probs=tree.draft_probs, path_probs=torch.from_numpy(np.asarray(path, dtype=np.float64)),
                     num_levels=tree.num_levels)


@dataclass
class OracleProbe:
    """What the target does on a whole draft tree, measured without committing anything.

    Attributes:
        target_tokens: ``[1 + N]`` the target's (greedy) next token after the root
            (index 0) and after each node ``v`` (index ``1 + v``).
        routing: ``[1 + N, L, k]`` experts the target routes the root and each node to at
            each MoE layer (``runtime.moe_layers`` order), or ``None`` without a runtime.
    """

    target_tokens: torch.Tensor
    routing: torch.Tensor | np.ndarray | None = None


@register_policy("oracle")
class OraclePolicy(SpecFitPolicy):
    """Upper bound on selection (benchmarks only): true acceptance and true experts.

    Drafts ``max_depth`` levels, then asks the loop for an :class:`OracleProbe` of the full
    tree through ``ctx.extras["oracle_probe"]`` (a callable ``tree -> OracleProbe``) and
    runs the exact search with ``P(v)`` = 1 if the target's greedy choices agree with the
    whole path to ``v`` else 0, and the true experts.  What the loop must provide: the
    probe runs the target on ``[root] + all nodes`` with the tree mask on a throw-away copy
    of the cache, and must leave the expert cache and its statistics as they were (or the
    oracle's own verification would be cheaper than it should); ``routing`` is the
    runtime's ``last_routing`` of that forward.  Without a probe this policy raises.
    Greedy decoding only (under sampling "accepted" is random).
    """

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        if self.cost is None:
            self.reset(ctx)
        if tree.num_levels < self.max_depth:
            return Selection(nodes=_EMPTY, stop=False)  # the oracle looks at the full tree
        probe_fn = ctx.extras.get("oracle_probe")
        if probe_fn is None:
            raise ValueError(
                "the 'oracle' policy needs ctx.extras['oracle_probe'] (tree -> OracleProbe) from the generation loop"
            )
        probe: OracleProbe = probe_fn(tree)
        target = torch.as_tensor(probe.target_tokens).reshape(-1).cpu().numpy()
        if target.size != len(tree) + 1:
            raise ValueError(f"oracle probe has {target.size} rows for a tree of {len(tree)} nodes + root")
        parents = tree.parents.numpy()
        tokens = tree.tokens.numpy()
        agree = tokens == target[parents + 1]  # parent -1 (root) -> row 0
        path = agree.astype(np.float64)
        path = path_acceptance(tree, path)
        experts = None
        if probe.routing is not None and self.runtime is not None:
            routing = np.asarray(torch.as_tensor(probe.routing).cpu().numpy(), dtype=np.int64)
            experts = (routing[1:], routing[0])
        sel = select_subtree(
            parents, path,
            None if experts is None else experts[0],
            None if experts is None else experts[1],
            None if experts is None else cached_mask(self.runtime),
            self.cost_model,
        )
        sel.stop = True
        self._last = sel
        return sel
