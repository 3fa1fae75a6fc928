"""``SpecFitConfig``: a ``GenerationConfig`` that switches ``generate`` to tree speculative decoding.

Passing ``generation_config=SpecFitConfig(...)`` together with ``assistant_model=draft`` to
``model.generate`` runs the tree loop of :mod:`specfit_hf.generation.loop`; any other
generation config keeps stock transformers behaviour.

Naming note: ``GenerationConfig.top_k`` already means the *sampling* top-k (applied through
the standard logits processors), so the tree's branching factor is called ``tree_top_k``.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from ..selection import validate_policy

__all__ = ["SpecFitConfig", "EAGLE3_DEFAULTS", "MAX_TREE_TOP_K", "MAX_DEPTH"]

#: EAGLE-2/3 reference settings (``total_token`` 60, depth 7, top-k 10): the one home of these numbers.
EAGLE3_DEFAULTS = {"max_verify_nodes": 60, "max_depth": 7, "tree_top_k": 10}
#: Largest branching factor accepted: a level drafts ``tree_top_k ** 2`` nodes, and the tree
#: mask and draft cache grow with the square of the tree size (EAGLE-3 uses 10, Qwen3 recipes 4).
MAX_TREE_TOP_K = 32
#: Deepest draft accepted (EAGLE-3 uses 7; acceptance decays geometrically with depth).
MAX_DEPTH = 64

# Attributes this class adds on top of GenerationConfig; used for (de)serialisation.
_TREE_ATTRIBUTES = ("max_depth", "tree_top_k", "max_verify_nodes", "policy", "policy_kwargs")


class SpecFitConfig(GenerationConfig):
    """Generation config for tree speculative decoding.

    Args:
        max_depth: draft levels of the tree per cycle (EAGLE-3: 7).  A policy may stop earlier;
            ``specfit``'s fixed one-child chains may go deeper, to ``policy_kwargs["max_chain"]``
            (default: 10 or ``max_depth``, whichever is more, climbing to 16 where deeper chains pay).
        tree_top_k: branching factor of the draft tree: each expanded node gets its
            ``tree_top_k`` most likely children and the ``tree_top_k`` best nodes of a level
            (by cumulative draft probability) are expanded (EAGLE-3: 10).
        max_verify_nodes: most draft nodes verified per cycle, root excluded (EAGLE-3: 60).
        policy: name of the selection policy (see ``specfit_hf.selection.available_policies()``):
            ``"specfit"`` (default; throughput-optimal subtree), ``"eagle3"`` (top
            ``max_verify_nodes`` by draft score), ``"autoregressive"``, ``"oracle"`` (benchmarks).
        policy_kwargs: the policy's options (``specfit``: the fields of
            :class:`~specfit_hf.selection.SpecFitOptions`), stored verbatim and checked when
            the config is built: an unknown key or a value of the wrong type raises ``ValueError``.
        **kwargs: any ``GenerationConfig`` argument (``max_new_tokens``, ``do_sample``, ...).

    Raises ``ValueError`` for a non-integer or out-of-range tree setting, an unknown policy
    or bad ``policy_kwargs``.
    """

    def __init__(
        self,
        max_depth: int = EAGLE3_DEFAULTS["max_depth"],
        tree_top_k: int = EAGLE3_DEFAULTS["tree_top_k"],
        max_verify_nodes: int = EAGLE3_DEFAULTS["max_verify_nodes"],
        policy: str = "specfit",
        policy_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before super().__init__, which calls validate().
        self.max_depth = _integer("max_depth", max_depth)
        self.tree_top_k = _integer("tree_top_k", tree_top_k)
        self.max_verify_nodes = _integer("max_verify_nodes", max_verify_nodes)
        if not isinstance(policy, str):
            raise ValueError(f"SpecFitConfig.policy must be a policy name (str), got {policy!r}")
        self.policy = policy
        if policy_kwargs is not None and not isinstance(policy_kwargs, dict):
            raise ValueError(f"SpecFitConfig.policy_kwargs must be a dict, got {type(policy_kwargs).__name__} "
                             f"{policy_kwargs!r}")
        self.policy_kwargs = dict(policy_kwargs or {})
        super().__init__(**kwargs)

    def validate(self, strict: bool = False, user_set_attributes: set | None = None) -> None:  # noqa: D102
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"SpecFitConfig.max_depth must be in [1, {MAX_DEPTH}], got {self.max_depth}")
        if not 1 <= self.tree_top_k <= MAX_TREE_TOP_K:
            raise ValueError(f"SpecFitConfig.tree_top_k must be in [1, {MAX_TREE_TOP_K}], got {self.tree_top_k}")
        if self.max_verify_nodes < 0:
            raise ValueError(f"SpecFitConfig.max_verify_nodes must be >= 0, got {self.max_verify_nodes}")
        validate_policy(self.policy, self.policy_kwargs)

    def to_diff_dict(self) -> dict[str, Any]:
        # GenerationConfig diffs against a plain GenerationConfig(), where the tree
        # attributes do not exist, so they are always written: a saved file then
        # reloads with SpecFitConfig.from_pretrained to the same settings.
        out = super().to_diff_dict()
        for name in _TREE_ATTRIBUTES:
            out[name] = getattr(self, name)
        return out

    def tree_settings(self) -> dict[str, Any]:
        """The tree-specific settings only (handy for logs and benchmarks)."""
        return {name: getattr(self, name) for name in _TREE_ATTRIBUTES}


def _integer(name: str, value: Any) -> int:
    """``value`` as an int; a non-integral number or another type raises (no silent truncation)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"SpecFitConfig.{name} must be an integer, got {value!r}")
    return int(value)
