"""Tree drafting with an EAGLE-3 draft model (stage 2 of the SpecFit cycle).

Sequence slots and positions
----------------------------
The draft's slot ``i`` holds the pair ``(feature of target position i, token i + 1)`` at
rotary position ``i``.  With ``P`` tokens in the target cache and the root ``x_P`` not yet
processed by the target, the *root pair* is ``(f_{P-1}, x_P)`` at position ``P - 1``, and
a tree node at depth ``d`` sits at position ``P - 1 + d`` (prefix + depth), consuming its
parent's draft hidden state and its own token.

Cache policy
------------
The draft cache (a one-layer :class:`~specfit_hf.generation.cache.SpecFitCache`) holds the
committed prefix, computed from **target** features, then
one slot per tree node (every node is run once, in creation order, so node ``n`` is slot
``stable + n``).  ``commit`` gathers the cache back to the committed prefix and queues
the accepted path's target features; the next cycle's first level runs those pairs and
the new root pair in one forward.  The accepted nodes' tree slots are not reused
because they were computed from the draft's own hidden states, while the EAGLE-3
recipe (and :mod:`specfit_hf.eagle3.train`) trains committed positions on target
features: recomputing those few rows is what keeps inference identical to training.

Expansion (EAGLE-2 style)
-------------------------
Level 1 = top-``k`` tokens of the root.  Each later level expands the ``k`` nodes of the
newest level with the highest path probability into their top-``k`` children (``k²``
new nodes).  Every new node is run immediately so it carries its own hidden state
(``tree.hidden``, read by expert predictors) and its children's distribution is ready
for the next level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..features import decoder_layers
from ..generation.drafter import Drafter, frontier_nodes
from ..generation.tree_mask import grow_ancestors
from ..tree import DraftTree, VerifyResult
from .kv import DraftKVCache, causal_mask

if TYPE_CHECKING:
    from .modeling import Eagle3DraftModel

__all__ = ["Eagle3TreeDrafter"]


@dataclass
class _DrafterState:
    """Everything that survives between cycles (what a snapshot copies)."""

    cache: DraftKVCache
    pending_tokens: list[int]  # tokens of queued target-feature pairs (root excluded)
    pending_features: list[torch.Tensor] | None  # [k, 3·H_t] blocks, one more row in all than pending_tokens
    # (lists: a run of plain steps queues one pair per step, joined once when drafting resumes)
    next_position: int  # position of the first queued pair
    expected_root: int | None  # the bonus token of the last commit


class Eagle3TreeDrafter(Drafter):
    """Grows draft trees with an :class:`Eagle3DraftModel`.

    Args:
        model: the EAGLE-3 draft.
        target: the target model (for its layer count and, when the draft has none, its
            input embeddings).
        top_k: children per expanded node, and nodes expanded per level.
    """

    def __init__(self, model: Eagle3DraftModel, target: nn.Module, top_k: int = 8) -> None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.model = model
        self.top_k = min(int(top_k), model.config.draft_vocab_size)
        self.target_feature_indices = tuple(model.config.target_feature_indices(len(decoder_layers(target))))
        model.attach_target_embeddings(target)
        self.device = model.fc.weight.device
        self.dtype = model.fc.weight.dtype
        self._state = self._empty_state()
        self._tree: DraftTree | None = None

    # -- helpers ----------------------------------------------------------------------
    def _empty_state(self) -> _DrafterState:
        return _DrafterState(DraftKVCache(), [], None, 0, None)

    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """One draft forward over ``m`` rows appended to the cache -> (next hidden, layer output)."""
        cache = self._state.cache
        attn = self.model.midlayer.self_attn

        def attend(q, k, v):
            k, v = cache.append(k, v)
            return attn.attend(q, k, v, mask)

        out = self.model.step(tokens[None].to(self.device), hidden[None], positions.to(self.device), attend)
        return self.model.next_hidden(out)[0], out[0]

    def _top_children(self, layer_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (log-prob, draft id) of the next-token distribution of each row."""
        logp = torch.log_softmax(self.model.compute_logits(layer_out).float(), dim=-1)
        return logp.topk(self.top_k, dim=-1)

    # -- Drafter API --------------------------------------------------------------------
    @torch.no_grad()
    def start(self, prompt_ids: torch.LongTensor, target_features: torch.Tensor | None) -> None:
        if target_features is None:
            raise ValueError("the EAGLE-3 drafter needs the target features of the prompt")
        prompt_ids = torch.as_tensor(prompt_ids).reshape(1, -1)
        if target_features.dim() != 3 or target_features.shape[:2] != prompt_ids.shape:
            raise ValueError(
                f"target features {tuple(target_features.shape)} do not match prompt ids {tuple(prompt_ids.shape)}"
            )
        self._state = self._empty_state()
        self._tree = None
        # Read the prompt now rather than in the first tree's catch-up, so every drafting
        # cycle costs what drafting costs (a policy deciding whether drafting pays measures
        # cycles).  Pairs are (token i+1, target feature i); the last feature waits for the
        # root token, which the first tree brings.
        st = self._state
        n = prompt_ids.shape[1]
        if n > 1:
            tokens = prompt_ids[0, 1:].cpu()
            hidden = self.model.project_features(target_features[0, :-1].to(self.device))
            positions = torch.arange(n - 1)
            self._run(tokens, hidden, positions, causal_mask(n - 1, 0, self.dtype, self.device))
            st.next_position = n - 1
        st.pending_tokens = []
        st.pending_features = [target_features[0, -1:]]

    @torch.no_grad()
    def draft_level(self, tree: DraftTree, expand: torch.Tensor | None = None, children: int | None = None) -> None:
        if self._state.pending_features is None and self._tree is None:
            raise RuntimeError("call start() before draft_level()")
        k = self.top_k if children is None else max(1, min(int(children), self.top_k))
        if tree.num_levels == 0:
            self._begin_tree(tree)
            vals, ids = self._root_top
            self._add_level(tree, ids[:k], vals[:k], torch.full((k,), -1, dtype=torch.long))
            return
        if tree is not self._tree:
            raise RuntimeError("draft_level() got a tree this drafter did not start")
        frontier = frontier_nodes(tree, expand, self.top_k)
        vals = self._node_top_vals[frontier][:, :k].reshape(-1)
        ids = self._node_top_ids[frontier][:, :k].reshape(-1)
        parents = frontier.repeat_interleave(k)
        self._add_level(tree, ids, vals, parents)

    def _begin_tree(self, tree: DraftTree) -> None:
        """Run the queued target-feature pairs plus the root pair; cache them as committed."""
        st = self._state
        if st.expected_root is not None and int(tree.root_token) != st.expected_root:
            raise ValueError(f"tree root {tree.root_token} is not the last committed token {st.expected_root}")
        tokens = torch.tensor([*st.pending_tokens, int(tree.root_token)], dtype=torch.long)
        feats = None if st.pending_features is None else torch.cat(st.pending_features)
        if feats is None or feats.shape[0] != tokens.numel():
            raise RuntimeError("target features and committed tokens are out of step")
        past = st.cache.length
        positions = torch.arange(st.next_position, st.next_position + tokens.numel())
        hidden = self.model.project_features(feats.to(self.device))
        mask = causal_mask(tokens.numel(), past, self.dtype, self.device)
        nxt, out = self._run(tokens, hidden, positions, mask)
        self._stable_len = st.cache.length
        self._root_position = int(positions[-1])
        st.pending_tokens = []
        st.pending_features = None
        st.next_position = self._root_position + 1
        tree.root_hidden = nxt[-1]
        self._root_hidden = nxt[-1]
        vals, ids = self._top_children(out[-1:])
        self._root_top = (vals[0].cpu(), ids[0].cpu())
        self._node_top_vals = torch.empty(0, self.top_k)
        self._node_top_ids = torch.empty(0, self.top_k, dtype=torch.long)
        self._node_hidden = torch.empty(0, nxt.shape[-1], dtype=nxt.dtype, device=nxt.device)
        self._ancestors = torch.zeros(0, 0, dtype=torch.bool)
        self._tree = tree

    def _add_level(self, tree: DraftTree, draft_ids: torch.Tensor, logp: torch.Tensor, parents: torch.Tensor) -> None:
        """Run the new nodes (tokens ``draft_ids`` under ``parents``) and append them to ``tree``."""
        m, n0 = parents.numel(), len(tree)
        if self._state.cache.length != self._stable_len + n0:
            raise RuntimeError("draft cache and tree are out of step")
        tokens = self.model.draft_to_target(draft_ids.to(self.device)).cpu()
        # ancestor-or-self relation among tree nodes, grown by one block per level
        anc, self._ancestors = grow_ancestors(self._ancestors, parents)
        has_parent = parents >= 0

        mask = torch.full((m, self._stable_len + n0 + m), torch.finfo(self.dtype).min, dtype=self.dtype)
        mask[:, : self._stable_len] = 0
        mask[:, self._stable_len :].masked_fill_(anc, 0)
        parent_depth = torch.zeros(m, dtype=torch.long)
        if n0:
            parent_depth[has_parent] = tree.depths[parents[has_parent]]
        positions = self._root_position + parent_depth + 1
        parent_hidden = self._root_hidden.expand(m, -1).clone()
        if has_parent.any():
            rows = parents[has_parent].to(self._node_hidden.device)
            parent_hidden[has_parent.to(parent_hidden.device)] = self._node_hidden[rows]
        nxt, out = self._run(tokens, parent_hidden, positions, mask[None, None].to(self.device))
        vals, ids = self._top_children(out)
        self._node_top_vals = torch.cat([self._node_top_vals, vals.cpu()])
        self._node_top_ids = torch.cat([self._node_top_ids, ids.cpu()])
        self._node_hidden = torch.cat([self._node_hidden, nxt])
        tree.add_level(tokens, parents, logp.exp(), hidden=nxt)

    @torch.no_grad()
    def commit(self, tree: DraftTree, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        if target_features is None:
            raise ValueError("the EAGLE-3 drafter needs the target features of the accepted path")
        accepted = list(result.accepted)
        feats = target_features.reshape(-1, target_features.shape[-1])
        if feats.shape[0] != len(accepted) + 1:
            raise ValueError(
                f"expected target features for the root and {len(accepted)} accepted nodes, got {feats.shape[0]} rows"
            )
        if list(result.new_tokens[:-1]) != [int(tree.tokens[i]) for i in accepted]:
            raise ValueError("result.new_tokens does not start with the accepted nodes' tokens")
        st = self._state
        if tree is self._tree:
            # Drop every tree slot: keep the committed prefix (which ends with the root pair).
            st.cache.keep(torch.arange(self._stable_len))
            st.pending_tokens = [int(t) for t in result.new_tokens[:-1]]
            st.pending_features = [feats]
        else:
            # Nothing was drafted for this root: it is still queued with the older pairs.
            if accepted:
                raise ValueError("accepted nodes reported for a tree this drafter never expanded")
            if st.expected_root is not None and int(tree.root_token) != st.expected_root:
                raise ValueError(f"tree root {tree.root_token} is not the last committed token {st.expected_root}")
            st.pending_tokens.append(int(tree.root_token))
            st.pending_features.append(feats.to(st.pending_features[-1]))
        st.expected_root = int(result.bonus_token)
        self._tree = None

    @torch.no_grad()
    def predicted_experts(self, tree: DraftTree) -> torch.LongTensor | None:
        """``[1 + N, L_moe, k]`` experts the draft's heads predict for the root then each node.

        ``None`` when the draft has no expert predictor.  Layer order is
        ``model.expert_moe_layers`` (target decoder-layer indices).
        """
        if self.model.expert_heads is None:
            return None
        if tree.root_hidden is None:
            raise ValueError("the tree has no draft hidden states yet (draft at least one level)")
        hidden = tree.root_hidden.reshape(1, -1)
        if tree.hidden is not None:
            hidden = torch.cat([hidden, tree.hidden.to(hidden)])
        return self.model.predict_experts(hidden).cpu()
