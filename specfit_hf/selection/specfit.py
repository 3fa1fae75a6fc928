"""The ``specfit`` selection policy: verify the draft subtree of highest predicted throughput.

After every draft level :meth:`SpecFitPolicy.select` runs the recipe:

1. **path acceptance** ``P(v)``: calibrated draft probability per node, multiplied along
   the path (:class:`~.acceptance.AcceptanceModel`);
2. **prune**: nodes with ``P(v) <= t_token / T(root alone)`` cannot be in the optimum
   (:func:`~.search.useful_nodes`, exact); their experts are never predicted;
3. **predict experts** of the root and of the remaining nodes per MoE layer, and read
   the device cache's residents (:class:`~.forecast.ExpertForecast`);
4. **search**: the exact ancestor-closed subtree maximizing ``E(S) / T(S)``
   (:func:`~.search.select_subtree`), warm-started from the previous level's optimum,
   with ``T`` from the measured cycle costs (:class:`~.costs.CycleCostTracker`);
5. **drafting plan**: draft another level only while it can pay, expanding only the nodes
   that can pay, with only the children that could ever be verified
   (:class:`~.lookahead.LookAhead`): the drafting width is part of the decision.

Before drafting (the empty tree) the drafting gate picks the kind of cycle
(:class:`~.gate.DraftingGate`): plain decoding, a fixed chain of 1 to ``max_chain`` levels, or the
adaptive tree above, whichever measurably delivers the most tokens per second here --
so the policy degrades to plain decoding or a short chain wherever the draft, link or
host make those faster, and runs the tree wherever it pays.  Then the cycle's
prompt-lookup chain (the continuation of the context's longest repeated suffix, drafted
for free) replaces a plain step or a short chain when its throughput-optimal prefix is
predicted to deliver more (:mod:`~.lookup`), and so may the lookup chain of a chain whose first
drafted token is the proposal's first (:meth:`SpecFitPolicy._agreed_lookup`).  After verification (:meth:`observe`) each
collaborator learns from the measured cycle.  Options: :class:`~.options.SpecFitOptions`.
Without an offload runtime there is no expert term.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import warnings
from typing import Any, Callable

import numpy as np
import torch

from ..clock import clock
from ..offload import get_runtime
from ..tree import CycleContext, CycleRecord, DraftTree, LookupProposal, Selection, VerifyResult
from .acceptance import AcceptanceModel, forget_acceptance, shared_acceptance
from .calibration import calibrate
from .costs import CycleCostTracker, default_cost_model, node_novelty
from .experts import make_predictor
from .forecast import ExpertForecast
from .gate import (
    LOOKUP,
    PROBE_DEPTH,
    DraftingGate,
    chain_kinds,
    drafting_measurements,
    forget_drafting,
    kind_depth,
    novel_at,
    shared_drafting,
)
from .lookahead import LookAhead, useful_children
from .lookup import AGREED, best_lookup_prefix, lookup_context
from .options import DEFAULT_MAX_CHAIN, MAX_CHAIN, SpecFitOptions
from .policy import SelectionPolicy, register_policy, top_n_by_path_prob
from .prefetch import DraftingStops, PrefetchHits, any_missing, named_experts, predicted_residents, prefetch_plan
from .search import CostModel, closed_part, save_instance, select_chain, select_subtree, useful_nodes

__all__ = ["SpecFitPolicy", "export_measurements", "forget_measurements", "import_measurements"]

_EMPTY = torch.empty(0, dtype=torch.long)
_UNSET = object()  # a per-cycle figure not computed yet
_SAMPLE_EVERY = 16  # every this many cycles a fixed chain also feeds the tree's models (expert forecast, calibrator)
_MAX_CACHED = 64
_CONTEXT_TRIALS = 2.0  # chain cycles (decayed) a lookup class needs before a lookup chain may replace a drafting kind
_LOOKUP_REPLACES = 2  # a lookup chain may replace plain steps and fixed chains up to this many levels ...
_LOOKUP_TOKENS = 4.0  # ... and deeper fixed chains whose cycles commit no more tokens than this
_RESIDUAL_DECAY = 0.9  # per fixed-chain cycle: the chain forecast's residual follows the last ten or so
_RESIDUAL_CYCLES = 4.0  # (decayed) chain cycles before the residual enters the forecast
_RESIDUAL_CLIP = 0.25  # a cycle's residual counts up to this share of its forecast
# the node lists a chain's selections use, made once (a tensor per level is host time every cycle)
_PREFIXES = [torch.arange(n, dtype=torch.long) for n in range(_MAX_CACHED + 1)]
_LAST = [torch.tensor([n], dtype=torch.long) for n in range(_MAX_CACHED)]


def _prefix(n: int) -> torch.Tensor:
    """``arange(n)`` (shared: callers must not modify it)."""
    return _PREFIXES[n] if n <= _MAX_CACHED else torch.arange(n, dtype=torch.long)


def _last(n: int) -> torch.Tensor:
    """``tensor([n - 1])``: expand the newest node of a chain of ``n`` (shared: callers must not modify it)."""
    return _LAST[n - 1] if n <= _MAX_CACHED else torch.tensor([n - 1], dtype=torch.long)


def _is_path(tree: DraftTree, selection: Selection) -> bool:
    """Whether the verified nodes are one path from the root (depths 1..n, ancestor-closed)."""
    n = selection.nodes.numel()
    return n > 0 and int(tree.depths[selection.nodes].max()) == n


def _is_top_path(tree: DraftTree, selection: Selection) -> bool:
    """Whether the verified nodes are the draft's top-1 path from the root: what a fixed chain of that many
    levels verifies (each node is its parent's most likely child, one per depth)."""
    if not _is_path(tree, selection):
        return False
    parents, probs = tree.parents.numpy(), tree.draft_probs.numpy()
    for node in selection.nodes.tolist():
        siblings = probs[parents == parents[node]]
        if probs[node] < siblings.max():
            return False
    return True


def forget_measurements() -> None:
    """Forget what SpecFit has measured in this process: drafting rates and costs of every offload runtime and
    the acceptance estimates of every draft.  The next ``generate`` call starts as a fresh process's first does
    (``specfit bench --first-call`` runs every generation so)."""
    forget_drafting()
    forget_acceptance()


def export_measurements(model: Any, draft: Any) -> dict[str, dict]:
    """A copy of what SpecFit has measured with ``model``'s offload runtime and ``draft``: drafting rates and costs,
    and the draft's acceptance, per policy configuration.  Plain data (picklable), for
    :func:`import_measurements` in a later process on the same host, link, cache size and pair."""
    runtime = get_runtime(model)
    if runtime is None:
        raise ValueError("export_measurements needs the target's offload runtime (offload_experts)")
    return copy.deepcopy({"drafting": dict(shared_drafting(runtime.view(), draft)),
                          "acceptance": dict(shared_acceptance(draft))})


def import_measurements(model: Any, draft: Any, measurements: dict[str, dict]) -> None:
    """Start later ``generate`` calls with ``model``'s current offload runtime and ``draft`` from ``measurements``
    (:func:`export_measurements`, possibly from another process) instead of from nothing: a process's first call
    then runs as a later one would.  They describe the host, link, cache size and pair they were measured on."""
    runtime = get_runtime(model)
    if runtime is None:
        raise ValueError("import_measurements needs the target's offload runtime (offload_experts)")
    if not isinstance(measurements, dict) or set(measurements) != {"drafting", "acceptance"}:
        raise ValueError("import_measurements takes what export_measurements returned")
    copied = copy.deepcopy(measurements)
    shared_drafting(runtime.view(), draft).update(copied["drafting"])
    shared_acceptance(draft).update(copied["acceptance"])


@register_policy("specfit")
class SpecFitPolicy(SelectionPolicy):
    """Throughput-optimal subtree selection (see the module docstring)."""

    options_class = SpecFitOptions
    options: SpecFitOptions

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.max_depth = int(getattr(config, "max_depth", 7))
        # the longest chain a cycle may run, and the longest ranked before deeper depths are measured
        # (DraftingGate.chain_limit): by default chains climb past DEFAULT_MAX_CHAIN only where they pay
        self.open_chain = (max(self.max_depth, DEFAULT_MAX_CHAIN) if self.options.max_chain is None
                           else int(self.options.max_chain))
        self.max_chain = max(self.open_chain, MAX_CHAIN) if self.options.max_chain is None else self.open_chain
        self.greedy = not bool(getattr(config, "do_sample", False))
        self.acceptance = AcceptanceModel.for_draft(None, dict(self.options.acceptance), share=False)
        self.costs: CycleCostTracker | None = None
        self.forecast = ExpertForecast(None, None)
        self.gate: DraftingGate | None = None
        self.lookahead = LookAhead(self.max_depth, getattr(config, "tree_top_k", None), self.options.lookahead)
        self._last: Selection | None = None
        self._root_guess: int | None = None  # the root's predicted misses this cycle was priced with
        self._context_guess: int | None = None  # this plain step's / lookup chain's misses as the repeat predicts
        self._repeat: Any = _UNSET  # this cycle's lookup_misses, once asked
        self._root_position = 0  # context position of this cycle's root
        self._kind = "tree"  # the kind of cycle the gate chose for this cycle
        self._shadow: list[int] = []  # a probe's chain tokens not yet compared with committed ones
        self._shadow_depth = 0  # depth of the last one compared
        self.lookup_tokens = self.options.lookup_tokens  # the loop offers prompt-lookup chains this long
        self._proposal: LookupProposal | None = None  # this cycle's prompt-lookup proposal
        self._context: int | None = None  # its class (lookup_context): the chains' acceptance is kept per class
        self._shadow_context: int | None = None  # the class of the cycle a probe's shadow started in
        self.prefetch_hits = PrefetchHits()
        self.drafting_stops = DraftingStops()
        self._stopping = False  # this chain cycle drafts its first level alone, to start its guessed copies
        self._checking = False  # ... or to compare its first token with the lookup proposal's (_agreed_lookup)
        self._stop_copies = 0  # experts this cycle's drafting stop copied (its forecast counts them resident)
        self._residual: float | None = None  # the residual this fixed chain's forecast added (None: not one)
        self._prefetch_counts = (0, 0, 0)  # the runtime's (prefetches, used, used by a root) when last observed

    # -------------------------------------------------------------- lifecycle
    def reset(self, ctx: CycleContext) -> None:
        """Set up the collaborators for a ``generate`` call (shared measurements carry over)."""
        opts = self.options
        initial = opts.cost
        if initial is None and opts.calibrate:
            initial = calibrate(ctx.target, ctx.draft, get_runtime(ctx.target))
        if initial is None:
            initial = default_cost_model(ctx.experts)
        if ctx.experts is None and initial.t_expert:
            initial = CostModel(initial.t0, initial.t_token, 0.0)
        # cycle costs depend on the policy and its settings (the oracle's include its probe); both
        # shared figures are kept per configuration, so side-by-side configurations learn apart
        key = f"{type(self).__name__}:{self.options!r}:{self.max_depth}:{self.max_chain}"
        drafting = drafting_measurements(ctx.experts, ctx.draft, key, opts.explore_every, opts.share_drafting)
        self.costs = CycleCostTracker(initial, drafting, opts.online_cost)
        self.gate = DraftingGate(drafting, opts.adaptive_drafting, chain_kinds(self.max_chain), opts.explore_every,
                                 opts.max_explore_every, self.open_chain)
        self.gate.start_call()
        self.acceptance = AcceptanceModel.for_draft(ctx.draft, dict(opts.acceptance), opts.share_acceptance, key)
        predictor = make_predictor(opts.expert_predictor, ctx.experts, ctx.target, ctx.draft)
        self.forecast = ExpertForecast(predictor, ctx.experts)
        # the prefill's routing: how the text's experts decay with depth (what unmeasured depths are priced by),
        # and where repeats will route (read by lookup proposals only)
        prompt = None if ctx.experts is None or ctx.prefix_len <= 0 else ctx.experts.last_routing(rows=ctx.prefix_len)
        self.gate.observe_text(prompt)
        if self.lookup_tokens:
            self.forecast.start_context(prompt)
        if self._prefetching():
            self._prefetch_counts = ctx.experts.prefetches()
        self._shadow, self._shadow_depth = [], 0

    @property
    def max_levels(self) -> int:
        """Draft levels a cycle may grow: the tree's ``max_depth`` or the longest fixed chain, whichever is more."""
        return max(self.max_depth, self.max_chain)

    @property
    def cost_model(self) -> CostModel:
        """The current verification cost model (drafting excluded)."""
        if self.costs is None:
            raise RuntimeError("the specfit policy is used before reset()")
        return self.costs.model

    # -------------------------------------------------------------- selection
    def select(self, tree: DraftTree, ctx: CycleContext) -> Selection:
        """The throughput-optimal subtree of ``tree`` so far, and whether to draft another level."""
        if self.costs is None:
            self.reset(ctx)
        if len(tree) == 0:
            self._root_position = ctx.prefix_len
            return self._before_drafting(tree, ctx.lookup)
        if self._kind.startswith("probe:"):
            return self._probe_cycle(tree, kind_depth(self._kind))
        if self._kind != "tree":
            return self._chain_cycle(tree, kind_depth(self._kind))
        path = self.acceptance.path(tree)
        self._root_guess = self.forecast.root_guess(tree)
        root_predicted = self._root_guess or 0  # the root's predicted misses (0 without a guess)
        cost = self.costs.cycle_model(tree.num_levels, len(tree), self._root_guess)
        if len(tree) == tree.num_levels:  # a chain (one node per level): prefixes only, in one pass
            return self._select_chain(tree, path, cost, root_predicted)
        candidates = self._prune(tree, path, cost)
        newest = np.nonzero(tree.depths.numpy() == tree.num_levels)[0]
        experts = self.forecast.nodes(tree, np.union1d(candidates, newest))  # the look-ahead reads the frontier
        sel = self._search(tree, path, candidates, experts, cost)
        threshold = self._useful_path(cost, root_predicted)
        self.lookahead.plan(tree, sel, path, experts, self.forecast.cached, self.acceptance,
                            self._cycle_models(self._root_guess), threshold)
        self._last = sel
        return sel

    def _chain_cycle(self, tree: DraftTree, depth: int) -> Selection:
        """A fixed-chain cycle: draft ``depth`` levels of one child, then verify them all.

        Its tokens are the gate's as last ranked (one per-depth acceptance for every chain);
        its forecast time is the per-node one, made once the chain is drafted: the experts its
        nodes are predicted to need against the residents.  The gate's figure is blind to the
        cycle's routing, which is most of a cycle's spread (4090 twin, GSM8K at half cache,
        host time frozen, 16 prompts: the 10-token chains took 22 to 132 ms; the gate's figure
        missed them by 91 % on average, the forecast's predicted misses correlate 0.97 with the
        loads).  Once drafted, only the prefix that pays is verified (:meth:`_best_prefix`).
        """
        n = len(tree)
        nodes = _prefix(n)
        levels = min(depth, self.max_chain)
        if tree.num_levels < levels and n == tree.num_levels:
            if n == 1 and self._checking:
                self._checking = False
                lookup = self._agreed_lookup(tree) if self._agrees(tree) else None
                self.gate.agreed_checked(self._context, lookup is not None)
                if lookup is not None:
                    self._kind = LOOKUP
                    return lookup
                if not self._stopping:
                    return Selection(nodes=nodes, stop=False, expand=_last(n), children=1, levels=levels - 1)
            if n == 1 and self._stopping:  # the other levels draft while the guessed experts move
                started = clock()
                draft = self.gate.state.draft
                drafting = None if draft.t_level is None else (levels - 1) * (draft.t_level + draft.t_node)
                pairs, hidden, keep = self._prefetch(tree, levels, drafting)
                self._stop_copies = 0 if pairs is None else int(pairs.shape[0])
                self.drafting_stops.observe(hidden, clock() - started)
                return Selection(nodes=nodes, stop=False, expand=_last(n), children=1, levels=levels - 1,
                                 prefetch=pairs, keep_resident=keep)
            return Selection(nodes=nodes, stop=False, expand=_last(n), children=1)
        figures = self.gate.ranked_figures().get(self._kind)
        missing = self._chain_missing(tree)  # read once: the forecast and the prefix search both price with it
        seconds = self._prefix_seconds(tree, n, missing)
        if figures is not None and not (n == tree.num_levels and self._sampled()):
            expected = figures[0]
            h, expected, seconds = self._best_prefix(tree, n, expected, seconds, missing)
            nodes = _prefix(h)
        else:  # not measured yet, or a sampled cycle: the tree's acceptance model
            expected = 1.0 + float(self.acceptance.path(tree).sum())
        if self._own_seconds() is not None:
            # the cycle's forecast: what the prefix search priced, plus what the last chain cycles ran past theirs
            self._residual = self._chain_residual()
            seconds = max(seconds + self._residual, 1e-9)
        ahead = keep = None
        if self._prefetching():  # the verified prefix's guessed experts move while the verify's layers compute
            # The forecast keeps its loads: its fits learn from what cycles really loaded, which a copy used in
            # time is not (taking the copies' seconds off too counted them twice: chain cycles forecast up to
            # 11 % short at a quarter cache).  Reading ``model`` refits the verification fit when due; in a run
            # of fixed chains this read is what renews the fit the gate and the prefix search use.
            verify = self.costs.model
            if missing is None or missing[len(nodes)] > 0:  # (none of the prefix's guessed experts missing: no plan)
                ahead, _, keep = self._prefetch(tree, len(nodes), (verify.t0 + verify.t_token * (len(nodes) + 1)),
                                                layer_by_layer=True)
        return Selection(nodes=nodes, expected_tokens=expected, predicted_time=seconds,
                         throughput=math.inf if seconds == 0 else expected / seconds, stop=True,
                         prefetch_ahead=ahead, keep_resident=keep)

    def _best_prefix(self, tree: DraftTree, n: int, expected: float, seconds: float,
                     missing: np.ndarray | None) -> tuple[int, float, float]:
        """The prefix of a drafted ``n``-level chain worth verifying: ``(h, E(h), T(h))`` of highest ``E / T``.

        The chain's kind was chosen on average figures; once it is drafted, the forecast says which
        of its nodes route to experts the cache lacks.  A verified node costs its compute and its
        loads, and the nodes past a costly one are worth less than they cost where they are
        unlikely to be reached: the verify stops before them (drafting is spent either way).
        ``E(h)``: the gate's chain tokens at ``h`` scaled to the kind's ``expected``; ``T(h)``: the
        kind's own seconds at its mean verified nodes, moved to ``h`` nodes by the verification fit,
        plus the forecast's loads of the root and ``h`` nodes (``missing``: :meth:`_chain_missing`).
        ``(n, expected, seconds)`` while a figure is missing.
        """
        gate, costs = self.gate, self.costs
        ct = gate.chain_tokens()
        own = gate.own_seconds(self._kind)
        verify = gate.state.verify_fit
        if n < 2 or ct is None or own is None or verify is None or missing is None or ct[n] <= 0:
            return n, expected, seconds
        v = gate.state.sums[self._kind]
        mean_nodes = float(v[3] / v[2])  # the nodes the kind's own seconds were measured at
        novelty = gate.novelty()
        # every prefix's new experts at once: at whole depths the interpolation is the table itself
        novel = novelty[:n].tolist() if n <= novelty.size else novel_at(novelty, np.arange(n)).tolist()
        novel_mean = novel_at(novelty, mean_nodes)
        tokens, misses = ct[:n].tolist(), missing[:n].tolist()
        scale = expected / float(ct[n])
        best = (n, expected, seconds)
        copies = self._stop_copies_used()
        # each prefix's expected loads, :meth:`~.costs.CycleCostTracker.expected_loads` term by term
        root, per_node, per_miss, root_missing = costs.loads_terms(self._root_guess)
        t_token, t_novel, t_expert = verify.t_token, verify.t_novel, costs.t_expert
        for h in range(1, n):
            compute = t_token * (h - mean_nodes) + t_novel * (novel[h] - novel_mean)
            t = own + compute + t_expert * (root + per_node * h + per_miss * (misses[h] - root_missing) + copies)
            e = tokens[h] * scale
            if t > 0 and e * best[2] > best[1] * t:
                best = (h, e, t)
        return best

    def _prefetching(self) -> bool:
        """Whether chains prefetch: a chain of two or more levels drafts its first level alone, to copy the experts
        the draft then guesses for the root and the first node while the other levels are drafted, and every
        chain copies its verified prefix's guessed experts as the verify starts.

        One stop while drafting: a second one half-way (the other nodes' guesses) gained 0.4 % more on the
        twins with host time frozen, and its heads call and plan cost about that much host time on the CPU.
        """
        view = self.forecast.experts
        return (self.options.prefetch and self.forecast.predictor is not None and view is not None
                and view.can_prefetch())

    def _prefetch(self, tree: DraftTree, verified: int, seconds: float | None,
                  layer_by_layer: bool = False) -> tuple[np.ndarray | None, float, np.ndarray | None]:
        """The experts of a chain's root and first ``verified`` nodes worth copying ahead of the verify, the
        transfer seconds they are expected to hide (:func:`~.prefetch.prefetch_plan`), and the residents the
        copies must not evict (those the same rows are predicted to use): ``(None, 0, None)`` when none is.

        Their predicted experts that are not resident, each needed with the prefetches' measured hit rate
        (a node's also times the chance it is reached), taken while a copy is predicted to hide more
        than it delays (:func:`~.prefetch.prefetch_plan`).  ``seconds``: the drafting still to come before
        the verify, the copies starting now (``None``: not known yet); with ``layer_by_layer``, the
        verify's compute, each layer's copies starting as the layer before it starts (one layer's share
        of it to arrive).  The cycle's later predictions count them resident (a drafting-time copy is not a
        load the chain's forecast prices, as it is not one the runtime counts once used).
        """
        predicted = self.forecast.nodes(tree)
        if predicted is None or seconds is None:
            return None, 0.0, None
        nodes, root = predicted
        rows, cached = np.concatenate([root[None], nodes[:verified]]), self.forecast.cached
        named = named_experts(rows, cached)
        if not any_missing(rows, cached, named):  # nothing to copy (most plans at a high cache fraction): no plan
            return None, 0.0, None
        view = self.forecast.experts
        each = view.transfer_seconds() or self.costs.t_expert
        layers = root.shape[0]
        # host floats: a plan reads a few dozen numbers, where each array call costs more than the arithmetic
        if layer_by_layer:
            window = [0.0] + [seconds / layers] * (layers - 1)  # the first layer's copies start with the verify
        else:
            window = [seconds] * layers
        depths = self.gate.depth_acceptance()  # a chain's nodes are reached with the chains' per-depth rates
        if depths is None:
            reach = self.acceptance.path(tree)[:verified].tolist()
        else:
            reach = list(itertools.accumulate(depths[:verified].tolist(), operator.mul))  # (np.cumprod's products)
        rate = self.prefetch_hits.rate
        needed = [rate * 1.0] + [rate * r for r in reach]
        keep = predicted_residents(rows, cached, named)
        pairs, hidden = prefetch_plan(rows, needed, cached, window,
                                      0.0 if layer_by_layer else view.link_busy_seconds(), each, layer_by_layer,
                                      room=view.slots() - keep.sum(axis=1), named=named)
        if pairs.size == 0:
            return None, 0.0, None
        self.forecast.assume_resident(pairs)
        return pairs, hidden, np.argwhere(keep)

    def _chain_missing(self, tree: DraftTree) -> np.ndarray | None:
        """The forecast's misses of the root plus each prefix of ``tree`` if it is a chain, else ``None``."""
        return self.forecast.chain_missing(tree) if len(tree) == tree.num_levels else None

    def _prefix_seconds(self, tree: DraftTree, verified: int, missing: Any = _UNSET) -> float:
        """The per-node forecast of a drafted ``tree`` with its first ``verified`` nodes verified (a chain prefix).

        A fixed chain that has run a few cycles takes its drafting and compute from them (what the
        gate prices it by) and its transfers from the forecast; otherwise the cycle cost model.
        ``missing``: :meth:`_chain_missing` of ``tree``, when the caller has it.
        """
        if missing is _UNSET:
            missing = self._chain_missing(tree)  # (root with it)
        self._root_guess = self.forecast.root_guess(tree)
        misses = (self._root_guess or 0) if missing is None else int(missing[verified])
        own = self._own_seconds()
        if own is not None:
            loads = self.costs.expected_loads(verified, self._root_guess, misses) + self._stop_copies_used()
            return own + self.costs.t_expert * loads
        cost = self.costs.cycle_model(tree.num_levels, len(tree), self._root_guess)
        return cost.predict(verified + 1, misses)

    def _own_seconds(self) -> float | None:
        """A fixed chain's seconds beside its transfers, from its own cycles (``None``: not a chain, or not
        measured enough); what its forecast is built on, and the forecasts the residual is learned from."""
        return self.gate.own_seconds(self._kind) if self._kind.startswith("chain:") else None

    def _chain_residual(self) -> float:
        """Seconds the fixed chains' forecasts have lately missed by on average (measured minus forecast).

        The forecast is the kind's own seconds beside its transfers plus the loads its nodes are predicted
        to make.  Own seconds take off every copy the verify used as a load, while the forecast adds back
        only the drafting stop's, and a cycle whose experts the heads guess resident still loads some:
        its cycles ran longer than forecast by a near-constant (host time frozen, 16 GSM8K prompts,
        quarter cache: the 4090 twin's chain cycles 15-27 % short, the GH200 ``+graphs`` twin's 27 %,
        with forecast and measured correlated 0.95-0.98).  Charging the verify's expected copies per
        cycle took the CPU's bias down but its error up (docs/acceptance, ``31d3196``); the residual's
        recent mean moves the cycle's forecast by what the last cycles missed.  It is left out of the
        prefix search: the same seconds on every prefix cut fewer prefixes, which cost where loads are
        dear (host time frozen, 16 prompts: Mixtral 4090 twin, GSM8K at a quarter cache, 0.962x; 26
        twin cells 1.005x geo-mean, 0.96-1.06x), and say nothing of what a further node costs.
        """
        total, cycles = self.gate.state.chain_residual
        return total / cycles if cycles >= _RESIDUAL_CYCLES else 0.0

    def _stop_copies_used(self) -> float:
        """The copies of this cycle's drafting stop its verify is expected to use, in loads.

        A kind's own seconds count a copy the verify used as one of its loads (its hidden time shows as a
        shorter cycle: :meth:`observe`), while the forecast counts the stop's copies resident and leaves
        them out of its misses.  Without this charge the hidden time was taken off twice: 4090 twin, CNN/DM
        at a quarter cache, host time frozen, 16 prompts, chain cycles forecast 21 % short (12.5 % with it,
        3 % with prefetching off).
        """
        return self.prefetch_hits.rate * self._stop_copies

    def _sampled(self) -> bool:
        """Whether this fixed-chain cycle also feeds the tree's models (forecast, calibrator)."""
        return self.gate.state.cycle % _SAMPLE_EVERY == 0

    def _probe_cycle(self, tree: DraftTree, depth: int) -> Selection:
        """A probe: draft a chain :data:`~.gate.PROBE_DEPTH` levels deeper than ``depth``, verify ``depth`` of it.

        The unverified tokens are compared with what the target commits (:meth:`observe`).
        """
        n = len(tree)
        if tree.num_levels < min(depth + PROBE_DEPTH, self.max_chain) and n == tree.num_levels:
            return Selection(nodes=_EMPTY, stop=False, expand=_last(n), children=1)
        tokens = self.gate.ranked_figures().get(self._kind, (1.0, math.nan))[0]
        nodes = _prefix(min(depth, n))
        return Selection(nodes=nodes, expected_tokens=tokens, predicted_time=self._prefix_seconds(tree, len(nodes)),
                         stop=True)

    def _follow_shadow(self, committed: list[int]) -> None:
        """Compare a probe's unverified tokens with the tokens the target committed, depth by depth."""
        for token in committed:
            if not self._shadow:
                return
            self._shadow_depth += 1
            hit = self._shadow.pop(0) == token
            self.gate.record_depth(self._shadow_depth, hit, self._shadow_context)
            if not hit:
                self._shadow = []

    def _select_chain(self, tree: DraftTree, path: np.ndarray, cost: CostModel, root_predicted: int) -> Selection:
        """:meth:`select` for a chain: the same recipe, where every closed set is a prefix.

        Most drafting cycles grow a chain (a draft rarely earns a second child), and this
        runs after every level, so it skips the general search's set-up.
        """
        candidates = self._prune(tree, path, cost)  # a prefix: path acceptance only falls along the chain
        missing = self.forecast.chain_missing(tree)
        sel = select_chain(path, missing, cost, candidates.size)
        threshold = self._useful_path(cost, root_predicted)
        self.lookahead.plan_chain(tree, sel, path, missing, self.acceptance, self._cycle_models(self._root_guess),
                                  threshold)
        self._last = sel
        return sel

    def _before_drafting(self, tree: DraftTree, proposal: LookupProposal | None = None) -> Selection:
        """The plain step (root alone) with its predicted time; the gate decides whether to draft, and how
        wide, unless the cycle's prompt-lookup chain (``proposal``) is predicted to pay more."""
        self._last = None
        self._root_guess = self._context_guess = None
        self._repeat = _UNSET
        self._kind = self.gate.choose()
        self._stop_copies = 0
        self._residual = None
        self._proposal, self._context = proposal, lookup_context(proposal)
        if proposal is not None:
            chain = self._lookup_cycle(proposal)
            if chain is not None:
                self._kind = LOOKUP
                return chain
        if self._kind != "tree" and self._kind in self.gate.state.sums:
            # plain or a fixed chain: nothing to decide, and the gate's figures are the forecast
            figures = self.gate.plain_figures() if self._kind == "plain" else (1.0, math.nan)
            if self._kind == "plain":
                figures = self._plain_forecast(proposal, figures)
            return Selection(nodes=_EMPTY, expected_tokens=figures[0], predicted_time=figures[1],
                             stop=self.max_depth < 1 or self._kind == "plain", children=1,
                             levels=self._chain_levels())
        plain_missing = self._root_guess = self.forecast.plain_step_missing(tree)
        cost = self.costs.cycle_model(0, 0, plain_missing)
        predicted = cost.predict(1, plain_missing or 0)
        stop = self.max_depth < 1 or self._kind == "plain"
        if self._kind == "tree":
            children = useful_children(1.0, self.acceptance.rank_acceptance(),
                                       self._useful_path(cost, None, predicted), self.lookahead.frontier_width or 1)
        else:
            children = 1
        return Selection(nodes=_EMPTY, expected_tokens=1.0, predicted_time=predicted, stop=stop, children=children,
                         levels=self._chain_levels())

    def _plain_forecast(self, proposal: LookupProposal | None, figures: tuple[float, float]) -> tuple[float, float]:
        """A plain step's (tokens, seconds): with a prompt-lookup match, its root's loads are what the routing
        of the text it repeats says (:meth:`~.forecast.ExpertForecast.lookup_misses`), else the running mean
        (``figures``).  On CNN/DM (4090 twin, half cache, 8 prompts) that guess correlates 0.90 with a plain
        step's loads, where the mean knows nothing of the step: most of a step's spread is its loads."""
        guess = self._repeat_guess(proposal)
        if guess is None:
            return figures
        self._context_guess = int(guess[0][0])
        return figures[0], self.gate.plain_seconds(self.costs.context_loads(self._context_guess))

    def _repeat_guess(self, proposal: LookupProposal | None) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`~.forecast.ExpertForecast.lookup_misses` of this cycle's proposal, computed at most once a cycle."""
        if self._repeat is _UNSET:
            self._repeat = self.forecast.lookup_misses(proposal)
        return self._repeat

    def _chain_levels(self) -> int:
        """Levels this cycle's kind drafts before its selection (1 for the tree, which decides after every level).

        A fixed chain or a probe drafts all of its levels at once: :meth:`_chain_cycle` and
        :meth:`_probe_cycle` only say "one more" until then, and a call per level was ~10 % of a
        chain cycle's policy time (GH200 twin, GSM8K).  A chain stops after its first level to start
        its guessed copies (:meth:`_prefetch`) or to compare its first token with the lookup proposal's
        (:meth:`_agreed_lookup`).
        """
        kind = self._kind
        self._stopping = self._checking = False
        if kind.startswith("chain:"):
            levels = max(1, min(kind_depth(kind), self.max_chain))
            self._stopping = levels >= 2 and self._prefetching() and self.drafting_stops.wanted()
            # a chain whose first token may agree with a lookup proposal that then pays stops after it
            # (_agreed_lookup): only where the agreed class is measured enough for the lookup to replace it
            self._checking = (levels >= 2 and self.options.agreed_lookup and self._proposal is not None
                              and bool(self._proposal.tokens)
                              and self.gate.context_trials(self._context + AGREED) >= _CONTEXT_TRIALS
                              and self.gate.agreed_check_due(self._context))
            return 1 if self._stopping or self._checking else levels
        if kind.startswith("probe:"):
            return max(1, min(kind_depth(kind) + PROBE_DEPTH, self.max_chain))
        return 1

    def _lookup_cycle(self, proposal: LookupProposal) -> Selection | None:
        """The prompt-lookup chain's best prefix, if it beats the kind the gate chose (``None`` otherwise).

        A lookup chain costs a plain step plus its verified tokens (no draft forward); its tokens
        come from the acceptance of lookup proposals after a match of this length.  It must beat the
        gate's kind as last ranked and every fixed chain with its tokens taken at the acceptance
        chains have in this class of proposal: where the context repeats itself the draft is right
        more often too (and a deeper chain than the gate's average choice may pay there), so
        comparing with the chains' average would hand the lookup the very cycles where the draft
        does best.  A class where chains have hardly run yet runs the gate's chain (that measures
        it); so do an exploration and a kind not measured yet.

        It replaces plain steps, chains of at most :data:`_LOOKUP_REPLACES` levels and a tree whose
        cycles commit no more than such a chain's (priced by its root's guessed loads, the tree runs
        where short chains did: H100 twin, CNN/DM at half cache, host time frozen, 16 prompts, lookup
        cycles 301 -> 113 and 168.3 -> 152.8 tok/s without this, 156.0 with it).  Where the gate
        runs deeper chains or a deeper tree, the draft accepts most of what repeats anyway
        (GSM8K, 4090 twin: ~0.96 per token after an 8-gram repeat), and replacing its easy cycles
        leaves it the hard ones: its acceptance estimates fall, the gate shortens its chains, and
        the call is slower (12 + 12 prompts at half cache: GSM8K 1.39x plain decoding against
        1.58x without lookup chains, where replacing only plain steps and short chains gives 1.58x;
        CNN/DM 1.25x against 1.14x and 1.24x).  A deeper chain counts as short where its cycles commit
        no more than :data:`_LOOKUP_TOKENS`: it verifies the prefixes its forecast says pay
        (:meth:`_best_prefix`), and on fresh text those are a short chain's (host time frozen, five
        twins x GSM8K and CNN/DM x 25 / 50 / 75 % cache, prompts 1-16, against deep chains never
        replaced: 1.021x geo-mean, 0.97-1.10x; CNN/DM alone 1.041x).

        Each copied token is priced by what the routing of the text it repeats says it adds
        (:meth:`~.forecast.ExpertForecast.lookup_misses`): the distinct experts its verify computes
        and the non-resident ones among them, where the chains' average prices every copied token
        alike.  A copy of text whose experts are resident is nearly free, one of text routed to
        evicted experts is not (4090, H100 and Mixtral 4090 twins, CNN/DM at 25 / 50 / 75 % cache,
        host time frozen, 14 cell x prompt-set pairs: 1.071x geo-mean, 0.94-1.19x, 11 of 14 at or
        above; GSM8K, where lookups are few, 14 pairs: 0.992x, 0.92-1.05x).

        Where it would replace a plain step, that step and the chain's root are both this cycle's
        plain step, its loads as the same routing guess says (docs/acceptance, ``36f0297``).
        """
        gate = self.gate
        state = gate.state
        kind = self._kind
        if kind == state.exploring or "plain" not in state.sums:
            return None
        # a chain of at most _LOOKUP_REPLACES levels, or a deeper one whose cycles commit no more than
        # _LOOKUP_TOKENS (it verifies the prefixes its forecast says pay: _best_prefix)
        short_chain = kind.startswith("chain:") and (
            kind_depth(kind) <= _LOOKUP_REPLACES
            or (kind in state.sums and gate.ranked_figures().get(kind, (math.inf,))[0] <= _LOOKUP_TOKENS))
        if kind != "plain" and kind != "tree" and not short_chain:
            return None
        verify = state.verify_fit
        figures = gate.plain_figures() if kind == "plain" else gate.ranked_figures().get(kind)
        if verify is None or figures is None:  # no verification fit yet: copied tokens cannot be priced
            return None
        tokens, kind_seconds = figures
        if kind == "tree" and tokens > 1 + _LOOKUP_REPLACES:
            return None  # a tree that commits what a long chain does: the draft takes the repeats
        if short_chain and gate.context_trials(self._context) < _CONTEXT_TRIALS:
            return None
        root_seconds = kind_seconds if kind == "plain" else gate.plain_figures()[1]
        guess = self._repeat_guess(proposal)  # read only once the lookup may run (a routing read each cycle)
        if kind == "plain" and guess is not None:
            # the lookup would replace this cycle's plain step: both are priced by this cycle's root.
            # Priced at the mean plain step, which once lookups take the repeats is the novel text's
            # costly one, a lookup looked cheaper than steps whose experts are resident (Mixtral 4090
            # twin, GSM8K at 25 % cache, prompts 1-16: 6.46 -> 7.52 tok/s, 0.97x -> 1.12x plain
            # decoding; prompts 17-32: 6.67 -> 6.73; host time frozen, 30 twin cells x the two prompt
            # sets: 1.002x / 1.001x geo-mean, 0.94-1.06x)
            root_seconds = kind_seconds = gate.plain_seconds(self.costs.context_loads(int(guess[0][0])))
        rate = tokens / max(kind_seconds, 1e-12)
        here = gate.chain_tokens_in(self._context)
        if here is not None:
            # the best chain at this class's acceptance: where the text repeats, a deeper chain than
            # the one the gate chose on average may be the better bet, and the lookup must beat it
            ranked = gate.ranked_figures()
            for chain, depth in gate.chain_depths:
                if chain in ranked:
                    rate = max(rate, here[depth] / max(ranked[chain][1], 1e-12))
        q = state.lookup.acceptance(proposal.ngram, len(proposal.tokens), proposal.from_prompt)
        # against a chain or the tree the hurdle prices the root at the ranked kinds' root mean: lookup
        # roots load less (the forecast below says so), but priced at that the lookup chains took the
        # draft's easy cycles and the calls were slower (host time frozen, CNN/DM prompts 1-16, against
        # this hurdle: 4090 twin at half cache 0.932x, Mixtral 4090 twin at half and 75 % cache 0.962x
        # and 0.981x, H100 twin 1.031x)
        return self._priced_lookup(proposal, q, rate, root_seconds, guess, verify)

    def _priced_lookup(self, proposal: LookupProposal, q: np.ndarray, rate: float, root_seconds: float,
                       guess: tuple[np.ndarray, np.ndarray] | None, verify: Any,
                       spent: float = 0.0, beside: float = 0.0) -> Selection | None:
        """The lookup chain's best prefix at acceptance ``q`` if ``E - rate T`` beats ``beside`` (else ``None``):
        its ``E / T`` beats ``rate`` where ``beside`` is 0.

        The root costs ``root_seconds`` and ``spent`` more has gone into the cycle already (a drafted level).
        Each copied token is priced by what the routing of the text it repeats says it adds (``guess``,
        :meth:`~.forecast.ExpertForecast.lookup_misses`): the distinct experts its verify computes and the
        loads among them; without a guess, at the chains' average.
        """
        gate = self.gate
        node_seconds = self._copy_seconds(proposal, guess, verify)
        h, expected, seconds = best_lookup_prefix(q, root_seconds + spent, node_seconds)
        if expected - rate * seconds <= beside:  # (beside 0: E / T no higher than the best kind's rate here)
            return None
        forecast = seconds - root_seconds + gate.lookup_root_seconds()
        if guess is not None:
            # the forecast of this chain: its root's and copied tokens' loads as the repeat says
            misses, added = guess
            self._context_guess = int(misses[h])
            forecast = (spent + gate.plain_seconds(self.costs.context_loads(self._context_guess))
                        + h * verify.t_token + verify.t_novel * float(added[h]))
        return Selection(nodes=_prefix(h), expected_tokens=expected, predicted_time=forecast,
                         throughput=expected / max(seconds, 1e-12), stop=True, lookup=True)

    def _copy_seconds(self, proposal: LookupProposal, guess: tuple[np.ndarray, np.ndarray] | None,
                      verify: Any) -> np.ndarray:
        """Seconds each of ``proposal``'s tokens adds to a verify: what the routing of the text it repeats says
        it adds (``guess``: the distinct experts its verify computes and the loads among them), else the
        chains' average."""
        if guess is None:
            return self.gate.node_seconds(len(proposal.tokens))
        misses, added = guess
        return (verify.t_token + verify.t_novel * np.diff(added)
                + self.gate.state.t_expert * np.diff(self.costs.context_loads(misses)))

    def _agreed_lookup(self, tree: DraftTree) -> Selection | None:
        """After a chain's first drafted level: the cycle's lookup chain instead, where the draft's first token is
        the proposal's and the lookup chain is worth more than the chains.

        Where the draft's next token is the one the repeated text continues with, the text is being repeated:
        the lookup is accepted far more there than on average (CPU + emulated ``qwen3-pcie4``, 16 prompts, the
        chain cycles that had a proposal: its tokens would have committed 3.0-5.6 a cycle where the draft's first
        token was the proposal's and 1.0-2.2 where it was not on CNN/DM at half cache, 3.3-5.5 and 1.0-1.3 on
        GSM8K at a quarter cache), and it drafts no further level.  A chain's acceptance in such cycles is its own
        class (``context + AGREED``: :meth:`~.gate.DraftingGate.chain_tokens_in`), and so is what such a chain
        cycle costs against its kind's figure (:meth:`~.gate.DraftingGate.agreed_cost`: a chain that repeats
        text loads fewer experts); a chain runs on until that class has :data:`_CONTEXT_TRIALS` chain cycles
        (decayed), so both follow the text.

        The two are weighed by what a cycle's tokens are worth beyond its seconds at the gate's kind's rate
        (``E - R T``), not by ``E / T``: a chain that commits twice the lookup's tokens in twice its time is
        worth more, since its extra seconds would earn less at the average rate.  The lookup's first token is
        the draft's, accepted at that class's first-depth rate; its root is priced at the ranked kinds' root mean
        as :meth:`_lookup_cycle` prices it, and the level drafted is part of its cycle.
        """
        gate = self.gate
        context = self._context + AGREED
        verify = gate.state.verify_fit
        if verify is None or gate.context_trials(context) < _CONTEXT_TRIALS:
            return None
        here = gate.chain_tokens_in(context)
        ranked = gate.ranked_figures()
        figure = ranked.get(self._kind)
        if here is None or figure is None or "plain" not in gate.state.sums:
            return None
        rate = figure[0] / max(figure[1], 1e-12)  # what a cycle's seconds are worth: the gate's kind's tokens
        cost = gate.agreed_cost(self._context)  # such a chain cycle's seconds against its kind's figure
        chain = max((here[depth] - rate * cost * ranked[kind][1]
                     for kind, depth in gate.chain_depths if kind in ranked), default=-math.inf)
        proposal = self._proposal
        q = gate.state.lookup.acceptance(proposal.ngram, len(proposal.tokens), proposal.from_prompt).copy()
        q[0] = here[1] - 1.0  # the same token as the draft's first
        root, spent = gate.plain_figures()[1], gate.state.draft.predict(1, 1)
        # the lookup at most worth its tokens less its root, level and copies' compute (no loads): most agreeing
        # cycles stop here, before the repeat's routing is read (~100 us a cycle on the GH200 ``+graphs`` twin)
        reach = np.cumprod(q)
        best = float(np.max(1.0 + np.cumsum(reach) - rate * (root + spent + verify.t_token * np.arange(1, q.size + 1))))
        if best <= chain:
            return None
        return self._priced_lookup(proposal, q, rate, root, self._repeat_guess(proposal), verify, spent, chain)

    def _cycle_models(self, root_predicted: int | None) -> Callable[[int, int], CostModel]:
        """``(levels, nodes) -> cycle cost model`` for this cycle's root (what the look-ahead prices with)."""
        return lambda levels, nodes: self.costs.cycle_model(levels, nodes, root_predicted)

    def _useful_path(self, cost: CostModel, root_missing: int | None, root_time: float | None = None) -> float:
        """Path acceptance a node needs to be worth drafting: it costs a draft slot and a verified token.

        A node adds at most its path acceptance to ``E`` and at least ``t_token + t_node`` to ``T``;
        below ``(t_token + t_node) / T(root alone)`` it cannot raise any set's throughput.
        """
        if root_time is None:
            root_time = cost.predict(1, root_missing)
        return (cost.t_token + self.costs.draft.t_node) / root_time

    def _prune(self, tree: DraftTree, path: np.ndarray, cost: CostModel) -> np.ndarray:
        """Indices of the nodes the optimum may hold (exact pruning, then ``max_nodes`` most likely)."""
        keep = useful_nodes(path, cost, self.forecast.root_missing(tree))
        limit = self.options.max_nodes
        if limit is not None and int(keep.sum()) > limit:
            ranked = DraftTree(root_token=tree.root_token, tokens=tree.tokens, parents=tree.parents,
                               depths=tree.depths, draft_probs=tree.draft_probs,
                               path_probs=torch.from_numpy(np.where(keep, path, -1.0)), num_levels=tree.num_levels)
            keep = np.zeros(len(tree), dtype=bool)
            keep[top_n_by_path_prob(ranked, limit).numpy()] = True
        return np.nonzero(keep)[0]

    def _search(self, tree: DraftTree, path: np.ndarray, candidates: np.ndarray,
                experts: tuple[np.ndarray, np.ndarray] | None, cost: CostModel) -> Selection:
        """The exact search over ``candidates``, warm-started from the previous level's optimum."""
        parents = tree.parents.numpy()
        remap = np.full(len(tree), -1, dtype=np.int64)
        remap[candidates] = np.arange(candidates.size)
        sub_parents = np.where(parents[candidates] >= 0, remap[np.maximum(parents[candidates], 0)], -1)
        warm = None
        if self._last is not None and self._last.nodes.numel() and int(self._last.nodes.max()) < len(tree):
            warm = remap[self._last.nodes.numpy()]
            warm = warm[warm >= 0]
        node_experts = None if experts is None else experts[0][candidates]
        root_experts = None if experts is None else experts[1]
        cached = None if experts is None else self.forecast.cached
        sel = select_subtree(sub_parents, path[candidates], node_experts, root_experts, cached, cost, warm_start=warm)
        chosen = candidates[sel.nodes.numpy()]
        closed = closed_part(parents, chosen)
        if not closed.all():
            # Never expected (the search returns closed sets); keep generation lossless by
            # verifying the closed part, and leave the instance behind for a bug report.
            dump = save_instance(parents=sub_parents, path=path[candidates], cached=cached, warm=warm,
                                 node_experts=node_experts, root_experts=root_experts,
                                 cost=np.array([cost.t0, cost.t_token, cost.t_expert]), chosen=sel.nodes.numpy())
            warnings.warn(f"specfit: the search returned a subtree that is not ancestor-closed; verifying its "
                          f"closed part (instance saved to {dump})", RuntimeWarning, stacklevel=3)
            chosen = chosen[closed]
        sel.nodes = torch.from_numpy(chosen)
        return sel

    def cycle_kind(self, tree: DraftTree) -> str:
        """The drafting gate's kind for this cycle (``"plain"`` when nothing was drafted)."""
        return "plain" if len(tree) == 0 else self._kind

    # -------------------------------------------------------------- learning
    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, record: CycleRecord) -> None:
        """Learn from the verified cycle: acceptance, cycle costs, drafting rates, routing."""
        # fixed chains rank on the gate's per-depth acceptance: the tree's models (calibrator,
        # expert forecast, the loads verified nodes add) learn from them on sampled cycles only
        full = not self._kind.startswith("chain:") or self._sampled()
        full = full and tree.source == "draft"  # a lookup chain carries no draft confidences or states
        # the committed rows' routing extends the context's (what later repeats are guessed from)
        self.forecast.remember(self._root_position, selection.nodes.numel(), result.accepted_positions)
        if full:
            self.acceptance.observe(tree, selection, result, greedy=self.greedy)
        if self.costs is None:
            return
        added = None
        if full:
            predicted = self.forecast.selection_missing(tree, selection)
            added = None if predicted is None else predicted - self.forecast.root_missing(tree)
            self.forecast.observe(tree, selection)  # the predictor learns the verified routing
        root_loads = record.root_experts_loaded  # what a plain step would have loaded in this cycle's place
        copied = copied_root = 0  # this cycle's prefetched experts its verify used, and those its root used
        if self._prefetching():
            counts = self.forecast.experts.prefetches()
            copies, copied, copied_root = (c - b for c, b in zip(counts, self._prefetch_counts))
            self.prefetch_hits.observe(copies, copied)
            self._prefetch_counts = counts
        self.costs.observe(tree, selection, record, added, root_loads, self._root_guess, self._context_guess)
        if (self._residual is not None and math.isfinite(record.cycle_seconds) and record.cycle_seconds > 0
                and math.isfinite(record.predicted_time)):
            # what this fixed chain's forecast missed by, before its residual
            total, cycles = self.gate.state.chain_residual
            forecast = record.predicted_time - self._residual
            # one cycle moves it by at most a quarter of its forecast: a cycle that loaded far more than
            # its forecast said is routing luck the next cycles do not share
            missed = min(max(record.cycle_seconds - forecast, -_RESIDUAL_CLIP * forecast), _RESIDUAL_CLIP * forecast)
            self.gate.state.chain_residual = (_RESIDUAL_DECAY * total + missed, _RESIDUAL_DECAY * cycles + 1.0)
        if math.isfinite(record.cycle_seconds) and record.cycle_seconds >= 0:  # 0: a stopped clock (tests)
            # The gate prices every kind's transfers from the loads of a plain step in its place (the root
            # mean) and the loads a chain's nodes add: an expert a chain copied ahead and then used counts
            # as one of its loads there, and the time its copy hid shows as a shorter cycle.  Not counted,
            # a chain whose root's experts were copied ahead during its drafting pulled the root mean below
            # what plain steps (which copy nothing) load, and plain decoding looked cheap: on the CPU at a
            # quarter cache (emulated qwen3-pcie4, GSM8K) chains' roots loaded 3.5 experts against a
            # plain step's 7.4, and the gate kept falling back to plain steps mid-answer.
            loads = None if record.experts_loaded is None else record.experts_loaded + copied
            root = None if root_loads is None else root_loads + copied_root
            self.gate.observe("plain" if len(tree) == 0 else self._kind, record.tokens_committed,
                              record.cycle_seconds, loads, root, self.costs.t_expert,
                              record.nodes_verified, record.tokens_accepted, self._context, node_novelty(record),
                              path=self._chain_like(tree, selection), agreed=self._agrees(tree))
        committed = list(result.new_tokens[: record.tokens_committed])
        self._follow_shadow(committed)  # an earlier probe's tokens against this cycle's
        if self.lookup_tokens:
            self.gate.state.lookup.observe(self._proposal, committed)  # every cycle teaches lookup acceptance
        depth = record.nodes_verified
        if self._kind.startswith("probe:") and len(tree) == tree.num_levels > depth == len(result.accepted):
            # the verified part was all accepted: the next committed token is the target's own at
            # the first unverified depth.  Greedy: the target commits a token iff it is its argmax;
            # sampling: it draws token x with probability p(x), the chance a verified child x is
            # accepted -- either way a match is an outcome of verifying that deeper chain
            self._shadow, self._shadow_depth = tree.tokens[depth:].tolist(), depth
            self._shadow_context = self._context
            self._follow_shadow(committed[depth:])

    def _agrees(self, tree: DraftTree) -> bool:
        """Whether ``tree`` is a drafted chain whose first token is the cycle's lookup proposal's first."""
        proposal = self._proposal
        return (proposal is not None and tree.source == "draft" and 0 < len(tree) == tree.num_levels
                and int(tree.tokens[0]) == proposal.tokens[0])

    def _chain_like(self, tree: DraftTree, selection: Selection) -> bool:
        """Whether this tree cycle counts as a chain's for the gate (:meth:`~.gate.DraftingGate.observe`'s ``path``).

        Without the gate no chain runs, and any path the tree verified teaches the depths' novelty.  With
        it, a tree cycle that verified exactly the draft's top-1 path is a chain cycle of that depth in
        all but its drafting: its acceptance, its nodes' new experts and loads are a chain's.  Without
        these, a tree stretch leaves the chains priced by the stretch they last ran in: in copied
        arithmetic (4090 twin, GSM8K, half cache) the tree committed 8 tokens a cycle in ~21 ms for
        whole calls while the 10-token chain, priced at 7.0 tokens and 61 ms from calls' cold starts,
        commits 11 there in ~25 ms.
        """
        if self._kind != "tree" or tree.source != "draft":
            return False
        if not self.gate.enabled:
            return _is_path(tree, selection)
        return _is_top_path(tree, selection)

    def report(self) -> dict[str, Any]:
        """Online figures: cost model, cycle-time MAPE, acceptance observations."""
        out: dict[str, Any] = {"acceptance_observations": self.acceptance.calibrator.observations}
        if self.costs is not None:
            out["cost_model"] = self.costs.model
            out["cycle_time_mape_percent"] = self.costs.mape
        return out
