"""Plain data types passed between the stages of one decoding cycle.

    draft  --DraftTree-->  select  --Selection-->  verify  --VerifyResult-->  commit  --CycleRecord-->  observe

A policy reads what it may know about the generation from a :class:`CycleContext`.

A cycle starts from the *root*: the last committed token, which the target has not
processed yet.  The draft grows a tree below the root level by level; a selection
policy picks an ancestor-closed subset of its nodes; the target verifies
``[root] + selected nodes`` in one forward pass with a tree attention mask; the
accepted path (plus one bonus token from the target) is committed.

Node indices are positions in the tree's flat arrays (creation order, so parents
always precede children).  Depth 1 means "child of the root".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

if TYPE_CHECKING:  # annotations only: the offload stage never imports this module's users
    from transformers import GenerationConfig, PreTrainedModel

    from .offload.view import ExpertCacheView

__all__ = ["DraftTree", "LookupProposal", "Selection", "VerifyResult", "CycleRecord", "CycleContext", "OracleProbe"]


def _flat_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.reshape(-1).to(dtype).cpu()``, skipping the steps that would change nothing (each
    costs a few microseconds, and :meth:`DraftTree.add_level` runs after every draft level)."""
    if t.dim() != 1:
        t = t.reshape(-1)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_cpu else t.cpu()


