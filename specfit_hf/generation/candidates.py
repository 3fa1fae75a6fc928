"""Stages 2-3 of the cycle: draft a tree and select the subtree to verify.

:func:`make_drafter` picks the drafter of a draft model.  :class:`TreeCandidateGenerator` is
a transformers ``CandidateGenerator`` whose candidates
are a *tree*: it alternates ``policy.select`` and ``drafter.draft_level`` until the
policy says stop (or ``max_depth`` levels exist), then lays the selected nodes out as a
verification block ``[root] + selected nodes`` (:class:`TreeCandidates`).  When the policy
takes prompt-lookup proposals (``policy.lookup_tokens``), each cycle's proposal is offered
to it first (``CycleContext.lookup``); a selection with ``lookup`` set verifies that chain
and drafts nothing.

Block layout: index 0 is the root; index ``1 + i`` is the ``i``-th selected node in tree
order, so parents precede children and ``block_parents`` indexes the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator

from ..clock import clock
from ..offload import OffloadRuntime
from ..selection import SelectionPolicy
from ..tree import CycleContext, CycleRecord, DraftTree, Selection, VerifyResult, _flat_host
from .causal_lm_drafter import CausalLMTreeDrafter
from .drafter import Drafter
from .lookup import PromptLookup
from .tree_mask import additive_mask, ancestors, causal_mask, is_chain, tree_attention_mask

__all__ = ["TreeCandidates", "TreeCandidateGenerator", "layout_candidates", "make_drafter"]


def make_drafter(assistant_model: torch.nn.Module, target: torch.nn.Module, config: GenerationConfig) -> Drafter:
    """The drafter for ``assistant_model``: its own ``make_tree_drafter`` if it has one (the
    EAGLE-3 draft does), else the generic :class:`~.causal_lm_drafter.CausalLMTreeDrafter`."""
    factory = getattr(assistant_model, "make_tree_drafter", None)
    if not callable(factory):
        return CausalLMTreeDrafter(assistant_model, target, config)
    drafter = factory(target, config)
    if not isinstance(drafter, Drafter):
        raise TypeError(
            f"{type(assistant_model).__name__}.make_tree_drafter returned {type(drafter).__name__}, "
            "which does not implement specfit_hf.generation.drafter.Drafter"
        )
    return drafter


@dataclass
class TreeCandidates:
    """The tree to verify, as the target's forward needs it.

    Attributes:
        tree: the whole draft tree of the cycle.
        selection: the policy's choice (tree indices of the selected nodes).
        input_ids: ``[1, 1 + n]`` root then the selected nodes' tokens (block order).
        block_parents: ``[1 + n]`` in-block parent index (root: -1).
        depths: ``[1 + n]`` depth below the root (root: 0).
        path_probs: ``[1 + n]`` cumulative draft probability (root: 1).
        position_ids: ``[1, 1 + n]`` = root position (``prefix_len`` without padding) ``+ depths``.
        attention_mask: ``[1, 1, 1 + n, prefix_len + 1 + n]`` additive float tree mask, or
            ``None`` for a root-only block that sees the whole prefix (a plain decode step).
        prefix_len: tokens in the target cache before the root.
        draft_seconds / select_seconds: time spent in the drafter / the policy.
    """

    tree: DraftTree
    selection: Selection
    input_ids: torch.LongTensor
    block_parents: torch.LongTensor
    depths: torch.LongTensor
    path_probs: torch.Tensor
    position_ids: torch.LongTensor
    attention_mask: torch.Tensor | None
    prefix_len: int
    draft_seconds: float = 0.0
    select_seconds: float = 0.0

    @property
    def num_nodes(self) -> int:
        """Selected draft nodes (root excluded)."""
        return int(self.input_ids.shape[1]) - 1


# a root-only block's layout (shared, never written to)
_ROOT_PARENTS, _ROOT_DEPTHS = torch.tensor([-1]), torch.tensor([0])
_ROOT_PATH_PROBS = torch.ones(1, dtype=torch.float64)


def _select_block(tree: DraftTree, nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Block arrays (tokens, parents, depths, path probs) for ``[root] + nodes``."""
    if nodes.numel() == 0:  # a plain step: most cycles where drafting does not pay
        return torch.tensor([tree.root_token]), _ROOT_PARENTS, _ROOT_DEPTHS, _ROOT_PATH_PROBS
    return tuple(torch.from_numpy(a) for a in _block_arrays(tree, nodes))


