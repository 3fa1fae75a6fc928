"""Acceptance estimates: draft confidence -> probability that the target accepts the node.

A draft's probability for its token is not the probability that the target agrees
(drafts are over- or under-confident, more so deep in the tree).  The calibrator maps
draft probability to acceptance with a binned estimate learned online from
verification outcomes, made monotone (isotonic, pool-adjacent-violators) so that a more
confident draft never gets a lower estimate.  Before any data it returns the draft
probability itself; each bin is shrunk (``prior_weight`` pseudo-observations) toward
the identity shifted in logit space by one learnt offset per group, so a uniformly
under-confident draft is corrected quickly everywhere.

Outcome of a node: it was verified and its parent was the root or accepted, so the
target's choice at the parent was observed; the node is accepted iff the target picked
its token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import isotonic_regression

from ..tree import DraftTree, Selection, VerifyResult

__all__ = [
    "AcceptanceCalibrator", "AcceptanceModel", "path_acceptance", "acceptance_outcomes", "forget_acceptance",
    "shared_acceptance", "sibling_ranks",
]


class AcceptanceCalibrator:
    """Binned, isotonic map from draft probability to acceptance probability.

    Args:
        num_bins: equal-width bins over [0, 1].
        prior_weight: pseudo-observations per bin pulling it toward the identity map.
        decay: per-update forgetting factor on the counts (1 = keep everything).
        depth_aware: keep separate bins for depth 1 and deeper nodes (deeper drafts
            are usually less reliable at the same confidence).
        rank_aware: keep separate bins for a node that is its parent's most confident
            child and for its siblings (a draft that spreads its mass over near-synonyms
            is right far more often with its first choice than its probability says);
            used when ``ranks`` are passed (``sibling_ranks``).
    """

    def __init__(self, num_bins: int = 20, prior_weight: float = 2.0, decay: float = 1.0, depth_aware: bool = True,
                 rank_aware: bool = True):
        if num_bins < 1 or prior_weight <= 0 or not 0 < decay <= 1:
            raise ValueError("num_bins >= 1, prior_weight > 0 and 0 < decay <= 1 required")
        self.num_bins = int(num_bins)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.depth_groups = 2 if depth_aware else 1
        self.rank_aware = bool(rank_aware)
        self.groups = self.depth_groups * (2 if rank_aware else 1)
        centres = (np.arange(self.num_bins) + 0.5) / self.num_bins
        self._prior = centres
        self.accepted = np.zeros((self.groups, self.num_bins))
        self.trials = np.zeros((self.groups, self.num_bins))
        self._table = np.tile(centres, (self.groups, 1))
        self._shift = np.zeros(self.groups)  # last fitted logit shift per group (Newton's warm start)
        self._stale = False  # outcomes were added since the table was fitted

    def _bins(self, draft_probs: np.ndarray) -> np.ndarray:
        return np.clip((draft_probs * self.num_bins).astype(np.int64), 0, self.num_bins - 1)

    def _group(self, depths: np.ndarray | None, n: int, ranks: np.ndarray | None = None) -> np.ndarray:
        group = np.zeros(n, dtype=np.int64)
        if self.depth_groups > 1 and depths is not None:
            group += (np.asarray(depths).reshape(-1) > 1).astype(np.int64)
        if self.rank_aware and ranks is not None:
            group += self.depth_groups * (np.asarray(ranks).reshape(-1) > 0).astype(np.int64)
        return group

    def __call__(self, draft_probs, depths=None, ranks=None) -> np.ndarray:
        """Acceptance estimate for each node given its parent is accepted.

        ``ranks`` (optional): each node's rank among its siblings by draft probability
        (0 = the most confident child), as :func:`sibling_ranks` gives.
        """
        p = np.asarray(draft_probs.detach().cpu() if isinstance(draft_probs, torch.Tensor) else draft_probs, float)
        d = depths.detach().cpu().numpy() if isinstance(depths, torch.Tensor) else depths
        r = ranks.detach().cpu().numpy() if isinstance(ranks, torch.Tensor) else ranks
        return self.table[self._group(d, p.size, r), self._bins(p)]

    def update(self, draft_probs, accepted, depths=None, ranks=None) -> None:
        """Add outcomes: ``accepted[i]`` is whether node ``i`` (draft prob ``draft_probs[i]``) was accepted."""
        p = np.asarray(draft_probs, dtype=float).reshape(-1)
        a = np.asarray(accepted, dtype=float).reshape(-1)
        if p.size != a.size:
            raise ValueError("draft_probs and accepted must have the same length")
        if self.decay < 1:
            self.accepted *= self.decay
            self.trials *= self.decay
        g = self._group(None if depths is None else np.asarray(depths).reshape(-1), p.size, ranks)
        b = self._bins(p)
        np.add.at(self.accepted, (g, b), a)
        np.add.at(self.trials, (g, b), 1.0)
        self._stale = True  # refitted when next read: cycles that never read it (plain, fixed chains) skip the fit

    def _fit(self) -> None:
        prior = self._group_prior()
        w = self.trials + self.prior_weight
        rate = (self.accepted + self.prior_weight * prior) / w
        self._table = np.stack([isotonic_regression(rate[i], weights=w[i]).x for i in range(self.groups)])
        self._stale = False

    def _group_prior(self) -> np.ndarray:
        """``[groups, bins]`` prior of each bin: the identity shifted in logit space per group.

        One shift ``b`` per group, the penalised maximum-likelihood fit of
        ``accepted ~ sigmoid(logit(p) + b)`` over all of the group's outcomes (Gaussian
        penalty ``b^2 / 2``, so no data means the identity).  A draft that is uniformly
        under- or over-confident is corrected after a handful of outcomes in *every*
        bin of the group, where the bins alone would need a few outcomes each.
        """
        centres = np.clip(self._prior, 1e-6, 1 - 1e-6)
        logit = np.log(centres / (1 - centres))
        n, a = self.trials, self.accepted
        b = self._shift.copy()  # warm start: the shift moves little per update
        active = np.ones(self.groups, dtype=bool)
        for _ in range(25):  # Newton on a concave 1-D objective per group, all groups at once
            s = 1.0 / (1.0 + np.exp(-(logit + b[:, None])))
            grad = (a - n * s).sum(axis=1) - b
            hess = (n * s * (1 - s)).sum(axis=1) + 1.0
            step = grad / hess
            b = np.where(active, b + np.clip(step, -2.0, 2.0), b)  # a converged group keeps its shift
            active &= np.abs(step) >= 1e-8
            if not active.any():
                break
        self._shift = b
        return 1.0 / (1.0 + np.exp(-(logit + b[:, None])))

    @property
    def table(self) -> np.ndarray:
        """``[groups, bins]`` the current map (a new array after every :meth:`update`)."""
        if self._stale:
            self._fit()
        return self._table

    @property
    def observations(self) -> int:
        return int(round(self.trials.sum()))


def sibling_ranks(tree: DraftTree) -> np.ndarray:
    """``[N]`` each node's rank among its siblings by draft probability (0 = most confident; ties by index)."""
    return _ranks(tree.parents.numpy(), tree.draft_probs.numpy())


