"""The stop rule: could drafting more levels beat the current optimum's throughput?

The search only sees drafted nodes, and the next level's value shows only after it is
drafted and paid for.  Drafting continues whenever the optimum holds a node of the
newest level (its children may pay too).  Otherwise a look-ahead: under each frontier
node ``v`` (the newest level's nodes the drafter expands next) imagine a chain of ``h``
children (``h`` up to the remaining depth) with path acceptance ``P(v) a^j`` (``a``: the
learnt acceptance of a node's most confident child), each adding as many predicted
misses as ``v`` adds to the rest of the set, and costing ``h`` more draft levels.
Drafting continues when any such set ``S* + ancestors(v) + chain`` has a higher
predicted throughput than ``S*``: it matters where a frontier node's ancestors are not in
the optimum yet, since a chain below can amortise them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..tree import DraftTree, Selection
from .forecast import MissingCounter
from .search import CostModel

__all__ = ["LookAhead"]


class LookAhead:
    """The stop rule (see the module docstring).

    Args:
        max_depth: draft levels at most.
        frontier_width: frontier nodes considered (the drafter's branching factor).
        enabled: ``False`` stops as soon as the optimum holds no node of the newest level.
    """

    def __init__(self, max_depth: int, frontier_width: int | None, enabled: bool) -> None:
        self.max_depth = max_depth
        self.frontier_width = frontier_width
        self.enabled = enabled

    def keep_drafting(self, tree: DraftTree, sel: Selection, path: np.ndarray,
                      experts: tuple[np.ndarray, np.ndarray] | None, cached: np.ndarray | None,
                      child_acceptance: float, cycle_model: Callable[[int], CostModel]) -> bool:
        """Whether to draft another level after ``sel`` (the optimum of the tree drafted so far)."""
        level = tree.num_levels
        if level >= self.max_depth:
            return False
        newest = np.nonzero(tree.depths.numpy() == level)[0]
        if bool(np.isin(sel.nodes.numpy(), newest).any()):
            return True  # the newest level already pays: its children may too
        if not self.enabled:
            return False
        width = self.frontier_width or newest.size
        frontier = newest[np.argsort(-tree.path_probs.numpy()[newest], kind="stable")[:width]]
        chosen = np.zeros(len(tree), dtype=bool)
        chosen[sel.nodes.numpy()] = True
        missing = MissingCounter(experts, cached) if experts is not None else None
        remaining = self.max_depth - level
        gains = np.cumsum(child_acceptance ** np.arange(1, remaining + 1))
        costs = [cycle_model(level + h) for h in range(1, remaining + 1)]
        return any(self._chain_pays(tree, int(v), chosen, path, missing, gains, costs, sel.throughput)
                   for v in frontier)

    @staticmethod
    def _chain_pays(tree: DraftTree, v: int, chosen: np.ndarray, path: np.ndarray, missing: MissingCounter | None,
                    gains: np.ndarray, costs: list[CostModel], base: float) -> bool:
        """Whether a chain of some length below ``v`` (with its ancestors) beats throughput ``base``."""
        mask = chosen.copy()
        mask[tree.ancestors(v)] = True
        e = 1.0 + float(path[mask].sum())
        size = int(mask.sum())
        miss = child_misses = 0
        if missing is not None:
            # a child is assumed to add what v adds to the rest of the set
            miss = missing.count(mask)
            without = mask.copy()
            without[v] = False
            child_misses = miss - missing.count(without)
        for h, cost in enumerate(costs, start=1):
            if (e + path[v] * gains[h - 1]) / cost.predict(size + h + 1, miss + h * child_misses) > base:
                return True
        return False
