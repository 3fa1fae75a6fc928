"""Tree attention masks: the one place where parent arrays become attention masks.

A block of ``n`` tokens laid out as a forest (``parents[i]`` is the in-block index of
token ``i``'s parent, ``-1`` when it hangs directly off the cached prefix) is run in one
forward over a cache holding ``prefix_len`` tokens.  Token ``i`` may attend to the whole
prefix, to itself and to its in-block ancestors, and to nothing else.

Masks are *additive float* masks (0 = visible, ``finfo.min`` = hidden) of shape
``[1, 1, n, prefix_len + n]``: transformers uses a 4D mask as-is, and with eager
attention a boolean 4D mask would silently give wrong logits.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = ["ancestor_matrix", "grow_ancestors", "tree_attention_mask", "visibility_to_mask", "block_depths",
           "model_tree_masks", "has_sliding_layers"]


def ancestor_matrix(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """``[n, n]`` bool: ``out[i, j]`` is True when ``j`` is ``i`` or one of its ancestors.

    Parents must precede children (``parents[i] < i``).  Runs one vectorised step per
    tree level; ``max_depth`` (the deepest chain length) saves the loop's end test.
    """
    parents = parents.reshape(-1).to(torch.long)
    n = parents.numel()
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    if n == 0:
        return anc
    rows = torch.arange(n, device=parents.device)
    cur = parents.clone()
    steps = n if max_depth is None else max_depth
    for _ in range(steps):
        valid = cur >= 0
        if max_depth is None and not bool(valid.any()):
            break
        anc[rows[valid], cur[valid]] = True
        cur = torch.where(valid, parents[cur.clamp(min=0)], cur)
    return anc


def grow_ancestors(anc: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a block of ``m`` nodes to an ancestor-or-self matrix ``anc`` ``[n, n]``.

    ``parents[i]`` is the row of new node ``i``'s parent in ``anc`` (``-1``: none in it).
    Returns the new block's rows ``[m, n + m]`` and the grown matrix ``[n + m, n + m]``.
    Drafters keep this relation level by level instead of recomputing it.
    """
    n, m = anc.shape[0], parents.numel()
    rows = torch.zeros(m, n + m, dtype=torch.bool)
    has_parent = parents >= 0
    if n and bool(has_parent.any()):
        rows[has_parent, :n] = anc[parents[has_parent]]
    rows[torch.arange(m), n + torch.arange(m)] = True
    grown = torch.zeros(n + m, n + m, dtype=torch.bool)
    grown[:n, :n] = anc
    grown[n:] = rows
    return rows, grown


def block_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each block token below the prefix (tokens with parent ``-1`` have depth 0)."""
    return ancestor_matrix(parents).sum(dim=1) - 1


def tree_attention_mask(
    parents: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    max_depth: int | None = None,
    prefix_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive ``[1, 1, n, prefix_len + n]`` mask for a block of ``n`` tree tokens.

    Args:
        parents: ``[n]`` in-block parent index of each token, ``-1`` for block roots.
        prefix_len: tokens already in the KV cache (visible to every block token).
        dtype: the attention computation dtype (the model's dtype).
        device: where to build the mask (defaults to ``parents.device``).
        max_depth: optional bound on the chain length inside the block.
        prefix_hidden: optional indices of prefix positions nobody may attend to
            (padding tokens of the prompt, as a 2D ``attention_mask`` with zeros marks them).
    """
    device = parents.device if device is None else torch.device(device)
    # The ancestor walk is a few tiny ops per level: run it where the parents live (the
    # CPU, normally) and ship one bool matrix, instead of syncing a GPU every level.
    anc = ancestor_matrix(parents, max_depth=max_depth).to(device)
    return visibility_to_mask(anc, prefix_len, dtype=dtype, prefix_hidden=prefix_hidden)


