"""Run a transformers MoE causal LM with its routed experts in host memory.

``offload_experts(model, ...)`` keeps every non-expert weight on ``device`` and replaces each
MoE layer's fused expert parameters with a small per-layer cache of *slots* on ``device``
(``[num_slots, ...]`` tensors).  The full expert weights stay in host memory (pinned on
CUDA).  An accelerate ``ModelHook`` on each experts module intercepts the call
``experts(hidden, top_k_index, top_k_weights)``:

1. ``pre_forward``: the distinct experts routed in this forward are looked up in the layer's
   ``ExpertCache``; misses are copied host→device into free or evicted slots (never evicting
   an expert this forward still needs), and ``top_k_index`` is remapped from expert ids to
   slot ids.
2. the experts compute runs on the slot tensors with the remapped ids: the model's own
   experts forward (any ``experts_implementation``), or on CUDA the fused Triton kernel
   ``specfit_hf.fused_experts`` when it is importable (see ``_experts_compute``).
3. if one forward routes to more distinct experts than there are slots, the experts are
   processed in *waves* of at most ``num_slots`` (resident experts first), each wave on the
   token rows that use it; ``post_forward`` adds the waves' partial sums together.

Summation order (exactness in bf16 / fp16).  The model's own experts forward loops over the
experts in ascending index order and adds each one's contribution to a token in that
order; floating-point addition is not associative, so summing in *slot* order would change
low-order bits (visible in bf16).  The runtime therefore keeps the model's order: when the
slots holding this forward's experts are not ascending in expert id, the experts are
handed to the model's forward as a gathered ``[n, ...]`` view in ascending expert-id order
(one device-side gather of the ``n`` experts, only for such forwards).  What holds:

* a forward whose distinct experts fit in the slots (single wave), computed by the model's
  own experts forward: bit-identical to the un-offloaded model, in every dtype;
* a forward that needs waves: each wave sums its experts in ascending id order, and the
  waves' partial sums are added afterwards, so a token whose experts all fall in one wave
  is bit-identical and a token whose experts span waves is the same sum re-associated
  (equal up to rounding: ~1e-7 relative in fp32, ~1e-2 in bf16);
* the fused kernel (``use_fused_kernel``) has its own accumulation: equal up to rounding.

Host memory (CUDA): each expert tensor's existing host pages are page-locked in place with
``cudaHostRegister`` (``specfit_hf.offload.pinning``): no copy and no power-of-two rounding
(``tensor.pin_memory()`` would copy and round, ~1.27 bytes pinned per expert byte on
Qwen3-30B-A3B); ``OffloadRuntime.pinned_bytes`` reports what is locked.

Transfers: on CUDA, copies from pinned host memory on a dedicated copy stream, ordered after
the compute already queued (an evicted slot may still be read) and before the compute that
needs them, via an event.  Evicted experts are never copied back (host has the master copy).
On CPU, a copy into the slot, optionally slowed to an ``EmulatedLink``'s speed.

Prefetch (``OffloadRuntime.prefetch``): experts a planner expects the next forward to need can be
copied while the host does other work (drafting).  On CUDA they go on the copy stream and the
first forward that computes with one waits for its event; on an emulated link each copy
occupies the link from when it is issued (or when the link frees up) for its emulated duration,
and a forward that needs an expert still on the link waits until it has arrived, as does a load
queued behind it (one copy engine).  ``OffloadRuntime.prefetch_ahead`` schedules copies for the
next forward instead, each layer's issued as the layer before it starts, after that layer's own
loads (so a load never waits behind a copy for a later layer).  Prefetched experts are resident
at once for the cache's bookkeeping (evicting by the cache policy); they are counted as
prefetches, not misses.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import fields
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from torch import nn

from specfit_hf.clock import advance, clock
from specfit_hf.features import decoder_layers

from .adapters import MoEAdapter, adapter_for
from .cache import POLICIES, ExpertCache
from .link import EmulatedLink, wait_until
from .pinning import HostPinner
from .stats import OffloadStats, TransferStats
from .view import ExpertCacheView

__all__ = ["OffloadRuntime", "offload_experts", "get_runtime", "quantized_expert_format"]

_RUNTIME_ATTR = "_specfit_offload_runtime"


def get_runtime(model: nn.Module) -> Optional["OffloadRuntime"]:
    """The ``OffloadRuntime`` attached to ``model`` by ``offload_experts``, or None."""
    return getattr(model, _RUNTIME_ATTR, None)


def _find_fused_experts() -> Optional[Callable]:
    """``specfit_hf.fused_experts`` if the Triton kernel package is there, else None."""
    try:
        from specfit_hf import fused_experts  # lazy attribute: imports specfit_kernels
    except ImportError:
        return None
    return fused_experts


class _MoELayer:
    """Everything the runtime keeps for one MoE decoder layer."""

    def __init__(self, layer_idx: int, block: nn.Module, experts: nn.Module, router: nn.Module,
                 param_names: tuple[str, ...], cache: ExpertCache) -> None:
        self.layer_idx = layer_idx
        self.block = block
        self.experts = experts
        self.router = router
        self.param_names = param_names
        self.cache = cache
        self.stats = TransferStats()
        self.original_params: dict[str, nn.Parameter] = {}  # the model's own parameters (host)
        self.original_num_experts: int = experts.num_experts
        self.had_instance_forward = "forward" in experts.__dict__
        self.host: dict[str, torch.Tensor] = {}  # [E, ...] master copies in host memory
        self.slots: dict[str, torch.Tensor] = {}  # [S, ...] device cache
        self.torch_forward: Optional[Callable] = None  # the model's experts forward
        self.fused_experts: Optional[Callable] = None
        self.fused_kwargs: dict = {}
        self.last_routing: Optional[torch.Tensor] = None
        # Slots of this call's experts in ascending expert id when they are not already in that
        # order (the ids passed to the compute are then ranks into this gather), else None.
        self.gather: Optional[torch.Tensor] = None
        # Set by a multi-wave pre_forward for post_forward: (partial output [T, H], rows of the last wave).
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.state_dict_hook = None  # handle of the hook that puts the full experts in state_dict()
        # prefetched slots not used yet: when their copy ends on the emulated link's clock (-inf: none), and
        # on CUDA the copy stream's event to wait for
        self.ready_at = np.full(cache.num_slots, -np.inf)
        self.ready_events: dict[int, torch.cuda.Event] = {}


def _experts_compute(layer: _MoELayer, hidden: torch.Tensor, slot_ids: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    """The routed-experts math on the slot tensors, ``slot_ids`` indexing slots.

    The single place where the fused kernel is wired in; everything else is residency.
    """
    gather, layer.gather = layer.gather, None
    if layer.fused_experts is not None:
        if gather is not None:
            slot_ids = gather[slot_ids]  # ranks -> slots: the kernel's order is its own anyway
        return layer.fused_experts(hidden, layer.slots["gate_up_proj"], layer.slots["down_proj"], slot_ids, weights,
                                   **layer.fused_kwargs)
    if gather is None:
        return layer.torch_forward(hidden, slot_ids, weights)
    # The model's forward reads experts.<param>: point them at the experts in id order.
    experts = layer.experts
    params = {name: experts._parameters[name] for name in layer.param_names}
    num_slots = experts.num_experts
    try:
        for name, param in params.items():
            param.data = layer.slots[name].index_select(0, gather)
        experts.num_experts = int(gather.numel())  # grouped / batched implementations count experts
        return layer.torch_forward(hidden, slot_ids, weights)
    finally:
        experts.num_experts = num_slots
        for name, param in params.items():
            param.data = layer.slots[name]


def _full_experts_state(layer: _MoELayer, module: nn.Module, state_dict: dict, prefix: str,
                        local_metadata: dict) -> None:
    """``state_dict`` post-hook: the experts' entries are the full host weights, not the slots.

    So ``model.state_dict()`` and ``save_pretrained`` on an offloaded model write a checkpoint
    that reloads as the original model (the slot cache is runtime state, never saved).
    """
    for name in layer.param_names:
        if prefix + name in state_dict:
            state_dict[prefix + name] = layer.host[name]


#: Rows of a forward whose first uses of experts are counted apart (a verify block: the root,
#: then its nodes); rows past the last share its count.
FIRST_USE_ROWS = 64


def _unique_on_device(top_k_index: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None, torch.Tensor]:
    """(needed expert ids ascending, on the host; each one's first row, ``None`` for one row; the
    pairs' positions in ``needed`` ``[T, k]``, on the device), with one host sync: residency is
    decided on the host."""
    uniq, inverse = torch.unique(top_k_index, sorted=True, return_inverse=True)
    if top_k_index.shape[0] == 1:
        return uniq.cpu().numpy(), None, inverse
    pair_row = torch.arange(inverse.numel(), device=inverse.device) // top_k_index.shape[-1]
    firsts = torch.full_like(uniq, top_k_index.shape[0], dtype=torch.long).scatter_reduce_(
        0, inverse.reshape(-1), pair_row, "amin")
    both = torch.cat([uniq, firsts.to(uniq.dtype)]).cpu().numpy()  # the same sync brings the first rows
    return both[: uniq.numel()], both[uniq.numel():], inverse


def _row_histogram(rows: np.ndarray) -> np.ndarray:
    """Counts per row of :data:`FIRST_USE_ROWS` (rows past the last count in the last)."""
    return np.bincount(np.minimum(rows, FIRST_USE_ROWS - 1), minlength=FIRST_USE_ROWS)


def _in_id_order(slots: np.ndarray) -> bool:
    """True when slots listed in ascending expert id are themselves ascending."""
    return bool(np.all(slots[1:] > slots[:-1]))


def _split_experts_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, top_k_index, top_k_weights) from an experts call, positional or keyword."""
    values = list(args)
    names = (("hidden_states",), ("top_k_index", "router_indices"), ("top_k_weights", "routing_weights"))
    for aliases in names[len(values):]:
        for name in aliases:
            if name in kwargs:
                values.append(kwargs[name])
                break
        else:
            raise TypeError(f"offloaded experts called without {aliases[0]}")
    return values[0], values[1], values[2]


class _OffloadHook(ModelHook):
    """accelerate hook on one experts module: residency before, wave sums after."""

    def __init__(self, runtime: "OffloadRuntime", layer: _MoELayer) -> None:
        self.runtime = runtime
        self.layer = layer

    def init_hook(self, module: nn.Module) -> nn.Module:
        # module._old_forward is the model's experts forward (bound, reads module params, which
        # are now the slot tensors).  The hook calls _experts_compute instead, which uses it
        # or the fused kernel.
        self.layer.torch_forward = module._old_forward
        module._old_forward = functools.partial(_experts_compute, self.layer)
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        hidden, top_k_index, top_k_weights = _split_experts_args(args, kwargs)
        prepared = self.runtime._prepare(self.layer, hidden, top_k_index, top_k_weights)
        if self.runtime._ahead:  # this layer's own loads are queued: the next layer's guesses follow them
            self.runtime._copy_next(self.layer)
        return prepared, {}

    def post_forward(self, module: nn.Module, output: torch.Tensor) -> torch.Tensor:
        pending = self.layer.pending
        if pending is None:
            return output
        self.layer.pending = None
        partial, rows = pending
        return partial.index_add_(0, rows, output.to(partial.dtype))

    def detach_hook(self, module: nn.Module) -> nn.Module:
        module._old_forward = self.layer.torch_forward
        return module


class OffloadRuntime:
    """Handle on a model whose routed experts live in host memory; see ``offload_experts``.

    Layer indices everywhere are decoder-layer indices (``model.model.layers[i]``).

    Attributes:
        moe_layers: decoder-layer indices with routed experts, in order.
        num_experts, top_k: experts per MoE layer and experts per token.
        expert_bytes: bytes of one expert (all its per-expert parameters), i.e. one miss.
        slots_per_layer, policy, device, link: the cache configuration.
        persistent: True (default) keeps residents across forwards; False flushes the cache at
            the start of every model forward (hook on the first MoE layer): a "no persistent
            cache" baseline where every expert of every forward is a miss.
        stats: ``OffloadStats`` counters (``stats.total.misses`` etc., see ``reset_stats``).
    """

    def __init__(self, model: nn.Module, adapter: MoEAdapter, device: torch.device, slots_per_layer: int,
                 policy: str, link: Optional[EmulatedLink], layers: list[_MoELayer], num_experts: int,
                 top_k: int, expert_bytes: int, original_device: torch.device) -> None:
        self.model = model
        self.adapter = adapter
        self.device = device
        self.slots_per_layer = slots_per_layer
        self.policy = policy
        self.link = link
        self.num_experts = num_experts
        self.top_k = top_k
        self.expert_bytes = expert_bytes
        self.persistent = True
        self._layers = {layer.layer_idx: layer for layer in layers}
        self._first_layer = layers[0]
        self._stats = OffloadStats(layers={layer.layer_idx: layer.stats for layer in layers})
        self._tick = 0
        # Per row of a forward, summed over layers and forwards: the distinct experts that row was the
        # first to route to, and of those the ones loaded.  A verify block's rows are its root and then
        # its nodes, so a chain's differences say how many new experts each depth brings (ExpertCacheView)
        self.first_uses = np.zeros(FIRST_USE_ROWS, dtype=np.int64)
        self.first_use_loads = np.zeros(FIRST_USE_ROWS, dtype=np.int64)
        self._original_device = original_device
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending_events: list[tuple[TransferStats, torch.cuda.Event, torch.cuda.Event]] = []
        self._attached = True
        self._view: ExpertCacheView | None = None
        # the caches' expert -> slot maps as rows of one table, in layer order (None if they are not)
        rows = [layer.cache.slot_of for layer in layers]
        table = rows[0].base
        shared = (table is not None and table.ndim == 2 and table.shape[0] == len(rows)
                  and all(r.base is table and r.ctypes.data == table[i].ctypes.data for i, r in enumerate(rows)))
        self._slot_table = table if shared else None
        # slots are fixed when the caches are made: every chain cycle's prefetch plan reads them
        self._slot_counts = np.array([layer.cache.num_slots for layer in layers], dtype=np.int64)
        self._slot_counts.setflags(write=False)
        self._pinner: Optional[HostPinner] = None  # set by offload_experts on CUDA
        # the emulated link's queue: when (clock()) its last prefetch ends; and whether any prefetch has been
        # issued since the last flush (forwards check their slots' arrivals only then)
        self._link_free = -np.inf
        self._prefetch_pending = False
        # prefetch_ahead's schedule for the next forward: layer position -> (experts, residents kept), and each
        # layer's position
        self._ahead: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._position = {layer.layer_idx: i for i, layer in enumerate(layers)}

    @property
    def pinned_bytes(self) -> int:
        """Host bytes page-locked for the experts (whole pages; 0 on CPU)."""
        return 0 if self._pinner is None else self._pinner.pinned_bytes

    @property
    def expert_host_bytes(self) -> int:
        """Bytes of all routed experts of all MoE layers (the host copy; one copy only)."""
        return self.expert_bytes * self.num_experts * len(self._layers)

    # ------------------------------------------------------------------ public API
    @property
    def moe_layers(self) -> list[int]:
        """Decoder-layer indices that have routed experts, in order."""
        return list(self._layers)

    @property
    def uses_fused_kernel(self) -> bool:
        return self._first_layer.fused_experts is not None

    @property
    def stats(self) -> OffloadStats:
        """Per-layer and total counters.  On CUDA this first waits for queued copies to time them."""
        self._collect_transfer_times()
        return self._stats

    def reset_stats(self) -> None:
        self._collect_transfer_times()
        self._stats.reset()
        self.first_uses[:] = 0
        self.first_use_loads[:] = 0

    def cached_experts(self, layer_idx: int) -> set[int]:
        """Experts resident in the device cache of that layer now."""
        return self._layer(layer_idx).cache.resident()

    def resident_mask(self, layer_idx: int) -> torch.Tensor:
        """Bool [num_experts] (CPU): True where the expert is resident in that layer's cache now."""
        return torch.from_numpy(self._layer(layer_idx).cache.slot_of >= 0)

    def slot_counts(self) -> np.ndarray:
        """``[L]`` int (read-only): device slots of every MoE layer's cache, layers in ``moe_layers`` order."""
        return self._slot_counts

    def resident_masks(self) -> np.ndarray:
        """Bool ``[L, E]`` (numpy, a copy): residents of every MoE layer's cache now, layers in ``moe_layers`` order."""
        table = self._slot_table
        if table is None:
            return np.stack([layer.cache.slot_of for layer in self._layers.values()]) >= 0
        return table >= 0

    def last_routing(self, layer_idx: int) -> Optional[torch.Tensor]:
        """Top-k expert ids [T, k] routed by the most recent forward at that layer (None before any)."""
        return self._layer(layer_idx).last_routing

    def last_routings(self) -> list[Optional[torch.Tensor]]:
        """:meth:`last_routing` of every MoE layer, in ``moe_layers`` order (read once per cycle)."""
        return [layer.last_routing for layer in self._layers.values()]

    def view(self) -> ExpertCacheView:
        """The read-only view for planners (the selection stage): residency, routing, routers.

        One view per runtime, so what planners learn about this cache can be keyed by it.
        """
        if self._view is None:
            self._view = ExpertCacheView(self)
        return self._view

    @torch.no_grad()
    def route(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids [T, k] that layer's real router picks for ``hidden`` [T, H].

        ``hidden`` is what the router sees (the post-attention-norm hidden state).  Runs the
        model's own router module, so DeepSeek-V3's biased group-limited routing and GPT-OSS's
        biased router are reproduced exactly.  Touches neither the cache nor the stats.
        """
        router = self._layer(layer_idx).router
        weight = router.weight
        flat = hidden.reshape(-1, hidden.shape[-1]).to(device=weight.device, dtype=weight.dtype)
        return router(flat)[2]

    @property
    def copies_overlap(self) -> bool:
        """Whether a prefetch's copies overlap other work: on an emulated link (its own clock) or a CUDA copy stream."""
        return self.link is not None or self._copy_stream is not None

    def link_busy_seconds(self) -> float:
        """Seconds until the emulated link has finished the prefetches queued on it (0 when idle; CUDA: 0)."""
        return max(0.0, float(self._link_free) - clock())

    def prefetch(self, experts: np.ndarray, keep: np.ndarray | None = None) -> int:
        """Start copying ``experts`` in, ahead of the forward that will need them; returns how many were copied.

        ``experts``: ``[P, 2]`` int pairs (position of the layer in :attr:`moe_layers`, expert id) in the
        order to copy them.  Experts already resident are skipped.  The experts are resident at once, each
        evicting by the cache policy, but never another of this call's experts nor a resident named in
        ``keep`` (``[K, 2]`` pairs alike: the residents the next forward is predicted to use), so a layer
        takes at most as many copies as its slots minus its kept residents.  The copies overlap whatever
        the host does next: on CUDA they run on the copy stream, on an emulated link they occupy the link
        for their duration from now (after the copies already queued), and the first forward to compute
        with one waits for it (:meth:`_prepare`).  Without a link on the CPU the copy is done here.
        """
        return self._prefetch(self._check_pairs(experts), None if keep is None else self._check_pairs(keep))

    def _prefetch(self, pairs: np.ndarray, keep: np.ndarray | None) -> int:
        """:meth:`prefetch` of pairs already checked (:meth:`_check_pairs`)."""
        if pairs.shape[0] == 0:
            return 0
        layers = list(self._layers.values())
        self._tick += 1
        issued = 0
        pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]  # layer by layer, each layer's in the given order
        for position in np.unique(pairs[:, 0]).tolist():
            layer = layers[position]
            cache = layer.cache
            kept = None if keep is None else keep[keep[:, 0] == position, 1]
            room = cache.num_slots - (0 if kept is None else int(np.count_nonzero(cache.slot_of[kept] >= 0)))
            wanted = pairs[pairs[:, 0] == position, 1]
            wanted = wanted[np.sort(np.unique(wanted, return_index=True)[1])]  # first mention wins
            wanted = wanted[cache.slot_of[wanted] < 0][: max(room, 0)]
            if wanted.size == 0:
                continue
            _, load_experts, load_slots = cache.assign(np.sort(wanted), self._tick, keep=kept)
            by_slot = dict(zip(load_experts.tolist(), load_slots.tolist()))
            slots = np.array([by_slot[e] for e in wanted.tolist()], dtype=np.int64)
            self._copy_ahead(layer, wanted, slots)
            issued += int(wanted.size)
        return issued

    def _check_pairs(self, experts: np.ndarray) -> np.ndarray:
        """``experts`` as ``[P, 2]`` int64 (layer position, expert id) pairs, checked."""
        pairs = np.asarray(experts, dtype=np.int64).reshape(-1, 2)
        if pairs.shape[0] == 0:
            return pairs
        if pairs[:, 0].min() < 0 or pairs[:, 0].max() >= len(self._layers):
            raise ValueError(f"prefetch layer positions must be in [0, {len(self._layers)}), "
                             f"got {pairs[:, 0].tolist()}")
        if pairs[:, 1].min() < 0 or pairs[:, 1].max() >= self.num_experts:
            raise ValueError(f"prefetch expert ids must be in [0, {self.num_experts}), got {pairs[:, 1].tolist()}")
        return pairs

    def prefetch_ahead(self, experts: np.ndarray, keep: np.ndarray | None = None) -> None:
        """Copy ``experts`` (``[P, 2]`` pairs as in :meth:`prefetch`) during the next forward, each layer's as the
        layer before it starts computing (after that layer's own loads), so a load the next forward needs
        never waits behind a copy for a later layer.  Pairs of the first MoE layer are copied now.
        ``keep``: as in :meth:`prefetch`.  Replaces any schedule not yet used.
        """
        pairs = self._check_pairs(experts)
        keep = None if keep is None else self._check_pairs(keep)
        self._ahead = {}
        if pairs.shape[0] == 0:
            return
        first = pairs[:, 0] == 0
        if first.any():
            self._prefetch(pairs[first], keep)
        for position in np.unique(pairs[~first, 0]).tolist():
            self._ahead[position] = (pairs[pairs[:, 0] == position],
                                     None if keep is None else keep[keep[:, 0] == position])

    def _copy_next(self, layer: _MoELayer) -> None:
        """A forward reached ``layer``: start the copies scheduled for the next MoE layer."""
        scheduled = self._ahead.pop(self._position[layer.layer_idx] + 1, None)
        if scheduled is not None:
            self._prefetch(*scheduled)  # checked by prefetch_ahead

    def _copy_ahead(self, layer: _MoELayer, experts: np.ndarray, slots: np.ndarray) -> None:
        """The copies of :meth:`prefetch` for one layer (slots already assigned)."""
        n = int(experts.size)
        nbytes = n * self.expert_bytes
        for stats in (layer.stats, self._stats.total):
            stats.prefetches += n
            stats.bytes_h2d += nbytes
        names = layer.param_names
        pairs = [(layer.slots[name][s], layer.host[name][e])
                 for e, s in zip(experts.tolist(), slots.tolist()) for name in names]
        if self.link is None and self._copy_stream is not None:
            compute, copy = torch.cuda.current_stream(self.device), self._copy_stream
            copy.wait_stream(compute)  # an evicted slot may still be read by queued compute
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(copy):
                start.record(copy)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                end.record(copy)
            for s in slots.tolist():
                layer.ready_events[s] = end
            self._pending_events.append((layer.stats, start, end))
            self._prefetch_pending = True
            return
        start_time = time.perf_counter()
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
        self._prefetch_pending = True
        if self.link is None:  # nothing to overlap with: the copy is done (arrived now, for the counts)
            layer.ready_at[slots] = clock()
            self._add_seconds(layer.stats, time.perf_counter() - start_time)
            return
        each = self.link.transfer_seconds(self.expert_bytes)
        ends = max(clock(), self._link_free) + each * np.arange(1, n + 1)
        layer.ready_at[slots] = ends
        self._link_free = float(ends[-1])
        self._add_seconds(layer.stats, each * n)

    def _wait(self, until: float, layer_stats: TransferStats) -> None:
        """Wait (on the emulated link's terms) until ``clock()`` reaches ``until``."""
        now = clock()
        if until <= now or self.link is None:  # (no emulated timeline: CUDA orders copies by events)
            return
        if self.link.virtual:
            advance(until - now)
        else:
            wait_until(time.perf_counter() + (until - now))
        layer_stats.wait_seconds += until - now
        self._stats.total.wait_seconds += until - now

    def _arrivals(self, layer: _MoELayer, slots: np.ndarray, load_slots: np.ndarray,
                  root: np.ndarray | None = None) -> None:
        """Before a forward computes with ``slots``: count the prefetched ones it uses and wait for any
        still on their way.  ``load_slots``: the slots this forward loads into (a prefetched expert there
        was evicted unused); ``root``: per slot, whether the forward's first row routed to it first
        (``None``: a one-row forward, all of them)."""
        if load_slots.size:
            layer.ready_at[load_slots] = -np.inf
            for s in load_slots.tolist():
                layer.ready_events.pop(s, None)
        if layer.ready_events:
            compute = torch.cuda.current_stream(self.device)
            used = np.zeros(len(slots), dtype=bool)
            for i, s in enumerate(slots.tolist()):
                event = layer.ready_events.pop(s, None)
                if event is not None:
                    compute.wait_event(event)
                    used[i] = True
            self._count_used(layer, used, root)
            return
        ready = layer.ready_at[slots]
        arrived = ready > -np.inf
        if not arrived.any():
            return
        self._count_used(layer, arrived, root)
        self._wait(float(ready.max()), layer.stats)
        layer.ready_at[slots] = -np.inf

    def _count_used(self, layer: _MoELayer, used: np.ndarray, root: np.ndarray | None) -> None:
        """Count the prefetched experts a forward used (``used``: per slot), and those its first row used first."""
        n = int(np.count_nonzero(used))
        if not n:
            return
        first = n if root is None else int(np.count_nonzero(used & root))
        for stats in (layer.stats, self._stats.total):
            stats.prefetches_used += n
            stats.first_row_prefetches_used += first

    def flush(self) -> None:
        """Drop every resident expert of every layer: the next use of any expert misses."""
        for layer in self._layers.values():
            layer.cache.flush()
            layer.ready_at.fill(-np.inf)
            layer.ready_events.clear()
        self._prefetch_pending = False
        self._ahead = {}

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Forwards inside leave the expert cache as they found it (benchmarks only).

        The "oracle" selection policy runs the target over a whole draft tree to learn the
        true acceptance and routing, then must leave no trace: the resident experts, the
        eviction state, the slot contents and the counters are restored on exit, and the
        emulated link is bypassed while inside.  Exactness of the forward is unchanged.
        Costs a copy of every slot buffer, so it is not for the decoding hot path.
        """
        self._collect_transfer_times()
        saved_link, saved_tick = self.link, self._tick
        saved = []
        for layer in self._layers.values():
            cache = layer.cache
            saved.append((
                layer,
                {name: getattr(cache, name).copy() for name in ("slot_of", "expert_in_slot", "last_use", "use_count")},
                {name: t.clone() for name, t in layer.slots.items()},
                layer.stats.copy(),
                layer.ready_at.copy(),
            ))
        total = self._stats.total.copy()
        first_uses = (self.first_uses.copy(), self.first_use_loads.copy())
        ahead, self._ahead = self._ahead, {}  # the schedule is the next real forward's
        self.link = None
        try:
            yield
        finally:
            self._collect_transfer_times()
            for layer, arrays, slot_copies, stats, ready_at in saved:
                layer.ready_at[...] = ready_at
                for name, value in arrays.items():
                    getattr(layer.cache, name)[...] = value  # in place: slot_of is a row of the shared table
                for name, t in slot_copies.items():
                    layer.slots[name].copy_(t)
                for f in fields(stats):
                    setattr(layer.stats, f.name, getattr(stats, f.name))
            for f in fields(total):
                setattr(self._stats.total, f.name, getattr(total, f.name))
            self.link, self._tick, self._ahead = saved_link, saved_tick, ahead
            self.first_uses, self.first_use_loads = first_uses

    def detach(self) -> None:
        """Undo ``offload_experts``: the model's own expert parameters, forward and device come back."""
        if not self._attached:
            raise RuntimeError("this OffloadRuntime is already detached")
        self._collect_transfer_times()
        _restore(self.model, list(self._layers.values()), self._original_device, self.device, self._pinner)
        self._attached = False

    def __repr__(self) -> str:
        return (
            f"OffloadRuntime({self.adapter.model_type}, moe_layers={len(self._layers)}, experts={self.num_experts}, "
            f"top_k={self.top_k}, slots_per_layer={self.slots_per_layer}, policy={self.policy!r}, "
            f"device={self.device}, link={self.link}, fused_kernel={self.uses_fused_kernel})"
        )

    # ------------------------------------------------------------------ hot path
    def _layer(self, layer_idx: int) -> _MoELayer:
        try:
            return self._layers[layer_idx]
        except KeyError:
            raise ValueError(f"layer {layer_idx} has no routed experts; MoE layers are {self.moe_layers}") from None

    def _prepare(self, layer: _MoELayer, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make this forward's experts resident; return the experts call's args with slot ids."""
        if not self.persistent and layer is self._first_layer:
            self.flush()
        layer.last_routing = top_k_index
        layer.gather = None
        self._tick += 1
        tick = self._tick
        cache = layer.cache
        on_cpu = top_k_index.device.type == "cpu"
        num_rows, k = top_k_index.shape[0], top_k_index.shape[-1]
        single = num_rows == 1  # then every expert is first used by row 0 (no need to know which row)
        first_row = None  # per needed expert: the first row routed to it (None: all row 0)
        if on_cpu:
            # numpy on a few dozen ids is several times cheaper than torch.unique
            ids = top_k_index.numpy()
            if single:
                needed = np.unique(ids)
            else:
                needed, first_pair = np.unique(ids, return_index=True)
                first_row = first_pair // k
            inverse = None
        else:
            needed, first_row, inverse = _unique_on_device(top_k_index)
        num_needed = len(needed)
        layer.stats.forwards += 1
        self._stats.total.forwards += 1

        if num_needed <= cache.num_slots:
            slots, load_experts, load_slots = cache.assign(needed, tick)
            loaded_rows = None if first_row is None else first_row[np.searchsorted(needed, load_experts)]
            self._count(layer, num_needed - len(load_experts), len(load_experts), first_row, loaded_rows)
            if self._prefetch_pending:
                self._arrivals(layer, slots, load_slots, None if first_row is None else first_row == 0)
            if len(load_experts):
                self._load(layer, load_experts, load_slots)
            if not _in_id_order(slots):
                # Ranks in ascending expert id, and the slots to gather in that order.
                layer.gather = torch.from_numpy(slots).to(hidden.device, non_blocking=True)
                ranks = torch.from_numpy(np.searchsorted(needed, ids)) if on_cpu else inverse
                return hidden, ranks, top_k_weights
            if on_cpu:
                return hidden, torch.from_numpy(cache.slot_of[ids]), top_k_weights
            slot_map = torch.from_numpy(slots).to(inverse.device, non_blocking=True)
            return hidden, slot_map[inverse], top_k_weights

        # More distinct experts than slots: waves of at most num_slots experts, the resident
        # ones first (so no resident expert is evicted before it is used).
        if on_cpu:
            inverse = torch.from_numpy(np.searchsorted(needed, ids))  # pair -> position in needed
        layer.stats.multi_wave_forwards += 1
        self._stats.total.multi_wave_forwards += 1
        resident = cache.slot_of[needed] >= 0
        # The cache ends up holding the last wave, and the next forwards (the decode after a
        # prefill) route much like this one: the missing experts go in ascending order of the
        # rows routed to them and the first wave is the short one, so the last, full wave is
        # the busiest experts.  Transfers are the same in any order; the decode's first tokens
        # miss far less (tiny Qwen3-MoE pair, half cache, plain decoding, 12 CNN/DM prompts:
        # 1.45 loads per token over the first 24, 2.93 when the last wave was the highest ids).
        rows_per_expert = (np.bincount(inverse.numpy().ravel(), minlength=num_needed) if on_cpu
                           else torch.bincount(inverse.reshape(-1), minlength=num_needed).cpu().numpy())
        missing = np.flatnonzero(~resident)
        order = np.concatenate([np.flatnonzero(resident), missing[np.argsort(rows_per_expert[missing], kind="stable")]])
        self._count(layer, num_needed - missing.size, missing.size, first_row,
                    None if first_row is None else first_row[missing])
        partial = torch.zeros_like(hidden)
        short = num_needed % cache.num_slots
        waves = ([order[:short]] if short else []) + [
            order[i:i + cache.num_slots] for i in range(short, num_needed, cache.num_slots)]
        for wave_no, positions in enumerate(waves):
            positions = np.sort(positions)  # ascending expert id inside the wave
            slots, load_experts, load_slots = cache.assign(needed[positions], tick)
            if self._prefetch_pending:
                self._arrivals(layer, slots, load_slots, None if first_row is None else first_row[positions] == 0)
            if len(load_experts):
                self._load(layer, load_experts, load_slots)
            if not _in_id_order(slots):
                layer.gather = torch.from_numpy(slots).to(hidden.device, non_blocking=True)
                slots = np.arange(len(slots))  # ranks into the gather
            # Per distinct expert (position in needed): its slot (or rank) if in this wave, else -1.
            wave_slot = np.full(num_needed, -1, dtype=np.int64)
            wave_slot[positions] = slots
            pair_slot = torch.from_numpy(wave_slot).to(inverse.device)[inverse]  # [T, k]
            in_wave = pair_slot >= 0
            rows = in_wave.any(dim=-1).nonzero().squeeze(1)
            # Pairs of other waves get weight 0 on some slot of this wave (their result is 0 * finite).
            ids_wave = torch.where(in_wave, pair_slot, int(slots[0]))[rows]
            weights = top_k_weights.masked_fill(~in_wave, 0)[rows]
            if wave_no == len(waves) - 1:
                layer.pending = (partial, rows)
                return hidden[rows], ids_wave, weights
            out = _experts_compute(layer, hidden[rows], ids_wave, weights)
            partial.index_add_(0, rows, out.to(partial.dtype))
        raise AssertionError("unreachable")

    def _count(self, layer: _MoELayer, hits: int, misses: int, first_row: np.ndarray | None = None,
               loaded_rows: np.ndarray | None = None) -> None:
        """Count a forward's hits and misses; ``first_row`` / ``loaded_rows``: the first row routed to each
        needed / loaded expert (``None``: a one-row forward, all row 0)."""
        total = self._stats.total
        layer.stats.hits += hits
        total.hits += hits
        if first_row is None:
            self.first_uses[0] += hits + misses
            self.first_use_loads[0] += misses
        else:
            self.first_uses += _row_histogram(first_row)
            if misses:
                self.first_use_loads += _row_histogram(loaded_rows)
        if misses:
            first_row_misses = misses if loaded_rows is None else int(np.count_nonzero(loaded_rows == 0))
            layer.stats.first_row_misses += first_row_misses
            total.first_row_misses += first_row_misses
            nbytes = misses * self.expert_bytes
            layer.stats.misses += misses
            layer.stats.bytes_h2d += nbytes
            total.misses += misses
            total.bytes_h2d += nbytes

    def _load(self, layer: _MoELayer, experts: np.ndarray, slots: np.ndarray) -> None:
        """Copy ``experts`` (host) into ``slots`` (device)."""
        names = layer.param_names
        pairs_per_expert = [
            [(layer.slots[name][s], layer.host[name][e]) for name in names]
            for e, s in zip(experts.tolist(), slots.tolist())
        ]
        if self.link is not None:
            self._wait(self._link_free, layer.stats)  # one copy engine: behind the prefetches still on the link
            seconds = sum(self.link.copy(pairs, self.expert_bytes) for pairs in pairs_per_expert)
            self._add_seconds(layer.stats, seconds)
        elif self._copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            copy = self._copy_stream
            # The evicted slots may still be read by compute already queued: copy after it.
            copy.wait_stream(compute)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(copy):
                start.record(copy)
                for pairs in pairs_per_expert:
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
                end.record(copy)
            compute.wait_event(end)
            self._pending_events.append((layer.stats, start, end))
        else:
            start_time = time.perf_counter()
            with torch.no_grad():
                for pairs in pairs_per_expert:
                    for dst, src in pairs:
                        dst.copy_(src)
            self._add_seconds(layer.stats, time.perf_counter() - start_time)

    def _add_seconds(self, layer_stats: TransferStats, seconds: float) -> None:
        layer_stats.transfer_seconds += seconds
        self._stats.total.transfer_seconds += seconds

    def _collect_transfer_times(self) -> None:
        pending, self._pending_events = self._pending_events, []
        for layer_stats, start, end in pending:
            end.synchronize()
            self._add_seconds(layer_stats, start.elapsed_time(end) / 1e3)


# ---------------------------------------------------------------------- setup / teardown
def _model_device(model: nn.Module) -> torch.device:
    devices = {t.device for t in model.parameters()} | {t.device for t in model.buffers()}
    if len(devices) != 1:
        raise ValueError(
            "offload_experts needs a model loaded on one device (no device_map dispatch); "
            f"found {sorted(map(str, devices))}"
        )
    (device,) = devices
    if device.type == "meta":
        raise ValueError("offload_experts needs materialised weights; the model is on the meta device")
    return device


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                        "float8_e8m0fnu") if hasattr(torch, n)}


def quantized_expert_format(experts: nn.Module, config=None) -> Optional[str]:
    """The quantized format of an experts module, or None for plain floating-point experts.

    The runtime remaps expert ids to slot ids and moves only the per-expert parameters it
    knows; the scale tensors of quantized formats are indexed by expert id as well, so they
    would be read at the wrong index.  Recognised: native FP8 (``FP8Experts``, DeepSeek-V3
    checkpoints: ``*_scale_inv`` block scales per expert), MXFP4 (``Mxfp4GptOssExperts``,
    gpt-oss: packed ``uint8`` blocks with ``*_scales``), and any ``config.quantization_config``.
    """
    names = {n for n, _ in experts.named_parameters(recurse=False)}
    names |= {n for n, _ in experts.named_buffers(recurse=False)}
    dtypes = {t.dtype for t in list(experts.parameters(recurse=False)) + list(experts.buffers(recurse=False))}
    kind = type(experts).__name__.lower()
    if "fp8" in kind or any(n.endswith("_scale_inv") for n in names) or dtypes & _FLOAT8:
        return "native FP8 (block-scaled *_scale_inv experts, e.g. DeepSeek-V3)"
    if "mxfp4" in kind or any(n.endswith(("_blocks", "_scales")) for n in names) or torch.uint8 in dtypes:
        return "MXFP4 (packed uint8 blocks + *_scales experts, e.g. gpt-oss)"
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if getattr(quant, "dequantize", False) or (isinstance(quant, dict) and quant.get("dequantize")):
            return None
        return f"quantized ({getattr(method, 'value', method)!s})"
    return None


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"offload_experts supports device 'cuda' or 'cpu', got {str(device)!r}")
    return device


def _restore(model: nn.Module, layers: list[_MoELayer], original_device: torch.device,
             device: torch.device, pinner: Optional[HostPinner] = None) -> None:
    """Put back what ``offload_experts`` changed (works on a partly applied offload too)."""
    for layer in layers:
        experts = layer.experts
        if layer.state_dict_hook is not None:
            layer.state_dict_hook.remove()
            layer.state_dict_hook = None
        if getattr(experts, "_hf_hook", None) is not None and isinstance(experts._hf_hook, _OffloadHook):
            remove_hook_from_module(experts)
            if not layer.had_instance_forward:
                experts.__dict__.pop("forward", None)
        for name, param in layer.original_params.items():
            if param.device != original_device:  # its data went to pinned host memory
                param.data = param.data.to(original_device)
            experts._parameters[name] = param
        experts.num_experts = layer.original_num_experts
        layer.slots.clear()
    if getattr(model, _RUNTIME_ATTR, None) is not None:
        delattr(model, _RUNTIME_ATTR)
    if device != original_device:
        model.to(original_device)
    if pinner is not None:
        pinner.unregister_all()  # after the data moved back: the pages are plain host memory again


def offload_experts(
    model: nn.Module,
    device: str | torch.device = "cuda",
    slots_per_layer: Optional[int] = None,
    cache_fraction: Optional[float] = None,
    policy: str = "lru",
    link: Optional[EmulatedLink] = None,
    use_fused_kernel: Optional[bool] = None,
) -> OffloadRuntime:
    """Keep ``model``'s routed experts in host memory with a per-layer device cache.

    Args:
        model: a transformers MoE causal LM (model types in ``SUPPORTED_MODEL_TYPES``),
            loaded the normal way on one device.
        device: where non-expert weights and the expert cache slots live ("cuda" or "cpu").
        slots_per_layer: device slots per MoE layer (>= the model's top-k; capped at the
            number of experts).  Give this or ``cache_fraction``.
        cache_fraction: slots as a fraction of the experts per layer, in (0, 1].
        policy: eviction policy, "lru" or "lfu" (see ``specfit_hf.offload.cache``).
        link: an ``EmulatedLink`` to slow host→device copies to a modelled link (used on CPU
            to emulate PCIe); None copies as fast as the machine does.
        use_fused_kernel: compute experts with ``specfit_hf.fused_experts`` (the Triton
            kernel on CUDA, its torch reference on CPU).  None (default): on CUDA when it is
            importable and implements the layout, never on CPU; False: always the model's
            own experts forward; True: require it (any device).

    Returns the ``OffloadRuntime`` (also ``get_runtime(model)``); ``runtime.detach()`` undoes
    everything.  ``model.state_dict()`` / ``save_pretrained`` keep giving the full expert
    weights (from host memory), never the slot cache.  Raises ``ValueError`` for unsupported
    models or bad arguments, before anything is changed.
    """
    # ---- validate everything first: nothing is touched until all checks pass
    adapter = adapter_for(model)
    if get_runtime(model) is not None:
        raise ValueError("model already has offloaded experts; call get_runtime(model).detach() first")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if link is not None and not isinstance(link, EmulatedLink):
        raise TypeError(f"link must be an EmulatedLink or None, got {type(link).__name__}")
    target = _resolve_device(device)
    original_device = _model_device(model)

    found = []
    for idx, decoder_layer in enumerate(decoder_layers(model)):
        block = adapter.moe_block(decoder_layer)
        if block is not None:
            found.append((idx, block, adapter.experts(block), adapter.router(block)))
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE layers with routed experts")
    first_experts, first_router = found[0][2], found[0][3]
    num_experts = int(first_experts.gate_up_proj.shape[0])
    top_k = int(first_router.top_k)
    for idx, _, experts, router in found:
        if getattr(experts, "_hf_hook", None) is not None:
            raise ValueError(f"layer {idx} experts already carry an accelerate hook (device_map dispatch?)")
        fmt = quantized_expert_format(experts, model.config)
        if fmt is not None:
            hint = ("quantization_config=FineGrainedFP8Config(dequantize=True)" if "FP8" in fmt
                    else "quantization_config=Mxfp4Config(dequantize=True)" if "MXFP4" in fmt
                    else "without quantization_config")
            raise ValueError(
                f"offload_experts does not support {fmt} experts (layer {idx}, {type(experts).__name__}): their "
                f"scales are indexed by expert id and would not follow the slots. Load the model dequantized "
                f"({hint}), e.g. in bf16"
            )
        for name in adapter.expert_params:
            param = getattr(experts, name, None)
            if not isinstance(param, nn.Parameter) or param.shape[0] != num_experts:
                raise ValueError(f"layer {idx}: expected experts.{name} with leading dim {num_experts}")
        if int(router.top_k) != top_k:
            raise ValueError(f"layer {idx}: top_k {router.top_k} differs from the first MoE layer's {top_k}")

    if (slots_per_layer is None) == (cache_fraction is None):
        raise ValueError("give exactly one of slots_per_layer or cache_fraction")
    if cache_fraction is not None:
        if not (isinstance(cache_fraction, (int, float)) and 0 < cache_fraction <= 1):
            raise ValueError(f"cache_fraction must be in (0, 1], got {cache_fraction}")
        slots = max(1, int(round(cache_fraction * num_experts)))
        if slots < top_k:
            raise ValueError(
                f"cache_fraction={cache_fraction} gives {slots} slots per layer, fewer than the "
                f"{top_k} experts each token uses (num_experts_per_tok)"
            )
    else:
        slots = int(slots_per_layer)
        if slots != slots_per_layer or slots < top_k:
            raise ValueError(
                f"slots_per_layer must be an integer >= num_experts_per_tok ({top_k}), got {slots_per_layer}"
            )
        slots = min(slots, num_experts)

    fused = None
    if use_fused_kernel or (use_fused_kernel is None and target.type == "cuda"):
        fused = _find_fused_experts()
        if fused is None and use_fused_kernel:
            raise ValueError("use_fused_kernel=True but specfit_hf.fused_experts is not importable")
        probe = adapter.fused_kwargs(first_experts, {name: None for name in adapter.expert_params})
        if probe is None:
            if use_fused_kernel:
                raise ValueError(f"the fused kernel does not implement this model's experts "
                                 f"(hidden_act={getattr(model.config, 'hidden_act', None)!r})")
            fused = None

    # ---- apply; on any failure put everything back
    pinner = HostPinner() if target.type == "cuda" else None
    # every layer's expert -> slot map is a row of one table: the planners' residency read is one comparison
    slot_table = np.empty((len(found), num_experts), dtype=np.int64)
    layers = [
        _MoELayer(idx, block, experts, router, adapter.expert_params,
                  ExpertCache(num_experts, slots, policy, slot_of=slot_table[i]))
        for i, (idx, block, experts, router) in enumerate(found)
    ]
    try:
        expert_bytes = 0
        for layer in layers:
            experts = layer.experts
            for name in adapter.expert_params:
                param = experts._parameters[name]
                layer.original_params[name] = param
                host = param.data
                if target.type == "cuda":
                    # Master copy page-locked in place (cudaHostRegister; one exact-size copy only
                    # when the model is on the GPU or the range cannot be registered), so copies are
                    # async DMA on the copy engine.  Never tensor.pin_memory(): it copies and rounds
                    # each allocation up to a power of two.
                    host = pinner.pin(host.to("cpu"))
                    param.data = host
                layer.host[name] = host
                slot_shape = (slots,) + tuple(host.shape[1:])
                slot = torch.zeros(slot_shape, dtype=host.dtype, device=target)
                experts._parameters[name] = nn.Parameter(slot, requires_grad=False)
                if layer is layers[0]:
                    expert_bytes += host[0].numel() * host.element_size()
            experts.num_experts = slots  # the experts forward now indexes slots
        if target != original_device:
            model.to(target)
        for layer in layers:
            # model.to may have replaced tensors: read the slot tensors after it.
            layer.slots = {name: layer.experts._parameters[name].data for name in adapter.expert_params}
            if fused is not None:
                layer.fused_experts = fused
                layer.fused_kwargs = adapter.fused_kwargs(layer.experts, layer.slots)
        runtime = OffloadRuntime(model, adapter, target, slots, policy, link, layers, num_experts, top_k,
                                 expert_bytes, original_device)
        runtime._pinner = pinner
        for layer in layers:
            add_hook_to_module(layer.experts, _OffloadHook(runtime, layer))
            layer.state_dict_hook = layer.experts.register_state_dict_post_hook(
                functools.partial(_full_experts_state, layer)
            )
        setattr(model, _RUNTIME_ATTR, runtime)
    except BaseException:
        _restore(model, layers, original_device, target, pinner)
        raise
    return runtime

