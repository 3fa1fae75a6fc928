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


def _flat_host(t: torch.Tensor | np.ndarray, dtype: type) -> np.ndarray:
    """``t`` as a flat host array of ``dtype``, skipping the steps that would change nothing (each
    costs a few microseconds, and :meth:`DraftTree.add_level` runs after every draft level)."""
    if isinstance(t, torch.Tensor):
        t = (t if t.is_cpu else t.cpu()).numpy()
    t = np.asarray(t)
    if t.ndim != 1:
        t = t.reshape(-1)
    return t if t.dtype == dtype else t.astype(dtype)


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
    # host buffers behind the fields, and the field tensors made from them (see add_level)
    _buffers: tuple[np.ndarray, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _views: tuple[torch.Tensor, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def add_level(
        self,
        tokens: torch.Tensor | np.ndarray,
        parents: torch.Tensor | np.ndarray,
        draft_probs: torch.Tensor | np.ndarray,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append one level of nodes; returns the indices of the new nodes.

        ``parents`` index existing nodes (or ``-1`` for the root).  Path probabilities
        and depths are derived here so every drafter computes them the same way.  The
        fields may come as tensors or host (numpy) arrays.
        """
        tokens = _flat_host(tokens, np.int64)
        parents = _flat_host(parents, np.int64)
        draft_probs = _flat_host(draft_probs, np.float64)
        m = tokens.size
        if not (m == parents.size == draft_probs.size):
            raise ValueError("tokens, parents and draft_probs must have the same length")
        n0 = len(self)
        listed = parents.tolist()  # (min / max of a few Python ints beat numpy's reductions)
        if m and max(listed) >= n0:
            raise ValueError("a node's parent must already be in the tree")
        # The fields grow in host buffers, each new level written in place and the fields made
        # views of them: this runs after every draft level, where concatenating five tensors
        # and converting between torch and numpy cost several microseconds each.
        buf = self._grow(n0 + m)
        if n0 == 0:  # the first level: every parent is the root
            parent_path, parent_depth = 1.0, 0
        elif min(listed, default=0) >= 0:  # every later level of a drafter
            parent_path, parent_depth = buf[4][parents], buf[2][parents]
        else:
            has_parent, rows = parents >= 0, np.maximum(parents, 0)
            parent_path = np.where(has_parent, buf[4][rows], 1.0)
            parent_depth = np.where(has_parent, buf[2][rows], 0)
        n = n0 + m
        for column, values in zip(buf, (tokens, parents, parent_depth + 1, draft_probs, parent_path * draft_probs)):
            column[n0:n] = values
        self.tokens, self.parents, self.depths, self.draft_probs, self.path_probs = views = tuple(
            torch.from_numpy(column[:n]) for column in buf
        )
        self._views = views
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
        return torch.from_numpy(np.arange(n0, n))

    def _grow(self, size: int) -> tuple[np.ndarray, ...]:
        """Host buffers (tokens, parents, depths, draft_probs, path_probs) holding the fields, with room
        for ``size`` nodes; rebuilt from the fields when they were set from outside (a lookup chain, a
        hand-made tree) rather than by :meth:`add_level`."""
        fields = (self.tokens, self.parents, self.depths, self.draft_probs, self.path_probs)
        buf = self._buffers
        if buf is None or any(f is not v for f, v in zip(fields, self._views)) or buf[0].size < size:
            n0 = len(self)
            capacity = max(16, 2 * size)
            grown = tuple(np.empty(capacity, dtype=d) for d in (np.int64,) * 3 + (np.float64,) * 2)
            for column, f in zip(grown, fields):
                column[:n0] = f.reshape(-1)[:n0].cpu().numpy()
            buf = self._buffers = grown
        return buf

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
        source: context position of the first copied token (``None``: unknown), so the matched
            suffix's earlier occurrence ends at ``source - 1``; a repeat routes much like its
            original, which the expert forecast reads there.
    """

    tokens: tuple[int, ...]
    ngram: int
    from_prompt: bool = False
    source: int | None = None

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
    # Draft this many levels before the policy is asked again: the first by ``expand`` /
    # ``children``, each further one below the newest level with ``children`` each (a fixed
    # chain's drafting is decided up front, and a policy call per level is host time).
    levels: int = 1
    # ``nodes`` index the cycle's prompt-lookup chain (``CycleContext.lookup``) instead of the
    # draft tree: the cycle verifies tokens copied from the context and drafts nothing.
    lookup: bool = False
    # ``[P, 2]`` (MoE layer position, expert id) pairs to start copying to the device now, most
    # wanted first: the experts this cycle's verify is predicted to need, copied while drafting
    # goes on (``OffloadRuntime.prefetch``); ``None``: none.
    prefetch: np.ndarray | None = None
    # the same, copied during the verify instead: each layer's pairs as the layer before it starts
    # computing (``OffloadRuntime.prefetch_ahead``); ``None``: none.
    prefetch_ahead: np.ndarray | None = None
    # ``[K, 2]`` pairs alike: residents the copies must not evict (the verify is predicted to use them)
    keep_resident: np.ndarray | None = None

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
            :func:`specfit_hf.clock.clock` of the whole cycle / the drafter / the policy's
            selection / target forward + acceptance.
        observe_seconds: the policy learning from the previous cycle (``observe``), which runs
            after that cycle is recorded and is timed into this one: ``cycle_seconds`` covers every
            host second of the decoding loop, and the policy's share of a cycle is
            ``policy_seconds / cycle_seconds`` (``policy_seconds = select_seconds + observe_seconds``).
        levels_drafted: draft levels grown this cycle (0: a plain decode step or a lookup chain).
        experts_loaded: expert loads (cache misses) of the offload runtime in this cycle,
            ``None`` without a runtime.
        root_experts_loaded: of those, the ones the root's own routing needed (what a plain
            decode step would have loaded in this cycle's place), ``None`` without a runtime.
        expected_tokens / predicted_time: the policy's predictions for its selection
            (``nan`` when the policy does not model them).
        source: what the verified nodes came from: ``"draft"`` (the draft model, or none
            verified) or ``"lookup"`` (a prompt-lookup chain).
        kind: the kind of cycle as the policy names it
            (:meth:`~specfit_hf.selection.SelectionPolicy.cycle_kind`; SpecFit: ``"plain"``,
            ``"chain:h"``, ``"probe:h"``, ``"tree"`` or ``"lookup"``), so a cycle's time can be
            traced to the gate's choice.
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
    observe_seconds: float = 0.0
    experts_loaded: int | None = None
    root_experts_loaded: int | None = None
    expected_tokens: float = math.nan
    predicted_time: float = math.nan
    source: str = "draft"
    row_experts: tuple[int, ...] | None = None
    row_loads: tuple[int, ...] | None = None
    kind: str = ""

    @property
    def policy_seconds(self) -> float:
        """The policy's host time in this cycle: its selection and its learning from the previous cycle."""
        return self.select_seconds + self.observe_seconds


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
