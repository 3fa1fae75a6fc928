"""Expert predictors: which experts will each draft node route to at each target MoE layer?

The cost model charges a subtree for the union of its nodes' experts that the device
cache lacks, so before verification we need, for every draft node and every MoE layer
of the target, a guess of its top-k experts.  Three predictors:

* :class:`RouterPredictor` (training-free): the target's own router of each MoE layer
  applied to the draft's hidden state of the node (after that layer's
  post-attention norm when the target has one).  EAGLE-3 drafts live in the target's
  hidden space, so this is a cheap proxy of the target's hidden state there.
* :class:`HistoryPredictor` (training-free, learned online): per token id, a decayed
  count of the experts the target actually routed that token to in verified forwards
  (the view's ``last_routing``); unseen tokens fall back to another predictor.
* :class:`DraftHeadPredictor`: the EAGLE-3 draft's learned expert heads
  (``draft.predict_experts``).

All read the offload runtime through its read-only
:class:`~specfit_hf.offload.ExpertCacheView` and return int arrays ``[n, L, k]`` over
its ``moe_layers`` (negative = no guess).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ..features import decoder_layers
from ..offload.view import ExpertCacheView
from ..tree import DraftTree

__all__ = [
    "ExpertPredictor",
    "RouterPredictor",
    "HistoryPredictor",
    "DraftHeadPredictor",
    "make_predictor",
    "available_predictors",
]


class ExpertPredictor:
    """Base class: predicts ``[n, L, k]`` experts for draft nodes (and the root)."""

    name = ""
    learns = False  # whether observe() uses the routing (else the forecast skips reading it)

    def __init__(self, experts: ExpertCacheView) -> None:
        self.experts = experts
        self.num_layers = experts.num_layers
        self.top_k = experts.top_k

    def available(self, tree: DraftTree) -> bool:
        """Whether :meth:`predict` can guess anything for this tree."""
        return True

    def predict(self, tree: DraftTree, nodes: np.ndarray) -> np.ndarray:
        """``[len(nodes), L, k]`` predicted experts of those nodes."""
        raise NotImplementedError

    def predict_root(self, tree: DraftTree) -> np.ndarray:
        """``[L, k]`` predicted experts of the root."""
        raise NotImplementedError

    def predict_with_root(self, tree: DraftTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(root ``[L, k]``, nodes ``[len(nodes), L, k]``): :meth:`predict_root` and :meth:`predict` at once."""
        return self.predict_root(tree), self.predict(tree, nodes)

    def predict_rows(self, tree: DraftTree, start: int, stop: int) -> np.ndarray:
        """:meth:`predict` of the nodes ``start .. stop - 1`` (a chain's newest levels)."""
        return self.predict(tree, np.arange(start, stop))

    def observe(self, tokens: np.ndarray, routing: np.ndarray) -> None:
        """Verified rows: token ids ``[T]`` and the experts they were routed to ``[T, L, k]``."""

    def _empty(self, n: int) -> np.ndarray:
        return np.full((n, self.num_layers, self.top_k), -1, dtype=np.int64)


class RouterPredictor(ExpertPredictor):
    """The target's routers applied to the draft's hidden states (training-free)."""

    name = "router"

    def __init__(self, experts: ExpertCacheView, target: Any = None) -> None:
        super().__init__(experts)
        self._norms: list[Any] = [None] * self.num_layers
        if target is not None:
            try:
                layers = decoder_layers(target)
                self._norms = [getattr(layers[i], "post_attention_layernorm", None) for i in experts.moe_layers]
            except ValueError:
                pass
        self._usable: bool | None = None

    def available(self, tree: DraftTree) -> bool:
        return tree.hidden is not None and self._usable is not False

    @torch.no_grad()
    def _route(self, hidden: torch.Tensor) -> np.ndarray:
        n = hidden.shape[0]
        if n == 0:
            return self._empty(0)
        out = np.empty((n, self.num_layers, self.top_k), dtype=np.int64)
        try:
            for i, layer in enumerate(self.experts.moe_layers):
                h = hidden
                norm = self._norms[i]
                if norm is not None:
                    h = norm(h.to(device=norm.weight.device, dtype=norm.weight.dtype))
                out[:, i] = self.experts.route(layer, h).detach().cpu().reshape(n, -1).numpy()[:, : self.top_k]
        except RuntimeError:  # hidden size differs from the target's: no router proxy
            self._usable = False
            return self._empty(n)
        self._usable = True
        return out

    def predict(self, tree: DraftTree, nodes: np.ndarray) -> np.ndarray:
        if tree.hidden is None:
            return self._empty(len(nodes))
        return self._route(tree.hidden[torch.as_tensor(nodes, dtype=torch.long)])

    def predict_root(self, tree: DraftTree) -> np.ndarray:
        if tree.root_hidden is None:
            return self._empty(1)[0]
        return self._route(tree.root_hidden.reshape(1, -1))[0]


