"""The ``oracle`` selection policy (benchmarks only): true acceptance and true experts.

It drafts ``max_depth`` levels, then asks the loop for an :class:`~specfit_hf.tree.OracleProbe`
of the full tree through ``ctx.oracle_probe`` and runs the exact search with ``P(v)`` = 1
if the target's greedy choices agree with the whole path to ``v`` else 0, and the experts
the target really routes each node to.  The loop's probe runs the target on
``[root] + all nodes`` with the tree mask and crops the target cache back afterwards, and
leaves the expert cache and its statistics as they were (or the oracle's own
verification would be cheaper than it should).  Greedy decoding only (under sampling
"accepted" is random).  Its cycle time includes the probe forward.
"""

from __future__ import annotations

import numpy as np
import torch

from ..tree import CycleContext, DraftTree, Selection
from .acceptance import path_acceptance
from .policy import register_policy
from .search import select_subtree
from .specfit import SpecFitPolicy

__all__ = ["OraclePolicy"]


@register_policy("oracle")
class OraclePolicy(SpecFitPolicy):
    """Upper bound on selection (see the module docstring); without a probe it raises."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.lookup_tokens = 0  # it verifies the drafted tree only: no prompt-lookup proposals

    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        """Draft to ``max_depth``, then the optimum under the true acceptance and routing."""
        if self.costs is None:
            self.reset(ctx)
        if tree.num_levels < self.max_depth:
            return Selection(nodes=torch.empty(0, dtype=torch.long), stop=False)  # it looks at the full tree
        if ctx.oracle_probe is None:
            raise ValueError(
                "the 'oracle' policy needs ctx.oracle_probe (tree -> OracleProbe) from the generation loop"
            )
        probe = ctx.oracle_probe(tree)
        target = torch.as_tensor(probe.target_tokens).reshape(-1).cpu().numpy()
        if target.size != len(tree) + 1:
            raise ValueError(f"oracle probe has {target.size} rows for a tree of {len(tree)} nodes + root")
        parents = tree.parents.numpy()
        agree = tree.tokens.numpy() == target[parents + 1]  # parent -1 (root) -> row 0
        path = path_acceptance(tree, agree.astype(np.float64))
        node_experts = root_experts = cached = None
        if probe.routing is not None and ctx.experts is not None:
            routing = np.asarray(probe.routing, dtype=np.int64)
            node_experts, root_experts, cached = routing[1:], routing[0], ctx.experts.resident()
        sel = select_subtree(parents, path, node_experts, root_experts, cached, self.cost_model)
        sel.stop = True
        self._last = sel
        return sel
