"""Page-locked host memory for offloaded experts, without copies or power-of-two rounding.

Fast (DMA, copy-engine) host→device copies need page-locked ("pinned") host memory.
``tensor.pin_memory()`` copies the tensor into PyTorch's caching host allocator, which
rounds every allocation up to a power of two: a Qwen3-30B-A3B layer's experts (805 MB
``gate_up_proj`` + 403 MB ``down_proj`` in bf16) would pin 1 GiB + 512 MiB, i.e. 74 GiB
for 58 GB of experts, on top of the copy being pinned from.  Instead :class:`HostPinner`
*registers* the tensor's existing host pages with the CUDA driver
(``cudaHostRegister``): no copy, and only the pages the tensor spans are locked (at most
one page more than its size per tensor).  Only when the driver refuses a range (e.g. a
read-only file mapping, or pages already registered) is the tensor copied once into a
fresh exact-size allocation, which is registered and replaces the original (whose memory
is then released by its owner): one host copy of an expert at any time.

Host RAM a model needs with ``offload_experts(device="cuda")``: the expert bytes
(``expert_host_bytes``) plus the loader's transient peak, plus the usual non-expert
weights while they are moved to the GPU.  :func:`pinned_bytes` computes what the code
pins for given tensor sizes (CPU-only, used by the tests and by ``examples/bench_gpu.py``
to compare against the measured ``OffloadRuntime.pinned_bytes``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["HostPinner", "pinned_bytes", "PinningPlan", "pinning_plan", "PAGE_SIZE", "TORCH_ALIGNMENT"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TORCH_ALIGNMENT = 64  # c10's CPU allocator alignment: a tensor need not start on a page


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pages_spanned(offset: int, nbytes: int, page: int) -> int:
    """Bytes of the whole pages covering ``[offset, offset + nbytes)`` (offset within its first page)."""
    if nbytes == 0:
        return 0
    start = offset - offset % page
    end = -(-(offset + nbytes) // page) * page
    return end - start


def pinned_bytes(tensor_nbytes: Iterable[int], method: str = "register", page: int = PAGE_SIZE,
                 offset: int = TORCH_ALIGNMENT) -> int:
    """Host bytes page-locked for tensors of the given sizes.

    ``method="register"`` (what :class:`HostPinner` does): the pages each tensor spans,
    assuming it starts ``offset`` bytes into a page (worst case for the CPU allocator's
    64-byte alignment: one extra page per tensor).  ``method="pin_memory"``: what
    ``tensor.pin_memory()`` would lock (the next power of two of each size), for comparison.
    """
    sizes = [int(n) for n in tensor_nbytes]
    if method == "register":
        return sum(_pages_spanned(offset % page, n, page) for n in sizes)
    if method == "pin_memory":
        return sum(_next_pow2(n) for n in sizes if n)
    raise ValueError(f"method must be 'register' or 'pin_memory', got {method!r}")


@dataclass(frozen=True)
class PinningPlan:
    """Expert host bytes of a model and what pinning them costs (see :func:`pinning_plan`)."""

    expert_bytes: int
    pinned_bytes: int  # HostPinner (cudaHostRegister)
    pin_memory_bytes: int  # tensor.pin_memory(), for comparison

    @property
    def pinned_per_expert_byte(self) -> float:
        return self.pinned_bytes / self.expert_bytes

    @property
    def pin_memory_per_expert_byte(self) -> float:
        return self.pin_memory_bytes / self.expert_bytes


def pinning_plan(model: torch.nn.Module) -> PinningPlan:
    """What ``offload_experts(model, device="cuda")`` would pin, computed on the CPU.

    Works on a model built on the ``meta`` device (no memory), so real configs can be
    checked: ``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)``.
    One tensor per per-expert parameter and MoE layer, as the runtime registers them.
    """
    from specfit_hf.features import decoder_layers

    from .adapters import adapter_for

    adapter = adapter_for(model)
    sizes = []
    for layer in decoder_layers(model):
        block = adapter.moe_block(layer)
        if block is None:
            continue
        experts = adapter.experts(block)
        sizes += [getattr(experts, name).numel() * getattr(experts, name).element_size()
                  for name in adapter.expert_params]
    if not sizes:
        raise ValueError(f"{type(model).__name__} has no MoE layers with routed experts")
    return PinningPlan(sum(sizes), pinned_bytes(sizes, "register"), pinned_bytes(sizes, "pin_memory"))


_OWN_PAGES_MIN_BYTES = 1 << 20  # glibc serves allocations this large with their own mmap'd pages


def _owns_its_pages(t: torch.Tensor) -> bool:
    """True when registering ``t``'s range in place is safe: contiguous, the whole of its own
    allocation (not a view into a shared / file-mapped storage), and large enough to sit on
    pages no other allocation uses."""
    nbytes = t.numel() * t.element_size()
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == nbytes
        and nbytes >= _OWN_PAGES_MIN_BYTES
    )


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused ``cudaHostRegister``.

    torch's ``cudart()`` bindings do not expose ``cudaGetLastError``; call it in the
    ``libcudart`` torch already loaded (same handle, same error state).
    """
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("cudaHostRegister failed and libcudart is not loaded to clear the error")
    ctypes.CDLL(sorted(paths)[0]).cudaGetLastError()


class HostPinner:
    """Page-locks host tensors in place (``cudaHostRegister``) and undoes it (``unregister_all``).

    ``pin(t)`` returns a CPU tensor holding ``t``'s values whose pages are registered with
    the CUDA driver: ``t`` itself when its range can be registered, else one exact-size copy.
    ``pinned_bytes`` counts the page-locked bytes (whole pages).  CUDA only.
    """

    def __init__(self) -> None:
        self._registered: list[int] = []  # base pointers, for cudaHostUnregister
        self.pinned_bytes = 0
        self.copies = 0  # tensors that had to be copied once (their range was not registrable)

    def _register(self, t: torch.Tensor) -> bool:
        cudart = torch.cuda.cudart()
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)  # cudaHostRegisterDefault
        if int(err) != 0:
            _clear_last_cuda_error()  # else torch's next launch check would raise it
            return False
        self._registered.append(ptr)
        self.pinned_bytes += _pages_spanned(ptr % PAGE_SIZE, nbytes, PAGE_SIZE)
        return True

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            raise ValueError(f"HostPinner.pin needs a CPU tensor, got one on {t.device}")
        if t.numel() == 0 or t.is_pinned():
            return t
        if _owns_its_pages(t) and self._register(t):
            return t
        copy = torch.empty(t.shape, dtype=t.dtype)  # exact size, its own pages, then registered
        copy.copy_(t)
        if not self._register(copy):
            raise RuntimeError(
                f"cudaHostRegister failed for a fresh {copy.numel() * copy.element_size()} byte host tensor; "
                "is the process's locked-memory limit (ulimit -l) too small?"
            )
        self.copies += 1
        return copy

    def unregister_all(self) -> None:
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered.clear()
        self.pinned_bytes = 0
