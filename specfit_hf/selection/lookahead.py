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
            remaining = self.max_depth - level
            gains = np.cumsum(ranks[0] ** np.arange(1, remaining + 1))
            others = [int(v) for v in frontier if not chosen[v]]
            for v in others:
                children = useful_children(float(path[v]), ranks, threshold, width)
                costs = [cycle_model(level + h, len(tree) + h * children) for h in range(1, remaining + 1)]
                if self._chain_pays(tree, v, chosen, path, missing, gains, costs, sel.throughput):
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
            remaining = self.max_depth - level
            gains = np.cumsum(ranks[0] ** np.arange(1, remaining + 1))
            children = useful_children(float(path[v]), ranks, threshold, width)
            e = 1.0 + float(path.sum())
            miss = child_misses = 0
            if missing is not None:
                miss, child_misses = int(missing[n]), int(missing[n] - missing[n - 1])
            for h in range(1, remaining + 1):
                cost = cycle_model(level + h, n + h * children)
                if (e + path[v] * gains[h - 1]) / cost.predict(n + h + 1, miss + h * child_misses) > sel.throughput:
                    pays = True
                    break
        if not pays:
            return
        sel.stop = False
        sel.expand = torch.tensor([v], dtype=torch.long)
        sel.children = useful_children(float(path[v]), ranks, threshold, width)

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
