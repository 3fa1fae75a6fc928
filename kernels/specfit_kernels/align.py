"""Align step: group (token, choice) pairs by slot and pad each group to the kernel's row block.

Same idea as vLLM's ``moe_align_block_size``, written with plain torch ops so that it has no
data-dependent host sync (no ``.item()``, no ``bincount``/``nonzero``): the padded length is bounded
from the shapes alone, and blocks past the real end are marked with slot ``-1`` so the kernels skip them.

Pairs are numbered ``p = t * k + j`` (row-major over ``slot_ids [T, k]``). The GEMM kernels process
``BLOCK_M`` consecutive entries of ``sorted_pairs`` per program; all entries of one block belong to the
same slot (``block_slot[b]``), and padding entries hold the sentinel ``num_pairs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedPairs:
    """Pairs grouped by slot, padded per slot to a multiple of ``block_m``."""

    sorted_pairs: torch.Tensor  # int32 [num_blocks * block_m]; pair ids, `num_pairs` = padding
    block_slot: torch.Tensor  # int32 [num_blocks]; slot of each block, -1 = past the end (skip)
    num_pairs: int
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_slot.numel()


def padded_capacity(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on the padded length: every used slot wastes at most ``block_m - 1`` rows."""
    used_slots_bound = min(num_pairs, num_slots)
    padded = num_pairs + used_slots_bound * (block_m - 1)
    return (padded + block_m - 1) // block_m * block_m


def align_pairs_by_slot(slot_ids: torch.Tensor, num_slots: int, block_m: int) -> AlignedPairs:
    """Group the pairs of ``slot_ids [T, k]`` by slot; see the module docstring.

    Within a slot, pairs keep ascending pair order (stable sort), so the layout — and therefore the
    kernels' result — is a deterministic function of ``slot_ids``.

    Raises:
        RuntimeError ("index out of bounds" on CPU, a device-side assert on CUDA): a slot id outside
            ``[0, num_slots)``.
    """
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = slot_ids.device
    flat = slot_ids.reshape(-1).long()
    num_pairs = flat.numel()
    capacity = padded_capacity(num_pairs, num_slots, block_m)
    num_blocks = capacity // block_m

    # Per-slot counts via scatter_add_ (not bincount: bincount syncs to size its output, and
    # scatter_add_ rejects out-of-range ids instead of silently growing the histogram).
    counts = torch.zeros(num_slots, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded_counts, 0)
    padded_start = padded_end - padded_counts
    start = torch.cumsum(counts, 0) - counts

    sorted_slots, order = torch.sort(flat, stable=True)
    rank_in_slot = torch.arange(num_pairs, device=device) - start[sorted_slots]
    dest = padded_start[sorted_slots] + rank_in_slot
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)

    block_first_row = torch.arange(num_blocks, device=device) * block_m
    # The slot whose padded range contains the block's first row; == num_slots past the end.
    block_slot = torch.searchsorted(padded_end, block_first_row, right=True)
    block_slot = torch.where(block_slot < num_slots, block_slot, torch.full_like(block_slot, -1))
    return AlignedPairs(sorted_pairs, block_slot.to(torch.int32), num_pairs, block_m)