def _block_arrays(tree: DraftTree, nodes: torch.Tensor) -> tuple[np.ndarray, ...]:
    """:func:`_select_block` of a non-empty selection, as numpy arrays.

    Index bookkeeping in numpy: a microsecond an op, where a torch op on these few rows
    costs 5-20 (this runs every drafting cycle).
    """
    nodes = np.sort(_flat_host(nodes, np.int64))
    n = nodes.size
    if nodes.tolist() == list(range(n)):
        # The first n nodes (a chain, or any prefix of creation order): node i is block
        # index i + 1, and parents precede children, so the selection is ancestor-closed.
        pick = slice(0, n)
        parents = tree.parents.numpy()[pick] + 1
    else:
        pick = nodes
        tree_parents = tree.parents.numpy()[nodes]
        block_of_node = np.full(len(tree) + 1, -1, dtype=np.int64)
        block_of_node[nodes] = np.arange(1, n + 1)
        # Parent -1 (the root) maps to block index 0.
        parents = np.where(tree_parents >= 0, block_of_node[np.maximum(tree_parents, 0)], 0)
        if (parents < 0).any():
            orphans = nodes[parents < 0][:8]
            raise ValueError(
                f"the selection is not ancestor-closed: nodes {orphans.tolist()} are selected without their parents "
                f"{tree.parents.numpy()[orphans].tolist()}"
            )
    tokens = np.concatenate(([tree.root_token], tree.tokens.numpy()[pick])).astype(np.int64, copy=False)
    block_parents = np.concatenate(([-1], parents)).astype(np.int64, copy=False)
    depths = np.concatenate(([0], tree.depths.numpy()[pick])).astype(np.int64, copy=False)
    path_probs = np.concatenate(([1.0], tree.path_probs.numpy()[pick])).astype(np.float64, copy=False)
    return tokens, block_parents, depths, path_probs


def layout_candidates(
    tree: DraftTree,
    selection: Selection,
    prefix_len: int,
    root_position: int,
    prefix_hidden: torch.Tensor | None,
    device,
    mask_dtype: torch.dtype,
) -> TreeCandidates:
    """Lay ``[root] + selection.nodes`` out as a verification block with its tree mask.

    A root-only block over an unpadded prefix gets no mask (``None``): it sees the whole
    prefix, as a plain decode step does, so the target's own causal mask serves and a
    plain step costs no more host time than in stock ``generate``.
    """
    device = torch.device(device)
    if len(selection):
        tokens, parents, depths, path_probs = _block_arrays(tree, selection.nodes)
        if prefix_hidden is None and is_chain(parents):  # the commonest block
            mask = causal_mask(parents.size, prefix_len, mask_dtype, device)
        else:
            mask = additive_mask(ancestors(parents), prefix_len, mask_dtype, device, prefix_hidden)
        input_ids = torch.from_numpy(tokens[None])
        position_ids = torch.from_numpy((root_position + depths)[None])
        if device.type != "cpu":  # (a .to() that changes nothing still costs a dispatch)
            input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        parents, depths, path_probs = torch.from_numpy(parents), torch.from_numpy(depths), torch.from_numpy(path_probs)
    else:
        tokens, parents, depths, path_probs = _select_block(tree, selection.nodes)
        mask = None
        if prefix_hidden is not None:
            mask = tree_attention_mask(parents, prefix_len, mask_dtype, device, max_depth=0,
                                       prefix_hidden=prefix_hidden)
        input_ids = tokens.to(device)[None]
        position_ids = torch.tensor([[root_position]], device=device)
    return TreeCandidates(
        tree=tree,
        selection=selection,
        input_ids=input_ids,
        block_parents=parents,
        depths=depths,
        path_probs=path_probs,
        position_ids=position_ids,
        attention_mask=mask,
        prefix_len=prefix_len,
    )


