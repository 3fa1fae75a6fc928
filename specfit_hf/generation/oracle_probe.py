"""The loop's side of the "oracle" selection policy (benchmarks only).

The oracle policy asks, through ``ctx.oracle_probe``, what the target would do
on the *whole* draft tree: its greedy token after the root and after every node, and the
experts each of them routes to.  :class:`TreeOracleProbe` answers with one tree-masked
target forward over ``[root] + all nodes``, then crops the target cache back so nothing
is committed.

With an offload runtime attached the probe must not disturb the expert cache or its
statistics; it runs inside ``runtime.frozen()`` when the runtime offers such a context
manager and raises a clear error otherwise (never a silently perturbed benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import DraftTree, OracleProbe, Selection
from .cache import SpecFitCache
from .candidates import layout_candidates
from .verify import verify_forward

__all__ = ["TreeOracleProbe"]


@dataclass
class TreeOracleProbe:
    """Callable ``tree -> OracleProbe``; the loop updates the per-cycle fields before drafting."""

    model: object
    cache: SpecFitCache
    runtime: object | None
    mask_dtype: torch.dtype
    prefix_len: int = 0
    root_position: int = 0
    prefix_hidden: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, tree: DraftTree) -> OracleProbe:
        selection = Selection(nodes=torch.arange(len(tree)))
        block = layout_candidates(
            tree, selection, self.prefix_len, self.root_position, self.prefix_hidden, self.model.device,
            self.mask_dtype,
        )
        routing = None
        if self.runtime is None:
            logits = verify_forward(self.model, self.cache, block)
        else:
            frozen = getattr(self.runtime, "frozen", None)
            if frozen is None:
                raise NotImplementedError(
                    "the oracle probe needs OffloadRuntime.frozen() (a forward that leaves the expert cache and "
                    "its statistics untouched); run the oracle policy without offloaded experts or add it"
                )
            with frozen():
                logits = verify_forward(self.model, self.cache, block)
                routing = self.runtime.view().last_routing(rows=len(tree) + 1)
        self.cache.crop_to(self.prefix_len)  # nothing of the probe stays in the cache
        return OracleProbe(target_tokens=logits.argmax(dim=-1).cpu(), routing=routing)