@dataclass
class DraftTree:
    """A draft token tree below ``root_token``.

    Attributes:
        root_token: the committed token the cycle starts from (verified in every cycle).
        tokens: ``[N]`` target-vocabulary token id of each node.
        parents: ``[N]`` index of each node's parent, ``-1`` when the parent is the root.
        depths: ``[N]`` depth of each node (root children have depth 1).
        draft_probs: ``[N]`` draft probability of the node's token given its parent path.
        path_probs: ``[N]`` product of ``draft_probs`` along the path root -> node
            (the draft's cumulative score; EAGLE-2/3 rank nodes by it).
        hidden: ``[N, D]`` the draft's hidden state after consuming each node's token, or
            ``None`` when the drafter exposes none.  Expert predictors read it.
        root_hidden: ``[D]`` the draft's hidden state for the root token, or ``None``.
        num_levels: how many levels have been drafted (the frontier is the newest level).
        source: ``"draft"`` (grown by the drafter) or ``"lookup"`` (a chain copied from the
            context by prompt lookup, :mod:`specfit_hf.generation.lookup`: no draft model ran,
            so the drafter keeps its accepted tokens as committed ones it has not read yet).
    """

    root_token: int
    tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    parents: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    depths: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    draft_probs: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    path_probs: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    hidden: torch.Tensor | None = None
    root_hidden: torch.Tensor | None = None
    num_levels: int = 0
    source: str = "draft"

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def add_level(
        self,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append one level of nodes; returns the indices of the new nodes.

        ``parents`` index existing nodes (or ``-1`` for the root).  Path probabilities
        and depths are derived here so every drafter computes them the same way.
        """
        tokens = _flat_cpu(tokens, torch.long)
        parents = _flat_cpu(parents, torch.long)
        draft_probs = _flat_cpu(draft_probs, torch.float64)
        m = tokens.numel()
        if not (m == parents.numel() == draft_probs.numel()):
            raise ValueError("tokens, parents and draft_probs must have the same length")
        n0 = len(self)
        # Derived fields in numpy: this runs after every draft level, and a torch op on a
        # few rows costs 5-20 us of dispatch where numpy costs about one.
        p = parents.numpy()
        listed = p.tolist()  # (min / max of a few Python ints beat numpy's reductions)
        if m and max(listed) >= n0:
            raise ValueError("a node's parent must already be in the tree")
        if n0 == 0:  # the first level: every parent is the root
            parent_path, parent_depth = np.ones(m), np.zeros(m, dtype=np.int64)
        elif min(listed, default=0) >= 0:  # every later level of a drafter
            parent_path = self.path_probs.numpy()[p].astype(np.float64)
            parent_depth = self.depths.numpy()[p].astype(np.int64)
        else:
            parent_path = np.ones(m)
            parent_depth = np.zeros(m, dtype=np.int64)
            has_parent = p >= 0
            parent_path[has_parent] = self.path_probs.numpy()[p[has_parent]]
            parent_depth[has_parent] = self.depths.numpy()[p[has_parent]]
        # (cat promotes the float fields to float64, as the new rows are)
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, torch.from_numpy(parent_depth + 1)])
        self.draft_probs = torch.cat([self.draft_probs, draft_probs])
        self.path_probs = torch.cat([self.path_probs, torch.from_numpy(parent_path * draft_probs.numpy())])
        if hidden is not None:
            if hidden.dim() != 2 or hidden.shape[0] != m:
                hidden = hidden.reshape(m, -1)
            if self.hidden is None:
                self.hidden = hidden
            else:
                if hidden.dtype != self.hidden.dtype or hidden.device != self.hidden.device:
                    hidden = hidden.to(self.hidden)
                self.hidden = torch.cat([self.hidden, hidden])
        self.num_levels += 1
        return torch.from_numpy(np.arange(n0, n0 + m))

    def level(self, depth: int) -> torch.Tensor:
        """Indices of the nodes at ``depth``."""
        return torch.nonzero(self.depths == depth).reshape(-1)

    def ancestors(self, node: int) -> list[int]:
        """Path root -> node as node indices (root excluded, ``node`` included)."""
        path = []
        while node >= 0:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def subtree(self, nodes: torch.Tensor | list[int]) -> "DraftTree":
        """The tree restricted to ``nodes`` (must be ancestor-closed), re-indexed in order."""
        nodes = torch.as_tensor(nodes, dtype=torch.long).sort().values
        remap = torch.full((len(self) + 1,), -1, dtype=torch.long)
        remap[nodes] = torch.arange(nodes.numel())
        parents = self.parents[nodes]
        new_parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        if bool(((parents >= 0) & (new_parents < 0)).any()):
            raise ValueError("subtree nodes must be ancestor-closed")
        return DraftTree(
            root_token=self.root_token,
            tokens=self.tokens[nodes],
            parents=new_parents,
            depths=self.depths[nodes],
            draft_probs=self.draft_probs[nodes],
            path_probs=self.path_probs[nodes],
            hidden=None if self.hidden is None else self.hidden[nodes],
            root_hidden=self.root_hidden,
            num_levels=int(self.depths[nodes].max()) if nodes.numel() else 0,
            source=self.source,
        )


@dataclass(frozen=True)
class LookupProposal:
    """A chain copied from the context: what followed the latest earlier occurrence of its suffix.

    Attributes:
        tokens: the continuation (at most the proposer's cap), the root's would-be children in order.
        ngram: length of the context suffix (ending with the root) that matched; longer matches
            are accepted more often, so acceptance is estimated per ``ngram``.
        from_prompt: the continuation is copied from the prompt (else from the generated text,
            which a model repeats at other rates than it copies its prompt).
    """

    tokens: tuple[int, ...]
    ngram: int
    from_prompt: bool = False

    def tree(self, root_token: int, length: int | None = None) -> DraftTree:
        """The first ``length`` tokens (default: all) as a chain below ``root_token``.

        Each node is a point-mass proposal (draft probability 1): rejection sampling then
        accepts token ``x`` with the target's own probability of ``x``, which keeps sampling exact.
        """
        n = len(self.tokens) if length is None else min(int(length), len(self.tokens))
        chain = DraftTree(root_token=int(root_token), source="lookup")
        if n:
            chain.tokens = torch.tensor(self.tokens[:n], dtype=torch.long)
            chain.parents = torch.arange(-1, n - 1, dtype=torch.long)
            chain.depths = torch.arange(1, n + 1, dtype=torch.long)
            chain.draft_probs = torch.ones(n, dtype=torch.float64)
            chain.path_probs = torch.ones(n, dtype=torch.float64)
            chain.num_levels = n
        return chain


@dataclass
class Selection:
    """The subtree chosen for verification.

    ``nodes`` are sorted tree indices, ancestor-closed; empty means a plain decode step
    (only the root is verified).  The predicted figures are filled by policies that
    model the cycle (``specfit``); others leave them ``nan``.  ``expand`` / ``children``
    steer the next draft level (the drafting width is the policy's decision too).
    """

    nodes: torch.Tensor
    expected_tokens: float = float("nan")
    predicted_time: float = float("nan")
    throughput: float = float("nan")
    stop: bool = False  # the policy asks the drafter to stop expanding
    # How to draft the next level (unless ``stop``): which nodes of the newest level to
    # expand and how many children each gets; ``None`` leaves it to the drafter's own
    # rule (the ``tree_top_k`` most likely nodes, ``tree_top_k`` children each).
    expand: torch.Tensor | None = None
    children: int | None = None
    # ``nodes`` index the cycle's prompt-lookup chain (``CycleContext.lookup``) instead of the
    # draft tree: the cycle verifies tokens copied from the context and drafts nothing.
    lookup: bool = False

    def __len__(self) -> int:
        return int(self.nodes.numel())


@dataclass
class VerifyResult:
    """Outcome of verifying ``[root] + selection`` with one target forward.

    Attributes:
        accepted: tree indices of the accepted nodes, root-to-leaf order.
        accepted_positions: positions (0 = root) within the verified block of the root
            and the accepted nodes; the caches keep exactly these.
        new_tokens: token ids committed this cycle: the accepted nodes' tokens then
            the bonus token sampled from the target.
        bonus_token: the target's own token after the accepted path (next cycle's root).
    """

    accepted: list[int]
    accepted_positions: list[int]
    new_tokens: list[int]
    bonus_token: int


@dataclass
class CycleRecord:
    """What one draft / select / verify cycle did and cost (the policy learns from it).

    Attributes:
        nodes_drafted: nodes in the draft tree.
        nodes_verified: selected nodes verified with the root (root excluded).
        tokens_accepted: draft nodes accepted (the bonus token not counted).
        tokens_committed: tokens appended to the sequence (accepted + bonus, after any
            truncation by max_new_tokens / eos); the accepted length tau.
        cycle_seconds / draft_seconds / select_seconds / verify_seconds: time on
            :func:`specfit_hf.clock.clock` of the whole cycle / the drafter / the policy /
            target forward + acceptance.
        levels_drafted: draft levels grown this cycle (0: a plain decode step or a lookup chain).
        experts_loaded: expert loads (cache misses) of the offload runtime in this cycle,
            ``None`` without a runtime.
        root_experts_loaded: of those, the ones the root's own routing needed (what a plain
            decode step would have loaded in this cycle's place), ``None`` without a runtime.
        expected_tokens / predicted_time: the policy's predictions for its selection
            (``nan`` when the policy does not model them).
        source: what the verified nodes came from: ``"draft"`` (the draft model, or none
            verified) or ``"lookup"`` (a prompt-lookup chain).
        row_experts / row_loads: per verified row (the root, then the nodes in block order),
            summed over layers, the distinct experts that row was the first of the block to
            route to, and the loads among them (``None`` without a runtime).  In a chain,
            what each depth brought that the tokens before it had not.
    """

    nodes_drafted: int
    nodes_verified: int
    tokens_accepted: int
    tokens_committed: int
    cycle_seconds: float
    draft_seconds: float
    select_seconds: float
    verify_seconds: float
    levels_drafted: int = 0
    experts_loaded: int | None = None
    root_experts_loaded: int | None = None
    expected_tokens: float = math.nan
    predicted_time: float = math.nan
    source: str = "draft"
    row_experts: tuple[int, ...] | None = None
    row_loads: tuple[int, ...] | None = None


@dataclass
class OracleProbe:
    """What the target does on a whole draft tree, measured without committing anything.

    Attributes:
        target_tokens: ``[1 + N]`` the target's (greedy) next token after the root
            (index 0) and after each node ``v`` (index ``1 + v``).
        routing: ``[1 + N, L, k]`` experts the target routes the root and each node to at
            each MoE layer, or ``None`` without offloaded experts.
    """

    target_tokens: torch.Tensor
    routing: np.ndarray | None = None


@dataclass
class CycleContext:
    """What a selection policy may read about the current ``generate`` call.

    Attributes:
        target: the target model.
        config: the ``SpecFitConfig`` in use.
        experts: read-only view of the target's offloaded experts (residency, routing,
            routers), or ``None`` when the experts are not offloaded.
        draft: the draft model (``assistant_model``), or ``None``.
        prefix_len: tokens in the target cache before this cycle's root.
        oracle_probe: ``tree -> OracleProbe`` (the loop provides it; only the benchmark's
            "oracle" policy calls it), or ``None``.
        lookup: this cycle's prompt-lookup proposal (the continuation of the context's longest
            suffix n-gram seen before), or ``None`` when there is none or the policy takes none.
    """

    target: PreTrainedModel | None
    config: GenerationConfig
    experts: ExpertCacheView | None = None
    draft: torch.nn.Module | None = None
    prefix_len: int = 0
    oracle_probe: Callable[[DraftTree], OracleProbe] | None = None
    lookup: LookupProposal | None = None