class TreeCandidateGenerator(CandidateGenerator):
    """Draft + select: produces the :class:`TreeCandidates` of each cycle.

    Args:
        drafter: the :class:`~specfit_hf.generation.drafter.Drafter` of this ``generate`` call.
        policy: a selection policy (``specfit_hf.selection.get_policy``).
        ctx: the policy's ``CycleContext`` (``prefix_len`` is updated every cycle).
        max_depth: hard cap on draft levels (the policy may stop earlier).
        device / mask_dtype: where and in which dtype the target runs.
        lookup: the context's n-gram index, when the policy takes prompt-lookup proposals.
        runtime: the target's offload runtime, which copies the experts a selection asks to prefetch.
    """

    def __init__(self, drafter: Drafter, policy: SelectionPolicy, ctx: CycleContext, max_depth: int,
                 device: torch.device | str, mask_dtype: torch.dtype, lookup: PromptLookup | None = None,
                 runtime: OffloadRuntime | None = None) -> None:
        self.drafter = drafter
        self.runtime = runtime
        self.policy = policy
        self.ctx = ctx
        self.max_depth = int(max_depth)
        self.device = device
        self.mask_dtype = mask_dtype
        self.lookup = lookup
        self.last_candidates: TreeCandidates | None = None

    def start(self, prompt_ids: torch.LongTensor, prompt_features: torch.Tensor | None, first_token: int) -> None:
        """After the prefill: the drafter reads the prompt; the lookup indexes it and the first token."""
        self.drafter.start(prompt_ids, prompt_features)
        if self.lookup is not None:
            self.lookup.start([*prompt_ids.reshape(-1).tolist(), int(first_token)], prompt_len=prompt_ids.numel())

    def propose(
        self,
        root_token: int,
        prefix_len: int,
        root_position: int | None = None,
        prefix_hidden: torch.Tensor | None = None,
    ) -> TreeCandidates:
        """Grow the tree below ``root_token`` while the policy asks, and lay out its selection.

        ``root_position`` is the root's position id (default ``prefix_len``; differs when the
        prompt holds padding); ``prefix_hidden`` lists padded prefix positions to mask out.
        """
        root_position = prefix_len if root_position is None else int(root_position)
        self.ctx.prefix_len = prefix_len
        tree = DraftTree(root_token=int(root_token))
        draft_s = 0.0
        t = clock()
        self.ctx.lookup = None if self.lookup is None else self.lookup.propose()
        selection = self.policy.select(tree, self.ctx)
        select_s = clock() - t
        while not selection.lookup and not selection.stop and tree.num_levels < self.max_depth:
            size_before = len(tree)
            t = clock()
            for level in range(selection.levels):  # the plan's further levels grow below the newest level
                if level and tree.num_levels >= self.max_depth:
                    break
                expand = selection.expand if level == 0 else None
                if expand is None and selection.children is None:
                    self.drafter.draft_level(tree)  # the drafter's own frontier rule
                else:
                    self.drafter.draft_level(tree, expand=expand, children=selection.children)
            draft_s += clock() - t
            t = clock()
            selection = self.policy.select(tree, self.ctx)
            select_s += clock() - t
            if self.runtime is not None:
                # the experts the verify is predicted to need move while the next levels are drafted, or
                # while the verify computes the layers before theirs
                if selection.prefetch is not None:
                    self.runtime.prefetch(selection.prefetch, selection.keep_resident)
                if selection.prefetch_ahead is not None:
                    self.runtime.prefetch_ahead(selection.prefetch_ahead, selection.keep_resident)
            if len(tree) == size_before:  # the drafter has nothing more to add
                break
        if selection.lookup:
            # verify the prompt-lookup chain: nothing drafted, or the levels drafted are dropped (the drafter's
            # commit keeps only the root it read)
            if self.ctx.lookup is None:
                raise RuntimeError(f"{type(self.policy).__name__} selected a lookup chain in a cycle without one")
            tree = self.ctx.lookup.tree(root_token)
        candidates = layout_candidates(
            tree, selection, prefix_len, root_position, prefix_hidden, self.device, self.mask_dtype
        )
        candidates.draft_seconds = draft_s
        candidates.select_seconds = select_s
        self.last_candidates = candidates
        return candidates

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, None]:
        """``CandidateGenerator`` entry point: ``input_ids`` ends with the root (not yet in the
        target cache).  Returns ``input_ids`` followed by the selected nodes in block order
        (a flattened tree, not a path) and no logits; the tree itself is ``self.last_candidates``."""
        candidates = self.propose(int(input_ids[0, -1]), input_ids.shape[1] - 1)
        return torch.cat([input_ids, candidates.input_ids[:, 1:].to(input_ids.device)], dim=1), None

    def commit(self, candidates: TreeCandidates, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        """Tell the drafter which path was accepted (its cache keeps only that path), and the lookup the
        committed tokens (generation goes on, so none were cut by a stop rule)."""
        self.drafter.commit(candidates.tree, result, target_features)
        if self.lookup is not None:
            self.lookup.extend(result.new_tokens)

    def observe(self, candidates: TreeCandidates, result: VerifyResult, record: CycleRecord) -> None:
        """Let the policy learn from the cycle's outcome."""
        self.policy.observe(candidates.tree, candidates.selection, result, record)
