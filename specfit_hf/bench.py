"""Side-by-side benchmark of decoding policies on a target with offloaded experts.

One run compares, on the same prompts, seeds and offload settings:

==================  ==========================================================================
``autoregressive``  stock ``model.generate`` (greedy), experts through the same device cache
``eagle3-vanilla``  EAGLE-3's dynamic tree (N=60, depth 7, top-k 10) and *no persistent
                    expert cache*: every verify loads the union of its experts
``eagle3``          the same tree with the same persistent expert cache as SpecFit
``eagle3-best``     the best fixed verify size N, tuned on other prompts of the category
``static:<shape>``  a fixed tree shape (the ``eagle3`` policy with fixed depth, branching and
                    verify size): ``static`` expands to :data:`STATIC_FAMILY` (chains of
                    depth 1-7, two small trees, the EAGLE-3 default 60/7/10)
``static-best``     the family member with the best decode tok/s on the tune prompts
``lookup:d<h>``     prompt lookup decoding: verify up to ``h`` tokens copied from the context
                    after its longest repeated suffix, no draft model; ``lookup`` expands to
                    :data:`LOOKUP_FAMILY` (``h`` = 2, 4, 7, 10; transformers' default is 10)
``specfit``         throughput-optimal subtree selection, offered prompt-lookup chains as well
``specfit-eagle``   the same policy without prompt-lookup chains (the draft model's proposals only)
``specfit-tree``    the same search every cycle, without the drafting gate (the adaptive tree
                    alone: what the gate's plain steps and fixed chains add or cost)
``oracle``          selection knowing the true acceptance and experts (upper bound)
==================  ==========================================================================

For every (category, cache fraction, link regime) cell and every policy it records
decode-phase tokens/s (tokens after the first / seconds after the first token; the
headline figure), split into the warm-up (the first :data:`WARMUP_TOKENS` decode tokens,
while the expert cache still holds the prompt's experts) and the steady state after it,
time to first token, end-to-end tokens/s (median over runs), decode
speed-ups against each baseline, mean accepted length,
experts loaded and bytes moved per committed token, predicted vs measured cycle time
(MAPE), the selection's share of cycle time, and whether the output equals the
autoregressive output token for token.

On a CPU host the link is emulated (:mod:`specfit_hf.regimes`): the figures show how
each policy copes with a given ratio of expert-transfer time to decode compute, not
what a GPU would measure.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from .clock import clock, paused
from .generation import EAGLE3_DEFAULTS, SpecFitConfig
from .offload import EmulatedLink, get_runtime, offload_experts
from .regimes import REGIMES, LinkRegime, emulated_link_params
from .selection import SpecFitOptions, available_policies, forget_measurements, mape, mape_floors

if TYPE_CHECKING:
    from .twin import Twin

__all__ = [
    "Variant",
    "PromptRun",
    "STATIC_FAMILY",
    "WARMUP_TOKENS",
    "static_label",
    "static_variant",
    "static_family",
    "LOOKUP_FAMILY",
    "lookup_variant",
    "lookup_family",
    "named_variant",
    "expand_policies",
    "default_variants",
    "frozen_heap",
    "measure_cached_step",
    "link_for_regime",
    "run_variant",
    "tune_fixed_n",
    "tune_static",
    "run_benchmark",
    "summarize",
    "time_by_kind",
    "host_info",
    "merge_results",
    "speedup_summary",
    "write_report",
]


@dataclass(frozen=True)
class Variant:
    """One policy column of the benchmark.

    Attributes:
        label: the name in results (``policy`` field).
        policy: the selection policy of the SpecFit loop; ``None`` runs stock ``generate``.
        persistent_cache: keep experts resident across forwards (``False``: flush before
            every target forward, the "vanilla" setting without an expert cache).
        config: ``SpecFitConfig`` overrides (tree settings, ``policy_kwargs``).
    """

    label: str
    policy: str | None
    persistent_cache: bool = True
    config: dict = field(default_factory=dict)



# Decode tokens counted as the warm-up.  A prefill leaves the expert cache holding the
# prompt's experts; the first decode tokens route elsewhere and load many (at half cache a
# plain step's loads fall from ~8 tiny experts to ~1 over its first ten tokens).  On 128-token
# generations the first 24 decode tokens take about a third of plain decoding's decode time
# (4090 twin, half cache), speculation pays less there, and the best kind of cycle is not
# always the best after (CNN/DM: plain decoding first, a 2-token chain after), so the
# benchmark reports the two parts apart.
WARMUP_TOKENS = 24

# Static tree shapes: (max_depth, tree_top_k, max_verify_nodes).  Chains of depth 1-7 (EAGLE-3's
# depth) and 10 (where the draft accepts nearly everything, as on GSM8K, a chain deeper than
# EAGLE-3's is the best static row: 4090 twin, half cache, 1.82x plain decoding against 1.79x
# for depth 7), two small trees and EAGLE-3's default tree.
STATIC_FAMILY: tuple[tuple[int, int, int], ...] = (
    (1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 1, 5), (6, 1, 6), (7, 1, 7), (10, 1, 10), (3, 2, 4), (4, 3, 8),
    (EAGLE3_DEFAULTS["max_depth"], EAGLE3_DEFAULTS["tree_top_k"], EAGLE3_DEFAULTS["max_verify_nodes"]),
)
_STATIC_RE = re.compile(r"^static:d(\d+)k(\d+)n(\d+)$")

# Prompt lookup decoding's proposal lengths (transformers' ``prompt_lookup_num_tokens`` defaults to 10).
LOOKUP_FAMILY: tuple[int, ...] = (2, 4, 7, 10)
_LOOKUP_RE = re.compile(r"^lookup:d(\d+)$")
_CHAIN_CAP_RE = re.compile(r"^specfit:c(\d+)$")
_PARAMETRISED = ("static:", "lookup:", "specfit:")  # label prefixes whose variant is built from the label


def lookup_variant(label: str) -> Variant:
    """The variant of a ``lookup:d<h>`` label (the ``lookup`` policy verifying up to ``h`` tokens)."""
    m = _LOOKUP_RE.match(label)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"bad prompt lookup label {label!r}: expected lookup:d<tokens>, tokens >= 1, e.g. lookup:d4")
    return Variant(label, "lookup", config={"max_depth": int(m.group(1))})


def lookup_family() -> list[Variant]:
    """Every member of :data:`LOOKUP_FAMILY` as a variant."""
    return [lookup_variant(f"lookup:d{h}") for h in LOOKUP_FAMILY]


def chain_cap_variant(label: str) -> Variant:
    """The variant of a ``specfit:c<h>`` label: SpecFit whose drafting gate ranks fixed chains of up to ``h`` levels
    (``policy_kwargs={"max_chain": h}``; the tree keeps EAGLE-3's depth)."""
    m = _CHAIN_CAP_RE.match(label)
    if m is None:
        raise ValueError(f"bad SpecFit chain cap label {label!r}: expected specfit:c<levels>, e.g. specfit:c10")
    try:
        SpecFitOptions(max_chain=int(m.group(1)))  # the options own the bound
    except ValueError as e:
        raise ValueError(f"bad SpecFit chain cap label {label!r}: {e}") from e
    return Variant(label, "specfit", config={**EAGLE3_DEFAULTS, "policy_kwargs": {"max_chain": int(m.group(1))}})


def named_variant(label: str) -> Variant:
    """The variant of a parametrised label: ``static:d<d>k<k>n<n>``, ``lookup:d<h>`` or ``specfit:c<h>``."""
    if label.startswith("lookup:"):
        return lookup_variant(label)
    return chain_cap_variant(label) if label.startswith("specfit:") else static_variant(label)


def static_label(depth: int, top_k: int, nodes: int) -> str:
    """Row label of a static tree: ``static:d<depth>k<top_k>n<nodes>`` (a chain has ``k1``)."""
    return f"static:d{depth}k{top_k}n{nodes}"


def static_variant(label: str) -> Variant:
    """The variant of a ``static:d<depth>k<top_k>n<nodes>`` label (the ``eagle3`` policy, fixed shape)."""
    m = _STATIC_RE.match(label)
    if m is None:
        raise ValueError(
            f"bad static tree label {label!r}: expected static:d<depth>k<top_k>n<nodes>, e.g. static:d3k1n3"
        )
    depth, top_k, nodes = (int(x) for x in m.groups())
    if min(depth, top_k, nodes) < 1:
        raise ValueError(f"static tree {label!r}: depth, top_k and nodes must all be >= 1")
    return Variant(label, "eagle3", config={"max_depth": depth, "tree_top_k": top_k, "max_verify_nodes": nodes})


def static_family() -> list[Variant]:
    """Every member of :data:`STATIC_FAMILY` as a variant."""
    return [static_variant(static_label(*shape)) for shape in STATIC_FAMILY]


def default_variants(
    best_n: int | None = None, include_oracle: bool = True, static_best: str | None = None
) -> list[Variant]:
    """The benchmark's policy columns.

    ``best_n`` adds the tuned fixed-N EAGLE-3 tree (``eagle3-best``); ``static_best`` (a
    ``static:...`` label) adds ``static-best`` with that shape.  The static family is included.
    """
    variants = [
        Variant("autoregressive", None),
        Variant("eagle3-vanilla", "eagle3", persistent_cache=False, config=dict(EAGLE3_DEFAULTS)),
        Variant("eagle3", "eagle3", config=dict(EAGLE3_DEFAULTS)),
    ]
    if best_n is not None:
        variants.append(Variant("eagle3-best", "eagle3", config={**EAGLE3_DEFAULTS, "max_verify_nodes": int(best_n)}))
    variants.extend(static_family())
    variants.extend(lookup_family())
    if static_best is not None:
        variants.append(Variant("static-best", "eagle3", config=static_variant(static_best).config))
    variants.append(Variant("specfit", "specfit", config=dict(EAGLE3_DEFAULTS)))
    variants.append(Variant("specfit-eagle", "specfit",
                            config={**EAGLE3_DEFAULTS, "policy_kwargs": {"lookup_tokens": 0}}))
    variants.append(Variant("specfit-tree", "specfit",
                            config={**EAGLE3_DEFAULTS, "policy_kwargs": {"adaptive_drafting": False}}))
    if include_oracle and "oracle" in available_policies():
        variants.append(Variant("oracle", "oracle", config=dict(EAGLE3_DEFAULTS)))
    return variants


def expand_policies(policies: Sequence[str]) -> list[str]:
    """Validate ``--policies`` names and expand ``static`` to the family's labels.

    Accepts the default labels (``autoregressive``, ``eagle3``, ``eagle3-vanilla``,
    ``eagle3-best``, ``specfit``, ``specfit-eagle``, ``specfit-tree``, ``oracle``), ``static``,
    ``static-best``, any ``static:d<depth>k<top_k>n<nodes>``, ``lookup`` (the prompt-lookup family),
    any ``lookup:d<tokens>`` and any ``specfit:c<levels>`` (SpecFit with chains of up to that many levels).
    Raises ``ValueError`` naming what is wrong.
    """
    known = {v.label for v in default_variants(best_n=0, static_best=static_label(*STATIC_FAMILY[0]))}
    out: list[str] = []
    unknown = []
    for name in policies:
        if name == "static":
            out.extend(static_label(*shape) for shape in STATIC_FAMILY)
        elif name == "lookup":
            out.extend(v.label for v in lookup_family())
        elif name.startswith(_PARAMETRISED):
            named_variant(name)  # raises on a malformed shape
            out.append(name)
        elif name in known:
            out.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"unknown policies {sorted(unknown)}; choose from "
            f"{sorted(known - {v.label for v in static_family() + lookup_family()})}, "
            "'static' (the whole family), static:d<depth>k<top_k>n<nodes>, 'lookup' (its family), lookup:d<tokens> "
            "or specfit:c<levels>"
        )
    return list(dict.fromkeys(out))


