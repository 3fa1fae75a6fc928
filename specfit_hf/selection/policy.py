"""Selection policies: which drafted nodes to verify, and when to stop drafting.

The generation loop calls a policy in three places of every cycle:

* ``reset(ctx)`` once when a ``generate`` call starts (``ctx``: a
  :class:`~specfit_hf.tree.CycleContext`);
* ``select(tree, ctx)`` before drafting (on the empty tree) and after each draft
  level.  It returns a :class:`~specfit_hf.tree.Selection`; ``selection.stop`` ends
  drafting and the last selection is verified.
* ``observe(tree, selection, result, record)`` after verification (``record``: a
  :class:`~specfit_hf.tree.CycleRecord`), so a policy can refine its estimates online.

Policies are looked up by name (``SpecFitConfig(policy=...)``) in a small registry:
``eagle3``, ``autoregressive`` and ``lookup`` (prompt lookup decoding) here, ``specfit``
(throughput-optimal subtree, exact search) in :mod:`.specfit`, ``oracle`` (benchmark upper
bound) in :mod:`.oracle`.  A policy that takes ``policy_kwargs`` names a frozen dataclass of options
(``options_class``); :func:`validate_policy` checks a name and its kwargs, which
``SpecFitConfig`` does when it is built.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import GenerationConfig

from ..tree import CycleContext, CycleRecord, DraftTree, Selection, VerifyResult
from .options import parse_options

__all__ = [
    "SelectionPolicy",
    "register_policy",
    "get_policy",
    "policy_class",
    "validate_policy",
    "available_policies",
    "Eagle3Policy",
    "AutoregressivePolicy",
    "PromptLookupPolicy",
]


class SelectionPolicy:
    """Base class.  Subclasses are registered with :func:`register_policy` and implement :meth:`select`.

    ``options_class``: the frozen dataclass of the policy's ``policy_kwargs`` (``None``: it
    takes none); the parsed options are ``self.options``.
    """

    name: str = ""
    options_class: type | None = None
    #: The longest prompt-lookup chain the policy may verify (0: it takes no proposals, and the
    #: loop keeps no n-gram index of the context).
    lookup_tokens: int = 0

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.options = self.parse_options(getattr(config, "policy_kwargs", None))

    @property
    def max_levels(self) -> int:
        """Draft levels a cycle may grow at most (the loop's hard cap): ``config.max_depth``."""
        return int(getattr(self.config, "max_depth", 7))

    @classmethod
    def parse_options(cls, kwargs: Any) -> Any:
        """The policy's options from ``policy_kwargs``; ``ValueError`` for unknown keys or bad values."""
        if cls.options_class is not None:
            return parse_options(cls.options_class, kwargs, cls.name)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"policy_kwargs must be a dict, got {type(kwargs).__name__} {kwargs!r}")
        if kwargs:
            raise ValueError(f"policy {cls.name!r} takes no policy_kwargs; got {sorted(kwargs)}")
        return None

    def reset(self, ctx: CycleContext) -> None:
        """Called once when a ``generate`` call starts."""

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        """The subtree to verify so far, and whether to stop drafting."""
        raise NotImplementedError

    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, record: CycleRecord) -> None:
        """Called after each verification; default: nothing to learn."""

    def cycle_kind(self, tree: DraftTree) -> str:
        """The kind of the cycle that drafted ``tree`` (``CycleRecord.kind``): ``"plain"`` when nothing
        was drafted, else the policy's name."""
        return "plain" if len(tree) == 0 else self.name


_REGISTRY: dict[str, type[SelectionPolicy]] = {}


def register_policy(name: str) -> Callable[[type[SelectionPolicy]], type[SelectionPolicy]]:
    """Class decorator: make the policy available as ``SpecFitConfig(policy=name)``."""

    def deco(cls: type[SelectionPolicy]) -> type[SelectionPolicy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available_policies() -> list[str]:
    """Registered policy names."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[SelectionPolicy]:
    """The policy class registered as ``name``; ``ValueError`` listing the names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown selection policy {name!r}; available: {available_policies()}") from None


def validate_policy(name: str, kwargs: Any) -> None:
    """Check a policy name and its ``policy_kwargs`` (``ValueError`` naming what is wrong)."""
    policy_class(name).parse_options(kwargs)


def get_policy(name: str, config: GenerationConfig) -> SelectionPolicy:
    """Instantiate the policy registered as ``name``."""
    return policy_class(name)(config)


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
        depth = int(self.config.max_depth)
        if len(tree) == 0 and depth > 0:
            # every level is drafted by the drafter's own rule and only the last selection is
            # verified: the whole drafting plan up front, one call instead of one per level
            return Selection(nodes=torch.empty(0, dtype=torch.long), stop=False, levels=depth)
        nodes = top_n_by_path_prob(tree, int(self.config.max_verify_nodes))
        return Selection(nodes=nodes, stop=tree.num_levels >= depth)


@register_policy("autoregressive")
class AutoregressivePolicy(SelectionPolicy):
    """Plain decoding through the same loop and cache: never drafts, verifies the root only."""

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        return Selection(nodes=torch.empty(0, dtype=torch.long), expected_tokens=1.0, stop=True)


@register_policy("lookup")
class PromptLookupPolicy(SelectionPolicy):
    """Prompt lookup decoding through the same loop and cache: verify the whole proposal (the
    continuation of the context's longest repeated suffix, up to ``max_depth`` tokens) whenever
    there is one, else a plain step.  The draft model is never run."""

    def __init__(self, config: GenerationConfig) -> None:
        super().__init__(config)
        self.lookup_tokens = max(int(getattr(config, "max_depth", 7)), 1)

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        if ctx.lookup is None or not ctx.lookup.tokens:
            return Selection(nodes=torch.empty(0, dtype=torch.long), expected_tokens=1.0, stop=True)
        return Selection(nodes=torch.arange(len(ctx.lookup.tokens)), stop=True, lookup=True)
