"""The drafting plan: draft another level?  Which nodes, how many children each?

The search only sees drafted nodes, and the next level's value shows only after it is
drafted and paid for, so the plan looks ahead.  A node ``v`` of the newest level is
worth expanding when it is in the current optimum ``S*`` (its children may pay too), or
when a chain of ``h`` children below it (``h`` up to the remaining depth) with path
acceptance ``P(v) a^j`` (``a``: the learnt acceptance of a node's most confident child),
each adding as many predicted misses as ``v`` adds to the rest of the set and costing
``h`` more draft levels, makes ``S* + ancestors(v) + chain`` beat ``S*``'s predicted
throughput (it matters where ``v``'s ancestors are not in the optimum yet: a chain below
can amortise them).  Drafting stops when no node is worth expanding.

Each expanded node gets ``1 + #{r >= 1 : P(v) a_r > P_min}`` children, ``a_r`` the learnt
acceptance of a rank-``r`` child and ``P_min = t_token / T(root alone)`` the path
acceptance below which a node can never be in the optimum
(:func:`~.search.useful_nodes`): a child that could never be verified is not drafted.
So a draft that is right with its first choice grows a chain, and a level costs what
its few useful nodes cost.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..tree import DraftTree, Selection
from .acceptance import AcceptanceModel
from .forecast import MissingCounter
from .search import CostModel

__all__ = ["LookAhead", "useful_children"]


def useful_children(parent_path: float, rank_acceptance: np.ndarray, threshold: float, limit: int) -> int:
    """Children worth drafting below a node of path acceptance ``parent_path`` (at least 1, at most ``limit``)."""
    useful = parent_path * rank_acceptance[1:limit] > threshold
    return 1 + int(np.count_nonzero(useful))


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

    def plan(self, tree: DraftTree, sel: Selection, path: np.ndarray, experts: tuple[np.ndarray, np.ndarray] | None,
             cached: np.ndarray | None, acceptance: AcceptanceModel, cycle_model: Callable[[int, int], CostModel],
             threshold: float) -> None:
        """Set ``sel.stop``, ``sel.expand`` and ``sel.children`` for the tree drafted so far (``sel``: its optimum)."""
        level = tree.num_levels
        sel.stop = True
        if level >= self.max_depth:
            return
        newest = np.nonzero(tree.depths.numpy() == level)[0]
        width = self.frontier_width or newest.size
        frontier = newest[np.argsort(-tree.path_probs.numpy()[newest], kind="stable")[:width]]
        chosen = np.zeros(len(tree), dtype=bool)
        chosen[sel.nodes.numpy()] = True
        ranks = acceptance.rank_acceptance()
        expand = frontier[chosen[frontier]]  # the newest level already pays: its children may too
        if self.enabled:
            missing = MissingCounter(experts, cached) if experts is not None else None
            gains = np.cumsum(ranks[0] ** np.arange(1, self.max_depth - level + 1))
            others = [int(v) for v in frontier if not chosen[v]]
            for v in others:
                children = useful_children(float(path[v]), ranks, threshold, width)
                if self._chain_pays(tree, v, chosen, path, missing, gains, sel.throughput,
                                    lambda h: cycle_model(level + h, len(tree) + h * children)):
                    expand = np.append(expand, v)
        if expand.size == 0:
            return
        sel.stop = False
        sel.expand = torch.from_numpy(np.sort(expand).astype(np.int64))
        sel.children = useful_children(float(path[expand].max()), ranks, threshold, width)

    def plan_chain(self, tree: DraftTree, sel: Selection, path: np.ndarray, missing: np.ndarray | None,
                   acceptance: AcceptanceModel, cycle_model: Callable[[int, int], CostModel], threshold: float) -> None:
        """:meth:`plan` for a chain (one node per level), from its prefix misses ``missing`` (``[1 + N]`` or None).

        The frontier is the last node ``v``; with all its ancestors the chain is the whole
        tree, so the look-ahead's set is the tree and ``v`` adds ``missing[N] - missing[N-1]``.
        """
        level, n = tree.num_levels, len(tree)
        sel.stop = True
        if level >= self.max_depth:
            return
        v = n - 1
        width = self.frontier_width or 1
        ranks = acceptance.rank_acceptance()
        pays = len(sel) == n  # the optimum holds the newest node: its children may pay too
        if not pays and self.enabled:
            gains = np.cumsum(ranks[0] ** np.arange(1, self.max_depth - level + 1))
            children = useful_children(float(path[v]), ranks, threshold, width)
            miss = child_misses = 0
            if missing is not None:
                miss, child_misses = int(missing[n]), int(missing[n] - missing[n - 1])
            pays = _extension_pays(1.0 + float(path.sum()), n, float(path[v]), miss, child_misses, gains,
                                   sel.throughput, lambda h: cycle_model(level + h, n + h * children))
        if not pays:
            return
        sel.stop = False
        sel.expand = torch.tensor([v], dtype=torch.long)
        sel.children = useful_children(float(path[v]), ranks, threshold, width)

    @staticmethod
    def _chain_pays(tree: DraftTree, v: int, chosen: np.ndarray, path: np.ndarray, missing: MissingCounter | None,
                    gains: np.ndarray, base: float, cost_of: Callable[[int], CostModel]) -> bool:
        """Whether a chain of some length below ``v`` (with its ancestors) beats throughput ``base``."""
        mask = chosen.copy()
        mask[tree.ancestors(v)] = True
        miss = child_misses = 0
        if missing is not None:
            # a child is assumed to add what v adds to the rest of the set
            miss = missing.count(mask)
            without = mask.copy()
            without[v] = False
            child_misses = miss - missing.count(without)
        return _extension_pays(1.0 + float(path[mask].sum()), int(mask.sum()), float(path[v]), miss, child_misses,
                               gains, base, cost_of)


def _extension_pays(expected: float, size: int, p_v: float, misses: int, child_misses: int, gains: np.ndarray,
                    base: float, cost_of: Callable[[int], CostModel]) -> bool:
    """Whether a set of ``size`` nodes (``expected`` tokens, ``misses``), extended by a chain of ``h`` children
    below its node of path acceptance ``p_v`` (``gains[h-1]`` accepted per unit of ``p_v``, ``child_misses``
    each, priced by ``cost_of(h)``), beats throughput ``base`` for some ``h``."""
    for h in range(1, gains.size + 1):
        if (expected + p_v * gains[h - 1]) / cost_of(h).predict(size + h + 1, misses + h * child_misses) > base:
            return True
    return False
