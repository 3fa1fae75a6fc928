"""Stage 4b of the cycle: keep only the accepted path in a KV cache.

After a tree forward the cache holds ``prefix + [root] + verified nodes``; only the
prefix, the root and the accepted nodes belong to the sequence.  :class:`SpecFitCache`
gathers those positions along the sequence axis (no recomputation).  The draft model's
cache uses the same class.

Only plain full-attention layers (``DynamicLayer``) can be gathered: a sliding-window
layer has already dropped old entries and a linear-attention layer keeps a recurrent
state that has absorbed the rejected branches, so both raise a clear error.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["SpecFitCache", "UnsupportedCacheLayerError"]


class UnsupportedCacheLayerError(TypeError):
    """A cache layer kind that cannot keep an arbitrary subset of its positions."""


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
    layer kinds the config implies are checked up front.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.check_layers()

    def check_layers(self) -> None:
        """Raise :class:`UnsupportedCacheLayerError` if any layer cannot be gathered."""
        for i, layer in enumerate(self.layers):
            _check_gatherable(layer, i)

    @classmethod
    def from_dynamic(cls, cache: DynamicCache) -> "SpecFitCache":
        """Adopt the layers of an existing ``DynamicCache`` (tensors are shared, not copied)."""
        new = cls.__new__(cls)
        new.__dict__.update(cache.__dict__)
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
