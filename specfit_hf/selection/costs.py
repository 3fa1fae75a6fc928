"""What a cycle costs: the verification cost model, drafting per level, and the miss scale.

:class:`CycleCostTracker` keeps, online, the three measured terms the search's
``T(S)`` is built from:

* the verification cost ``t0 + t_token * tokens + t_expert * misses``, refitted on the
  measured (cycle - draft - select) seconds and *measured* expert loads of each cycle
  (:class:`~specfit_hf.selection.calibration.OnlineCostModel`);
* the seconds of drafting (draft steps + the search after each level) per level and per
  drafted node (:class:`~.gate.DraftCost`), added to ``t0`` for what the tree holds;
* the miss scale: measured expert loads per *predicted* miss of the verified sets.  The
  search counts predicted misses, and a predictor with imperfect recall predicts fewer
  distinct experts than a large block really routes to, so big selections would look
  cheaper than they are; the search's ``t_expert`` is multiplied by this ratio.
"""

from __future__ import annotations

import math

from ..offload.view import ExpertCacheView
from ..tree import CycleRecord, DraftTree, Selection
from .calibration import OnlineCostModel, mape
from .gate import DraftCost, DraftingMeasurements
from .search import CostModel

__all__ = ["CycleCostTracker", "default_cost_model"]

_MISS_DECAY = 0.9  # per cycle: the loads-per-predicted-miss ratio follows the cache state
_MISS_PRIOR = 4.0  # pseudo-misses on both sides: the ratio starts at 1
_DRAFT_DECAY = 0.9  # per drafting cycle: the drafting cost fit follows the host's load


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
        self._miss_sums = (0.0, 0.0)  # decayed (measured loads, predicted misses) of verified sets
        self._models: dict[tuple[int, int], CostModel] = {}
        self._base: tuple[CostModel, float] | None = None  # (verification model, miss scale) the cache is built on

    @property
    def model(self) -> CostModel:
        """The current verification cost model (drafting excluded)."""
        return self.fit.model

    @property
    def draft(self) -> DraftCost:
        """The fitted cost of drafting (shared with later calls on the same runtime and draft)."""
        return self.drafting.draft

    @property
    def miss_scale(self) -> float:
        """Measured expert loads per predicted miss of the verified sets (1 before data)."""
        loaded, predicted = self._miss_sums
        return min(max((loaded + _MISS_PRIOR) / (predicted + _MISS_PRIOR), 0.25), 4.0)

    def cycle_model(self, levels: int, nodes: int) -> CostModel:
        """The cost model of a whole cycle that drafted ``levels`` levels of ``nodes`` nodes (drafting is in ``t0``)."""
        key = (levels, nodes)
        model = self._models.get(key)
        if model is None:  # a select asks for the same few models many times; they change only in observe
            if not self._models:
                self._base = (self.model, self.miss_scale)
            c, scale = self._base
            model = CostModel(c.t0 + self.draft.predict(levels, nodes), c.t_token, c.t_expert * scale)
            self._models[key] = model
        return model

    def observe(self, tree: DraftTree, selection: Selection, record: CycleRecord,
                predicted_misses: int | None) -> None:
        """Learn from a measured cycle; ``predicted_misses``: the forecast's misses of root + selection."""
        self._models.clear()
        seconds, draft_s, select_s = record.cycle_seconds, record.draft_seconds, record.select_seconds
        if predicted_misses is not None and record.experts_loaded is not None:
            loaded, predicted = self._miss_sums
            self._miss_sums = (_MISS_DECAY * loaded + record.experts_loaded,
                               _MISS_DECAY * predicted + predicted_misses)
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if tree.num_levels > 0:  # a level costs its draft step and the search after it
            self.draft.add(tree.num_levels, len(tree), draft_s + select_s, _DRAFT_DECAY)
        if self.online:
            self.fit.add(tokens=record.nodes_verified + 1,
                         misses=0 if record.experts_loaded is None else record.experts_loaded,
                         seconds=max(seconds - draft_s - select_s, 1e-9))
        # forecast vs measurement of the whole cycle, for the MAPE report
        if not self.online or math.isfinite(selection.predicted_time):
            self.predicted.append(float(selection.predicted_time))
            self.measured.append(seconds)

    @property
    def mape(self) -> float:
        """MAPE (%) of the whole-cycle forecasts against measured cycle seconds."""
        return mape(self.predicted, self.measured)
