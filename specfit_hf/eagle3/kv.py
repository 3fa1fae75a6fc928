"""The draft's key/value store and its causal mask (shared by the model and the tree drafter)."""

from __future__ import annotations

import torch

from ..generation.cache import SpecFitCache

__all__ = ["DraftKVCache", "causal_mask"]


def causal_mask(q_len: int, past_len: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """Additive float mask ``[1, 1, q_len, past_len + q_len]``: full past, causal among new rows."""
    mask = torch.zeros(q_len, past_len + q_len, dtype=dtype, device=device)
    new = torch.ones(q_len, q_len, dtype=torch.bool, device=device).triu(1)
    mask[:, past_len:].masked_fill_(new, torch.finfo(dtype).min)
    return mask[None, None]


class DraftKVCache(SpecFitCache):
    """The draft's key/value store: the loop's :class:`SpecFitCache` with one layer.

    The draft computes attention itself (its q/k/v read 2·H inputs), so it only needs
    append / read-all and the cache's gather (``keep``) to drop rejected tree slots.
    Slots are rows in creation order.
    """

    @property
    def length(self) -> int:
        """Number of cached slots."""
        return self.get_seq_length(0) if self.layers else 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``[B, nkv, T, D]`` rows; returns the whole store."""
        return self.update(key, value, 0)
