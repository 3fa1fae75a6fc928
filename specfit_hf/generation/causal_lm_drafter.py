"""Stage 2 (generic): draft a token tree with any small causal LM sharing the target's tokenizer.

EAGLE-2 style dynamic tree, level by level:

* level 1 runs the root (plus any committed tokens the draft has not consumed yet) and
  adds the root's ``tree_top_k`` most likely children;
* level ``d >= 2`` runs the ``tree_top_k`` nodes of level ``d-1`` with the highest
  cumulative draft probability in ONE forward (tree attention mask, positions
  ``prefix + depth``) and adds each one's ``tree_top_k`` children.  All children enter
  the tree; the selection policy reranks them.

The draft's KV cache (:class:`~specfit_hf.generation.cache.SpecFitCache`) holds the
committed sequence followed by a *tree region*: the root and every node run this cycle,
in run order.  At commit the region is gathered down to the root and the accepted nodes
that were run; accepted leaves the draft never ran are fed at the next level 1.

Hidden states (``tree.hidden``): the draft's final hidden state after consuming the
node's token for every node that has been expanded; a node not expanded (yet) carries
its parent's state, i.e. the state whose LM head proposed it (the best the draft knows
about it without another forward).  ``tree.root_hidden`` is the root's own state.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tree import DraftTree, VerifyResult
from .cache import SpecFitCache
from .drafter import Drafter, frontier_nodes
from .tree_mask import grow_ancestors, model_tree_masks, visibility_to_mask

__all__ = ["CausalLMTreeDrafter"]


class CausalLMTreeDrafter(Drafter):
    """Top-k tree drafter over a transformers causal LM (``AutoModelForCausalLM``-style).

    Args:
        draft_model: the draft causal LM (shares the target's tokenizer).
        target: the target model; only its vocabulary size is read (draft logits beyond
            it are ignored, so a draft with a padded vocabulary is fine).
        config: the ``SpecFitConfig`` (``tree_top_k`` is the branching factor).
    """

    target_feature_indices = None

    def __init__(self, draft_model: Any, target: Any, config: Any) -> None:
        self.model = draft_model
        self.top_k = int(config.tree_top_k)
        target_vocab = target.config.get_text_config().vocab_size
        draft_vocab = draft_model.config.get_text_config().vocab_size
        if draft_vocab < target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft_vocab} tokens) is smaller than the target's "
                f"({target_vocab}): target token ids would index past the draft's embedding table. "
                "A generic draft must share the target's tokenizer (a larger, padded vocabulary is fine); "
                "use an EAGLE-3 draft with a d2t table for a reduced draft vocabulary"
            )
        self.vocab_limit = int(min(target_vocab, draft_vocab))
        self.device = draft_model.device
        self.mask_dtype = draft_model.dtype if draft_model.dtype.is_floating_point else torch.float32
        self.cache: SpecFitCache | None = None
        self._committed_len = 0
        self._pending: list[int] = []
        self._reset_region()

    # ------------------------------------------------------------------ helpers
    def _reset_region(self) -> None:
        # Per-cycle bookkeeping of the draft cache's tree region.
        self._region_anc = torch.empty(0, 0, dtype=torch.bool)  # [R, R] ancestor-or-self within the region
        self._region_pos = torch.empty(0, dtype=torch.long)  # [R] sequence position of each region entry
        self._node_region = torch.empty(0, dtype=torch.long)  # tree node -> region index (-1: not run)
        self._last_level = torch.empty(0, dtype=torch.long)

    @torch.no_grad()
    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, n_logits: int):
        out = self.model(
            input_ids=tokens.reshape(1, -1).to(self.device),
            position_ids=positions.reshape(1, -1).to(self.device),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=n_logits,
        )
        logits = out.logits[0, -n_logits:, : self.vocab_limit].float()
        hidden = out.hidden_states[-1][0, -n_logits:]
        return logits, hidden

    def _chain_mask(self, n: int, prefix_len: int) -> torch.Tensor:
        """Causal mask of a plain chain of ``n`` tokens (a tree without branches)."""
        visible = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        mask = visibility_to_mask(visible, prefix_len, dtype=self.mask_dtype)
        return model_tree_masks(self.model.config, mask, prefix_len + torch.arange(n),
                                sliding_offset=self.cache.sliding_offset)

    def _top_children(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[m, V]`` logits -> (``[m, k]`` tokens, ``[m, k]`` probabilities)."""
        k = min(self.top_k, logits.shape[-1])
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, k, dim=-1)
        return top.indices, top.values.exp()

    # ---------------------------------------------------------------- interface
    @torch.no_grad()
    def start(self, prompt_ids: torch.LongTensor, target_features: torch.Tensor | None) -> None:
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise ValueError(f"CausalLMTreeDrafter works on batch size 1, got prompt shape {tuple(prompt_ids.shape)}")
        self.cache = SpecFitCache(config=self.model.config)
        n = prompt_ids.shape[1]
        # A plain causal prefill: the model builds its own (cheaper) causal mask.
        self._forward(prompt_ids[0], torch.arange(n), None, 1)
        self._committed_len = n
        self._pending = []
        self._reset_region()

    @torch.no_grad()
    def draft_level(self, tree: DraftTree, expand: torch.Tensor | None = None, children: int | None = None) -> None:
        if self.cache is None:
            raise RuntimeError("CausalLMTreeDrafter.start() must run before draft_level()")
        k = self.top_k if children is None else max(1, min(int(children), self.top_k))
        if tree.num_levels == 0:
            self._draft_root_children(tree, k)
        else:
            self._draft_next_level(tree, expand, k)

    def _draft_root_children(self, tree: DraftTree, k: int) -> None:
        # Feed committed-but-unseen tokens and the root as one chain; they become
        # committed draft positions, the root opens the tree region.
        chain_tokens = torch.tensor(self._pending + [tree.root_token], dtype=torch.long)
        m = chain_tokens.numel()
        mask = self._chain_mask(m, self._committed_len)
        logits, hidden = self._forward(chain_tokens, self._committed_len + torch.arange(m), mask, 1)
        self._committed_len += m - 1
        self._pending = []
        tokens, probs = self._top_children(logits)
        tokens, probs = tokens[:, :k], probs[:, :k]
        root_hidden = hidden[-1]
        tree.root_hidden = root_hidden
        new = tree.add_level(
            tokens[0], torch.full((k,), -1, dtype=torch.long), probs[0], hidden=root_hidden.unsqueeze(0).repeat(k, 1)
        )
        self._region_anc = torch.ones(1, 1, dtype=torch.bool)
        self._region_pos = torch.tensor([self._committed_len])
        self._node_region = torch.full((len(tree),), -1, dtype=torch.long)
        self._last_level = new

    def _draft_next_level(self, tree: DraftTree, expand: torch.Tensor | None, k: int) -> None:
        last = self._last_level
        if last.numel() == 0:
            return
        # Expand the best tree_top_k nodes of the newest level (EAGLE-2 frontier), or those asked for.
        frontier = frontier_nodes(tree, expand, self.top_k).sort().values
        k_front = frontier.numel()
        if k_front == 0:
            return
        tree_parents = tree.parents[frontier]
        # Region index of each frontier node's parent (the root is region index 0).
        parent_region = torch.where(tree_parents >= 0, self._node_region[tree_parents.clamp(min=0)], 0)
        if bool((parent_region < 0).any()):
            raise RuntimeError("draft tree invariant broken: an expanded node's parent was never run")
        region_len = self._region_anc.shape[0]
        # A frontier node sees its parent's ancestors and itself (rows built incrementally).
        new_rows, region_anc = grow_ancestors(self._region_anc, parent_region)
        mask = visibility_to_mask(new_rows.to(self.device), self._committed_len, dtype=self.mask_dtype)
        positions = self._committed_len + tree.depths[frontier]
        key_positions = torch.cat([torch.arange(self._committed_len), self._region_pos, positions])
        mask = model_tree_masks(self.model.config, mask, positions, key_positions,
                                sliding_offset=self.cache.sliding_offset)
        logits, hidden = self._forward(tree.tokens[frontier], positions, mask, k_front)

        self._region_anc = region_anc
        self._node_region[frontier] = region_len + torch.arange(k_front)
        self._region_pos = torch.cat([self._region_pos, positions])
        if tree.hidden is not None:
            # These nodes have now been run: store their own state (see module docstring).
            tree.hidden[frontier] = hidden.to(tree.hidden)

        tokens, probs = self._top_children(logits)  # [k_front, top_k]
        tokens, probs = tokens[:, :k], probs[:, :k]
        new = tree.add_level(
            tokens.reshape(-1),
            frontier.repeat_interleave(k),
            probs.reshape(-1),
            hidden=hidden.repeat_interleave(k, dim=0),
        )
        self._node_region = torch.cat([self._node_region, torch.full((new.numel(),), -1, dtype=torch.long)])
        self._last_level = new

    @torch.no_grad()
    def commit(self, tree: DraftTree, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        if self.cache is None:
            raise RuntimeError("CausalLMTreeDrafter.start() must run before commit()")
        accepted = torch.as_tensor(result.accepted, dtype=torch.long)
        accepted_tokens = tree.tokens[accepted].tolist() if accepted.numel() else []
        if self._region_anc.numel() == 0:
            # Nothing was drafted this cycle (a plain step, or a prompt-lookup chain): the draft
            # never saw the root nor the accepted tokens.
            self._pending += [tree.root_token] + accepted_tokens
        elif tree.num_levels == 0 or tree.source != "draft":
            # Drafted, then a prompt-lookup chain was verified instead: keep the root the draft read, drop
            # its drafted levels; the accepted tokens are unseen
            self.cache.keep_prefix_and(self._committed_len, torch.zeros(1, dtype=torch.long))
            self._committed_len += 1
            self._pending += accepted_tokens
        else:
            region = self._node_region[accepted] if accepted.numel() else torch.empty(0, dtype=torch.long)
            n_run = int((region >= 0).sum())
            # Run nodes form a prefix of the accepted path (a node is run only if its parent was).
            if n_run and bool((region[:n_run] < 0).any()):
                raise RuntimeError("draft tree invariant broken: accepted path runs a node below an unrun one")
            keep_block = torch.cat([torch.zeros(1, dtype=torch.long), region[:n_run]])
            self.cache.keep_prefix_and(self._committed_len, keep_block)
            self._committed_len += 1 + n_run
            self._pending += accepted_tokens[n_run:]
        self._reset_region()
