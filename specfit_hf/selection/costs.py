"""What a cycle costs: the verification cost model, drafting per level, and the miss scale.

:class:`CycleCostTracker` keeps, online, the three measured terms the search's
``T(S)`` is built from:

* the verification cost ``t0 + t_token * tokens + t_expert * misses``, refitted on the
  measured (cycle - draft - select) seconds and *measured* expert loads of each cycle
  (:class:`~specfit_hf.selection.calibration.OnlineCostModel`);
* draft + search seconds per draft level (EMA), added to ``t0`` for the levels drafted;
* the miss scale: measured expert loads per *predicted* miss of the verified sets.  The
  search counts predicted misses, and a predictor with imperfect recall predicts fewer
  distinct experts than a large block really routes to, so big selections would look
  cheaper than they are; the search's ``t_expert`` is multiplied by this ratio.
"""

from __future__ import annotations

import math

import numpy as np

from ..offload.view import ExpertCacheView
from ..tree import CycleRecord, DraftTree, Selection
from .calibration import OnlineCostModel
from .gate import DraftingMeasurements
from .search import CostModel

__all__ = ["CycleCostTracker", "default_cost_model"]

_MISS_DECAY = 0.9  # per cycle: the loads-per-predicted-miss ratio follows the cache state
_MISS_PRIOR = 4.0  # pseudo-misses on both sides: the ratio starts at 1


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
        drafting: measurements shared with the drafting gate (``level_seconds`` lives there).
        ema: weight of the newest cycle in ``level_seconds``.
        online: refit the verification model from measured cycles.
    """

    def __init__(self, initial: CostModel, drafting: DraftingMeasurements, ema: float, online: bool) -> None:
        self.fit = OnlineCostModel(initial)
        self.drafting = drafting
        self.ema = ema
        self.online = online
        self._miss_sums = (0.0, 0.0)  # decayed (measured loads, predicted misses) of verified sets

    @property
    def model(self) -> CostModel:
        """The current verification cost model (drafting excluded)."""
        return self.fit.model

    @property
    def level_seconds(self) -> float | None:
        """Measured draft + search seconds per draft level (EMA)."""
        return self.drafting.level_seconds

    @property
    def miss_scale(self) -> float:
        """Measured expert loads per predicted miss of the verified sets (1 before data)."""
        loaded, predicted = self._miss_sums
        return float(np.clip((loaded + _MISS_PRIOR) / (predicted + _MISS_PRIOR), 0.25, 4.0))

    def cycle_model(self, levels: int) -> CostModel:
        """The cost model of a whole cycle that drafted ``levels`` levels (drafting is in ``t0``)."""
        c = self.model
        return CostModel(c.t0 + (self.level_seconds or 0.0) * levels, c.t_token, c.t_expert * self.miss_scale)

    def observe(self, tree: DraftTree, selection: Selection, record: CycleRecord,
                predicted_misses: int | None) -> None:
        """Learn from a measured cycle; ``predicted_misses``: the forecast's misses of root + selection."""
        seconds, draft_s, select_s = record.cycle_seconds, record.draft_seconds, record.select_seconds
        if predicted_misses is not None and record.experts_loaded is not None:
            loaded, predicted = self._miss_sums
            self._miss_sums = (_MISS_DECAY * loaded + record.experts_loaded,
                               _MISS_DECAY * predicted + predicted_misses)
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if tree.num_levels > 0:
            per_level = (draft_s + select_s) / tree.num_levels  # a level costs its draft step and the search after it
            previous = self.drafting.level_seconds
            self.drafting.level_seconds = per_level if previous is None else (1 - self.ema) * previous + self.ema * per_level
        if self.online:
            self.fit.add(tokens=record.nodes_verified + 1,
                         misses=0 if record.experts_loaded is None else record.experts_loaded,
                         seconds=max(seconds - draft_s - select_s, 1e-9))
        # forecast vs measurement of the whole cycle, for the MAPE report
        if not self.online or math.isfinite(selection.predicted_time):
            self.fit.predicted.append(float(selection.predicted_time))
            self.fit.measured.append(seconds)

    @property
    def mape(self) -> float:
        """MAPE (%) of the whole-cycle forecasts against measured cycle seconds."""
        return self.fit.mape
