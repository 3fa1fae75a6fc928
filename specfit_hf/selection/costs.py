"""What a cycle costs: the verification cost model, drafting per level, and expected loads.

:class:`CycleCostTracker` keeps, online, the three measured terms the search's
``T(S)`` is built from:

* the verification cost ``t0 + t_token * tokens + t_expert * misses``, refitted on the
  measured (cycle - draft - select) seconds and *measured* expert loads of each cycle
  (:class:`~specfit_hf.selection.calibration.OnlineCostModel`);
* the seconds of drafting (draft steps + the search after each level): once per drafting
  cycle (its first level reads the committed tokens), per level and per drafted node
  (:class:`~.gate.DraftCost`), added to ``t0`` for what the tree holds;
* expected expert loads, in two parts measured apart.  The *root's* loads (a plain
  step's) vary by routing luck (at half cache a tiny root loads 0 to 5 experts).  Where the
  expert forecast guessed the root's experts (a cycle that has drafted: the draft's heads read
  the root's draft state), they are ``a_r + b_r * guess``, fitted on the cycles that had a
  guess, with ``guess`` the root's predicted misses (the guess as it is until a call's first
  guessed cycles have fitted it); without a guess (a plain step before drafting) they are a
  running mean of what roots really loaded.  (The running mean is blind
  to the cycle's routing: 4090 twin, GSM8K at a quarter cache, host time frozen, 16 prompts,
  the tree's roots: mean error 3.2 loads against 1.0 for the fit on the heads' guess, which
  tracks the real loads with a correlation of 0.96.)  The loads the *draft nodes* add --
  measured as a verified block's loads minus what its root alone needed -- are fitted as
  ``b`` per miss the expert forecast predicted the nodes add (the search's coverage term)
  plus ``g`` per node and expected root load: the experts a node needs that the forecast did
  not see are lacking about as often as the root's (where the root's experts are resident, so
  are most of the nodes'; the fit's error on the tree's verified blocks, same runs: 1.50 ->
  1.26 loads on GSM8K at a quarter cache, 1.87 -> 1.71 on CNN/DM at a quarter, 0.61 -> 0.55
  at half).
"""

from __future__ import annotations

import math

import numpy as np

from ..offload.view import ExpertCacheView
from ..tree import CycleRecord, DraftTree, Selection
from .calibration import DecayedRidge, OnlineCostModel, mape
from .gate import DraftCost, DraftingMeasurements, current_novelty
from .search import CostModel

__all__ = ["CycleCostTracker", "default_cost_model", "node_novelty"]

_LOAD_DECAY = 0.9  # per cycle: expected loads follow the cache state
_NODE_RIDGE = 1.0  # pseudo-observations pulling (g, b) toward (0, 1): the forecast as it is before data
_DRAFT_DECAY = 0.9  # per drafting cycle: the drafting cost fit follows the host's load
_ROOT_DECAY = 0.95  # per guessed cycle: the root-loads fit on the forecast's guess
_ROOT_RIDGE = 1.0  # pseudo-observations pulling (a_r, b_r) toward (0, 1): the guess as it is
_ROOT_MIN_WEIGHT = 3.0  # guessed cycles (decayed) before the fit replaces the running mean


def node_novelty(record: CycleRecord) -> list[float] | None:
    """Per verified node of ``record``, the distinct experts it was the first of its block to compute,
    in roots' worth (``None`` without the runtime's per-row counts)."""
    rows = record.row_experts
    if not rows or rows[0] <= 0:
        return None
    return [r / rows[0] for r in rows[1:]]


def default_cost_model(experts: ExpertCacheView | None = None) -> CostModel:
    """A starting point before calibration / online refinement.

    ``t_expert`` comes from the runtime's emulated link when it has one (0 without offloading).
    """
    t_expert = 0.0
    if experts is not None:
        link_seconds = experts.transfer_seconds()
        t_expert = 1e-4 if link_seconds is None or not experts.expert_bytes else link_seconds
    return CostModel(t0=5e-3, t_token=5e-4, t_expert=t_expert)


