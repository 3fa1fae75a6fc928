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

import numpy as np
import torch
from torch import nn

from ..features import decoder_layers
from ..generation.drafter import Drafter, newest_to_expand, without_grad
from ..generation.tree_mask import additive_mask, causal_pattern, grow_ancestor_rows
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
        self._on_cpu = self.device.type == "cpu"  # host tensors need no .to(device)
        # bound once: module and config reads cost microseconds in every draft forward
        self._attend = model.midlayer.self_attn.attend
        self._next_hidden = model.next_hidden_fn()
        self._draft_to_target = model.draft_to_target_host_fn()
        self._state = self._empty_state()
        self._tree: DraftTree | None = None

    # -- helpers ----------------------------------------------------------------------
    def _empty_state(self) -> _DrafterState:
        return _DrafterState(DraftKVCache(), [], None, 0, None)

    def _run(self, tokens: np.ndarray, hidden: torch.Tensor, positions: range | np.ndarray, mask: torch.Tensor | None):
        """One draft forward over ``m`` rows appended to the cache -> (next hidden, layer output).

        ``tokens`` (target ids) and ``positions`` (a ``range`` or an int array) are host
        values: the ids become one tensor, and the rotary rows are read from the model's
        table without a device round trip.
        """
        cache = self._state.cache
        attend_fn = self._attend

        def attend(q, k, v):
            k, v = cache.append(k, v)
            return attend_fn(q, k, v, mask)

        ids = torch.from_numpy(tokens.reshape(1, -1))
        if not self._on_cpu:
            ids = ids.to(self.device)
        out, nxt = self.model.draft_forward(ids, hidden, positions, attend, self._next_hidden)
        return nxt, out

    def _top_children(self, layer_out: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Top-k log-probs ``[m, k]`` and their *target* token ids ``[m, k]`` of each row's
        next-token distribution, on the host (numpy)."""
        vals, ids = self.model.top_children(layer_out, self.top_k)
        if not self._on_cpu:
            vals, ids = vals.cpu(), ids.cpu()
        return vals.numpy(), self._draft_to_target(ids.numpy())

    # -- Drafter API --------------------------------------------------------------------
    @without_grad
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
            tokens = prompt_ids[0, 1:].cpu().numpy()
            hidden = self.model.project_features(target_features[0, :-1].to(self.device))
            self._run(tokens, hidden, range(n - 1), causal_mask(n - 1, 0, self.dtype, self.device))
            st.next_position = n - 1
        st.pending_tokens = []
        st.pending_features = [target_features[0, -1:]]

    @without_grad
    def draft_level(self, tree: DraftTree, expand: torch.Tensor | None = None, children: int | None = None) -> None:
        if self._state.pending_features is None and self._tree is None:
            raise RuntimeError("call start() before draft_level()")
        k = self.top_k if children is None else max(1, min(int(children), self.top_k))
        if tree.num_levels == 0:
            self._begin_tree(tree)
            vals, ids = self._root_top
            self._add_level(tree, ids[:k], vals[:k], np.full(k, -1, dtype=np.int64))
            return
        if tree is not self._tree:
            raise RuntimeError("draft_level() got a tree this drafter did not start")
        # the newest level is the one this drafter added last
        frontier = newest_to_expand(tree, expand, self.top_k, range(self._level_start, len(tree)))
        vals = self._node_top_vals[frontier, :k].reshape(-1)
        ids = self._node_top_ids[frontier, :k].reshape(-1)
        self._add_level(tree, ids, vals, frontier if k == 1 else np.repeat(frontier, k))

    def _begin_tree(self, tree: DraftTree) -> None:
        """Run the queued target-feature pairs plus the root pair; cache them as committed."""
        st = self._state
        if st.expected_root is not None and int(tree.root_token) != st.expected_root:
            raise ValueError(f"tree root {tree.root_token} is not the last committed token {st.expected_root}")
        tokens = np.array([*st.pending_tokens, int(tree.root_token)], dtype=np.int64)
        pending = st.pending_features
        feats = None if pending is None else pending[0] if len(pending) == 1 else torch.cat(pending)
        if feats is None or feats.shape[0] != tokens.size:
            raise RuntimeError("target features and committed tokens are out of step")
        q, past = tokens.size, st.cache.length
        positions = range(st.next_position, st.next_position + q)
        if not (self._on_cpu and feats.is_cpu):
            feats = feats.to(self.device)
        hidden = self.model.project_features(feats)
        nxt, out = self._run(tokens, hidden, positions, causal_mask(q, past, self.dtype, self.device))
        self._stable_len = past + q
        self._root_position = positions[-1]
        st.pending_tokens = []
        st.pending_features = None
        st.next_position = self._root_position + 1
        tree.root_hidden = self._root_hidden = nxt[-1]
        vals, ids = self._top_children(out[-1:])
        self._root_top = (vals[0], ids[0])
        # Per tree node, on the host: its top-k children (log-prob, target id) and its
        # ancestor-or-self row; the newest level's hidden states (the next level's parents).
        self._node_top_vals = np.empty((0, self.top_k), dtype=vals.dtype)
        self._node_top_ids = np.empty((0, self.top_k), dtype=np.int64)
        self._ancestors: np.ndarray | None = None  # None while the tree is a chain
        self._level_start, self._level_hidden = 0, None
        self._tree = tree

    def _add_level(self, tree: DraftTree, tokens: np.ndarray, logp: np.ndarray, parents: np.ndarray) -> None:
        """Run the new nodes (target ids ``tokens`` under ``parents``) and append them to ``tree``.

        A level's parents are all the root (the first level) or all nodes of the newest
        level (:func:`~specfit_hf.generation.drafter.frontier_nodes`), so every new node has the same depth.
        """
        m, n0 = parents.size, len(tree)
        if self._state.cache.length != self._stable_len + n0:
            raise RuntimeError("draft cache and tree are out of step")
        if self._ancestors is None and m == 1:
            # The tree stays a chain (most drafting cycles): the new node sees every slot, so it
            # needs no mask (attention over all keys; the same values as an all-zero additive
            # mask, one allocation less) and no ancestor rows.
            mask = None
        else:
            # ancestor-or-self relation among tree nodes (a chain's is the lower triangle),
            # grown by one block per level
            anc = causal_pattern(n0) if self._ancestors is None else self._ancestors
            rows, self._ancestors = grow_ancestor_rows(anc, parents)
            mask = additive_mask(rows, self._stable_len, self.dtype, self.device)
        # every node of the level sits at the same position: prefix + depth, the depth being
        # one more than the newest level's (tree.num_levels)
        position = self._root_position + 1 + tree.num_levels
        positions = range(position, position + 1) if m == 1 else np.full(m, position)
        if n0 == 0:  # children of the root
            parent_hidden = self._root_hidden.expand(m, -1).contiguous()
        elif m == 1:  # one parent: its row of the newest level's hidden states, no index tensor
            row = int(parents[0]) - self._level_start
            parent_hidden = self._level_hidden[row : row + 1]
        else:
            index = torch.from_numpy(parents - self._level_start)
            parent_hidden = self._level_hidden.index_select(0, index.to(self.device))
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        nxt, out = self._run(tokens, parent_hidden, positions, mask)
        vals, ids = self._top_children(out)
        self._node_top_vals = np.concatenate([self._node_top_vals, vals])
        self._node_top_ids = np.concatenate([self._node_top_ids, ids])
        self._level_start, self._level_hidden = n0, nxt
        # exp in torch, as before (numpy's float32 exp may differ in the last bit), then float64 as the tree keeps
        draft_probs = torch.from_numpy(np.ascontiguousarray(logp)).exp().numpy().astype(np.float64)
        tree.add_level(tokens, parents, draft_probs, hidden=nxt)

    @without_grad
    def commit(self, tree: DraftTree, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        if target_features is None:
            raise ValueError("the EAGLE-3 drafter needs the target features of the accepted path")
        accepted = list(result.accepted)
        feats = target_features.reshape(-1, target_features.shape[-1])
        if feats.shape[0] != len(accepted) + 1:
            raise ValueError(
                f"expected target features for the root and {len(accepted)} accepted nodes, got {feats.shape[0]} rows"
            )
        tree_tokens = tree.tokens.tolist() if accepted else []
        if list(result.new_tokens[:-1]) != [tree_tokens[i] for i in accepted]:
            raise ValueError("result.new_tokens does not start with the accepted nodes' tokens")
        st = self._state
        if self._tree is not None:
            # Drop every tree slot: keep the committed prefix (which ends with the root pair).  The tree
            # verified may be a prompt-lookup chain the policy chose after this drafter's first levels.
            other_root = int(tree.root_token) != int(self._tree.root_token)
            if tree is not self._tree and (tree.source == "draft" or other_root):
                raise ValueError("commit() got a tree of another root, or a drafted tree this drafter did not grow")
            st.cache.crop_to(self._stable_len)
            st.pending_tokens = [int(t) for t in result.new_tokens[:-1]]
            st.pending_features = [feats]
        else:
            # Nothing was drafted for this root (a plain step, or a prompt-lookup chain): the root
            # and the accepted tokens join the queued pairs, read when drafting resumes.
            if accepted and tree.source == "draft":
                raise ValueError("accepted nodes reported for a tree this drafter never expanded")
            if st.expected_root is not None and int(tree.root_token) != st.expected_root:
                raise ValueError(f"tree root {tree.root_token} is not the last committed token {st.expected_root}")
            st.pending_tokens.append(int(tree.root_token))
            st.pending_tokens.extend(int(t) for t in result.new_tokens[:-1])
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
