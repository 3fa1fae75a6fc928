"""Slot bookkeeping for one MoE layer's device expert cache (no tensors moved here).

The cache has ``num_slots`` device slots.  ``assign(needed)`` makes every expert in
``needed`` resident, choosing victims by policy among slots whose expert is *not* needed,
and returns the slot of each needed expert plus the list of loads the caller must perform.

Policies (deterministic, so miss counts can be checked against a simulation):

* ``"lru"``: evict the resident expert used least recently.  All experts of one forward
  are used "at the same time"; ties are broken by the smaller expert id (as if a forward
  touched its experts in ascending id order).
* ``"lfu"``: evict the resident expert with the fewest uses so far (counted per forward,
  kept across ``flush``), ties broken like LRU.

Free slots are always filled (lowest slot first) before anything is evicted.  All state
lives in small numpy arrays indexed by expert or slot, so a lookup costs a few
vectorised operations rather than a Python loop over tokens.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ExpertCache", "POLICIES"]

POLICIES = ("lru", "lfu")


class ExpertCache:
    def __init__(self, num_experts: int, num_slots: int, policy: str = "lru",
                 slot_of: np.ndarray | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; expected one of {POLICIES}")
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"num_slots must be in [1, {num_experts}], got {num_slots}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.policy = policy
        # expert -> slot, -1 = not resident; ``slot_of``: a row of a table shared by every layer's cache (the
        # runtime then reads all layers' residents in one comparison), kept and only ever written in place
        if slot_of is None:
            slot_of = np.empty(num_experts, dtype=np.int64)
        elif slot_of.shape != (num_experts,) or slot_of.dtype != np.int64:
            raise ValueError(f"slot_of must be an int64 array of shape ({num_experts},), got {slot_of.dtype} "
                             f"{tuple(slot_of.shape)}")
        slot_of.fill(-1)
        self.slot_of = slot_of
        self.expert_in_slot = np.full(num_slots, -1, dtype=np.int64)  # slot -> expert, -1 = free
        self.last_use = np.zeros(num_slots, dtype=np.int64)  # slot -> tick of last use
        self.use_count = np.zeros(num_experts, dtype=np.int64)  # expert -> forwards that used it

    def resident(self) -> set[int]:
        return set(self.expert_in_slot[self.expert_in_slot >= 0].tolist())

    def flush(self) -> None:
        """Forget every resident expert (usage counts for LFU are kept)."""
        self.slot_of.fill(-1)
        self.expert_in_slot.fill(-1)
        self.last_use.fill(0)

    def assign(self, needed: np.ndarray, tick: int,
               keep: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Make ``needed`` (unique expert ids, at most ``num_slots``) resident.

        Returns ``(slots, load_experts, load_slots)``: the slot of each needed expert, and
        the experts to copy in with their destination slots (the misses).  The bookkeeping
        is updated as if those loads have happened.  ``keep``: expert ids that are not evicted
        either, if resident (a prefetch keeps the residents the forward it prepares will use).
        """
        if len(needed) > self.num_slots:
            raise ValueError(f"{len(needed)} experts cannot be resident in {self.num_slots} slots at once")
        slots = self.slot_of[needed]
        miss = slots < 0
        if miss.any():
            load_experts = needed[miss]
            evictable = np.ones(self.num_slots, dtype=bool)
            evictable[slots[~miss]] = False
            if keep is not None and len(keep):
                kept = self.slot_of[keep]
                evictable[kept[kept >= 0]] = False
                if np.count_nonzero(evictable) < len(load_experts):
                    raise ValueError(f"{len(load_experts)} experts cannot be loaded into {self.num_slots} slots "
                                     f"keeping {np.count_nonzero(kept >= 0)} residents and {len(needed)} needed")
            candidates = np.flatnonzero(evictable)
            occupant = self.expert_in_slot[candidates]
            occupied = occupant >= 0
            # np.lexsort: the LAST key is the primary one.  Free slots (occupied=False) first.
            if self.policy == "lru":
                order = np.lexsort((occupant, self.last_use[candidates], occupied))
            else:
                uses = np.where(occupied, self.use_count[occupant], 0)
                order = np.lexsort((occupant, self.last_use[candidates], uses, occupied))
            load_slots = candidates[order[: len(load_experts)]]
            evicted = self.expert_in_slot[load_slots]
            self.slot_of[evicted[evicted >= 0]] = -1
            self.slot_of[load_experts] = load_slots
            self.expert_in_slot[load_slots] = load_experts
            slots = slots.copy()
            slots[miss] = load_slots
        else:
            load_experts = load_slots = needed[:0]
        self.last_use[slots] = tick
        self.use_count[needed] += 1
        return slots, load_experts, load_slots
