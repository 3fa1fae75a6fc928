"""Acceptance estimates: draft confidence -> probability that the target accepts the node.

A draft's probability for its token is not the probability that the target agrees
(drafts are over- or under-confident, more so deep in the tree).  The calibrator maps
draft probability to acceptance with a binned estimate learned online from
verification outcomes, made monotone (isotonic, pool-adjacent-violators) so that a more
confident draft never gets a lower estimate.  Before any data it returns the draft
probability itself (a Beta prior centred on the identity, worth ``prior_weight``
observations per bin).

Outcome of a node: it was verified and its parent was the root or accepted, so the
target's choice at the parent was observed; the node is accepted iff the target picked
its token.
"""

from __future__ import annotations

import numpy as np
import torch

from ..tree import DraftTree, Selection, VerifyResult

__all__ = ["AcceptanceCalibrator", "path_acceptance", "acceptance_outcomes"]


def _isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted non-decreasing least-squares fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            wt = w1 + w2
            blocks.append([(m1 * w1 + m2 * w2) / wt, wt, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks])


class AcceptanceCalibrator:
    """Binned, isotonic map from draft probability to acceptance probability.

    Args:
        num_bins: equal-width bins over [0, 1].
        prior_weight: pseudo-observations per bin pulling it toward the identity map.
        decay: per-update forgetting factor on the counts (1 = keep everything).
        depth_aware: keep separate bins for depth 1 and deeper nodes (deeper drafts
            are usually less reliable at the same confidence).
    """

    def __init__(self, num_bins: int = 20, prior_weight: float = 2.0, decay: float = 1.0, depth_aware: bool = True):
        if num_bins < 1 or prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError("num_bins >= 1, prior_weight > 0 and 0 < decay <= 1 required")
        self.num_bins = int(num_bins)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.groups = 2 if depth_aware else 1
        centres = (np.arange(self.num_bins) + 0.5) / self.num_bins
        self._prior = centres
        self.accepted = np.zeros((self.groups, self.num_bins))
        self.trials = np.zeros((self.groups, self.num_bins))
        self._table = np.tile(centres, (self.groups, 1))

    def _bins(self, draft_probs: np.ndarray) -> np.ndarray:
        return np.clip((draft_probs * self.num_bins).astype(np.int64), 0, self.num_bins - 1)

    def _group(self, depths: np.ndarray | None, n: int) -> np.ndarray:
        if self.groups == 1 or depths is None:
            return np.zeros(n, dtype=np.int64)
        return (np.asarray(depths) > 1).astype(np.int64)

    def __call__(self, draft_probs, depths=None) -> np.ndarray:
        """Acceptance estimate for each node given its parent is accepted."""
        p = np.asarray(draft_probs.detach().cpu() if isinstance(draft_probs, torch.Tensor) else draft_probs, float)
        d = depths.detach().cpu().numpy() if isinstance(depths, torch.Tensor) else depths
        return self._table[self._group(d, p.size), self._bins(p)]

    def update(self, draft_probs, accepted, depths=None) -> None:
        """Add outcomes: ``accepted[i]`` is whether node ``i`` (draft prob ``draft_probs[i]``) was accepted."""
        p = np.asarray(draft_probs, dtype=float).reshape(-1)
        a = np.asarray(accepted, dtype=float).reshape(-1)
        if p.size != a.size:
            raise ValueError("draft_probs and accepted must have the same length")
        if self.decay < 1:
            self.accepted *= self.decay
            self.trials *= self.decay
        g = self._group(None if depths is None else np.asarray(depths).reshape(-1), p.size)
        b = self._bins(p)
        np.add.at(self.accepted, (g, b), a)
        np.add.at(self.trials, (g, b), 1.0)
        w = self.trials + self.prior_weight
        rate = (self.accepted + self.prior_weight * self._prior) / w
        self._table = np.stack([_isotonic(rate[i], w[i]) for i in range(self.groups)])

    @property
    def observations(self) -> int:
        return int(round(self.trials.sum()))


def path_acceptance(tree: DraftTree, node_acceptance: np.ndarray) -> np.ndarray:
    """P(path root -> v accepted) = product of per-node acceptance along the path."""
    parents = tree.parents.numpy()
    out = np.asarray(node_acceptance, dtype=np.float64).copy()
    depths = tree.depths.numpy()
    for d in range(2, int(depths.max(initial=0)) + 1):
        idx = np.nonzero(depths == d)[0]
        out[idx] *= out[parents[idx]]
    return out


def acceptance_outcomes(tree: DraftTree, selection: Selection, result: VerifyResult) -> tuple[np.ndarray, np.ndarray]:
    """(observed node indices, accepted flags): verified nodes whose parent's choice was seen."""
    nodes = selection.nodes.numpy() if isinstance(selection.nodes, torch.Tensor) else np.asarray(selection.nodes)
    if nodes.size == 0:
        return nodes.astype(np.int64), np.zeros(0, dtype=bool)
    accepted = set(int(v) for v in result.accepted)
    parents = tree.parents.numpy()[nodes]
    observed = np.array([p < 0 or int(p) in accepted for p in parents], dtype=bool)
    seen = nodes[observed].astype(np.int64)
    return seen, np.array([int(v) in accepted for v in seen], dtype=bool)
