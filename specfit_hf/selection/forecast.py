"""Which experts a cycle will need, and which of them the device cache lacks.

:class:`ExpertForecast` predicts, with an expert predictor, the experts of the root and
of every draft node per MoE layer, level by level as the tree grows (a node's
prediction is made once), and snapshots the device cache's residents when a cycle's
predictions start (drafting does not touch the target's expert cache).
:class:`MissingCounter` counts a node set's predicted misses the way the search's cost
does: the union of the root's and the nodes' experts that are not resident.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..offload.view import ExpertCacheView
from ..tree import DraftTree, LookupProposal, Selection
from .experts import ExpertPredictor

__all__ = ["ContextRouting", "ExpertForecast", "MissingCounter", "root_missing"]

_MAX_PENDING = 256  # reads a context keeps pending before it makes them (each holds a verify's routing ids)


class ContextRouting:
    """The experts the target routed every context position to (the prompt, then each committed token).

    Text repeats, and a repeat routes like its original: with the tiny Qwen3-MoE pair (8 + 8
    test prompts, greedy, 128 tokens), a token whose longest earlier-occurring suffix (up to 8
    tokens, the prompt-lookup match) ends at position ``s`` shares 90 % of its top-k experts with
    position ``s`` (94-95 % after a match of 4+ tokens), against 43-47 % with the token just before
    it and 18-26 % with a random earlier one; such a match exists at ~90 % of the positions.  So a
    prompt-lookup proposal also says which experts its root and its copied tokens will need,
    which the draft's heads cannot say for a cycle that does not draft (a plain step, a lookup
    chain).  Rows are ``[L, k]`` expert ids (-1: none), kept in one growing int16 array (a 48-layer
    top-8 model: 768 bytes a position).
    """

    def __init__(self) -> None:
        self._rows: np.ndarray | None = None
        self.length = 0  # positions known: 0 .. length - 1 (the pending reads' included)
        self._pending: list[tuple[Callable[[], np.ndarray], list[int]]] = []  # reads not made yet, in order

    def start(self, routing: np.ndarray | None) -> None:
        """A new context whose first positions (the prompt) routed as ``routing`` ``[T, L, k]``
        (``None``: unknown, and nothing is guessed in this call)."""
        self._rows, self.length, self._pending = None, 0, []
        if routing is not None and routing.ndim == 3 and routing.shape[0] > 0 and routing.max() < 2 ** 15:
            self._rows = np.array(routing, dtype=np.int16)
            self.length = routing.shape[0]

    @property
    def active(self) -> bool:
        return self._rows is not None

    def append(self, routing: np.ndarray) -> None:
        """The next positions' routing ``[n, L, k]`` (a cycle's root and accepted nodes, in order)."""
        self._settle()
        self._write(routing)

    def append_later(self, read: Callable[[], np.ndarray], positions: list[int]) -> None:
        """The next positions' routing: rows ``positions`` of what ``read()`` returns (a verify's ``[T, L, k]``
        routing, :meth:`~specfit_hf.offload.ExpertCacheView.last_routing_later`), read once a caller asks for
        the positions.  Most cycles of a call that runs drafted chains never do (only prompt-lookup proposals
        read the context), and a verify's routing read every cycle was ~50 us of the policy's host time there
        (CPU, emulated ``qwen3-pcie5``, GSM8K at 75 % cache)."""
        if self._rows is None:
            return
        self._pending.append((read, positions))
        self.length += len(positions)
        if len(self._pending) >= _MAX_PENDING:
            self._settle()

    def _settle(self) -> None:
        """Make the pending reads, in order."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self.length -= sum(len(positions) for _, positions in pending)
        for read, positions in pending:
            if self._rows is None:
                return
            self._write(read()[positions])

    def _write(self, routing: np.ndarray) -> None:
        if self._rows is None or routing.shape[1:] != self._rows.shape[1:]:
            self.stop()  # another shape: stop guessing rather than misalign
            return
        need = self.length + routing.shape[0]
        if need > self._rows.shape[0]:
            grown = np.full((max(need, 2 * self._rows.shape[0]), *self._rows.shape[1:]), -1, dtype=np.int16)
            grown[: self.length] = self._rows[: self.length]
            self._rows = grown
        self._rows[self.length:need] = routing
        self.length = need

    def stop(self) -> None:
        """Stop guessing for the rest of the call (the positions no longer line up with the context)."""
        self._rows, self.length, self._pending = None, 0, []

    def known(self, start: int, count: int) -> np.ndarray | None:
        """``[count, L, k]`` routing of positions ``start .. start + count - 1`` when every one is known and
        names an expert in every slot (a view; ``None`` otherwise: see :meth:`at`)."""
        self._settle()
        if self._rows is None or start < 0 or start + count > self.length:
            return None
        rows = self._rows[start:start + count]
        return rows if rows.min() >= 0 else None

    def at(self, start: int, count: int) -> np.ndarray | None:
        """``[count, L, k]`` routing of positions ``start .. start + count - 1`` (-1 rows where unknown)."""
        self._settle()
        if self._rows is None or start < 0:
            return None
        out = np.full((count, *self._rows.shape[1:]), -1, dtype=np.int64)
        known = max(0, min(count, self.length - start))
        out[:known] = self._rows[start:start + known]
        return out


