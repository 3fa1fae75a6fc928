"""Selection policies: which drafted nodes to verify, and when to stop drafting.

The generation loop calls a policy in three places of every cycle:

* ``select(tree, ctx)`` before drafting (on the empty tree) and after each draft
  level.  It returns a :class:`~specfit_hf.tree.Selection`; ``selection.stop`` ends
  drafting and the last selection is verified.
* ``observe(tree, selection, result, record)`` after verification, so a policy can
  refine its estimates online.

Policies are looked up by name (``SpecFitConfig(policy=...)``) in a small registry:
``eagle3`` and ``autoregressive`` here, ``specfit`` (throughput-optimal subtree, exact
search) and ``oracle`` (benchmark upper bound) in :mod:`specfit_hf.selection.specfit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..tree import DraftTree, Selection, VerifyResult

__all__ = [
    "CycleContext",
    "SelectionPolicy",
    "register_policy",
    "get_policy",
    "available_policies",
    "Eagle3Policy",
    "AutoregressivePolicy",
]


@dataclass
class CycleContext:
    """What a policy may read about the current generation.

    Attributes:
        target: the target model.
        runtime: the offload runtime attached to the target, or ``None``.
        config: the ``SpecFitConfig`` in use.
        prefix_len: tokens in the target cache before this cycle's root.
        extras: free slot for policy state shared with the loop (e.g. the drafter).
    """

    target: Any
    runtime: Any
    config: Any
    prefix_len: int = 0
    extras: dict = field(default_factory=dict)


class SelectionPolicy:
    """Base class.  Subclasses set ``name`` and implement :meth:`select`."""

    name: str = ""

    def __init__(self, config: Any) -> None:
        self.config = config

    def reset(self, ctx: CycleContext) -> None:
        """Called once when a ``generate`` call starts."""

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        raise NotImplementedError

    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, record: Any) -> None:
        """Called after each verification; default: nothing to learn."""


_REGISTRY: dict[str, type[SelectionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[SelectionPolicy]], type[SelectionPolicy]]:
    def deco(cls: type[SelectionPolicy]) -> type[SelectionPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, config: Any) -> SelectionPolicy:
    """Instantiate the policy registered as ``name``."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selection policy {name!r}; available: {available_policies()}") from None
    return cls(config)


def top_n_by_path_prob(tree: DraftTree, n: int) -> torch.Tensor:
    """The ``n`` nodes with the highest cumulative draft score, ancestor-closed.

    A child's path probability never exceeds its parent's, and a parent's index is
    smaller, so ranking by (score desc, index asc) keeps every chosen node's parent.
    """
    if n <= 0 or len(tree) == 0:
        return torch.empty(0, dtype=torch.long)
    idx = torch.arange(len(tree))
    # stable sort on -score keeps index order among ties
    order = torch.sort(-tree.path_probs, stable=True).indices
    return idx[order[:n]].sort().values


@register_policy("eagle3")
class Eagle3Policy(SelectionPolicy):
    """EAGLE-2/3 dynamic tree: draft ``max_depth`` levels, verify the top ``max_verify_nodes``."""

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        nodes = top_n_by_path_prob(tree, int(self.config.max_verify_nodes))
        stop = tree.num_levels >= int(self.config.max_depth)
        return Selection(nodes=nodes, stop=stop)


@register_policy("autoregressive")
class AutoregressivePolicy(SelectionPolicy):
    """Plain decoding through the same loop and cache: never drafts, verifies the root only."""

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        return Selection(nodes=torch.empty(0, dtype=torch.long), expected_tokens=1.0, stop=True)