class _TimingStreamer:
    """A ``generate`` streamer that records :func:`clock` and the token count of each ``put``.

    Stock ``generate`` puts the prompt first; the SpecFit loop may or may not (it is
    recognised afterwards from the token counts, see :meth:`first_token_time`).
    """

    def __init__(self) -> None:
        self.puts: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((clock(), int(value.numel())))

    def end(self) -> None:
        pass

    def _new_token_puts(self, prompt_len: int, new_tokens: int) -> list[tuple[float, int]]:
        puts = self.puts
        if puts and sum(n for _, n in puts) == prompt_len + new_tokens and puts[0][1] == prompt_len:
            puts = puts[1:]  # the prompt
        return [(t, n) for t, n in puts if n > 0]

    def first_token_time(self, prompt_len: int, new_tokens: int) -> tuple[float, int]:
        """``(clock at the put that carried the first new token, tokens in that put)``."""
        puts = self._new_token_puts(prompt_len, new_tokens)
        if not puts:
            raise RuntimeError("generate produced no token through the streamer")
        return puts[0]

    def warmup(self, prompt_len: int, new_tokens: int, window: int) -> tuple[float, float]:
        """``(decode tokens, seconds)`` of the first ``window`` decode tokens (those after the first put's).

        A put carries the tokens of one cycle, all emitted at its end: the cycle that crosses
        the window's end is split in proportion to its tokens.  Fewer decode tokens than
        ``window``: all of them.
        """
        puts = self._new_token_puts(prompt_len, new_tokens)
        if not puts:
            raise RuntimeError("generate produced no token through the streamer")
        start, _ = puts[0]
        last, done = start, 0
        for t, n in puts[1:]:
            if done + n >= window:
                return float(window), (last - start) + (t - last) * (window - done) / n
            done, last = done + n, t
        return float(done), last - start


