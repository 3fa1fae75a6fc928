"""Stage 4b of the cycle: keep only the accepted path in a KV cache.

After a tree forward the cache holds ``prefix + [root] + verified nodes``; only the
prefix, the root and the accepted nodes belong to the sequence.  :class:`SpecFitCache`
gathers those positions along the sequence axis (no recomputation).  The draft model's
cache uses the same class.

Only plain full-attention layers (``DynamicLayer``) and the tree-aware sliding-window
layer below can be gathered.  A transformers ``DynamicSlidingWindowLayer`` (gpt-oss,
Mistral) drops positions as soon as a block is appended, before the tree's rejected
branches are known; :class:`SpecFitCache` replaces each one by a :class:`TreeSlidingLayer`,
which keeps everything appended since the last commit and, at each commit
(:meth:`SpecFitCache.keep` / :meth:`~SpecFitCache.crop_to`), drops what the window no longer
needs: it then holds the last ``window - 1`` committed positions, exactly what the next
forward's queries can see (transformers' rule: query ``q`` sees key ``k`` iff
``q - k < window``), plus the block being verified.  The window itself is applied by the
attention mask (:func:`~specfit_hf.generation.tree_mask.model_tree_masks`, one mask per
layer type, its sliding part cut to the positions the sliding layers still hold,
:attr:`SpecFitCache.sliding_offset`); transformers' own masks read the same offset for the
prefill.  A config-less ``SpecFitCache()`` creates plain layers lazily: they keep every
position (more memory, same results, since the mask still applies the window).  A
linear-attention layer keeps a recurrent state that has absorbed the rejected branches
and raises a clear error.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["SpecFitCache", "TreeSlidingLayer", "UnsupportedCacheLayerError"]


class UnsupportedCacheLayerError(TypeError):
    """A cache layer kind that cannot keep an arbitrary subset of its positions."""


class TreeSlidingLayer(DynamicLayer):
    """A sliding-window cache layer for tree decoding (see the module docstring).

    Holds the positions ``[offset, offset + stored)`` of the sequence; ``get_seq_length``
    is the whole sequence length and ``get_mask_sizes`` reports the offset, as
    transformers' sliding layers do, so its own masks line up.
    """

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = int(sliding_window)
        self.offset = 0  # sequence positions dropped from the front

    @property
    def stored(self) -> int:
        return 0 if not self.is_initialized or self.keys is None else int(self.keys.shape[-2])

    def get_seq_length(self) -> int:
        return self.offset + self.stored

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored + query_length, self.offset

    def keep_positions(self, positions: torch.Tensor) -> None:
        """Keep sequence ``positions`` (ascending) that are still held, then trim to the window."""
        if not self.stored:
            return
        pos = positions[positions >= self.offset] - self.offset
        idx = pos.to(self.keys.device)
        self.keys = self.keys.index_select(-2, idx)
        self.values = self.values.index_select(-2, idx)
        self.trim()

    def crop_to(self, length: int) -> None:
        """Keep the sequence's first ``length`` positions, then trim to the window."""
        if length < self.offset:
            raise ValueError(f"cannot crop a sliding layer to {length}: positions before {self.offset} were dropped")
        if self.stored:
            self.keys = self.keys[..., : length - self.offset, :]
            self.values = self.values[..., : length - self.offset, :]
        self.trim()

    def trim(self) -> None:
        """Drop the committed positions no future query can see (keep the last ``window - 1``)."""
        drop = self.stored - (self.sliding_window - 1)
        if drop > 0:
            self.keys = self.keys[..., drop:, :]
            self.values = self.values[..., drop:, :]
            self.offset += drop


def _as_tree_layer(layer: object, index: int) -> object:
    """A ``DynamicSlidingWindowLayer`` that has dropped nothing, as a :class:`TreeSlidingLayer`
    holding the same tensors; any other layer unchanged.  Raises if the window already dropped
    entries (they may be needed again once rejected branches are removed)."""
    if type(layer) is not DynamicSlidingWindowLayer:
        return layer
    stored = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None else 0
    if stored != layer.get_seq_length():
        raise UnsupportedCacheLayerError(
            f"cache layer {index} is a sliding-window layer that already dropped "
            f"{layer.get_seq_length() - stored} old positions; tree speculative decoding needs every "
            "committed position (start from an empty cache)"
        )
    tree_layer = TreeSlidingLayer(layer.sliding_window)
    if layer.is_initialized:
        tree_layer.lazy_initialization(layer.keys, layer.values)
        tree_layer.keys, tree_layer.values = layer.keys, layer.values
    return tree_layer