class HistoryPredictor(ExpertPredictor):
    """Per-token routing history learned from verified forwards (training-free, online).

    Args:
        fallback: predictor for tokens never verified yet (``None``: global frequencies).
        decay: weight of past counts at each new observation of a token.
        max_tokens: most token ids remembered (least recently seen dropped first).
    """

    name = "history"
    learns = True

    def __init__(self, experts: ExpertCacheView, fallback: ExpertPredictor | None = None, decay: float = 0.8,
                 max_tokens: int = 4096) -> None:
        super().__init__(experts)
        self.fallback = fallback
        self.decay = float(decay)
        self.max_tokens = int(max_tokens)
        self.num_experts = experts.num_experts
        self.table: OrderedDict[int, np.ndarray] = OrderedDict()
        self.global_counts = np.zeros((self.num_layers, self.num_experts), dtype=np.float32)

    def _top(self, counts: np.ndarray) -> np.ndarray:
        return np.argsort(-counts, axis=-1, kind="stable")[..., : self.top_k]

    def _predict_tokens(self, tokens: np.ndarray, fallback: np.ndarray | None) -> np.ndarray:
        out = np.empty((tokens.size, self.num_layers, self.top_k), dtype=np.int64)
        have_global = self.global_counts.sum() > 0
        for i, t in enumerate(tokens.tolist()):
            counts = self.table.get(int(t))
            if counts is not None:
                out[i] = self._top(counts)
            elif fallback is not None:
                out[i] = fallback[i]
            elif have_global:
                out[i] = self._top(self.global_counts)
            else:
                out[i] = -1
        return out

    def predict(self, tree: DraftTree, nodes: np.ndarray) -> np.ndarray:
        tokens = tree.tokens.numpy()[nodes]
        fb = None
        if self.fallback is not None and self.fallback.available(tree):
            unseen = np.array([int(t) not in self.table for t in tokens.tolist()], dtype=bool)
            if unseen.any():
                fb = self._empty(len(nodes))
                fb[unseen] = self.fallback.predict(tree, np.asarray(nodes)[unseen])
        return self._predict_tokens(tokens, fb)

    def predict_root(self, tree: DraftTree) -> np.ndarray:
        fb = None
        if int(tree.root_token) not in self.table and self.fallback is not None and self.fallback.available(tree):
            fb = self.fallback.predict_root(tree)[None]
        return self._predict_tokens(np.array([int(tree.root_token)]), fb)[0]

    def observe(self, tokens: np.ndarray, routing: np.ndarray) -> None:
        layer_idx = np.arange(self.num_layers)[:, None]
        for t, r in zip(np.asarray(tokens).tolist(), routing):
            counts = self.table.pop(int(t), None)
            if counts is None:
                counts = np.zeros((self.num_layers, self.num_experts), dtype=np.float32)
            else:
                counts *= self.decay
            valid = r >= 0
            np.add.at(counts, (np.broadcast_to(layer_idx, r.shape)[valid], r[valid]), 1.0)
            self.table[int(t)] = counts
            np.add.at(self.global_counts, (np.broadcast_to(layer_idx, r.shape)[valid], r[valid]), 1.0)
        while len(self.table) > self.max_tokens:
            self.table.popitem(last=False)


