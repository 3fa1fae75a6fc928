"""Stage 2 of the cycle: grow a draft tree below the root, level by level.

A :class:`Drafter` wraps a draft model for one ``generate`` call.  The loop drives it:

    drafter.start(prompt_ids, features)        # once, after the target's prefill
    each cycle:
        tree = DraftTree(root_token)
        drafter.draft_level(tree)               # repeated while the policy wants more
        ... verify ...
        drafter.commit(tree, result, features)  # keep only the accepted path

``features`` are the target's hidden states the drafter asked for through
``target_feature_indices`` (HF ``hidden_states`` indices), concatenated on the last
axis in that order: ``[1, T, len(indices) * H_target]``, one row per target position
(prompt positions at ``start``; root + accepted nodes at ``commit``).  Drafters that
need no target features leave ``target_feature_indices`` as ``None`` and get ``None``.

Draft models plug in through ``assistant_model.make_tree_drafter(target, config)``
when they define it (the EAGLE-3 draft does); any other causal LM sharing the
target's tokenizer gets the generic top-k tree drafter
(:class:`specfit_hf.generation.causal_lm_drafter.CausalLMTreeDrafter`).
:func:`specfit_hf.generation.candidates.make_drafter` applies that rule.

``config`` is the :class:`~specfit_hf.generation.config.SpecFitConfig` of the call; the
tree's branching factor is ``config.tree_top_k`` (``config.top_k`` is the *sampling*
top-k of ``GenerationConfig``), the draft depth ``config.max_depth``.

Position convention: the root sits at position ``prefix_len`` (tokens before it in the
target's cache) and a node of depth ``d`` at ``prefix_len + d``.  The root is the token
the target produced last (at prefill, or the previous cycle's bonus token).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Callable, ParamSpec, TypeVar

import numpy as np
import torch

from ..tree import DraftTree, VerifyResult

__all__ = ["Drafter", "frontier_nodes", "newest_to_expand", "without_grad"]

P = ParamSpec("P")
R = TypeVar("R")


class Drafter(ABC):
    """Interface between the generation loop and a draft model."""

    #: HF ``hidden_states`` indices of the target features this drafter consumes, or None.
    target_feature_indices: tuple[int, ...] | None = None

    @abstractmethod
    def start(self, prompt_ids: torch.LongTensor, target_features: torch.Tensor | None) -> None:
        """Prefill the draft on the prompt (``[1, T]``); the root comes with the first tree."""

    @abstractmethod
    def draft_level(self, tree: DraftTree, expand: torch.Tensor | None = None, children: int | None = None) -> None:
        """Add one level of children to ``tree`` (the first call adds the root's children).

        ``expand``: the nodes of the newest level to expand (default: the drafter's own
        frontier rule); ``children``: children per expanded node (default: the drafter's
        branching factor; never more).  Must fill tokens (target vocabulary ids), parents,
        draft_probs and, when the drafter has one, each node's hidden state
        (``tree.hidden``, ``tree.root_hidden``).
        """

    @abstractmethod
    def commit(self, tree: DraftTree, result: VerifyResult, target_features: torch.Tensor | None) -> None:
        """Verification finished: keep the root and the accepted path, drop the rest.

        ``target_features`` covers the root and the accepted nodes, in path order.
        The next cycle's root is ``result.bonus_token``.  A tree this drafter did not grow
        (``tree.source == "lookup"``: a chain copied from the context) commits its root and
        accepted tokens as tokens the draft has not read yet, like a plain step's root; where this
        drafter had begun a tree for the same root (the policy chose the lookup chain after a level),
        its drafted levels are dropped and the root it read is kept.
        """


def without_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """``@torch.no_grad()`` that enters no context when gradients are already off.

    The generation loop runs under ``no_grad``; entering the decorator's context again costs
    a few Python frames in every draft level, verification and commit.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def frontier_nodes(tree: DraftTree, expand: torch.Tensor | None, width: int) -> torch.Tensor:
    """The newest level's nodes to expand: ``expand`` (checked), else the ``width`` most likely."""
    nodes = torch.from_numpy(newest_to_expand(tree, expand, width))
    return nodes.to(expand.device) if isinstance(expand, torch.Tensor) and not expand.is_cpu else nodes


def newest_to_expand(
    tree: DraftTree, expand: torch.Tensor | None, width: int, newest: range | None = None
) -> np.ndarray:
    """:func:`frontier_nodes` as a host (numpy) array of node indices.

    ``newest``: the newest level's nodes when the caller knows them (a drafter that grew the
    tree itself), which spares scanning the depths.  Host bookkeeping in numpy / Python: this
    runs before every draft level, and each torch op on these few rows costs 5-20 us of dispatch.
    """
    if expand is None:
        if newest is None:
            nodes = np.flatnonzero(tree.depths.numpy() == tree.num_levels)
        else:
            nodes = np.arange(newest.start, newest.stop)
        if nodes.size == 1 and width >= 1:  # a chain: nothing to rank
            return nodes
        ranked = torch.from_numpy(nodes)
        return ranked[tree.path_probs[ranked].topk(min(width, ranked.numel())).indices].numpy()
    if not isinstance(expand, torch.Tensor) or expand.dtype != torch.long or expand.dim() != 1:
        expand = torch.as_tensor(expand, dtype=torch.long).reshape(-1)
    listed = expand.tolist()
    if newest is not None:
        ok = all(v in newest for v in listed)
    else:
        depths = tree.depths.numpy()
        ok = all(0 <= v < depths.size and depths[v] == tree.num_levels for v in listed)
    if not ok:
        raise ValueError(f"can only expand nodes of the newest level {tree.num_levels}; got {listed}")
    return np.array(listed, dtype=np.int64)