@dataclass
class PromptRun:
    """One generation of one prompt under one variant."""

    variant: str
    prompt_index: int
    run: int
    new_tokens: list[int]
    seconds: float
    cycles: int
    mean_accepted: float
    experts_loaded: int
    bytes_h2d: int
    predicted_cycle_seconds: list[float] = field(default_factory=list)
    measured_cycle_seconds: list[float] = field(default_factory=list)
    policy_seconds: float = 0.0  # the policy's host time: selection and learning (CycleRecord.observe_seconds)
    ttft_seconds: float = float("nan")
    decode_seconds: float = float("nan")
    decode_tokens: int = 0
    warmup_seconds: float = float("nan")  # the first WARMUP_TOKENS decode tokens (see _TimingStreamer.warmup)
    warmup_tokens: float = 0.0
    cycle_shapes: list[tuple[int, int]] = field(default_factory=list)  # (levels drafted, nodes verified)
    cycle_loads: list[int] = field(default_factory=list)  # expert loads of each cycle
    cycle_kinds: list[str] = field(default_factory=list)  # each cycle's kind (CycleRecord.kind)
    cycle_tokens: list[int] = field(default_factory=list)  # tokens each cycle committed
    cycle_policy_seconds: list[float] = field(default_factory=list)  # each cycle's policy host time