class _TreePredictions:
    """Predicted experts of one cycle's tree, extended level by level (never recomputed)."""

    def __init__(self, tree: DraftTree, cached: np.ndarray) -> None:
        self.tree = tree
        self.cached = cached
        self.root: np.ndarray | None = None  # predicted when first asked for
        self.nodes: np.ndarray | None = None
        self.done = np.zeros(0, dtype=bool)  # which node rows hold predictions
        self.upto = 0  # rows 0 .. upto - 1 hold predictions (a chain's are made in order)
        self.root_missing: int | None = None
        self.chain: _ChainMisses | None = None  # prefix misses while the tree is a chain


class ExpertForecast:
    """Predicted experts of the current cycle's tree and the cache residents they meet.

    Args:
        predictor: the expert predictor, or ``None`` (no expert term: nothing is offloaded
            or the policy was told ``expert_predictor="none"``).
        experts: the offload runtime's read-only view (``None`` without offloading).
    """

    def __init__(self, predictor: ExpertPredictor | None, experts: ExpertCacheView | None) -> None:
        self.predictor = predictor
        self.experts = experts
        self.current: _TreePredictions | None = None
        self.context = ContextRouting()

    def start_context(self, routing: np.ndarray | None) -> None:
        """A ``generate`` call starts: the prefill routed the prompt's positions as ``routing`` (``[T, L, k]``,
        the context's first positions; ``None``: unknown)."""
        self.context.start(None if self.experts is None else routing)

    def remember(self, root_position: int, verified: int, accepted_positions: list[int]) -> None:
        """After a verify of the root at ``root_position`` and ``verified`` nodes: the committed rows'
        routing extends the context (the root's row, then the accepted nodes'), read when first needed."""
        if self.experts is None or not self.context.active:
            return
        read = self.experts.last_routing_later(rows=1 + verified)
        if read is None or self.context.length != root_position:
            self.context.stop()  # positions no longer line up (e.g. a padded or chunked context)
            return
        self.context.append_later(read, list(accepted_positions))

    def lookup_misses(self, proposal: LookupProposal | None) -> tuple[np.ndarray, np.ndarray] | None:
        """From the routing of the text ``proposal`` repeats (:class:`ContextRouting`), for the root plus each
        prefix of its chain (``[1 + N]`` each): the predicted misses against the residents now, and the
        distinct experts the prefix adds to the root's, in roots' worth (what its verify computes beyond
        a plain step).  ``None`` without a guess."""
        if proposal is None or proposal.source is None or not self.context.active or self.experts is None:
            return None
        start, count = proposal.source - 1, 1 + len(proposal.tokens)
        rows = self.context.known(start, count)  # the usual case: every row known and valid
        padded = rows is None
        if padded:
            rows = self.context.at(start, count)
            if rows is None or not (rows[0] >= 0).any():
                return None
        resident = self.experts.resident()
        # each (layer, expert) id is paid by the first row naming it: one unique over all rows
        offsets = _layer_offsets(rows.shape[1], resident.shape[1])
        if padded:
            ids = np.where(rows >= 0, rows + offsets, -1).reshape(count, -1)
            new, row = _first_rows(ids, ids >= 0)
        else:
            ids = (rows + offsets).reshape(count, -1)
            new, first = np.unique(ids, return_index=True)
            row = first // ids.shape[1]
        distinct = np.cumsum(np.bincount(row, minlength=rows.shape[0]))
        misses = np.cumsum(np.bincount(row, weights=~resident.reshape(-1)[new], minlength=rows.shape[0]))
        return misses.astype(np.int64), (distinct - distinct[0]) / max(int(distinct[0]), 1)

    def snapshot(self, tree: DraftTree) -> np.ndarray | None:
        """``[L, E]`` the residents of ``tree``'s cycle, read now if this is its first question (no prediction)."""
        if self.experts is None:
            return None
        if self.current is None or self.current.tree is not tree:
            self.current = _TreePredictions(tree, self.experts.resident())
        return self.current.cached

    def root(self, tree: DraftTree) -> np.ndarray | None:
        """``[L, k]`` predicted experts of ``tree``'s root (a new tree starts the cycle's predictions)."""
        if self.predictor is None:
            return None
        self.snapshot(tree)
        if self.current.root is None:  # a drafted tree's nodes so far come with it
            self._start(tree, np.arange(len(tree)))
        return self.current.root

    @property
    def cached(self) -> np.ndarray | None:
        """``[L, E]`` residents when the current cycle's predictions started."""
        return None if self.current is None else self.current.cached

    def nodes(self, tree: DraftTree, need: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """(node experts ``[N, L, k]``, root experts); rows neither in ``need`` (``None``: every node) nor
        predicted before are -1."""
        if self.predictor is None:
            return None
        self.snapshot(tree)
        n = len(tree)
        if self.current.root is None:
            self._start(tree, np.arange(n) if need is None else need)
            if need is None:
                self.current.upto = n
        pred = self.current
        grow = n - pred.nodes.shape[0]
        if grow > 0:
            pred.nodes = np.concatenate([pred.nodes, np.full((grow, *pred.root.shape), -1, dtype=np.int64)])
            pred.done = np.concatenate([pred.done, np.zeros(grow, dtype=bool)])
        if need is None:
            start = pred.upto
            if start < n and not pred.done[start:n].any():  # a chain's newest levels: one slice of rows
                pred.nodes[start:n] = self.predictor.predict_rows(tree, start, n)
                pred.done[start:n] = True
                pred.upto = n
                return pred.nodes, pred.root
            if start >= n:
                return pred.nodes, pred.root
            need = np.arange(n)
        todo = need[~pred.done[need]]
        if todo.size:
            pred.nodes[todo] = self.predictor.predict(tree, todo)
            pred.done[todo] = True
        return pred.nodes, pred.root

    def _start(self, tree: DraftTree, need: np.ndarray) -> None:
        """The cycle's first prediction: the root, with the ``need`` nodes in the same predictor call
        (each call is mostly fixed host time)."""
        pred = self.current
        if need.size:
            pred.root, first = self.predictor.predict_with_root(tree, need)
        else:
            pred.root, first = self.predictor.predict_root(tree), None
        pred.nodes = np.full((len(tree), *pred.root.shape), -1, dtype=np.int64)
        pred.done = np.zeros(len(tree), dtype=bool)
        if first is not None:
            pred.nodes[need] = first
            pred.done[need] = True

    def assume_resident(self, pairs: np.ndarray) -> None:
        """The cycle's forecast counts these ``[P, 2]`` (layer position, expert) pairs resident: they are being
        prefetched.  Call after the cycle's first prediction and before its misses are counted."""
        pred = self.current
        if pred is None or pred.cached is None:
            return
        pred.cached[pairs[:, 0], pairs[:, 1]] = True
        pred.root_missing, pred.chain = None, None

    def root_missing(self, tree: DraftTree) -> int:
        """Predicted misses of verifying the root alone, against the cycle's residents."""
        root = self.root(tree)
        if root is None:
            return 0
        if self.current.root_missing is None:
            self.current.root_missing = root_missing(root, self.current.cached)
        return self.current.root_missing

    def root_guess(self, tree: DraftTree) -> int | None:
        """:meth:`root_missing` when the predictor guessed the root's experts, ``None`` when it could not.

        The draft's heads guess a root from the draft state of its first level, so a cycle that has
        drafted has a guess and a plain step (before drafting) has none.
        """
        root = self.root(tree)
        if root is None or not (root >= 0).any():
            return None
        return self.root_missing(tree)

    def plain_step_missing(self, tree: DraftTree) -> int | None:
        """Predicted misses of a plain decode step (before any drafting), against the residents now;
        ``None`` when the predictor has no guess for the root yet."""
        if self.predictor is None:
            return None
        # history knows the root token; the other predictors need a draft hidden state
        root = self.predictor.predict_root(tree)
        if not (root >= 0).any():
            return None  # no guess: skip reading the residents
        return root_missing(root, self.experts.resident())

    def chain_missing(self, tree: DraftTree) -> np.ndarray | None:
        """``[1 + N]`` predicted misses of the root plus each prefix of ``tree``, a chain.

        What :class:`MissingCounter` counts for each prefix, extended by the new nodes only,
        level by level.  ``None`` without a forecast.
        """
        experts = self.nodes(tree)
        if experts is None:
            return None
        pred = self.current
        if pred.chain is None:
            pred.chain = _ChainMisses(pred.root, pred.cached)
        out = pred.chain.extend(pred.nodes)
        if pred.root_missing is None:  # the root's misses, counted once (root_missing asks next)
            pred.root_missing = pred.chain.out[0]
        return out

    def selection_missing(self, tree: DraftTree, selection: Selection) -> int | None:
        """Predicted misses of verifying the root and ``selection`` (``None`` if not predicted for this tree)."""
        pred = self.current
        if pred is None or pred.tree is not tree or pred.nodes is None or pred.nodes.shape[0] != len(tree):
            return None
        mask = np.zeros(len(tree), dtype=bool)
        mask[selection.nodes.numpy()] = True
        return MissingCounter((pred.nodes, pred.root), pred.cached).count(mask)

    def verified_block(self, tree: DraftTree, selection: Selection) -> np.ndarray | None:
        """``[1 + n, L, k]`` this cycle's predictions of the verified block (root first), if made for ``tree``."""
        pred = self.current
        if pred is None or pred.tree is not tree or pred.root is None:
            return None
        return np.concatenate([pred.root[None], pred.nodes[selection.nodes.numpy()]])

    def observe(self, tree: DraftTree, selection: Selection) -> np.ndarray | None:
        """Teach the predictor the routing of the verified block; returns that routing ``[1 + n, L, k]``."""
        if self.experts is None:
            return None
        if len(tree) == 0 and (self.predictor is None or not self.predictor.learns):
            return None  # a plain step teaches nothing here: skip reading the routing
        nodes = selection.nodes.numpy()
        routing = self.experts.last_routing(rows=1 + nodes.size)
        if routing is None or self.predictor is None:
            return routing
        tokens = np.concatenate([[int(tree.root_token)], tree.tokens.numpy()[nodes]])
        self.predictor.observe(tokens, routing)
        return routing


@functools.lru_cache(maxsize=8)
def _layer_offsets(layers: int, num_experts: int) -> np.ndarray:
    """``[1, L, 1]`` (read-only): each layer's first flat (layer, expert) id, ``layer * num_experts``."""
    out = (np.arange(layers) * num_experts)[None, :, None]
    out.setflags(write=False)
    return out


def root_missing(root: np.ndarray, cached: np.ndarray | None) -> int:
    """Distinct (layer, expert) pairs of ``root`` ``[L, k]`` (-1 = none) not resident in ``cached`` ``[L, E]``."""
    valid = root >= 0
    if cached is None:
        num_experts = int(root.max(initial=-1)) + 1
        ids = (root + np.arange(root.shape[0])[:, None] * num_experts)[valid]
        return int(np.unique(ids).size)
    # flat (layer, expert) ids: a 1-D unique is far cheaper than a unique over pairs
    ids = np.unique((root + np.arange(root.shape[0])[:, None] * cached.shape[1])[valid])
    return int(np.count_nonzero(~cached.reshape(-1)[ids]))


def _first_rows(ids: np.ndarray, counted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids among ``ids[counted]`` (``[rows, m]``) and, for each, the first row naming it: a block's
    forward computes (and loads) each expert once, and the earliest row pays for it."""
    new, first = np.unique(ids[counted], return_index=True)
    return new, np.nonzero(counted)[0][first]


def _after_root(root: np.ndarray, cached: np.ndarray | None, num_experts: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(per-layer id offsets ``[L, 1]``, flat costly mask with the root's experts paid, the root's misses).

    A node set pays for the costly (non-resident) experts it adds; the root pays for its own
    whatever is verified, so they are taken out of what a node can add.
    """
    off = _layer_offsets(root.shape[0], num_experts)[0]
    costly = np.ones(root.shape[0] * num_experts, dtype=bool) if cached is None else ~cached.reshape(-1)
    before = np.count_nonzero(costly)
    costly[(root + off)[root >= 0]] = False  # the root's distinct costly experts are the ones this clears
    return off, costly, int(before - np.count_nonzero(costly))


class MissingCounter:
    """Predicted missing experts of node sets (the search's expert term, for the look-ahead)."""

    def __init__(self, experts: tuple[np.ndarray, np.ndarray], cached: np.ndarray | None) -> None:
        nodes, root = experts
        num_experts = cached.shape[1] if cached is not None else int(max(nodes.max(initial=0), root.max(initial=0))) + 1
        off, self.costly, self.root_missing = _after_root(root, cached, num_experts)
        self.ids = np.where(nodes >= 0, nodes + off[None], -1).reshape(nodes.shape[0], -1)

    def count(self, mask: np.ndarray) -> int:
        """Misses of verifying the root and the nodes in ``mask``."""
        ids = self.ids[mask].reshape(-1)
        ids = np.unique(ids[ids >= 0])
        return self.root_missing + int(self.costly[ids].sum())


class _ChainMisses:
    """Prefix misses of a chain, extended node by node (each adds the costly experts no one before it brought).

    The root is counted with the first nodes, as the block's first row (:attr:`out` is empty until then)."""

    def __init__(self, root: np.ndarray, cached: np.ndarray) -> None:
        self.root = root
        self.off = _layer_offsets(root.shape[0], cached.shape[1])
        self.costly = ~cached.reshape(-1)  # the experts a row still pays for
        self.out: list[int] = []  # misses of the root, then of the root and each prefix

    def extend(self, nodes: np.ndarray) -> np.ndarray:
        start = len(self.out) - 1  # node rows counted (-1: not the root either)
        if nodes.shape[0] > start:
            # the new rows at once: each costly id is paid by the first row that names it (one
            # unique over the rows, not one per row; this runs in every fixed chain's cycle)
            rows = np.concatenate([self.root[None], nodes]) if start < 0 else nodes[start:]
            ids = np.where(rows >= 0, rows + self.off, -1).reshape(rows.shape[0], -1)
            new, row = _first_rows(ids, (ids >= 0) & self.costly[np.maximum(ids, 0)])
            paid = np.bincount(row, minlength=rows.shape[0])
            self.costly[new] = False
            self.out.extend(((self.out[-1] if self.out else 0) + np.cumsum(paid)).tolist())
        return np.array(self.out, dtype=np.int64)