def _only_children(parents: np.ndarray) -> bool:
    """Whether no two of these nodes share a parent (a chain's nodes; a few dozen ids: a set, not a sort)."""
    return len(set(parents.tolist())) == parents.size


def _ranks(parents: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """Rank of each node among the nodes with the same parent, by ``probs`` descending (ties by index)."""
    if _only_children(parents):  # a chain: every rank is 0
        return np.zeros(parents.size, dtype=np.int64)
    order = np.lexsort((np.arange(parents.size), -probs, parents))  # by parent, then prob desc
    ranks = np.empty(parents.size, dtype=np.int64)
    sorted_parents = parents[order]
    starts = np.concatenate([[True], sorted_parents[1:] != sorted_parents[:-1]]) if parents.size else np.zeros(0, bool)
    group_start = np.maximum.accumulate(np.where(starts, np.arange(parents.size), 0)) if parents.size else starts
    ranks[order] = np.arange(parents.size) - group_start
    return ranks


def path_acceptance(tree: DraftTree, node_acceptance: np.ndarray) -> np.ndarray:
    """P(path root -> v accepted) = product of per-node acceptance along the path."""
    parents = tree.parents.numpy()
    out = np.asarray(node_acceptance, dtype=np.float64).copy()
    depths = tree.depths.numpy()
    for d in range(2, int(depths.max(initial=0)) + 1):
        idx = np.nonzero(depths == d)[0]
        out[idx] *= out[parents[idx]]
    return out


def acceptance_outcomes(
    tree: DraftTree, selection: Selection, result: VerifyResult, *, include_unverified: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(observed node indices, accepted flags): nodes whose parent's choice was seen.

    By default only verified nodes count.  With ``include_unverified`` every drafted
    node whose parent is the root or an accepted node counts, verified or not: the
    target's choice at that parent is the next committed token, so under *greedy*
    decoding the node would have been accepted iff its token equals it.  This is what
    lets a policy that verifies few nodes still learn that the draft is better than its
    confidence says (otherwise a pessimistic estimate is never corrected).  Under
    sampling an unverified node's acceptance is not determined by the committed token;
    use the default there.
    """
    nodes = selection.nodes.numpy() if isinstance(selection.nodes, torch.Tensor) else np.asarray(selection.nodes)
    accepted = [int(v) for v in result.accepted]
    if include_unverified:
        if len(result.new_tokens) < len(accepted) + 1:
            raise ValueError("result.new_tokens must hold the accepted tokens and the bonus token")
        # the target's token after the root (row 0) and after each accepted node
        choice_after = {-1: int(result.new_tokens[0])}
        for i, v in enumerate(accepted):
            choice_after[v] = int(result.new_tokens[i + 1])
        parents = tree.parents.numpy().tolist()  # a few dozen nodes: a set lookup each (np.isin sorts)
        seen = [i for i, p in enumerate(parents) if p in choice_after]
        target = np.array([choice_after[parents[i]] for i in seen], dtype=np.int64)
        seen = np.array(seen, dtype=np.int64)
        return seen, tree.tokens.numpy()[seen] == target
    if nodes.size == 0:
        return nodes.astype(np.int64), np.zeros(0, dtype=bool)
    accepted_set = set(accepted)
    parents = tree.parents.numpy()[nodes]
    observed = np.array([p < 0 or int(p) in accepted_set for p in parents], dtype=bool)
    seen = nodes[observed].astype(np.int64)
    return seen, np.array([int(v) in accepted_set for v in seen], dtype=bool)


_CHILD_DECAY = 0.98  # per observed parent: follows the text over a few hundred tokens

# draft model -> {calibrator settings: model}; acceptance is a property of the pair, so
# the estimates carry over from one generate call to the next with the same draft
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_acceptance(draft: object) -> dict[str, AcceptanceModel]:
    """The acceptance models kept for ``draft``, by scope and settings (the live dict; made if missing)."""
    return _SHARED.setdefault(draft, {})


def forget_acceptance() -> None:
    """Drop the acceptance estimates kept for every draft model (the next call starts from the priors)."""
    _SHARED.clear()


_MAX_RANKS = 32  # sibling ranks tracked (SpecFitConfig bounds tree_top_k to this)


def _rank_prior() -> tuple[np.ndarray, np.ndarray]:
    """Prior (accepted, trials) per sibling rank ``r``: acceptance ``1 / (2 (r + 1)^2)`` worth 2 outcomes.

    1/2 for the first child, 1/8 for the second, 1/18 for the third: a draft's later
    choices are rarely the target's, so a tree starts narrow and widens as data shows
    the draft's second choices pay.
    """
    trials = np.full(_MAX_RANKS, 2.0)
    return 1.0 / (np.arange(_MAX_RANKS) + 1.0) ** 2, trials


@dataclass
class AcceptanceModel:
    """What a policy has learnt about the draft's acceptance (shared across ``generate`` calls).

    ``calibrator``: per-node acceptance from draft confidence.  ``rank_accepted`` /
    ``rank_trials``: decayed counts, per sibling rank ``r`` (0: a parent's most confident
    child), of "the rank-``r`` child of an observed parent (or of the root) was accepted"
    -- what the stop rule's look-ahead assumes for children not drafted yet, and how many
    children a level is worth drafting.
    """

    calibrator: AcceptanceCalibrator
    rank_accepted: np.ndarray = field(default_factory=lambda: _rank_prior()[0])
    rank_trials: np.ndarray = field(default_factory=lambda: _rank_prior()[1])
    _path_cache: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def for_draft(cls, draft: object, settings: dict, share: bool, scope: str = "") -> AcceptanceModel:
        """The model learnt so far for ``draft`` with these calibrator ``settings`` (new if none or not shared).

        ``scope`` names who learns it (the policy and its settings): each policy configuration
        learns from its own cycles, so one configuration's estimates never depend on which other
        configurations ran before it in the process (a benchmark runs several side by side).
        """
        fresh = cls(AcceptanceCalibrator(**settings))
        if not share or draft is None:
            return fresh
        try:
            per_draft = shared_acceptance(draft)
        except TypeError:  # not weak-referenceable: keep this call's own estimates
            return fresh
        return per_draft.setdefault(f"{scope}|{sorted(settings.items())!r}", fresh)

    def rank_acceptance(self) -> np.ndarray:
        """``[R]`` learnt acceptance of a parent's rank-``r`` child (non-increasing in ``r``)."""
        return np.minimum.accumulate(self.rank_accepted / self.rank_trials)

    def child_acceptance(self) -> float:
        """Learnt acceptance of a parent's most confident child."""
        return float(self.rank_accepted[0] / self.rank_trials[0])

    def path(self, tree: DraftTree) -> np.ndarray:
        """``[N]`` estimated probability that the whole path root -> v is accepted.

        Called after every draft level: while the calibrator's table is unchanged, the nodes
        of earlier levels keep their values and only the new level is computed.
        """
        table = self.calibrator.table
        cached = self._path_cache
        if cached is None or cached[0] is not tree or cached[1].size > len(tree) or cached[2] is not table:
            cached = (tree, np.zeros(0), table)
        done = cached[1]
        if done.size == len(tree):
            return done
        parents = tree.parents.numpy()
        new = np.arange(done.size, len(tree))
        probs = tree.draft_probs.numpy()[new]
        # a new node's siblings are new too (a level adds whole sibling groups), so ranks are local;
        # a chain's level is an only child, rank 0
        ranks = np.zeros(1, np.int64) if new.size == 1 else _ranks(parents[new], probs)
        node = self.calibrator(probs, tree.depths.numpy()[new], ranks)
        out = np.concatenate([done, np.asarray(node, dtype=np.float64)])
        for v in new:  # parents precede children
            par = parents[v]
            if par >= 0:
                out[v] *= out[par]
        self._path_cache = (tree, out, table)
        return out

    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, greedy: bool) -> None:
        """Learn from a verified cycle (greedy: unverified nodes count too, see :func:`acceptance_outcomes`)."""
        if len(tree) == 0:
            return  # a plain step: nothing drafted, nothing to learn
        seen, accepted = acceptance_outcomes(tree, selection, result, include_unverified=greedy)
        if not seen.size:
            return
        probs = tree.draft_probs.numpy()[seen]
        depths = tree.depths.numpy()[seen]
        ranks = sibling_ranks(tree)[seen]
        self.calibrator.update(probs, accepted, depths, ranks)
        parents = tree.parents.numpy()[seen]
        if _only_children(parents):
            # one child seen per parent (a chain's nodes): the same updates, parent by parent, on host floats
            order = np.argsort(parents, kind="stable")
            ranks_, hits = np.minimum(ranks[order], _MAX_RANKS - 1).tolist(), accepted[order].tolist()
            rank_accepted, rank_trials = self.rank_accepted.tolist(), self.rank_trials.tolist()
            for rank, hit in zip(ranks_, hits):
                rank_accepted[rank] = rank_accepted[rank] * _CHILD_DECAY + float(hit)
                rank_trials[rank] = rank_trials[rank] * _CHILD_DECAY + 1.0
            self.rank_accepted[:], self.rank_trials[:] = rank_accepted, rank_trials
        else:
            self._learn_ranks_by_parent(parents, ranks, accepted)

    def _learn_ranks_by_parent(self, parents: np.ndarray, ranks: np.ndarray, accepted: np.ndarray) -> None:
        """Per parent, the outcomes of its seen children by sibling rank (decayed counts, one decay a parent)."""
        for parent in np.unique(parents):
            among = np.nonzero(parents == parent)[0]
            rank = np.minimum(ranks[among], _MAX_RANKS - 1)
            self.rank_accepted[rank] *= _CHILD_DECAY
            self.rank_trials[rank] *= _CHILD_DECAY
            np.add.at(self.rank_accepted, rank, accepted[among].astype(np.float64))
            np.add.at(self.rank_trials, rank, 1.0)