@torch.inference_mode()
def measure_cached_step(
    target: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = 16, repeats: int = 3
) -> float:
    """Median seconds per decode step of ``target`` with every expert resident.

    Call it before attaching the offload runtime (then every expert is on the device).
    """
    if get_runtime(target) is not None:
        raise ValueError("measure the cached decode step before offload_experts() is attached")
    times = []
    for _ in range(repeats + 1):
        t = clock()
        target.generate(input_ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        prefill_t = clock()
        target.generate(input_ids, do_sample=False, max_new_tokens=1, min_new_tokens=1)
        one = clock() - prefill_t
        times.append(max(1e-6, (prefill_t - t - one) / (new_tokens - 1)))
    return statistics.median(times[1:])  # the first run warms up


def link_for_regime(
    regime: LinkRegime | str, runtime: Any, cached_step_seconds: float, *, virtual: bool = False
) -> EmulatedLink:
    """The emulated link that gives this model ``regime``'s transfer/compute ratio.

    ``virtual=True`` accounts transfer time on :func:`specfit_hf.offload.clock` instead of
    waiting it out (same timeline, far less wall time; see :mod:`specfit_hf.offload.link`).
    """
    if isinstance(regime, str):
        regime = REGIMES[regime]
    gbps, latency_us = emulated_link_params(
        regime,
        expert_bytes=runtime.expert_bytes,
        experts_per_token=runtime.top_k * len(runtime.moe_layers),
        cached_step_seconds=cached_step_seconds,
    )
    return EmulatedLink(gbps=gbps, latency_us=latency_us, virtual=virtual)


@torch.inference_mode()
def run_variant(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    input_ids: torch.Tensor,
    variant: Variant,
    max_new_tokens: int,
    *,
    prompt_index: int = 0,
    run: int = 0,
    seed: int = 0,
    first_call: bool = False,
) -> PromptRun:
    """Generate for one prompt with one variant, from a flushed expert cache.

    ``first_call``: forget what SpecFit measured in earlier calls first
    (:func:`~specfit_hf.selection.forget_measurements`): the generation is a fresh process's first.
    """
    runtime = get_runtime(target)
    if runtime is None:
        raise ValueError("attach offload_experts() to the target first")
    if first_call:
        forget_measurements()
    runtime.flush()
    runtime.persistent = variant.persistent_cache
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    before = runtime.stats.total.copy()
    torch.manual_seed(seed)
    pauses = paused()
    if pauses is not None:  # every policy's generation of a prompt meets the same busy host
        pauses.reseed(f"{prompt_index}:{run}:{int(input_ids.sum())}")
    streamer = _TimingStreamer()
    t = clock()
    if variant.policy is None:
        out = target.generate(
            input_ids, do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True, streamer=streamer
        )
        cycles = []
    else:
        config = SpecFitConfig(
            policy=variant.policy,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            **variant.config,
        )
        out = target.generate(input_ids, assistant_model=draft, generation_config=config, streamer=streamer)
        cycles = list(out.cycles or [])
    if out.sequences.is_cuda:
        torch.cuda.synchronize()
    end = clock()
    seconds = end - t
    runtime.persistent = True
    moved = runtime.stats.total - before
    new = out.sequences[0, input_ids.shape[1]:].tolist()
    first_t, first_n = streamer.first_token_time(input_ids.shape[1], len(new))
    warmup_tokens, warmup_seconds = streamer.warmup(input_ids.shape[1], len(new), WARMUP_TOKENS)
    accepted = [c.tokens_committed for c in cycles]
    return PromptRun(
        variant=variant.label,
        prompt_index=prompt_index,
        run=run,
        new_tokens=new,
        seconds=seconds,
        cycles=len(cycles) if cycles else len(new),
        mean_accepted=statistics.fmean(accepted) if accepted else 1.0,
        experts_loaded=int(moved.misses),
        bytes_h2d=int(moved.bytes_h2d),
        predicted_cycle_seconds=[c.predicted_time for c in cycles],
        measured_cycle_seconds=[c.cycle_seconds for c in cycles],
        cycle_shapes=[(c.levels_drafted, c.nodes_verified) for c in cycles],
        cycle_loads=[c.experts_loaded or 0 for c in cycles],
        cycle_kinds=[c.kind for c in cycles],
        cycle_tokens=[c.tokens_committed for c in cycles],
        policy_seconds=sum(c.policy_seconds for c in cycles),
        cycle_policy_seconds=[c.policy_seconds for c in cycles],
        ttft_seconds=first_t - t,
        decode_seconds=end - first_t,
        decode_tokens=len(new) - first_n,
        warmup_seconds=warmup_seconds,
        warmup_tokens=warmup_tokens,
    )


def time_by_kind(generations: Iterable[Sequence[tuple[str, int, float]]],
                 first_tokens: int = WARMUP_TOKENS) -> dict[str, dict[str, dict[str, float]]]:
    """Where decoding time goes, by the kind of cycle (``CycleRecord.kind``), over each generation's start and the rest.

    ``generations``: per ``generate`` call, its cycles in order as ``(kind, tokens committed, seconds)``.  Returns,
    per phase (``"first"``: the cycles until the generation has committed ``first_tokens`` decode tokens, the phase
    a fresh prefill leaves the expert cache cold for; ``"rest"``) and kind: ``cycles``, ``tokens``, ``seconds``,
    ``ms_per_token`` and ``share`` (of the phase's seconds).
    """
    out: dict[str, dict[str, dict[str, float]]] = {"first": {}, "rest": {}}
    for cycles in generations:
        committed = 0
        for kind, tokens, seconds in cycles:
            row = out["first" if committed < first_tokens else "rest"].setdefault(
                kind or "unknown", {"cycles": 0, "tokens": 0, "seconds": 0.0})
            row["cycles"] += 1
            row["tokens"] += int(tokens)
            row["seconds"] += float(seconds)
            committed += int(tokens)
    for rows in out.values():
        total = sum(r["seconds"] for r in rows.values())
        for r in rows.values():
            r["ms_per_token"] = 1e3 * r["seconds"] / r["tokens"] if r["tokens"] else float("nan")
            r["share"] = r["seconds"] / total if total > 0 else float("nan")
    return out


def _tokens_per_second(runs: Iterable[PromptRun]) -> float:
    """End to end: every new token over the whole generate call (prefill included)."""
    runs = list(runs)
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.new_tokens) for r in runs) / seconds if seconds > 0 else float("nan")


def _decode_tokens_per_second(runs: Iterable[PromptRun], part: str = "all") -> float:
    """Decode phase: tokens after the first over the seconds after the first token.

    ``part``: ``"all"``, ``"warmup"`` (the first :data:`WARMUP_TOKENS` decode tokens) or
    ``"steady"`` (the decode tokens after them).
    """
    runs = list(runs)
    if part == "warmup":
        tokens, seconds = sum(r.warmup_tokens for r in runs), sum(r.warmup_seconds for r in runs)
    elif part == "steady":
        tokens = sum(r.decode_tokens - r.warmup_tokens for r in runs)
        seconds = sum(r.decode_seconds - r.warmup_seconds for r in runs)
    elif part == "all":
        tokens, seconds = sum(r.decode_tokens for r in runs), sum(r.decode_seconds for r in runs)
    else:
        raise ValueError(f"part must be 'all', 'warmup' or 'steady', got {part!r}")
    return tokens / seconds if seconds > 0 and tokens > 0 else float("nan")


def _tune(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts_ids: Sequence[torch.Tensor],
    max_new_tokens: int,
    candidates: dict[Any, Variant],
    desc: str,
) -> tuple[Any, dict[Any, float]]:
    """The key of ``candidates`` whose variant has the best decode tok/s on ``prompts_ids``."""
    scores: dict[Any, float] = {}
    for key, variant in tqdm(candidates.items(), desc=desc, leave=False, disable=len(candidates) < 3):
        runs = [run_variant(target, draft, ids, variant, max_new_tokens, prompt_index=i)
                for i, ids in enumerate(prompts_ids)]
        scores[key] = _decode_tokens_per_second(runs)
    best = max(scores, key=lambda k: -math.inf if math.isnan(scores[k]) else scores[k])
    return best, scores


def tune_fixed_n(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts_ids: Sequence[torch.Tensor],
    max_new_tokens: int,
    candidates: Sequence[int] = (4, 8, 16, 32, 60),
) -> tuple[int, dict[int, float]]:
    """The verify size N of the EAGLE-3 tree with the best decode tokens/s on ``prompts_ids``.

    Use prompts disjoint from the evaluation prompts (the benchmark takes them from
    further down the same split).
    """
    variants = {int(n): Variant(f"eagle3-N{n}", "eagle3", config={**EAGLE3_DEFAULTS, "max_verify_nodes": int(n)})
                for n in candidates}
    return _tune(target, draft, prompts_ids, max_new_tokens, variants, "tune eagle3 N")