def visibility_to_mask(
    visible: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype = torch.float32,
    prefix_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[q, k]`` bool visibility of the non-prefix keys -> additive ``[1, 1, q, prefix_len + k]`` mask.

    Callers that maintain ancestor rows incrementally (the tree drafter) use this directly.
    """
    q, k = visible.shape
    mask = torch.zeros((1, 1, q, prefix_len + k), dtype=dtype, device=visible.device)
    mask[0, 0, :, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    if prefix_hidden is not None and prefix_hidden.numel():
        mask[0, 0, :, prefix_hidden.to(visible.device)] = torch.finfo(dtype).min
    return mask


# id(config) -> (weak reference to the config, (layer_types, sliding_window) when read, the
# answer): asked every cycle, and reading the layer types costs about as much as a small
# tree's whole mask.  Keyed by id: transformers configs compare by value and are unhashable.
_KINDS: dict[int, tuple[Any, tuple, tuple[bool, bool, int | None]]] = {}


def _attention_layer_kinds(config) -> tuple[bool, bool, int | None]:
    """(has full-attention layers, has sliding-window layers, the window) from a model config."""
    key = (tuple(getattr(config, "layer_types", None) or ()), getattr(config, "sliding_window", None))
    known = _KINDS.get(id(config))
    if known is not None and known[0]() is config and known[1] == key:
        return known[2]
    kinds = _read_attention_layer_kinds(config)
    try:
        ref = weakref.ref(config, lambda _, i=id(config): _KINDS.pop(i, None))
    except TypeError:  # not weak-referenceable: read it every time
        return kinds
    _KINDS[id(config)] = (ref, key, kinds)
    return kinds


def _read_attention_layer_kinds(config) -> tuple[bool, bool, int | None]:
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    windows = {kw["sliding_window"] for t, kw in zip(layer_types, kwargs) if t == "sliding_attention"}
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention", "dummy"})
    if other:
        raise ValueError(f"tree attention masks support full and sliding-window attention layers, not {other}")
    if len(windows) > 1:
        raise ValueError(f"sliding-window layers with different windows {sorted(windows)} are not supported")
    return "full_attention" in layer_types, bool(windows), (windows.pop() if windows else None)


def has_sliding_layers(config) -> bool:
    """Whether the model of ``config`` has sliding-window attention layers."""
    return _attention_layer_kinds(config)[1]


def model_tree_masks(
    config,
    mask: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor | None = None,
    sliding_offset: int = 0,
):
    """The attention-mask argument for a tree forward of a model with this ``config``.

    ``mask`` is the full-attention tree mask (``[1, 1, q, K]``, e.g. from
    :func:`tree_attention_mask`); ``q_positions`` are the sequence positions the ``q`` block
    tokens take once accepted (``prefix_len + depth``), ``k_positions`` those of the ``K``
    keys (default: the prefix ``0 .. K - q - 1`` followed by the block itself).  A
    sliding-window layer of window ``w`` (transformers' rule: query ``i`` sees key ``j`` iff
    ``i - j < w``) must also hide every prefix or ancestor key ``w`` or more positions back.

    ``sliding_offset``: leading keys the sliding-window cache layers no longer hold
    (:attr:`SpecFitCache.sliding_offset`); the sliding mask drops those columns.

    Returns ``mask`` unchanged for a model without sliding layers, the windowed mask when
    every layer slides (Mistral), and ``{"full_attention": mask, "sliding_attention":
    windowed}`` for mixed models (gpt-oss; transformers uses such a dict as-is, one mask
    per layer type).  Raises ``ValueError`` for other attention kinds (chunked, ...).
    """
    has_full, has_sliding, window = _attention_layer_kinds(config)
    if not has_sliding:
        return mask
    q_pos = q_positions.reshape(-1).to(device=mask.device, dtype=torch.long)
    if k_positions is None:
        k_positions = torch.cat([torch.arange(mask.shape[-1] - q_pos.numel(), device=mask.device), q_pos])
    k_pos = k_positions.reshape(-1).to(device=mask.device, dtype=torch.long)
    if (q_pos.numel(), k_pos.numel()) != tuple(mask.shape[-2:]):
        raise ValueError(f"mask {tuple(mask.shape)} does not match {q_pos.numel()} queries and {k_pos.numel()} keys")
    too_far = (q_pos[:, None] - k_pos[None, :]) >= window
    windowed = mask.masked_fill(too_far[None, None], torch.finfo(mask.dtype).min)[..., int(sliding_offset):]
    if not has_full:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}
