"""Typed, validated settings of the selection policies (``SpecFitConfig.policy_kwargs``).

``SpecFitConfig(policy="specfit", policy_kwargs={...})`` stores the dict verbatim (it is
saved as JSON with the config) and checks it when the config is built: each policy
declares a frozen dataclass of options, and :func:`parse_options` turns the dict into
it, rejecting unknown keys (naming the valid ones) and values of the wrong type.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, TypeVar

from .acceptance import AcceptanceCalibrator
from .experts import available_predictors
from .search import CostModel

__all__ = ["DEFAULT_MAX_CHAIN", "MAX_CHAIN", "SpecFitOptions", "parse_options"]

OptionsT = TypeVar("OptionsT")

DEFAULT_MAX_CHAIN = 10  # chains ranked from the start unless the tree is deeper (SpecFitOptions.max_chain)
MAX_CHAIN = 16  # the longest fixed chain a gate may run


@dataclass(frozen=True)
class SpecFitOptions:
    """Options of the ``specfit`` policy (all optional; pass them as ``policy_kwargs``)."""

    cost: CostModel | None = None
    """Starting verification cost model: a :class:`CostModel` or a dict ``{"t0", "t_token",
    "t_expert"}`` (give a dict if the config is to be saved).  Default: :attr:`calibrate`,
    else a default whose ``t_expert`` comes from the emulated link when there is one."""

    calibrate: bool = False
    """Profile this host at the start of ``generate`` (:func:`~specfit_hf.selection.calibrate`)."""

    expert_predictor: str = "auto"
    """Which experts each draft node will route to: ``auto`` (the draft's expert heads when
    it has them, else ``history+router``), ``router``, ``history``, ``history+router``,
    ``heads`` or ``none``."""

    max_nodes: int | None = None
    """Only the ``max_nodes`` most likely nodes are search candidates (None: all useful nodes)."""

    online_cost: bool = True
    """Refit the cost model from measured cycles (else keep the starting model)."""

    acceptance: dict = field(default_factory=dict)
    """Arguments of the :class:`~specfit_hf.selection.AcceptanceCalibrator` (``num_bins``,
    ``prior_weight``, ``decay``, ``depth_aware``, ``rank_aware``)."""

    adaptive_drafting: bool = True
    """Run the kind of cycle -- plain, a fixed chain of 1 to ``max_chain`` levels, or the adaptive tree --
    that measurably delivers the most tokens per second, re-measuring the others now and
    then (:class:`~specfit_hf.selection.gate.DraftingGate`); ``False`` always runs the tree."""

    max_chain: int | None = None
    """The longest fixed chain the drafting gate ranks, in draft levels, 1-16; the adaptive tree still
    drafts at most ``max_depth``.  Default: chains to ``max_depth`` or :data:`DEFAULT_MAX_CHAIN` levels,
    whichever is more, are ranked from the start, and deeper ones, to :data:`MAX_CHAIN`, once the chain
    that leads can probe their depths (:meth:`~specfit_hf.selection.gate.DraftingGate.chain_limit`).
    Where the draft accepts nearly everything and most experts are resident, a chain deeper than EAGLE-3's
    7 levels is the fastest simple choice: GSM8K's 10-token chain leads 8 of the 10 twin cells, where a
    gate capped at 7 levels stayed at 0.92-0.95 of it, and on host-bound twins a 16-token chain leads
    (docs/acceptance)."""

    explore_every: int = 8
    """Cycles between two explorations of another kind of cycle (at least)."""

    max_explore_every: int = 16
    """The exploration interval doubles while the best kind holds, up to this; a costly
    exploration waits longer, until its cost is within 1% of the cycles since the last one."""

    lookahead: bool = True
    """Stop rule: keep drafting while a chain below a frontier node could still beat the
    current optimum (else stop as soon as the optimum holds no node of the newest level)."""

    share_acceptance: bool = True
    """Keep acceptance estimates across ``generate`` calls with the same draft model (and the same
    policy settings: each configuration learns from its own cycles)."""

    share_drafting: bool = True
    """Keep drafting rates and costs across calls with the same offload runtime and draft."""

    lookup_tokens: int = 10
    """The longest prompt-lookup chain a cycle may verify (0: none).  Every cycle the context's
    longest repeated suffix proposes what followed it before; that chain costs no draft
    forward, and the cycle verifies its throughput-optimal prefix instead of the gate's choice
    (a plain step or a chain of 1-2 levels) when its predicted rate is higher
    (:mod:`~specfit_hf.selection.lookup`)."""

    agreed_lookup: bool = True
    """A chain whose first drafted token is the cycle's lookup proposal's first may verify the lookup chain
    instead of drafting on, where that is predicted to deliver more than the chains do in such cycles
    (:meth:`~specfit_hf.selection.specfit.SpecFitPolicy._agreed_lookup`).  Needs ``lookup_tokens``."""

    prefetch: bool = True
    """Copy the experts a chain's verify is predicted to need while its levels are drafted: once the
    first level is drafted, the draft's guess of the root's and first node's experts is copied in
    over the otherwise idle link (:mod:`~specfit_hf.selection.prefetch`).  Needs an offload
    runtime with a CUDA copy stream or an emulated link, and a draft with expert heads."""

    def __post_init__(self) -> None:
        if isinstance(self.cost, Mapping):
            object.__setattr__(self, "cost", _cost_model(self.cost))
        if self.expert_predictor not in available_predictors():
            raise ValueError(f"policy_kwargs['expert_predictor'] must be one of {available_predictors()}, "
                             f"got {self.expert_predictor!r}")
        if self.max_nodes is not None and self.max_nodes < 1:
            raise ValueError(f"policy_kwargs['max_nodes'] must be >= 1 or None, got {self.max_nodes}")
        if self.lookup_tokens < 0:
            raise ValueError(f"policy_kwargs['lookup_tokens'] must be >= 0, got {self.lookup_tokens}")
        if self.max_chain is not None and not 1 <= self.max_chain <= MAX_CHAIN:
            raise ValueError(f"policy_kwargs['max_chain'] must be in [1, {MAX_CHAIN}] or None, got {self.max_chain}")
        if self.explore_every < 1 or self.max_explore_every < 1:
            raise ValueError("policy_kwargs['explore_every'] and ['max_explore_every'] must be >= 1")
        _check_calibrator_args(self.acceptance)


def _cost_model(value: Mapping) -> CostModel:
    fields = dataclasses.fields(CostModel)
    names = [f.name for f in fields]
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    missing = [n for n in required if n not in value]
    extra = [k for k in value if k not in names]
    if missing or extra:
        raise ValueError(f"policy_kwargs['cost'] needs the fields {required} (optional: "
                         f"{[n for n in names if n not in required]}); missing {missing}, unknown {extra}")
    given = [n for n in names if n in value]
    for name in given:
        if isinstance(value[name], bool) or not isinstance(value[name], (int, float)):
            raise ValueError(f"policy_kwargs['cost'][{name!r}] must be a number, got {value[name]!r}")
    return CostModel(**{n: float(value[n]) for n in given})


def _check_calibrator_args(args: Mapping) -> None:
    accepted = list(inspect.signature(AcceptanceCalibrator).parameters)
    unknown = [k for k in args if k not in accepted]
    if unknown:
        raise ValueError(f"policy_kwargs['acceptance'] has unknown keys {unknown}; valid: {accepted}")
    try:
        AcceptanceCalibrator(**args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"policy_kwargs['acceptance'] is invalid: {err}") from None


def _matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits a field annotation (bool is not a number; int is a float)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is CostModel:
        return isinstance(value, (CostModel, Mapping))
    if annotation is dict:
        return isinstance(value, Mapping)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, annotation)


def parse_options(options_class: type[OptionsT], kwargs: Any, policy: str) -> OptionsT:
    """``options_class`` built from ``kwargs``; ``ValueError`` naming any unknown key or bad type."""
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"policy_kwargs must be a dict, got {type(kwargs).__name__} {kwargs!r}")
    hints = typing.get_type_hints(options_class)
    valid = [f.name for f in dataclasses.fields(options_class)]
    for key, value in kwargs.items():
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown option {key!r} for policy {policy!r}{hint}; valid options: {valid}")
        if not _matches(value, hints[key]):
            raise ValueError(f"policy_kwargs[{key!r}] for policy {policy!r} must be {_describe(hints[key])}, "
                             f"got {type(value).__name__} {value!r}")
    values = {k: tuple(v) if typing.get_origin(hints[k]) is tuple else v for k, v in kwargs.items()}
    return options_class(**values)


def _describe(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "")
    return {"<class 'bool'>": "a bool", "<class 'int'>": "an int", "<class 'float'>": "a number",
            "<class 'str'>": "a str", "<class 'dict'>": "a dict"}.get(text, text)
