"""Stages 2-3 of the cycle: draft a tree and select the subtree to verify.

:func:`make_drafter` picks the drafter of a draft model.  :class:`TreeCandidateGenerator` is
a transformers ``CandidateGenerator`` whose candidates
are a *tree*: it alternates ``policy.select`` and ``drafter.draft_level`` until the
policy says stop (or ``max_depth`` levels exist), then lays the selected nodes out as a
verification block ``[root] + selected nodes`` (:class:`TreeCandidates`).

Block layout: index 0 is the root; index ``1 + i`` is the ``i``-th selected node in tree
order, so parents precede children and ``block_parents`` indexes the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import CandidateGenerator

from ..clock import clock
from ..selection import SelectionPolicy
from ..tree import CycleContext, CycleRecord, DraftTree, Selection, VerifyResult
from .causal_lm_drafter import CausalLMTreeDrafter
from .drafter import Drafter
from .tree_mask import tree_attention_mask

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
    nodes = nodes.reshape(-1).to(torch.long).sort().values
    n = nodes.numel()
    block_of_node = torch.full((len(tree) + 1,), -1, dtype=torch.long)
    block_of_node[nodes] = torch.arange(1, n + 1)
    tree_parents = tree.parents[nodes]
    # Parent -1 (the root) maps to block index 0.
    parents = torch.where(tree_parents >= 0, block_of_node[tree_parents.clamp(min=0)], 0)
    if bool((parents < 0).any()):
        orphans = nodes[parents < 0].tolist()
        raise ValueError(
            f"the selection is not ancestor-closed: nodes {orphans[:8]} are selected without their parents "
            f"{tree.parents[orphans[:8]].tolist()}"
        )
    tokens = torch.cat([torch.tensor([tree.root_token]), tree.tokens[nodes]])
    block_parents = torch.cat([torch.tensor([-1]), parents])
    depths = torch.cat([torch.tensor([0]), tree.depths[nodes]])
    path_probs = torch.cat([torch.ones(1, dtype=torch.float64), tree.path_probs[nodes].to(torch.float64)])
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
    tokens, block_parents, depths, path_probs = _select_block(tree, selection.nodes)
    mask = None
    if len(selection) or prefix_hidden is not None:
        mask = tree_attention_mask(
            block_parents, prefix_len, dtype=mask_dtype, device=device, max_depth=int(depths.max()),
            prefix_hidden=prefix_hidden,
        )
    if mask is None:  # a root-only block
        position_ids = torch.tensor([[root_position]], device=device)
    else:
        position_ids = (root_position + depths).to(device)[None]
    return TreeCandidates(
        tree=tree,
        selection=selection,
        input_ids=tokens.to(device)[None],
        block_parents=block_parents,
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
    """

    def __init__(self, drafter: Drafter, policy: SelectionPolicy, ctx: CycleContext, max_depth: int,
                 device: torch.device | str, mask_dtype: torch.dtype) -> None:
        self.drafter = drafter
        self.policy = policy
        self.ctx = ctx
        self.max_depth = int(max_depth)
        self.device = device
        self.mask_dtype = mask_dtype
        self.last_candidates: TreeCandidates | None = None

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
        selection = self.policy.select(tree, self.ctx)
        select_s = clock() - t
        while not selection.stop and tree.num_levels < self.max_depth:
            size_before = len(tree)
            t = clock()
            if selection.expand is None and selection.children is None:
                self.drafter.draft_level(tree)  # the drafter's own frontier rule
            else:
                self.drafter.draft_level(tree, expand=selection.expand, children=selection.children)
            draft_s += clock() - t
            t = clock()
            selection = self.policy.select(tree, self.ctx)
            select_s += clock() - t
            if len(tree) == size_before:  # the drafter has nothing more to add
                break
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
        """Tell the drafter which path was accepted (its cache keeps only that path)."""
        self.drafter.commit(candidates.tree, result, target_features)

    def observe(self, candidates: TreeCandidates, result: VerifyResult, record: CycleRecord) -> None:
        """Let the policy learn from the cycle's outcome."""
        self.policy.observe(candidates.tree, candidates.selection, result, record)