def _check_gatherable(layer: object, index: int) -> bool:
    """True for a layer holding gatherable keys/values, False for one that stores nothing
    (``DummyLayer``: KV sharing / attention-free layers); raises for any other kind."""
    if type(layer) in (DynamicLayer, TreeSlidingLayer):
        return True
    if isinstance(layer, DummyLayer):
        return False
    kind = type(layer).__name__
    if isinstance(layer, DynamicSlidingWindowLayer) or getattr(layer, "is_sliding", False):
        why = "sliding-window layers drop old positions, so a tree's rejected branches cannot be removed"
    elif "LinearAttention" in kind or not isinstance(layer, DynamicLayer):
        why = "recurrent / linear-attention state has absorbed every verified token and cannot be gathered"
    else:
        why = "only plain full-attention DynamicLayer caches can be gathered along the sequence axis"
    raise UnsupportedCacheLayerError(
        f"tree speculative decoding cannot use cache layer {index} of kind {kind}: {why}"
    )


class SpecFitCache(DynamicCache):
    """A ``DynamicCache`` that can keep an arbitrary, ordered subset of its positions.

    Construct it like a ``DynamicCache`` (``SpecFitCache(config=model.config)``); the
    layer kinds the config implies are checked up front.  Sliding-window layers become
    :class:`TreeSlidingLayer` (see the module docstring); the window is the attention
    mask's job.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unslide()
        self.check_layers()

    def _unslide(self) -> None:
        self.layers = [_as_tree_layer(layer, i) for i, layer in enumerate(self.layers)]

    @property
    def sliding_offset(self) -> int:
        """Sequence positions the sliding-window layers no longer hold (0 without such layers)."""
        offsets = {layer.offset for layer in self.layers if isinstance(layer, TreeSlidingLayer)}
        if len(offsets) > 1:
            raise RuntimeError(f"sliding-window layers out of step: offsets {sorted(offsets)}")
        return offsets.pop() if offsets else 0

    def check_layers(self) -> None:
        """Raise :class:`UnsupportedCacheLayerError` if any layer cannot be gathered."""
        for i, layer in enumerate(self.layers):
            _check_gatherable(layer, i)

    @classmethod
    def from_dynamic(cls, cache: DynamicCache) -> "SpecFitCache":
        """Adopt the layers of an existing ``DynamicCache`` (tensors are shared, not copied)."""
        new = cls.__new__(cls)
        new.__dict__.update(cache.__dict__)
        new._unslide()
        new.check_layers()
        return new

    def keep(self, positions: torch.Tensor | Sequence[int]) -> None:
        """Keep exactly ``positions`` (sequence indices, in the order given) in every layer.

        A sorted contiguous run starting at 0 is a plain crop (no copy).
        """
        seq_len = self.get_seq_length()
        pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= seq_len):
            raise IndexError(f"keep(): positions must lie in [0, {seq_len}), got {pos.tolist()}")
        n = pos.numel()
        is_prefix = bool((pos == torch.arange(n)).all())
        if is_prefix and n == seq_len:
            for layer in self.layers:
                if isinstance(layer, TreeSlidingLayer):
                    layer.trim()
            return
        for i, layer in enumerate(self.layers):
            if not _check_gatherable(layer, i):
                continue
            if isinstance(layer, TreeSlidingLayer):
                if is_prefix:
                    layer.crop_to(n)
                elif not bool((pos[1:] > pos[:-1]).all()):
                    raise ValueError("keep(): a sliding-window layer needs ascending positions")
                else:
                    layer.keep_positions(pos)
                continue
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                continue
            if is_prefix:
                layer.keys = layer.keys[..., :n, :]
                layer.values = layer.values[..., :n, :]
            else:
                idx = pos.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)

    def keep_prefix_and(self, prefix_len: int, block_positions: torch.Tensor | Sequence[int]) -> None:
        """Keep the first ``prefix_len`` positions plus ``prefix_len + block_positions``.

        This is the commit after a tree forward: ``block_positions`` are the root's and
        the accepted nodes' positions inside the verified block (0 = root).
        """
        if isinstance(block_positions, torch.Tensor):
            block_positions = block_positions.reshape(-1).tolist()
        block = [int(p) for p in block_positions]
        # Fast path: accepted nodes sit right after the root in the block (a plain step or a chain).
        if block == list(range(len(block))):
            self.crop_to(prefix_len + len(block))
            return
        self.keep(torch.cat([torch.arange(prefix_len), prefix_len + torch.tensor(block, dtype=torch.long)]))

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` positions (``DynamicLayer.crop`` only takes n <= 0)."""
        drop = self.get_seq_length() - length
        if drop < 0:
            raise ValueError(f"crop_to({length}) on a cache of length {self.get_seq_length()}")
        for i, layer in enumerate(self.layers):
            if not _check_gatherable(layer, i):
                continue
            if isinstance(layer, TreeSlidingLayer):
                layer.crop_to(length)  # also trims to the window
            elif drop:
                layer.crop(-drop)
