"""Whether a cycle verifies its prompt-lookup chain, and how much of it.

A prompt-lookup proposal (:mod:`specfit_hf.generation.lookup`) costs no draft forward, so
verifying ``h`` of its tokens costs a plain step plus ``h`` verified tokens (their compute
and the experts they add).  What it delivers depends on how often such proposals are
right, which depends most on how long the matched n-gram was (a long repeated span goes
on repeating; a repeated single token rarely does).

:class:`LookupAcceptance` estimates ``P(token d accepted | tokens before it accepted)``
per matched n-gram length and depth, learned from **every** cycle at no cost: each
cycle's proposal is compared with the tokens the target then commits, over as many
cycles as the proposal reaches.  Greedy, the target commits a token iff it is its argmax,
so a match is exactly an acceptance; sampling, it commits ``x`` with probability
``p(x)``, the probability that a point-mass proposal ``x`` is accepted.  No cycle has to
verify proposals to find out whether they pay.  :func:`best_lookup_prefix` is the
throughput-optimal prefix of a chain under that estimate.
"""

from __future__ import annotations

import math

import numpy as np

from ..tree import LookupProposal

__all__ = ["AGREED", "LOOKUP_CONTEXTS", "LookupAcceptance", "best_lookup_prefix", "lookup_context"]

#: Classes of lookup proposal a draft model's acceptance is tracked by: (copied from the prompt or
#: from the generated text) x (matched n-gram of 1, 2-3, 4-7 or 8+ tokens), each class again for the
#: cycles whose first drafted token was the proposal's first token (class + :data:`AGREED`).
AGREED = 8
LOOKUP_CONTEXTS = 2 * AGREED
_NGRAM_CLASS = (0, 0, 1, 1, 2, 2, 2, 2)  # indexed by n < 8: 1 -> 0, 2-3 -> 1, 4-7 -> 2 (8+: 3)


def lookup_context(proposal: LookupProposal | None) -> int | None:
    """The class of a cycle's lookup proposal (``None``: the cycle had none)."""
    if proposal is None:
        return None
    n = proposal.ngram
    return (3 if n >= 8 else _NGRAM_CLASS[n]) + (4 if proposal.from_prompt else 0)


_DECAY = 0.99  # per observed cycle (~100 cycles of memory: a prompt or two)
_PRIOR = 2.0  # pseudo-trials pulling a (n-gram, depth) cell toward the depth's rate, and that toward the overall one


class LookupAcceptance:
    """Acceptance of prompt-lookup tokens per (matched n-gram length, depth), from committed tokens.

    Proposals copied from the prompt and from the generated text are counted apart: a model
    copies its prompt at other rates than it repeats itself (the first tokens of an answer can
    only copy the prompt, and are accepted less often than later repeats of the same length).

    Args:
        max_ngram: n-gram lengths above this share its estimate.
        max_depth: depths below this share its estimate.
    """

    def __init__(self, max_ngram: int = 8, max_depth: int = 16) -> None:
        self.max_ngram = int(max_ngram)
        self.max_depth = int(max_depth)
        # [accepted, tried] per (row, d - 1); row = n - 1 (from the generated text) or max_ngram + n - 1 (the prompt)
        self.counts = np.zeros((2, 2 * self.max_ngram, self.max_depth))
        self._following: list[list] = []  # [tokens left, n-gram row, next depth] of proposals still matching
        self._table: np.ndarray | None = None

    def _row(self, ngram: int, from_prompt: bool) -> int:
        return min(max(int(ngram), 1), self.max_ngram) - 1 + (self.max_ngram if from_prompt else 0)

    def acceptance(self, ngram: int, length: int, from_prompt: bool = False) -> np.ndarray:
        """``P(token d accepted | tokens before it accepted)`` for ``d = 1..length`` after an ``ngram``-token
        match (in the prompt when ``from_prompt``)."""
        if self._table is None:
            accepted, tried = self.counts
            overall = (accepted.sum() + 1.0) / (tried.sum() + 2.0)
            per_depth = (accepted.sum(axis=0) + _PRIOR * overall) / (tried.sum(axis=0) + _PRIOR)
            self._table = (accepted + _PRIOR * per_depth) / (tried + _PRIOR)
        row = self._table[self._row(ngram, from_prompt)]
        if length <= self.max_depth:
            return row[:length]
        return np.concatenate([row, np.full(length - self.max_depth, row[-1])])

    def observe(self, proposal: LookupProposal | None, committed: list[int]) -> None:
        """A cycle committed ``committed``; ``proposal`` was offered at its start (``None``: none)."""
        self.counts *= _DECAY
        self._table = None
        if proposal is not None and proposal.tokens:
            self._following.append([list(proposal.tokens), self._row(proposal.ngram, proposal.from_prompt), 0])
        if not self._following:
            return
        accepted, tried = self.counts
        cells: dict[tuple[int, int], list[float]] = {}  # (row, depth) -> [accepted, tried]: the same additions
        alive = []                                     # on host floats, written back once (not an array op each)
        for follow in self._following:
            tokens, row, depth = follow
            for token in committed:
                if not tokens:
                    break
                hit = tokens.pop(0) == token
                d = min(depth, self.max_depth - 1)
                cell = cells.get((row, d))
                if cell is None:
                    cell = cells[(row, d)] = [float(accepted[row, d]), float(tried[row, d])]
                cell[1] += 1.0
                cell[0] += float(hit)
                depth += 1
                if not hit:
                    tokens.clear()
            if tokens:
                follow[2] = depth
                alive.append(follow)
        for (row, d), (hits, tries) in cells.items():
            accepted[row, d], tried[row, d] = hits, tries
        self._following = alive


def best_lookup_prefix(acceptance: np.ndarray, root_seconds: float,
                       node_seconds: float | np.ndarray) -> tuple[int, float, float]:
    """The prefix length ``h >= 1`` of a chain maximizing expected tokens per second.

    ``E(h) = 1 + sum_{j <= h} prod_{i <= j} q_i`` (``q = acceptance``), ``T(h) = root_seconds +
    sum_{j <= h} s_j`` with ``s = node_seconds`` (one value for every depth, or one per depth).
    Returns ``(h, E(h), T(h))``.
    """
    if acceptance.size == 0:
        raise ValueError("an empty chain has no prefix to verify")
    q = acceptance.tolist()
    per_node = np.broadcast_to(np.asarray(node_seconds, dtype=np.float64), acceptance.shape).tolist()
    # at most a few dozen depths, every lookup cycle: one host loop costs less than the array calls
    best = (0, 0.0, 0.0, -math.inf)
    reach = tokens = spent = 0.0
    for d, (q_d, s_d) in enumerate(zip(q, per_node)):
        reach = q_d if d == 0 else reach * q_d
        tokens += reach
        spent += s_d
        expected, seconds = 1.0 + tokens, root_seconds + spent
        rate = expected / max(seconds, 1e-12)
        if rate > best[3]:
            best = (d + 1, expected, seconds, rate)
    return best[:3]
