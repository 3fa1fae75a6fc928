"""Exact throughput-optimal subtree search.

Given a draft tree, choose the ancestor-closed node set ``S`` maximizing

    throughput(S) = E(S) / T(S)
    E(S) = 1 + sum_{v in S} P(v)
    T(S) = t0 + t_token * (|S| + 1) + t_expert * |missing(S)|
    missing(S) = { (layer, expert) used by the root or a node of S, not cached }

(the root is always verified, so its missing experts are a constant part of ``T``).

Method (Dinkelbach on the ratio, each step a maximum-weight closure):

* For a fixed rate ``lam``, ``max_S E(S) - lam * T(S)`` is a maximum-weight closure
  problem: node ``v`` weighs ``P(v) - lam * t_token``; every missing (layer, expert)
  item weighs ``-lam * t_expert``; choosing a node forces its parent and its items.
  ``lam`` is the optimum iff that maximum is 0, and any set with a positive value
  has a strictly higher throughput than ``lam``; iterating from a good starting set
  converges in a few steps.
* The closure is a minimum s-t cut.  The graph is first shrunk without changing the
  optimum: an item also used by an ancestor is charged to the ancestor only (the
  ancestor is in every closure containing the node); items left with one user fold
  into that user's weight; items with the same user set merge; subtrees without a
  positive-weight node are dropped.
* Before any cut, a cheap certificate: split every shared item's cost over its users
  (any split is a relaxation whose optimum is a linear-time tree DP and bounds the
  closure from above).  If the bound cannot beat the incumbent, it is optimal; if the
  DP's set beats it, that is the next Dinkelbach step.  A few rounds move each item's
  cost toward the users the relaxation wants; most calls end here without a min cut.
* The cut itself is :func:`~specfit_hf.selection.mincut.min_cut` (OR-Tools' int64
  max-flow on capacities scaled to 2^52).  The returned figures are always evaluated
  exactly from the chosen set.

Without expert information (``node_experts is None``) the closure is a tree and a
linear-time dynamic program solves it exactly.  A tree with at most 2048 ancestor-closed
subsets (what a narrow draft grows: a chain of ``n`` nodes has ``n + 1``) is solved by
scoring every one of them at once.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..tree import Selection
from .mincut import min_cut

__all__ = [
    "CostModel", "select_subtree", "evaluate_subtree", "useful_nodes", "SearchProblem", "closed_part", "save_instance",
]

_MAX_DINKELBACH_STEPS = 100
_ENUMERATE_SETS = 2048  # up to this many closed subsets, scoring them all beats building a flow network
_SMALL_TREE = 12  # up to this many nodes, select_subtree scores the closed subsets without a SearchProblem
_SPLIT_ROUNDS = 4  # cost-split relaxations tried before a min cut


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of one cycle: ``t0 + t_token * tokens + t_expert * missing experts``.

    Attributes:
        t0: fixed seconds per cycle (launches, drafting, sampling, python).
        t_token: seconds per verified token (root included).
        t_expert: seconds per expert copied host -> device (a miss of the device cache).
        t_novel: seconds per root's worth of distinct experts the verified nodes compute beyond
            the root's (an MoE forward reads each distinct expert once: on a GPU most of a
            small block's cost).  The fit's term; the search sees it folded into ``t_token``.
    """

    t0: float
    t_token: float
    t_expert: float
    t_novel: float = 0.0

    def __post_init__(self) -> None:
        for name in ("t0", "t_token", "t_expert", "t_novel"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"CostModel.{name} must be finite and >= 0, got {value}")
        if self.t0 + self.t_token <= 0:
            raise ValueError("CostModel: t0 + t_token must be > 0 (a cycle verifying only the root takes time)")

    def predict(self, num_tokens: int | float, num_missing_experts: int | float) -> float:
        """Seconds for a cycle verifying ``num_tokens`` tokens (root included) with that many misses."""
        return self.t0 + self.t_token * num_tokens + self.t_expert * num_missing_experts