class CycleCostTracker:
    """Online cost of a cycle (see the module docstring).

    Args:
        initial: the starting verification cost model.
        drafting: measurements shared with the drafting gate (the drafting cost lives there).
        online: refit the verification model from measured cycles.
    """

    def __init__(self, initial: CostModel, drafting: DraftingMeasurements, online: bool) -> None:
        if drafting.verify is None:  # shared: later calls on the same runtime and draft start from this fit
            drafting.verify = OnlineCostModel(initial)
        self.fit: OnlineCostModel = drafting.verify
        self.drafting = drafting
        self.predicted: list[float] = []  # this call's whole-cycle forecasts and measurements (MAPE)
        self.measured: list[float] = []
        self.online = online
        self._root_sums = (0.0, 0.0)  # decayed (root loads, cycles)
        # each fit starts at (0, 1): the forecast's guess as it is
        self._node_fit = DecayedRidge(ridge=_NODE_RIDGE)  # extra loads ~ g * nodes * root + b * added
        self._root_fit = DecayedRidge(ridge=_ROOT_RIDGE)  # root loads ~ a_r + b_r * guess
        self._context_fit = DecayedRidge(ridge=_ROOT_RIDGE)  # loads ~ a_c + b_c * context guess
        self._models: dict[tuple[int, int, int | None], CostModel] = {}

    @property
    def model(self) -> CostModel:
        """The current verification cost model (drafting excluded)."""
        return self.fit.model

    @property
    def t_expert(self) -> float:
        """Seconds per expert load as last fitted (reading it does not refit)."""
        return self.fit.last_fit.t_expert

    @property
    def draft(self) -> DraftCost:
        """The fitted cost of drafting (shared with later calls on the same runtime and draft)."""
        return self.drafting.draft

    @property
    def root_loads(self) -> float:
        """Mean experts a root alone loads (0 before data)."""
        loads, cycles = self._root_sums
        return loads / cycles if cycles else 0.0

    def expected_root_loads(self, guess: int | None = None) -> float:
        """Experts the root is expected to load: ``a_r + b_r * guess`` with the forecast's
        ``guess`` (the root's predicted misses), the guess itself before the call's guessed cycles
        have fitted it, the running mean without one.

        Before the fit, the guess is better than the mean: the running mean comes from the
        call's first cycles, whose cold cache loads far more than later roots do, and it is
        blind to the root's routing (Mixtral 4090 twin, GSM8K at half cache, host time frozen,
        16 prompts: 30 % of the chains' root prices were that mean; over the chain cycles the
        root's expected loads missed what it loaded by 0.98 on average, by 0.43 with the guess
        in the mean's place).
        """
        if guess is None:
            return self.root_loads
        if self._root_fit.weight < _ROOT_MIN_WEIGHT:
            return float(guess)
        a, b = self._root_fit.fit()
        return float(a + b * guess)

    def context_loads(self, guess: int | np.ndarray) -> float | np.ndarray:
        """Experts a plain step or a lookup chain is expected to load when the routing of the text it
        repeats (:meth:`~.forecast.ExpertForecast.lookup_misses`) says ``guess`` of them are not resident
        (a count, or an array of them): ``a_c + b_c * guess``, fitted on such cycles (the guess itself
        before any)."""
        a, b = self._context_fit.fit()
        out = a + b * np.asarray(guess, dtype=np.float64)
        return float(out) if out.ndim == 0 else out

    @property
    def node_loads(self) -> tuple[float, float]:
        """``(g, b)``: expected extra loads per verified node and expected root load, and per predicted added miss."""
        return self._node_fit.fit()

    def expected_loads(self, nodes: int, root_predicted: int | None, missing: int) -> float:
        """Expected loads of verifying the root and ``nodes`` nodes whose union the forecast says misses
        ``missing`` experts (the root's ``root_predicted`` among them): what :meth:`cycle_model` charges."""
        root, per_node, per_miss, root_missing = self.loads_terms(root_predicted)
        return root + per_node * nodes + per_miss * (missing - root_missing)

    def loads_terms(self, root_predicted: int | None) -> tuple[float, float, float, int]:
        """``(r, g r, b, root_predicted or 0)``: :meth:`expected_loads` is ``r + g r nodes + b (missing - that)``
        (for a caller pricing many prefixes at once; the same operations, so the same bits)."""
        g, b = self.node_loads
        root = self.expected_root_loads(root_predicted)
        return root, g * root, b, root_predicted or 0

    def cycle_model(self, levels: int, nodes: int, root_predicted: int | None = None) -> CostModel:
        """The cost model of a whole cycle that drafted ``levels`` levels of ``nodes`` nodes (drafting is in ``t0``).

        ``T(S) = t0 + drafting + t_expert * (r + g r |S| + b * added(S)) + t_token * (|S| + 1)``,
        ``r`` the root's expected loads, ``added(S)``: the misses predicted for ``S`` beyond the root's, written
        for a search that counts the root's ``root_predicted`` predicted misses in every set
        (taken back out of ``t0``, which stays > 0 so the model stays valid when ``t_token`` fits to 0).
        ``root_predicted``: the forecast's guess of the root's misses (:meth:`expected_root_loads`),
        ``None`` when it has none.
        """
        key = (levels, nodes, root_predicted)
        model = self._models.get(key)
        if model is None:  # a select asks for the same few models many times; they change only in observe
            c = self.model
            g, b = self.node_loads
            root = self.expected_root_loads(root_predicted)
            g *= root  # the experts a node needs and the forecast missed are lacking as often as the root's are
            t0 = c.t0 + self.draft.predict(levels, nodes) + c.t_expert * (root - g - b * (root_predicted or 0))
            # a node computes the experts it adds: a chain's share per node at this depth
            novel = current_novelty(self.drafting)
            depth = min(max(levels, 1), novel.size - 1)
            per_node = c.t_novel * float(novel[depth]) / depth
            model = CostModel(max(t0, 1e-9), c.t_token + c.t_expert * g + per_node, c.t_expert * b)
            self._models[key] = model
        return model

    def observe(self, tree: DraftTree, selection: Selection, record: CycleRecord,
                predicted_added: int | None = None, root_loads: int | None = None,
                root_guess: int | None = None, context_guess: int | None = None) -> None:
        """Learn from a measured cycle.

        ``predicted_added``: the misses the forecast predicted the verified nodes add to the
        root's; ``root_loads``: the loads the root alone needed (a plain cycle: all of them; ``None``
        when unknown: a drafting cycle's loads then teach nothing about loads); ``root_guess``: the
        root's predicted misses this cycle was priced with (``None``: no guess); ``context_guess``:
        a plain step's or lookup chain's misses as the repeated text's routing predicted them
        (:meth:`context_loads`).
        """
        self._models.clear()
        seconds, draft_s, select_s = record.cycle_seconds, record.draft_seconds, record.select_seconds
        loads = record.experts_loaded
        if loads is not None and context_guess is not None:
            self._context_fit.add(1.0, float(context_guess), float(loads), _ROOT_DECAY)
        if loads is not None and (root_loads is not None or not record.nodes_verified):
            # a drafting cycle whose root's share is unknown teaches nothing about loads
            root = loads if not record.nodes_verified else min(root_loads, loads)
            expected_root = self.expected_root_loads(root_guess)  # what this cycle was priced with
            total, cycles = self._root_sums
            self._root_sums = (_LOAD_DECAY * total + root, _LOAD_DECAY * cycles + 1.0)
            if root_guess is not None:
                self._root_fit.add(1.0, float(root_guess), float(root), _ROOT_DECAY)
            if record.nodes_verified and predicted_added is not None and root_loads is not None:
                self._node_fit.add(float(record.nodes_verified) * expected_root, float(predicted_added),
                                   float(loads - root), _LOAD_DECAY)
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if tree.num_levels > 0 and tree.source == "draft":  # a level costs its draft step and the search after it
            self.draft.add(tree.num_levels, len(tree), draft_s + select_s, _DRAFT_DECAY)
        if self.online:
            self.fit.add(tokens=record.nodes_verified + 1,
                         misses=0 if record.experts_loaded is None else record.experts_loaded,
                         seconds=max(seconds - draft_s - select_s, 1e-9), novel=sum(node_novelty(record) or ()))
        # forecast vs measurement of the whole cycle, for the MAPE report
        if not self.online or math.isfinite(selection.predicted_time):
            self.predicted.append(float(selection.predicted_time))
            self.measured.append(seconds)

    @property
    def mape(self) -> float:
        """MAPE (%) of the whole-cycle forecasts against measured cycle seconds."""
        return mape(self.predicted, self.measured)
