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

import functools
import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

__all__ = ["ancestor_matrix", "ancestors", "is_chain", "causal_pattern", "causal_mask", "grow_ancestors",
           "grow_ancestor_rows", "tree_attention_mask", "visibility_to_mask", "additive_mask", "block_depths",
           "model_tree_masks", "has_sliding_layers"]


def ancestors(parents: np.ndarray, max_depth: int | None = None) -> np.ndarray:
    """:func:`ancestor_matrix` on the host: ``[n]`` int parents (numpy) -> ``[n, n]`` bool (numpy).

    The block and draft-tree bookkeeping runs here: a numpy op costs about a microsecond,
    a torch op on small tensors five to twenty.
    """
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    n = parents.size
    if (max_depth is None or max_depth >= n - 1) and is_chain(parents):
        # A chain, the commonest block: every earlier token.
        return causal_pattern(n).copy()
    anc = np.eye(n, dtype=bool)
    rows = np.arange(n)
    cur = parents
    for _ in range(n if max_depth is None else max_depth):
        valid = cur >= 0
        if not valid.any():
            break
        anc[rows[valid], cur[valid]] = True
        cur = np.where(valid, parents[np.maximum(cur, 0)], cur)
    return anc


def is_chain(parents: np.ndarray) -> bool:
    """Whether the block is a chain: token ``i``'s parent is ``i - 1`` (the first hangs off the prefix)."""
    return parents.tolist() == list(range(-1, parents.size - 1))


@functools.lru_cache(maxsize=64)
def causal_pattern(n: int) -> np.ndarray:
    """``[n, n]`` bool lower triangle (a chain's ancestor-or-self relation; causal visibility), read-only.

    Cached: ``np.tri`` alone costs several microseconds, and chains of a few tokens are
    laid out every cycle.
    """
    tri = np.tri(n, dtype=bool)
    tri.flags.writeable = False
    return tri


def ancestor_matrix(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """``[n, n]`` bool: ``out[i, j]`` is True when ``j`` is ``i`` or one of its ancestors.

    Parents must precede children (``parents[i] < i``).  Runs one vectorised step per
    tree level (on the host, see :func:`ancestors`); ``max_depth`` (the deepest chain
    length) bounds the number of steps.  The result lives on ``parents.device``.
    """
    anc = ancestors(parents.reshape(-1).to(torch.long).cpu().numpy(), max_depth)
    return torch.from_numpy(anc).to(parents.device)


def grow_ancestor_rows(anc: np.ndarray, parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`grow_ancestors` on numpy arrays (what the tree drafters keep between levels)."""
    n, m = anc.shape[0], parents.size
    rows = np.zeros((m, n + m), dtype=bool)
    has_parent = parents >= 0
    if n and has_parent.any():
        rows[has_parent, :n] = anc[parents[has_parent]]
    rows[:, n:] = np.eye(m, dtype=bool)
    grown = np.zeros((n + m, n + m), dtype=bool)
    grown[:n, :n] = anc
    grown[n:] = rows
    return rows, grown


def grow_ancestors(anc: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a block of ``m`` nodes to an ancestor-or-self matrix ``anc`` ``[n, n]``.

    ``parents[i]`` is the row of new node ``i``'s parent in ``anc`` (``-1``: none in it).
    Returns the new block's rows ``[m, n + m]`` and the grown matrix ``[n + m, n + m]``
    (CPU tensors).  Drafters keep this relation level by level instead of recomputing it.
    """
    rows, grown = grow_ancestor_rows(anc.cpu().numpy(), parents.reshape(-1).to(torch.long).cpu().numpy())
    return torch.from_numpy(rows), torch.from_numpy(grown)


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
    device = parents.device if device is None else device
    # The ancestor walk is a few tiny ops per level: run it on the host (where the parents
    # normally live) and ship one matrix, instead of syncing a GPU every level.
    anc = ancestors(parents.reshape(-1).to(torch.long).cpu().numpy(), max_depth)
    return additive_mask(anc, prefix_len, dtype, device, prefix_hidden)


def visibility_to_mask(
    visible: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype = torch.float32,
    prefix_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[q, k]`` bool visibility of the non-prefix keys -> additive ``[1, 1, q, prefix_len + k]`` mask.

    The mask lives on ``visible.device``.  Callers that maintain ancestor rows
    incrementally (the tree drafters) use this or :func:`additive_mask` directly.
    """
    return additive_mask(visible.cpu().numpy(), prefix_len, dtype, visible.device, prefix_hidden)


def causal_mask(q_len: int, prefix_len: int, dtype: torch.dtype, device: torch.device | str | None = None):
    """Additive ``[1, 1, q_len, prefix_len + q_len]`` mask: full prefix, causal among the new rows.

    ``additive_mask(causal_pattern(q_len), ...)`` (a chain block, or committed pairs run
    together) in fewer calls: a single row sees everything (zeros), and a CPU mask is zeros
    plus a cached causal block.
    """
    if q_len == 1:
        return torch.zeros((1, 1, 1, prefix_len + 1), dtype=dtype, device=device)
    np_dtype = _NUMPY_FLOATS.get(dtype)
    if np_dtype is None or (device is not None and torch.device(device).type != "cpu"):
        return additive_mask(causal_pattern(q_len), prefix_len, dtype, device)
    mask = np.zeros((1, 1, q_len, prefix_len + q_len), dtype=np_dtype)
    mask[0, 0, :, prefix_len:] = _causal_block(q_len, np_dtype, torch.finfo(dtype).min)
    return torch.from_numpy(mask)


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


@functools.lru_cache(maxsize=64)
def _causal_block(q_len: int, np_dtype: type, low: float) -> np.ndarray:
    """``[q, q]`` additive causal block (0 on and below the diagonal, ``low`` above), read-only."""
    block = np.where(causal_pattern(q_len), 0.0, low).astype(np_dtype)
    block.flags.writeable = False
    return block


def additive_mask(
    visible: np.ndarray,
    prefix_len: int,
    dtype: torch.dtype,
    device: torch.device | str | None = None,
    prefix_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`visibility_to_mask` of a host (numpy) ``[q, k]`` bool visibility, built on ``device``.

    The whole mask is built in numpy for a CPU model (one tensor at the end instead of a
    fill and a masked fill); for another device only the ``[q, k]`` block travels and the
    prefix columns are zeroed there (the prefix can be long).
    """
    q, k = visible.shape
    low = torch.finfo(dtype).min
    # float16 / bfloat16 have no numpy dtype; their finfo.min is exact in float32
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    device = torch.device("cpu" if device is None else device)
    hidden_cols = None if prefix_hidden is None or not prefix_hidden.numel() else prefix_hidden.reshape(-1)
    if device.type == "cpu":
        mask = np.zeros((1, 1, q, prefix_len + k), dtype=np_dtype)
        mask[0, 0, :, prefix_len:][~visible] = low
        if hidden_cols is not None:
            mask[0, 0, :, hidden_cols.cpu().numpy()] = low
        out = torch.from_numpy(mask)
        return out if out.dtype == dtype else out.to(dtype)
    block = torch.from_numpy(np.where(visible, 0.0, low).astype(np_dtype)).to(device=device, dtype=dtype)
    mask = torch.zeros((1, 1, q, prefix_len + k), dtype=dtype, device=device)
    mask[0, 0, :, prefix_len:] = block
    if hidden_cols is not None:
        mask[0, 0, :, hidden_cols.to(device)] = low
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
