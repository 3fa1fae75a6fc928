"""Stage 4b of the cycle: keep only the accepted path in a KV cache.

After a tree forward the cache holds ``prefix + [root] + verified nodes``; only the
prefix, the root and the accepted nodes belong to the sequence.  :class:`SpecFitCache`
gathers those positions along the sequence axis (no recomputation).  The draft model's
cache uses the same class.

Only plain full-attention layers (``DynamicLayer``) can be gathered.  Sliding-window
layers (gpt-oss, Mistral) are therefore stored as full ``DynamicLayer`` caches: a
``DynamicSlidingWindowLayer`` drops positions as a block is appended, before the tree's
rejected branches are known, so :class:`SpecFitCache` replaces each one it is given by a
``DynamicLayer`` that keeps every committed position, and the window is applied by the
attention mask instead (:func:`~specfit_hf.generation.tree_mask.model_tree_masks`, one
mask per layer type; transformers' own masks do the same for the prefill).  The cost is
memory: a sliding layer holds the whole sequence like a full-attention layer.  A
config-less ``SpecFitCache()`` creates plain layers lazily, which is the same thing.  A
linear-attention layer keeps a recurrent state that has absorbed the rejected branches
and raises a clear error.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["SpecFitCache", "UnsupportedCacheLayerError"]


class UnsupportedCacheLayerError(TypeError):
    """A cache layer kind that cannot keep an arbitrary subset of its positions."""


def _as_full_layer(layer: object, index: int) -> object:
    """A ``DynamicSlidingWindowLayer`` that has dropped nothing, as a ``DynamicLayer`` holding
    the same tensors; any other layer unchanged.  Raises if the window already dropped entries."""
    if type(layer) is not DynamicSlidingWindowLayer:
        return layer
    stored = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None else 0
    if stored != layer.get_seq_length():
        raise UnsupportedCacheLayerError(
            f"cache layer {index} is a sliding-window layer that already dropped "
            f"{layer.get_seq_length() - stored} old positions; tree speculative decoding needs every "
            "committed position (start from an empty cache)"
        )
    full = DynamicLayer()
    if layer.is_initialized:
        full.lazy_initialization(layer.keys, layer.values)
        full.keys, full.values = layer.keys, layer.values
    return full


def _check_gatherable(layer: object, index: int) -> bool:
    """True for a layer holding gatherable keys/values, False for one that stores nothing
    (``DummyLayer``: KV sharing / attention-free layers); raises for any other kind."""
    if type(layer) is DynamicLayer:
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
    layer kinds the config implies are checked up front.  Sliding-window layers are kept
    as full layers (see the module docstring): every layer holds the whole sequence, and
    the sliding window is the attention mask's job.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unslide()
        self.check_layers()

    def _unslide(self) -> None:
        self.layers = [_as_full_layer(layer, i) for i, layer in enumerate(self.layers)]

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
            return
        for i, layer in enumerate(self.layers):
            if not _check_gatherable(layer, i):
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
        block = torch.as_tensor(block_positions, dtype=torch.long).reshape(-1)
        # Fast path: accepted nodes sit right after the root in the block (a chain).
        if bool((block == torch.arange(block.numel())).all()):
            self.crop_to(prefix_len + block.numel())
            return
        self.keep(torch.cat([torch.arange(prefix_len), prefix_len + block]))

    def crop_to(self, length: int) -> None:
        """Keep the first ``length`` positions (``DynamicLayer.crop`` only takes n <= 0)."""
        drop = self.get_seq_length() - length
        if drop < 0:
            raise ValueError(f"crop_to({length}) on a cache of length {self.get_seq_length()}")
        if drop:
            for i, layer in enumerate(self.layers):
                if _check_gatherable(layer, i):
                    layer.crop(-drop)
