"""How well expert predictors forecast the experts a verified block routes to (reports only).

:class:`UnionQuality` measures the recall and precision of the predicted per-layer union
of a verified block against the union the target actually routed.  The
``specfit-measured`` policy is SpecFit plus that measurement, for its own predictor and
for any others named in ``measure_predictors`` (scored on the same blocks, never used
for decisions); ``report()["expert_union"]`` holds the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..tree import CycleContext, CycleRecord, DraftTree, Selection, VerifyResult
from .experts import DraftHeadPredictor, ExpertPredictor, make_predictor
from .options import SpecFitOptions
from .policy import register_policy
from .specfit import SpecFitPolicy

__all__ = ["UnionQuality", "MeasuredSpecFitOptions", "MeasuredSpecFitPolicy"]


class UnionQuality:
    """Recall / precision of predicted per-layer expert unions against the routed ones.

    For each verified block and MoE layer: predicted = union of the predicted experts
    of the root and the verified nodes; actual = union of the experts the target
    routed those rows to.  Sums over layers and blocks (micro-averaged).
    """

    def __init__(self) -> None:
        self.hit = 0
        self.predicted = 0
        self.actual = 0
        self.blocks = 0

    def add(self, predicted: np.ndarray, actual: np.ndarray) -> None:
        """``predicted`` ``[T, L, k]`` (negative = none), ``actual`` ``[T, L, k]``, same rows."""
        for layer in range(actual.shape[1]):
            a = set(actual[:, layer].reshape(-1).tolist())
            p = set(int(x) for x in predicted[:, layer].reshape(-1).tolist() if x >= 0)
            self.hit += len(a & p)
            self.predicted += len(p)
            self.actual += len(a)
        self.blocks += 1

    @property
    def recall(self) -> float:
        return self.hit / self.actual if self.actual else float("nan")

    @property
    def precision(self) -> float:
        return self.hit / self.predicted if self.predicted else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {"recall": self.recall, "precision": self.precision, "blocks": self.blocks}


@dataclass(frozen=True)
class MeasuredSpecFitOptions(SpecFitOptions):
    """:class:`SpecFitOptions` plus the predictors to score."""

    measure_predictors: tuple[str, ...] = ()
    """Predictor names (see ``make_predictor``) also scored on every verified block."""


@register_policy("specfit-measured")
class MeasuredSpecFitPolicy(SpecFitPolicy):
    """SpecFit that also scores expert predictors on every verified block (same decisions)."""

    options_class = MeasuredSpecFitOptions
    options: MeasuredSpecFitOptions

    def reset(self, ctx: CycleContext) -> None:
        super().reset(ctx)
        self.measured: dict[str, ExpertPredictor] = {}
        for name in self.options.measure_predictors:
            if ctx.experts is None or (name == "heads" and not DraftHeadPredictor.supported(ctx.draft)):
                continue
            self.measured[name] = make_predictor(name, ctx.experts, ctx.target, ctx.draft)
        self.quality = {name: UnionQuality() for name in ["policy", *self.measured]}

    def observe(self, tree: DraftTree, selection: Selection, result: VerifyResult, record: CycleRecord) -> None:
        super().observe(tree, selection, result, record)
        experts = self.forecast.experts
        nodes = selection.nodes.numpy()
        routing = None if experts is None else experts.last_routing(rows=1 + nodes.size)
        if routing is None:
            return
        predicted = self.forecast.verified_block(tree, selection)
        if predicted is not None:
            self.quality["policy"].add(predicted, routing)
        tokens = np.concatenate([[int(tree.root_token)], tree.tokens.numpy()[nodes]])
        for name, predictor in self.measured.items():
            if predictor.available(tree):
                block = np.concatenate([predictor.predict_root(tree)[None], predictor.predict(tree, nodes)])
                self.quality[name].add(block, routing)
            predictor.observe(tokens, routing)

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["expert_union"] = {name: q.as_dict() for name, q in self.quality.items()}
        return out