def tune_static(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    prompts_ids: Sequence[torch.Tensor],
    max_new_tokens: int,
    family: Sequence[Variant] | None = None,
) -> tuple[str, dict[str, float]]:
    """The static tree (label) with the best decode tokens/s on ``prompts_ids`` (disjoint tune prompts).

    A Sequoia-style hardware-tuned static tree: the shape is chosen on this host, link and
    cache, then fixed for the evaluated prompts.
    """
    family = list(family) if family is not None else static_family()
    return _tune(target, draft, prompts_ids, max_new_tokens, {v.label: v for v in family}, "tune static tree")


def _median_share(runs: Sequence[PromptRun]) -> float:
    """Median over cycles of the policy's host time over the cycle's time (NaN without per-cycle figures)."""
    shares = [p / c for r in runs for p, c in zip(r.cycle_policy_seconds, r.measured_cycle_seconds) if c > 0]
    return statistics.median(shares) if shares else float("nan")


def summarize(
    runs: list[PromptRun],
    reference: dict[int, list[int]],
    baselines: Sequence[str] = ("autoregressive", "eagle3-vanilla", "eagle3", "static-best"),
) -> dict[str, dict[str, Any]]:
    """Per-variant metrics of one cell; ``reference`` maps prompt index -> autoregressive tokens.

    ``speedup_vs_<base>`` are decode-phase ratios (``decode_tokens_per_s``);
    ``e2e_speedup_vs_<base>`` the end-to-end ones (``tokens_per_s``, prefill included).
    """
    by_variant: dict[str, list[PromptRun]] = {}
    for r in runs:
        by_variant.setdefault(r.variant, []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    for label, vruns in by_variant.items():
        per_run = {}
        for r in vruns:
            per_run.setdefault(r.run, []).append(r)
        tps_runs = [_tokens_per_second(rs) for rs in per_run.values()]
        decode_runs = [_decode_tokens_per_second(rs) for rs in per_run.values()]
        committed = sum(len(r.new_tokens) for r in vruns)
        cycle_records = [r for r in vruns if r.measured_cycle_seconds]
        cycle_seconds = sum(sum(r.measured_cycle_seconds) for r in cycle_records)
        measured = [m for r in vruns for m in r.measured_cycle_seconds]
        blind, loads_known = mape_floors([s for r in vruns for s in r.cycle_shapes],
                                         [x for r in vruns for x in r.cycle_loads], measured)
        rows[label] = {
            "decode_tokens_per_s": statistics.median(decode_runs),
            "decode_tokens_per_s_runs": decode_runs,
            "warmup_decode_tokens_per_s": statistics.median(
                _decode_tokens_per_second(rs, "warmup") for rs in per_run.values()),
            "steady_decode_tokens_per_s": statistics.median(
                _decode_tokens_per_second(rs, "steady") for rs in per_run.values()),
            "ttft_s": statistics.fmean(r.ttft_seconds for r in vruns),
            "tokens_per_s": statistics.median(tps_runs),
            "tokens_per_s_runs": tps_runs,
            "mean_accepted": statistics.fmean(len(r.new_tokens) / max(1, r.cycles) for r in vruns),
            "experts_loaded_per_token": sum(r.experts_loaded for r in vruns) / max(1, committed),
            "bytes_per_token": sum(r.bytes_h2d for r in vruns) / max(1, committed),
            "cycle_time_mape_pct": mape([p for r in vruns for p in r.predicted_cycle_seconds], measured),
            # post hoc references for that MAPE (see mape_floors): routing-blind, and loads known
            "cycle_time_mape_blind_floor_pct": blind,
            "cycle_time_mape_loads_known_pct": loads_known,
            "selection_overhead_share": (
                sum(r.policy_seconds for r in cycle_records) / cycle_seconds if cycle_seconds > 0 else 0.0
            ),
            # the goal is stated per cycle (the median cycle's share); the total share above is the
            # stricter figure (long cycles weigh more, and a cycle's policy time is mostly fixed)
            "selection_overhead_median_share": _median_share(vruns),
            "outputs_identical_to_autoregressive": all(r.new_tokens == reference[r.prompt_index] for r in vruns),
            # where the time goes, by the policy's kind of cycle (CycleRecord.kind), start and rest of each generation
            "time_by_kind": time_by_kind(zip(r.cycle_kinds, r.cycle_tokens, r.measured_cycle_seconds)
                                         for r in vruns if r.cycle_kinds),
            "generations": len(vruns),
            "first_output_tokens": min(vruns, key=lambda r: (r.run, r.prompt_index)).new_tokens,
        }
    for label, row in rows.items():
        for base in baselines:
            if base in rows and base != label:
                # headline ratios are decode-phase; the end-to-end one sits beside them
                row[f"speedup_vs_{base}"] = row["decode_tokens_per_s"] / rows[base]["decode_tokens_per_s"]
                row[f"e2e_speedup_vs_{base}"] = row["tokens_per_s"] / rows[base]["tokens_per_s"]
    return rows


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside, the objects alive on entry are out of the garbage collector's reach (``gc.freeze``).

    A loaded model is hundreds of thousands of Python objects, and a full collection scans them
    all: ~0.2 s on this project's CPU host (the tiny pair, 0.45 M tracked objects), about once in
    2,000 decoded tokens there, inside whichever cycle allocates at that moment.  That is a pause no
    policy causes, and it misprices the kind of cycle it lands in for the cycles after.  Serving
    engines freeze the heap after loading their model for the same reason.  On exit the objects are
    collectable again.  A caller that froze objects itself keeps its own arrangement (nothing is done).
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_benchmark(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tokenizer: Any,
    prompts: dict[str, list[str]],
    *,
    cache_fractions: Sequence[float] = (0.25, 0.5, 0.75),
    links: Sequence[str | LinkRegime] = ("qwen3-pcie4",),
    variants: Sequence[Variant] | None = None,
    policies: Sequence[str] | None = None,
    runs: int = 1,
    max_new_tokens: int = 128,
    tune_prompts: dict[str, list[str]] | None = None,
    tune_candidates: Sequence[int] = (4, 8, 16, 32, 60),
    offload_policy: str = "lru",
    device: str = "cpu",
    virtual_link: bool = True,
    progress: bool = True,
    twin: "str | Twin | None" = None,
    first_call: bool = False,
    warm_prompts: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Run the grid; returns ``{"runs": [row, ...], "meta": {...}}`` (see module docstring).

    Args:
        prompts: category -> prompt texts.
        links: link regimes emulated on the CPU; ignored on CUDA, where the real link is
            measured (the rows then say ``link="real"``).
        variants: the policy columns (default :func:`default_variants`, with the tuned N).
        policies: keep only these columns (see :func:`expand_policies`: default labels,
            ``static`` for the whole static family, ``static:d<d>k<k>n<n>``, ``static-best``;
            ``eagle3-best`` and ``static-best`` need ``tune_prompts``); exclusive with ``variants``.
        tune_prompts: category -> other prompts (disjoint from ``prompts``) used to pick the
            best fixed N (``eagle3-best``) and the best static tree (``static-best``); skipped if None.
        device: "cpu" (emulated link) or a CUDA device (real host→device copies).
        virtual_link: on CPU, account emulated transfer time on the virtual clock instead
            of waiting (see :mod:`specfit_hf.offload.link`); recorded in ``meta``.
        twin: a device twin (:mod:`specfit_hf.twin`): the clock charges the twin's modeled time
            for target/draft forwards and expert transfers (``links`` is then ignored; rows'
            ``link`` is the twin's name; ``meta["twin"]`` holds every constant and the scaling).
        first_call: every generation starts from nothing measured (what a process's first ``generate``
            gets; by default later calls on a cell's runtime start from what earlier ones measured).
        warm_prompts: category -> other prompts (disjoint from ``prompts``) that every SpecFit column
            generates, unrecorded, before the cell's evaluated prompts: its first evaluated call starts
            from what those measured, as a process that has served a few requests does (and as
            ``static-best`` is tuned on ``tune_prompts``).  Exclusive with ``first_call``.
    """
    if get_runtime(target) is not None:
        raise ValueError("run_benchmark attaches the offload runtime itself; detach the current one")
    if variants is not None and policies is not None:
        raise ValueError("pass either variants or policies, not both")
    if warm_prompts and first_call:
        raise ValueError("warm_prompts and first_call exclude each other: a first call starts from nothing measured")
    if policies is not None:
        policies = expand_policies(policies)
        for tuned in ("eagle3-best", "static-best"):
            if tuned in policies and not tune_prompts:
                raise ValueError(f"policy {tuned!r} needs tune_prompts to choose its tree")
    emulated = str(device) == "cpu"
    if twin is not None:
        from .twin import get_twin

        if not emulated:
            raise ValueError("a device twin models the GPU timeline on a CPU host; run it with device='cpu'")
        twin = get_twin(twin)
    host = host_info()  # now: the code that runs, not whatever is checked out when the grid ends

    def encode(texts: list[str]) -> list[torch.Tensor]:
        return [tokenizer(t, return_tensors="pt").input_ids.to(device) for t in texts]

    ids = {c: encode(ps) for c, ps in prompts.items()}
    tune_ids = {c: encode(ps) for c, ps in (tune_prompts or {}).items()}
    warm_ids = {c: encode(ps) for c, ps in (warm_prompts or {}).items()}
    regimes: list[LinkRegime | None] = [REGIMES[x] if isinstance(x, str) else x for x in links] if emulated else [None]
    if twin is not None:
        regimes = [None]
    first = next(iter(ids.values()))[0]
    cached_step = measure_cached_step(target, first) if emulated and twin is None else float("nan")
    rows: list[dict[str, Any]] = []
    cells = [(c, f, regime) for f in cache_fractions for regime in regimes for c in ids]
    bar = tqdm(total=len(cells), desc="benchmark cells", disable=not progress)
    tuning: dict[str, Any] = {}
    for category, fraction, regime in cells:
        link_name = regime.name if regime is not None else (twin.name if twin is not None else "real")
        runtime = offload_experts(target, device=device, cache_fraction=fraction, policy=offload_policy)
        timeline = None
        heap = contextlib.ExitStack()
        try:
            if regime is not None:
                runtime.link = link_for_regime(regime, runtime, cached_step, virtual=virtual_link)
            if twin is not None:
                from .twin import TwinTimeline

                timeline = TwinTimeline(twin, target, draft).attach()
            heap.enter_context(frozen_heap())  # no full garbage collection inside the cell's timings
            best_n, best_static = None, None
            cell_key = f"{category}/{fraction}/{link_name}"

            def wanted(label: str) -> bool:
                return variants is None and category in tune_ids and (policies is None or label in policies)

            if wanted("eagle3-best"):
                best_n, scores = tune_fixed_n(target, draft, tune_ids[category], max_new_tokens, tune_candidates)
                tuning.setdefault(cell_key, {}).update(best_n=best_n, decode_tokens_per_s=scores)
            if wanted("static-best"):
                best_static, scores = tune_static(target, draft, tune_ids[category], max_new_tokens)
                tuning.setdefault(cell_key, {}).update(static_best=best_static, static_decode_tokens_per_s=scores)
            if variants is not None:
                vs = list(variants)
            else:
                vs = default_variants(best_n, static_best=best_static)
                if policies is not None:
                    extra = [named_variant(p) for p in policies if p.startswith(_PARAMETRISED)]
                    vs = [v for v in vs if v.label in policies and not v.label.startswith(_PARAMETRISED)] + extra
                    order = {p: i for i, p in enumerate(policies)}
                    vs.sort(key=lambda v: order[v.label])
            for v in vs:  # SpecFit keeps what earlier calls on this runtime measured: the warm prompts are those calls
                if v.policy == "specfit":
                    for x in warm_ids.get(category, []):
                        run_variant(target, draft, x, v, max_new_tokens)
            cell_runs: list[PromptRun] = []
            reference: dict[int, list[int]] = {}
            inner = tqdm(
                total=len(vs) * runs * len(ids[category]),
                desc=f"{category} cache={fraction:g} {link_name}",
                leave=False,
                disable=not progress,
            )
            # Prompt-major order: every policy of a prompt runs back to back, so a change in
            # host load during the cell touches all policies alike instead of one column.
            for run in range(runs):
                for i, x in enumerate(ids[category]):
                    for v in vs:
                        r = run_variant(target, draft, x, v, max_new_tokens, prompt_index=i, run=run, seed=run,
                                        first_call=first_call)
                        if v.policy is None and run == 0:
                            reference[i] = r.new_tokens
                        cell_runs.append(r)
                        inner.update()
            inner.close()
            if not reference:  # no autoregressive column: use the first variant's output
                reference = {r.prompt_index: r.new_tokens for r in cell_runs if r.run == 0 and r.variant == vs[0].label}
            for label, metrics in summarize(cell_runs, reference).items():
                row = {"category": category, "cache_fraction": fraction, "link": link_name, "policy": label, **metrics}
                if label == "static-best":
                    row["static_best_shape"] = best_static
                rows.append(row)
        finally:
            heap.close()
            if timeline is not None:
                timeline.detach()
            runtime.detach()
        bar.update()
    bar.close()
    meta = {
        "cached_step_seconds": cached_step,
        "max_new_tokens": max_new_tokens,
        "runs": runs,
        "prompts_per_category": {c: len(v) for c, v in ids.items()},
        "links": {r.name: asdict(r) | {"rho": r.rho} for r in regimes if r is not None},
        "offload_policy": offload_policy,
        "first_call": first_call,
        "warm_prompts_per_category": {c: len(v) for c, v in warm_ids.items()},
        "tuning": tuning,
        "torch_threads": torch.get_num_threads(),
        "gc_frozen_in_cells": True,  # frozen_heap(): no full garbage collection inside a cell's timings
        "emulated_link": emulated and twin is None,
        "link_timing": (
            "twin" if twin is not None else (("virtual" if virtual_link else "wait") if emulated else "real")
        ),
        "timeline": (
            "modeled (device twin)" if twin is not None else ("emulated link, CPU compute" if emulated else "real")
        ),
        **({"twin": twin.meta()} if twin is not None else {}),
        "device": str(device),
        **host,
    }
    return {"runs": rows, "meta": meta}


def host_info() -> dict[str, Any]:
    """Where a benchmark ran: code commit, CPU, cores, GPU and library versions."""
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "commit": commit,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report from several ``run_benchmark`` results (e.g. one process per dataset/link).

    Rows are concatenated; a cell measured twice is an error.  ``meta`` keeps each part's
    meta under ``parts`` and the fields they all agree on at the top.
    """
    if not results:
        raise ValueError("merge_results needs at least one result")
    rows: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for res in results:
        for r in res["runs"]:
            key = (r["category"], r["cache_fraction"], r["link"], r["policy"])
            if key in seen:
                raise ValueError(f"cell {key} appears in more than one result")
            seen.add(key)
            rows.append(r)
    metas = [res.get("meta", {}) for res in results]
    common = {k: v for k, v in metas[0].items() if all(k in m and m[k] == v for m in metas[1:])}
    return {"runs": rows, "meta": {**common, "parts": metas}}


_TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("decode tok/s", "decode_tokens_per_s", "{:.2f}"),
    (f"first {WARMUP_TOKENS} / rest tok/s", ("warmup_decode_tokens_per_s", "steady_decode_tokens_per_s"),
     "{:.1f} / {:.1f}"),
    ("TTFT ms", "ttft_s", "{:.1f}"),
    ("e2e tok/s", "tokens_per_s", "{:.2f}"),
    ("x AR", "speedup_vs_autoregressive", "{:.2f}"),
    ("x static-best", "speedup_vs_static-best", "{:.2f}"),
    ("x EAGLE-3 vanilla", "speedup_vs_eagle3-vanilla", "{:.2f}"),
    ("x EAGLE-3 same cache", "speedup_vs_eagle3", "{:.2f}"),
    ("accepted len", "mean_accepted", "{:.2f}"),
    ("experts/token", "experts_loaded_per_token", "{:.2f}"),
    ("MB/token", "bytes_per_token", "{:.3f}"),
    ("cycle MAPE %", "cycle_time_mape_pct", "{:.1f}"),
    ("MAPE routing-blind floor / loads known %", ("cycle_time_mape_blind_floor_pct", "cycle_time_mape_loads_known_pct"),
     "{:.1f} / {:.1f}"),
    ("policy share: all / median cycle", ("selection_overhead_share", "selection_overhead_median_share"),
     "{:.1%} / {:.1%}"),
    ("identical", "outputs_identical_to_autoregressive", "{}"),
)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table per (category, cache fraction, link) cell.

    Speed-up columns are decode-phase ratios; TTFT and end-to-end tok/s sit beside them.
    """
    out = []
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["category"], r["cache_fraction"], r["link"]), []).append(r)
    for (category, fraction, link), rs in cells.items():
        out.append(f"\n**{category}**, cache {fraction:.0%} of experts, link `{link}`\n")
        out.append("| " + " | ".join(h for h, _, _ in _TABLE_COLUMNS) + " |")
        out.append("|" + "---|" * len(_TABLE_COLUMNS))
        for r in rs:
            cells_txt = []
            for _, key, fmt in _TABLE_COLUMNS:
                if isinstance(key, tuple):  # several figures in one cell
                    values = [r.get(k) for k in key]
                    missing = any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values)
                    cells_txt.append("–" if missing else fmt.format(*values))
                    continue
                value = r.get(key)
                if key == "bytes_per_token" and value is not None:
                    value = value / 1e6
                if key == "ttft_s" and value is not None:
                    value = value * 1e3
                if value is None or (isinstance(value, float) and math.isnan(value)):
                    cells_txt.append("–")
                else:
                    cells_txt.append(fmt.format(value))
            out.append("| " + " | ".join(cells_txt) + " |")
    return "\n".join(out) + "\n"


_CATEGORY_NAMES = {"summarization": "CNN/DailyMail", "math_reasoning": "GSM8K"}


def _best_static(by: dict[str, dict], family: str = "static:") -> dict | None:
    """The ``static:*`` (or other ``family``) row with the best decode tok/s of one cell (None without any)."""
    static = [r for p, r in by.items() if p.startswith(family)]
    return max(static, key=lambda r: r["decode_tokens_per_s"]) if static else None


def speedup_summary(rows: list[dict[str, Any]], policy: str = "specfit") -> str:
    """Markdown table: ``policy``'s decode tok/s relative to each baseline, one line per cell.

    Ratios are decode-phase (tokens after the first / seconds after it); ``policy``'s and
    autoregressive TTFT are given beside them, then ``policy``'s and EAGLE-3's mean accepted
    length and whether every policy's output in the cell was token-identical to
    autoregressive decoding.  "best static" is the best ``static:*`` row of the cell
    (chosen after the fact, on the evaluated prompts); ``static-best`` the one tuned on
    other prompts.
    """
    baselines = (("eagle3", "vs EAGLE-3, same cache"), ("eagle3-vanilla", "vs EAGLE-3 vanilla"),
                 ("eagle3-best", "vs best fixed N"), ("static-best", "vs static-best (tuned)"),
                 ("autoregressive", "vs autoregressive"))
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["link"], r["category"], r["cache_fraction"]), {})[r["policy"]] = r
    head = ["link", "dataset", "cache", f"{policy} decode tok/s", *[name for _, name in baselines],
            "vs best static:* row", "vs best lookup:* row", f"vs AR, first {WARMUP_TOKENS} / rest",
            f"TTFT ms {policy} / AR", f"{policy} τ / EAGLE-3 τ", "all identical"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def decode(r: dict) -> float:
        return r.get("decode_tokens_per_s", r["tokens_per_s"])  # results from before decode-phase timing

    for (link, category, fraction), by in sorted(cells.items()):
        if policy not in by:
            continue
        mine = by[policy]
        line = [f"`{link}`", _CATEGORY_NAMES.get(category, category), f"{fraction:.0%}", f"{decode(mine):.2f}"]
        for base, _ in baselines:
            line.append(f"{decode(mine) / decode(by[base]):.2f}x" if base in by else "–")
        for family in ("static:", "lookup:"):
            best = _best_static(by, family)
            line.append(f"{decode(mine) / decode(best):.2f}x (`{best['policy'][len(family):]}`)" if best else "–")
        ar = by.get("autoregressive", {})
        parts = [mine.get(k, math.nan) / ar.get(k, math.nan) if ar.get(k) else math.nan
                 for k in ("warmup_decode_tokens_per_s", "steady_decode_tokens_per_s")]
        line.append(" / ".join("–" if math.isnan(x) else f"{x:.2f}x" for x in parts))
        line.append(f"{1e3 * mine.get('ttft_s', math.nan):.1f} / {1e3 * ar.get('ttft_s', math.nan):.1f}")
        tau = by["eagle3"]["mean_accepted"] if "eagle3" in by else float("nan")
        line.append(f"{mine['mean_accepted']:.2f} / {tau:.2f}")
        line.append("yes" if all(r["outputs_identical_to_autoregressive"] for r in by.values()) else "**no**")
        out.append("| " + " | ".join(line) + " |")
    return "\n".join(out) + "\n"


def write_report(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and PNG plots to ``out_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "summary": out / "summary.md"}
    paths["json"].write_text(json.dumps(results, indent=2, default=float))
    paths["markdown"].write_text(markdown_table(results["runs"]))
    paths["summary"].write_text(speedup_summary(results["runs"]))

    rows = results["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    links = sorted({r["link"] for r in rows})
    # one panel per link regime, stacked, so a full grid stays readable
    fig, axes = plt.subplots(len(links), 1, figsize=(10, 3.2 * len(links)), squeeze=False, sharey=True)
    width = 0.8 / max(1, len(policies))
    for ax, link in zip(axes[:, 0], links):
        cells = sorted({(r["category"], r["cache_fraction"]) for r in rows if r["link"] == link})
        for j, policy in enumerate(policies):
            ys = []
            for category, fraction in cells:
                match = [r for r in rows if (r["category"], r["cache_fraction"], r["link"], r["policy"])
                         == (category, fraction, link, policy)]
                ys.append(match[0].get("speedup_vs_autoregressive", 1.0) if match else float("nan"))
            ax.bar([i + j * width for i in range(len(cells))], ys, width, label=policy)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
        ax.set_xticklabels([f"{_CATEGORY_NAMES.get(c, c)}\ncache {f:.0%}" for c, f in cells], fontsize=8)
        ax.set_ylabel("decode tok/s vs AR")
        ax.set_title(f"link {link}", fontsize=9)
    top = max([r.get("speedup_vs_autoregressive", 1.0) for r in rows] + [1.0])
    axes[0, 0].set_ylim(0, 1.3 * top)  # headroom for the legend
    axes[0, 0].legend(fontsize=7, ncol=min(len(policies), 6), loc="upper center")
    meta = results.get("meta", {})
    note = " (MODELED GPU timeline: device twin)" if "twin" in meta else (
        " (emulated link)" if meta.get("emulated_link", True) else "")
    fig.suptitle("decode-phase speed-up over autoregressive decoding" + note)
    fig.tight_layout()
    paths["speedup_png"] = out / "speedup.png"
    fig.savefig(paths["speedup_png"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 4))
    for policy in policies:
        pr = [r for r in rows if r["policy"] == policy]
        ax.scatter([r["experts_loaded_per_token"] for r in pr], [r["mean_accepted"] for r in pr], label=policy)
    ax.set_xlabel("experts loaded per committed token")
    ax.set_ylabel("mean accepted length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["accepted_png"] = out / "accepted_vs_experts.png"
    fig.savefig(paths["accepted_png"], dpi=120)
    plt.close(fig)
    return paths