class DraftHeadPredictor(ExpertPredictor):
    """The EAGLE-3 draft's learned expert heads (``draft.predict_experts``)."""

    name = "heads"

    def __init__(self, experts: ExpertCacheView, draft: Any) -> None:
        super().__init__(experts)
        self.draft = draft
        head_layers = list(getattr(draft, "expert_moe_layers", []) or [])
        where = {layer: i for i, layer in enumerate(head_layers)}
        # position of each runtime MoE layer among the draft's heads (-1: no head)
        self._head_of = np.array([where.get(layer, -1) for layer in experts.moe_layers], dtype=np.int64)
        # one head per MoE layer, in the runtime's order (the usual case): the heads' output is the prediction
        self._one_to_one = bool(np.array_equal(self._head_of, np.arange(len(head_layers))))
        # a predictor lives for one generate call, in which the heads do not change
        snapshot = getattr(draft, "expert_predictor_fn", None)
        self._predict = snapshot(self.top_k) if snapshot is not None else (
            lambda hidden: draft.predict_experts(hidden, top_k=self.top_k))

    @staticmethod
    def supported(draft: Any) -> bool:
        return (draft is not None and getattr(draft, "expert_heads", None) is not None
                and hasattr(draft, "predict_experts"))

    def available(self, tree: DraftTree) -> bool:
        return tree.hidden is not None and bool((self._head_of >= 0).any())

    def _heads(self, hidden: torch.Tensor) -> np.ndarray:
        n = hidden.shape[0]
        if n == 0:
            return self._empty(0)
        pred = self._predict(hidden).cpu().numpy()  # [n, L_heads, k]
        if self._one_to_one and pred.shape[2] == self.top_k:
            return pred.astype(np.int64, copy=False)
        out = self._empty(n)
        has = self._head_of >= 0
        out[:, has] = pred[:, self._head_of[has], : self.top_k]
        return out

    def predict(self, tree: DraftTree, nodes: np.ndarray) -> np.ndarray:
        if tree.hidden is None:
            return self._empty(len(nodes))
        return self._heads(tree.hidden[torch.as_tensor(nodes, dtype=torch.long)])

    def predict_root(self, tree: DraftTree) -> np.ndarray:
        if tree.root_hidden is None:
            return self._empty(1)[0]
        return self._heads(tree.root_hidden.reshape(1, -1))[0]

    def predict_rows(self, tree: DraftTree, start: int, stop: int) -> np.ndarray:
        if tree.hidden is None:
            return self._empty(stop - start)
        return self._heads(tree.hidden[start:stop])

    def predict_with_root(self, tree: DraftTree, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if tree.root_hidden is None or tree.hidden is None:
            return super().predict_with_root(tree, nodes)
        # one call of the heads for the root and the nodes: each call is mostly fixed host time
        every = len(nodes) == tree.hidden.shape[0] and np.array_equal(nodes, np.arange(len(nodes)))
        rows = tree.hidden if every else tree.hidden[torch.as_tensor(nodes, dtype=torch.long)]
        block = torch.cat([tree.root_hidden.reshape(1, -1), rows])
        out = self._heads(block)
        return out[0], out[1:]


def available_predictors() -> list[str]:
    """Names :func:`make_predictor` accepts."""
    return ["auto", "router", "history", "history+router", "heads", "none"]


def make_predictor(name: str, experts: ExpertCacheView | None, target: Any = None,
                   draft: Any = None) -> ExpertPredictor | None:
    """Build a predictor by name; ``auto`` = the draft's heads when it has them, else history+router."""
    if experts is None or name == "none":
        return None
    if name == "auto":
        name = "heads" if DraftHeadPredictor.supported(draft) else "history+router"
    if name == "router":
        return RouterPredictor(experts, target)
    if name == "history":
        return HistoryPredictor(experts)
    if name == "history+router":
        return HistoryPredictor(experts, fallback=RouterPredictor(experts, target))
    if name == "heads":
        if not DraftHeadPredictor.supported(draft):
            raise ValueError("expert predictor 'heads' needs an EAGLE-3 draft with expert heads")
        return DraftHeadPredictor(experts, draft)
    raise ValueError(f"unknown expert predictor {name!r}; available: {available_predictors()}")