def _as_numpy(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


class SearchProblem:
    """One search instance, with the lambda-independent preprocessing done once.

    Construct it directly to evaluate many sets (``throughput``) or run the search
    (``solve``); :func:`select_subtree` is the one-call interface.
    """

    def __init__(
        self,
        parents: Any,
        path_prob: Any,
        node_experts: Any | None,
        root_experts: Any | None,
        cached: Any | None,
        cost: CostModel,
    ) -> None:
        if not isinstance(cost, CostModel):
            raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
        self.cost = cost
        parents = _as_numpy(parents, np.int64).reshape(-1)
        p = _as_numpy(path_prob, np.float64).reshape(-1)
        n = parents.size
        if p.size != n:
            raise ValueError(f"path_prob has {p.size} entries for {n} nodes")
        if n and (np.any(parents < -1) or np.any(parents >= np.arange(n))):
            raise ValueError("parents must satisfy -1 <= parents[v] < v (parents precede children)")
        if not np.all(np.isfinite(p)) or np.any(p < 0):
            raise ValueError("path_prob must be finite and >= 0")
        self.n = n
        self.parents = parents
        self.p = p
        # depth levels (parents precede children, so one pass suffices)
        depth = np.zeros(n, dtype=np.int64)
        for v in range(n):
            pv = parents[v]
            depth[v] = 1 if pv < 0 else depth[pv] + 1
        self.depth = depth
        self.levels = [np.nonzero(depth == d)[0] for d in range(1, int(depth.max(initial=0)) + 1)]
        # ancestor-or-self indicator: anc[v, u] = u is v or an ancestor of v
        anc = np.zeros((n, n), dtype=bool)
        anc[np.arange(n), np.arange(n)] = True
        for idx in self.levels[1:]:
            anc[idx] |= anc[parents[idx]]
        self.anc = anc
        self._build_items(node_experts, root_experts, cached)

    # ------------------------------------------------------------------ items
    def _checked_experts(self, node_experts: Any, root_experts: Any | None,
                         cached: Any | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(node experts ``[N, L, k]``, root experts ``[L, k']``, cached ``[L, E]``) as arrays, shapes checked."""
        n = self.n
        ne = _as_numpy(node_experts, np.int64)
        if ne.ndim != 3 or ne.shape[0] != n:
            raise ValueError(f"node_experts must be [N={n}, L, k], got shape {tuple(ne.shape)}")
        num_layers = ne.shape[1]
        if cached is None:
            raise ValueError("cached ([L, E] bool) is required with node_experts")
        cached = _as_numpy(cached, bool)
        if cached.ndim != 2 or cached.shape[0] != num_layers:
            raise ValueError(f"cached must be [L={num_layers}, E], got shape {tuple(cached.shape)}")
        num_experts = cached.shape[1]
        if root_experts is None:
            re = np.full((num_layers, 0), -1, dtype=np.int64)
        else:
            re = _as_numpy(root_experts, np.int64)
            if re.ndim != 2 or re.shape[0] != num_layers:
                raise ValueError(f"root_experts must be [L={num_layers}, k], got shape {tuple(re.shape)}")
        if ne.size and ne.max() >= num_experts or re.size and re.max() >= num_experts:
            raise ValueError(f"expert ids must be < E={num_experts} (negative ids mean 'none')")
        return ne, re, cached

    def _build_items(self, node_experts: Any | None, root_experts: Any | None, cached: Any | None) -> None:
        n = self.n
        self.root_missing = 0
        self.num_items = 0
        self.pair_node = np.zeros(0, dtype=np.int64)
        self.pair_item = np.zeros(0, dtype=np.int64)
        self.private = np.zeros(n, dtype=np.float64)
        self.group_cost_count = np.zeros(0, dtype=np.float64)
        self.member_node = np.zeros(0, dtype=np.int64)
        self.member_group = np.zeros(0, dtype=np.int64)
        if node_experts is None:
            if root_experts is not None:
                raise ValueError("root_experts given without node_experts")
            return
        ne, re, cached = self._checked_experts(node_experts, root_experts, cached)
        num_layers, num_experts = cached.shape
        layer_off = (np.arange(num_layers, dtype=np.int64) * num_experts)[:, None]
        # items the root pays anyway or the cache holds cost nothing
        costly = ~cached.reshape(-1)
        re_ids = (re + layer_off)[re >= 0]
        root_missing = np.zeros(num_layers * num_experts, dtype=bool)
        root_missing[re_ids] = costly[re_ids]
        self.root_missing = int(root_missing.sum())
        costly[re_ids] = False

        if n == 0:
            return
        flat = (ne + layer_off[None]).reshape(n, -1)
        if ne.size and ne.min() < 0:
            keep = (ne.reshape(n, -1) >= 0) & costly[np.maximum(flat, 0)]
        else:
            keep = costly[flat]
        ids = flat[keep]
        nodes = np.repeat(np.arange(n), keep.sum(axis=1))
        used = np.zeros(num_layers * num_experts, dtype=bool)
        used[ids] = True
        compact = np.cumsum(used) - 1
        num_items = int(used.sum())
        self.num_items = num_items
        if num_items == 0:
            return
        items = compact[ids]
        # duplicates in these pairs are harmless for evaluation (set membership only)
        self.pair_node, self.pair_item = nodes, items
        lin = nodes * num_items + items
        usage_flat = np.zeros(n * num_items, dtype=bool)
        usage_flat[lin] = True
        usage = usage_flat.reshape(n, num_items)
        if int(usage_flat.sum()) != lin.size:  # repeated predictions: keep one pair per (node, item)
            lin, first_pair = np.unique(lin, return_index=True)
            nodes, items = nodes[first_pair], items[first_pair]

        self._charge_topmost_users(usage, nodes, items, lin, num_items)

    def _charge_topmost_users(self, usage: np.ndarray, nodes: np.ndarray, items: np.ndarray, lin: np.ndarray,
                              num_items: int) -> None:
        """Private cost per node and groups of shared items (items with the same user set merge).

        ``usage`` ``[n, items]``: which node uses which costly item; ``(nodes, items)`` its
        pairs, one per (node, item); ``lin`` their flat indices in ``usage``.
        """
        n = self.n
        # charge each item to its topmost users only: an ancestor's use covers the node's
        covered = np.zeros_like(usage)
        for idx in self.levels[1:]:
            par = self.parents[idx]
            covered[idx] = covered[par] | usage[par]
        top_pair = ~covered.reshape(-1)[lin]
        tn, ti = nodes[top_pair], items[top_pair]
        users = np.bincount(ti, minlength=num_items)
        self.private = np.bincount(tn[users[ti] == 1], minlength=n).astype(np.float64)
        shared_pair = users[ti] >= 2
        if shared_pair.any():
            sn, si = tn[shared_pair], ti[shared_pair]
            # items with the same user set merge into one group: key = user-set bitmask
            # exact float keys: a sum of distinct powers of two below 2^52 per word
            words = -(-n // 52)
            shared = np.nonzero(users >= 2)[0]
            keys = np.empty((num_items, words), dtype=np.float64)
            for w in range(words):
                in_word = (sn // 52) == w
                keys[:, w] = np.bincount(si[in_word], weights=np.ldexp(1.0, sn[in_word] % 52), minlength=num_items)
            keys = keys[shared]
            if words == 1:
                _, first, inverse, counts = np.unique(
                    keys[:, 0], return_index=True, return_inverse=True, return_counts=True
                )
            else:
                order = np.lexsort(keys.T[::-1])
                sorted_keys = keys[order]
                starts = np.concatenate([[True], np.any(sorted_keys[1:] != sorted_keys[:-1], axis=1)])
                first = order[starts]
                inverse = np.empty(shared.size, dtype=np.int64)
                inverse[order] = np.cumsum(starts) - 1
                counts = np.bincount(inverse)
            group_of = np.full(num_items, -1, dtype=np.int64)
            group_of[shared] = inverse.reshape(-1)
            is_rep = np.zeros(num_items, dtype=bool)
            is_rep[shared[first]] = True
            rep = is_rep[si]
            self.group_cost_count = counts.astype(np.float64)
            self.member_node, self.member_group = sn[rep], group_of[si[rep]]

    # ------------------------------------------------------------ evaluation
    def figures(self, selected: np.ndarray) -> tuple[float, float]:
        """(E(S), T(S)) for a boolean node mask ``selected`` (assumed ancestor-closed)."""
        e = 1.0 + float(self.p[selected].sum())
        size = int(selected.sum())
        missing = self.root_missing
        if self.num_items:
            hit = np.zeros(self.num_items, dtype=bool)
            hit[self.pair_item[selected[self.pair_node]]] = True
            missing += int(hit.sum())
        return e, self.cost.predict(size + 1, missing)

    def throughput(self, selected: np.ndarray) -> float:
        e, t = self.figures(selected)
        return e / t

    def is_closed(self, selected: np.ndarray) -> bool:
        has_parent = self.parents >= 0
        return bool(np.all(~selected[has_parent] | selected[self.parents[has_parent]]))

    # ---------------------------------------------------------------- search
    def _best_prefix(self) -> np.ndarray:
        """Best 'top-n by path probability' set: a cheap, good starting point."""
        n = self.n
        # non-increasing key along paths keeps every prefix ancestor-closed
        key = self.p.copy()
        for idx in self.levels[1:]:
            key[idx] = np.minimum(key[idx], key[self.parents[idx]])
        order = np.lexsort((np.arange(n), -key))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        e = 1.0 + np.concatenate([[0.0], np.cumsum(self.p[order])])
        missing = np.full(n + 1, float(self.root_missing))
        if self.num_items:
            first = np.full(self.num_items, n, dtype=np.int64)
            np.minimum.at(first, self.pair_item, rank[self.pair_node])
            new_at = np.bincount(first, minlength=n + 1)[:n]
            missing[1:] += np.cumsum(new_at)
        sizes = np.arange(n + 1)
        c = self.cost
        thr = e / (c.t0 + c.t_token * (sizes + 1) + c.t_expert * missing)
        best = int(np.argmax(thr))
        selected = np.zeros(n, dtype=bool)
        selected[order[:best]] = True
        return selected

    def _improve(self, lam: float, incumbent: np.ndarray) -> np.ndarray | None:
        """A closed set with throughput > ``lam`` if one exists, else None.

        ``lam`` is the throughput of ``incumbent``.  A set beats ``lam`` iff its closure
        value ``G(S) = sum_S (P - lam t_token) - lam t_expert |missing(S) \\ root|``
        exceeds ``lam * A - 1`` (``A``: the time of verifying the root alone).
        """
        c = self.cost
        threshold = lam * self.cost.predict(1, self.root_missing) - 1.0
        w = self.p - lam * (c.t_token + c.t_expert * self.private)
        positive = w > 0
        if not positive.any():
            return None  # every closure value is <= 0 = G(empty) <= threshold
        alive = self.anc[positive].any(axis=0)  # ancestors-or-self of positive nodes
        # groups restricted to alive users; groups left with one user fold into it
        m_alive = alive[self.member_node]
        m_node = self.member_node[m_alive]
        m_group = self.member_group[m_alive]
        num_groups = self.group_cost_count.size
        g_cost = lam * c.t_expert * self.group_cost_count
        if num_groups and m_node.size:
            alive_users = np.bincount(m_group, minlength=num_groups)
            single = alive_users[m_group] == 1
            if single.any():
                w = w - np.bincount(m_node[single], weights=g_cost[m_group[single]], minlength=self.n)
            multi = ~single
            m_node, m_group = m_node[multi], m_group[multi]
        slack = 1e-13 * (1.0 + float(np.abs(w[alive]).sum()))
        if m_node.size == 0:
            value, selected = self._tree_closure(w, alive)
            return self._if_better(selected, lam)
        # Cheap certificate first: charge every shared group's cost to its users (any
        # split of a group's cost over its users gives a relaxation whose optimum is a
        # tree DP and an upper bound on the true one).  Groups the incumbent touches
        # are charged to the incumbent's users, so the bound is tight at the incumbent.
        in_cur = incumbent[m_node] & alive[m_node]
        cur_users = np.bincount(m_group, weights=in_cur.astype(np.float64), minlength=num_groups)
        all_users = np.bincount(m_group, minlength=num_groups)
        touched = cur_users[m_group] > 0
        share = np.where(
            touched,
            np.where(in_cur, g_cost[m_group] / np.maximum(cur_users[m_group], 1), 0.0),
            g_cost[m_group] / all_users[m_group],
        )
        free = ~touched  # groups whose split may move
        g_cost_m = g_cost[m_group]
        for _ in range(_SPLIT_ROUNDS):
            relaxed_w = w - np.bincount(m_node, weights=share, minlength=self.n)
            bound, relaxed_set = self._tree_closure(relaxed_w, alive)
            if bound <= threshold + slack:
                return None  # certified: no set beats the incumbent
            better = self._if_better(relaxed_set, lam)
            if better is not None:
                return better
            # move each free group's cost toward the users the relaxation wants to take
            pull = np.where(relaxed_set[m_node], 1.0, 1e-3)
            total_pull = np.bincount(m_group, weights=pull, minlength=num_groups)
            share = np.where(free, 0.5 * share + 0.5 * g_cost_m * pull / total_pull[m_group], share)
        selected = self._cut_closure(w, alive, m_node, m_group, g_cost)
        return None if selected is None else self._if_better(selected, lam)

    def _if_better(self, selected: np.ndarray, lam: float) -> np.ndarray | None:
        if selected.any() and self.throughput(selected) > lam:
            return selected
        return None

    def _tree_closure(self, w: np.ndarray, alive: np.ndarray) -> tuple[float, np.ndarray]:
        """Exact maximum-weight closure of the tree alone (no shared items): bottom-up DP.

        Returns (value, node mask); ties exclude nodes.
        """
        dp = np.where(alive, w, -np.inf)
        for idx in reversed(self.levels[1:]):
            np.add.at(dp, self.parents[idx], np.maximum(dp[idx], 0.0))
        selected = np.zeros(self.n, dtype=bool)
        if not self.levels:
            return 0.0, selected
        top = self.levels[0]
        selected[top] = dp[top] > 0
        for idx in self.levels[1:]:
            selected[idx] = (dp[idx] > 0) & selected[self.parents[idx]]
        return float(np.maximum(dp[top], 0.0).sum()), selected

    def _cut_closure(
        self, w: np.ndarray, alive: np.ndarray, m_node: np.ndarray, m_group: np.ndarray, g_cost_all: np.ndarray
    ) -> np.ndarray | None:
        """Maximum-weight closure by a minimum s-t cut (``None``: the empty closure is optimal)."""
        nodes = np.nonzero(alive)[0]
        local = np.full(self.n, -1, dtype=np.int64)
        local[nodes] = np.arange(nodes.size)
        groups, g_local = np.unique(m_group, return_inverse=True)
        nn, ng = nodes.size, groups.size
        src, sink = nn + ng, nn + ng + 1
        wn = w[nodes]
        pos = np.maximum(wn, 0.0)
        neg = np.maximum(-wn, 0.0)
        g_cost = g_cost_all[groups]
        total = float(pos.sum())
        if total <= 0:  # folding made every weight non-positive: the empty closure is optimal
            return None
        if float(neg.sum() + g_cost.sum()) <= 0:  # nothing costs anything: take every alive node
            return alive.copy()
        inf = 4.0 * total + 1.0  # never saturated: no edge carries more than the total flow
        par = self.parents[nodes]
        tree_from = np.nonzero(par >= 0)[0]
        has_pos = np.nonzero(pos > 0)[0]
        has_neg = np.nonzero(neg > 0)[0]
        has_cost = np.nonzero(g_cost > 0)[0]
        rows = np.concatenate([tree_from, local[m_node], np.full(has_pos.size, src), has_neg, nn + has_cost])
        cols = np.concatenate(
            [local[par[tree_from]], nn + g_local, has_pos, np.full(has_neg.size, sink), np.full(has_cost.size, sink)]
        )
        caps = np.concatenate(
            [np.full(tree_from.size + m_node.size, inf), pos[has_pos], neg[has_neg], g_cost[has_cost]]
        )
        side = min_cut(rows, cols, caps, nn + ng + 2, src, sink)
        selected = np.zeros(self.n, dtype=bool)
        selected[nodes[side[:nn]]] = True
        return selected

    def _closed_subsets(self, limit: int | None = None) -> np.ndarray | None:
        """:func:`closed_subset_masks` of this tree (``limit`` default ``_ENUMERATE_SETS``)."""
        return closed_subset_masks(self.parents, _ENUMERATE_SETS if limit is None else limit)

    def _enumerate(self, masks: np.ndarray) -> np.ndarray:
        """The best of the closed subsets ``masks`` (``[count, n]`` bool), scored at once."""
        missing = np.full(masks.shape[0], float(self.root_missing))
        if self.num_items:
            usage = np.zeros((self.n, self.num_items), dtype=np.float64)
            usage[self.pair_node, self.pair_item] = 1.0
            missing += np.count_nonzero(masks.astype(np.float64) @ usage, axis=1)
        e = 1.0 + masks.astype(np.float64) @ self.p
        c = self.cost
        return masks[int(np.argmax(e / (c.t0 + c.t_token * (masks.sum(axis=1) + 1) + c.t_expert * missing)))]

    def solve(self, warm_start: np.ndarray | None = None) -> np.ndarray:
        """The optimal closed node mask (every closed subset when there are few, else Dinkelbach iteration)."""
        masks = self._closed_subsets() if _ENUMERATE_SETS else None
        if masks is not None:
            return self._enumerate(masks)
        best = np.zeros(self.n, dtype=bool)
        best_thr = self.throughput(best)
        candidates = [self._best_prefix()]
        if warm_start is not None:
            candidates.append(warm_start)
        for cand in candidates:
            if self.is_closed(cand):
                thr = self.throughput(cand)
                if thr > best_thr:
                    best, best_thr = cand, thr
        if self.n == 0:
            return best
        for _ in range(_MAX_DINKELBACH_STEPS):
            better = self._improve(best_thr, best)
            if better is None:
                return best
            best, best_thr = better, self.throughput(better)
        raise RuntimeError("select_subtree: Dinkelbach iteration did not converge")  # pragma: no cover


def useful_nodes(path_prob: Any, cost: CostModel, root_missing: int) -> np.ndarray:
    """Mask of the nodes an optimal subtree may hold: ``path_prob > t_token / T(root alone)``.

    Exact pruning before the search (fewer nodes to build the problem from and to predict
    experts for).  For a node ``v`` at or below the threshold, the subtree ``D`` under it
    adds at most ``|D| P(v)`` expected tokens (path acceptance never grows along a path)
    and at least ``|D| t_token`` seconds (expert costs are non-negative), a ratio no better
    than the throughput of verifying the root alone -- and the optimum's throughput is at
    least that, so dropping ``D`` from any set never lowers its throughput.  The mask is
    ancestor-closed because path acceptance is non-increasing along paths.

    ``root_missing``: distinct experts of the root that are not resident (priced in ``T``).
    """
    p = _as_numpy(path_prob, np.float64).reshape(-1)
    return p > cost.t_token / cost.predict(1, root_missing)


def select_subtree(
    parents: Any,
    path_prob: Any,
    node_experts: Any | None,
    root_experts: Any | None,
    cached: Any | None,
    cost: CostModel,
    *,
    warm_start: Sequence[int] | np.ndarray | torch.Tensor | None = None,
) -> Selection:
    """The ancestor-closed subset of draft nodes that maximizes predicted throughput.

    Args:
        parents: int ``[N]``, parent index of each node, ``-1`` for children of the root;
            parents precede children.
        path_prob: float ``[N]``, estimated probability that the path root -> node is accepted.
        node_experts: int ``[N, L, k]``, predicted experts of each node at each MoE layer
            (negative ids are ignored), or ``None`` for no expert term.
        root_experts: int ``[L, k]``, predicted experts of the root token (always verified).
        cached: bool ``[L, E]``, experts resident in the device cache.
        cost: the cycle-time model.
        warm_start: node indices of a previous solution (e.g. the previous draft level's);
            used as a starting point when it is ancestor-closed.

    Returns:
        A :class:`~specfit_hf.tree.Selection` with sorted ``nodes`` (possibly empty: verify
        the root alone) and its exact ``expected_tokens``, ``predicted_time`` (seconds)
        and ``throughput`` (tokens / second).  The throughput is the maximum over all
        ancestor-closed subsets (up to ~1e-12 relative).
    """
    small = _select_small(parents, path_prob, node_experts, root_experts, cached, cost)
    if small is not None:
        return small
    problem = SearchProblem(parents, path_prob, node_experts, root_experts, cached, cost)
    warm = None
    if warm_start is not None:
        idx = _as_numpy(warm_start, np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= problem.n):
            raise ValueError("warm_start holds node indices outside the tree")
        warm = np.zeros(problem.n, dtype=bool)
        warm[idx] = True
    selected = problem.solve(warm)
    return _selection(problem, selected)


def closed_subset_masks(parents: np.ndarray, limit: int) -> np.ndarray | None:
    """Every ancestor-closed subset of a tree (``parents[v] < v``) as a ``[count, n]`` bool array, or ``None``
    past ``limit`` of them.

    Grown node by node (parents first): each set holding ``v``'s parent spawns a copy with
    ``v``.  A chain of ``n`` nodes has ``n + 1`` closed subsets, a bushy tree far more.
    """
    n = parents.size
    if n > 62:
        return None
    bits = np.zeros(1, dtype=np.int64)
    for v in range(n):
        par = parents[v]
        grown = bits if par < 0 else bits[(bits >> par) & 1 == 1]
        bits = np.concatenate([bits, grown | (1 << v)])
        if bits.size > limit:
            return None
    return ((bits[:, None] >> np.arange(n)) & 1).astype(bool)


def _select_small(parents: Any, path_prob: Any, node_experts: Any | None, root_experts: Any | None,
                  cached: Any | None, cost: CostModel) -> Selection | None:
    """:func:`select_subtree` for the small trees most cycles draft, or ``None`` to take the general path.

    Same optimum (every closed subset scored), without the preprocessing the min-cut
    path needs: at a few nodes per level the search runs after every draft level, and
    its host time is part of the cycle it optimises.
    """
    if not isinstance(parents, np.ndarray) or not isinstance(path_prob, np.ndarray) or parents.size > _SMALL_TREE:
        return None
    n = parents.size
    if not isinstance(cost, CostModel) or path_prob.shape != (n,) or n == 0:
        return None
    if parents.min() < -1 or (parents >= np.arange(n)).any() or not np.isfinite(path_prob).all() or path_prob.min() < 0:
        return None  # let SearchProblem explain what is wrong
    if node_experts is not None:
        arrays = (node_experts, root_experts, cached)
        if not all(isinstance(a, np.ndarray) for a in arrays):
            return None
        if node_experts.ndim != 3 or root_experts.ndim != 2:
            return None
        layers = cached.shape[0] if cached.ndim == 2 else -1
        if node_experts.shape[:2] != (n, layers) or root_experts.shape[0] != layers:
            return None
        if max(node_experts.max(initial=-1), root_experts.max(initial=-1)) >= cached.shape[1]:
            return None
    masks = closed_subset_masks(parents, 1 << n).astype(np.float64)
    missing = np.zeros(masks.shape[0])
    if node_experts is not None:
        cached = np.asarray(cached, dtype=bool)
        num_experts = cached.shape[1]
        off = np.arange(cached.shape[0])[:, None] * num_experts
        costly = ~cached.reshape(-1)
        root = (root_experts + off)[root_experts >= 0]
        root_missing = int(costly[np.unique(root)].sum())
        costly[root] = False
        ids = np.where(node_experts >= 0, node_experts + off[None], -1).reshape(n, -1)
        items, column = np.unique(ids[(ids >= 0) & costly[np.maximum(ids, 0)]], return_inverse=True)
        usage = np.zeros((n, items.size))
        rows = np.repeat(np.arange(n), ((ids >= 0) & costly[np.maximum(ids, 0)]).sum(axis=1))
        usage[rows, column] = 1.0
        missing = root_missing + np.count_nonzero(masks @ usage, axis=1)
    else:
        root_missing = 0
    e = 1.0 + masks @ path_prob
    t = cost.t0 + cost.t_token * (masks.sum(axis=1) + 1) + cost.t_expert * missing
    best = int(np.argmax(e / t))
    return Selection(nodes=torch.from_numpy(np.nonzero(masks[best])[0].astype(np.int64)),
                     expected_tokens=float(e[best]), predicted_time=float(t[best]), throughput=float(e[best] / t[best]))


def select_chain(path_prob: np.ndarray, missing: np.ndarray | None, cost: CostModel, candidates: int) -> Selection:
    """:func:`select_subtree` for a chain: the best of its first ``candidates + 1`` prefixes.

    A chain's ancestor-closed subsets are its prefixes.  ``path_prob`` ``[N]``: path
    acceptance of the nodes in chain order; ``missing`` ``[1 + N]``: predicted misses of
    the root plus each prefix (:meth:`~specfit_hf.selection.forecast.ExpertForecast.chain_missing`;
    ``None``: no expert term).  Ties go to the shorter prefix.
    """
    k = np.arange(candidates + 1)
    e = 1.0 + np.concatenate([[0.0], np.cumsum(path_prob[:candidates])])
    t = cost.t0 + cost.t_token * (k + 1) + (0.0 if missing is None else cost.t_expert * missing[: candidates + 1])
    best = int(np.argmax(e / t))
    return Selection(nodes=torch.arange(best, dtype=torch.long), expected_tokens=float(e[best]),
                     predicted_time=float(t[best]), throughput=float(e[best] / t[best]))


def evaluate_subtree(
    parents: Any,
    path_prob: Any,
    node_experts: Any | None,
    root_experts: Any | None,
    cached: Any | None,
    cost: CostModel,
    nodes: Sequence[int] | np.ndarray | torch.Tensor,
) -> Selection:
    """The predicted figures of a given ancestor-closed node set (no search)."""
    problem = SearchProblem(parents, path_prob, node_experts, root_experts, cached, cost)
    idx = _as_numpy(nodes, np.int64).reshape(-1)
    selected = np.zeros(problem.n, dtype=bool)
    selected[idx] = True
    if not problem.is_closed(selected):
        raise ValueError("nodes must be ancestor-closed")
    return _selection(problem, selected)


def closed_part(parents: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Mask over ``nodes`` of those whose ancestors are all in ``nodes`` (all True: the set is closed)."""
    ok = np.zeros(parents.size, dtype=bool)
    inside = np.zeros(parents.size, dtype=bool)
    inside[nodes] = True
    for v in np.sort(nodes):  # parents precede children
        par = parents[v]
        ok[v] = par < 0 or (inside[par] and ok[par])
    return ok[nodes]


def save_instance(**arrays: Any) -> str:
    """Write a search instance to a temporary ``.npz`` (for a bug report); returns its path."""
    fd, path = tempfile.mkstemp(prefix="specfit_unclosed_", suffix=".npz")
    os.close(fd)
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items() if v is not None})
    return path


def _selection(problem: SearchProblem, selected: np.ndarray) -> Selection:
    e, t = problem.figures(selected)
    return Selection(
        nodes=torch.from_numpy(np.nonzero(selected)[0].astype(np.int64)),
        expected_tokens=e,
        predicted_time=t,
        throughput=e / t,
    )
