"""The draft's key/value store and its causal mask (shared by the model and the tree drafter)."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from ..generation.cache import SpecFitCache
from ..generation.tree_mask import causal_mask as block_causal_mask

__all__ = ["DraftKVCache", "causal_mask"]


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Additive float mask ``[1, 1, q_len, past_len + q_len]``: full past, causal among new rows."""
    return block_causal_mask(q_len, past_len, dtype, device)


class DraftKVCache(SpecFitCache):
    """The draft's key/value store: the loop's :class:`SpecFitCache` with one layer.

    The draft computes attention itself (its q/k/v read 2·H inputs), so it only needs
    append / read-all and the cache's gather (``keep``) to drop rejected tree slots.
    Slots are rows in creation order.
    """

    @property
    def length(self) -> int:
        """Number of cached slots."""
        # read off the one plain layer (get_seq_length's generality costs microseconds, and
        # the tree drafter asks at every level)
        if not self.layers:
            return 0
        layer = self.layers[0]
        if type(layer) is not DynamicLayer:
            return self.get_seq_length(0)
        return layer.keys.shape[-2] if layer.is_initialized and layer.keys.numel() else 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``[B, nkv, T, D]`` rows; returns the whole store."""
        return self.update(key, value, 0)
