"""Cost-model calibration: t0, t_token, t_expert of this host and link.

``calibrate(model, draft, runtime)`` times target forwards of ``n`` new tokens on top of
a short cached prefix, once with the device expert cache warm and once right after
``runtime.flush()`` (every expert misses), for several ``n``; a non-negative least
squares fit of ``seconds ~ t0 + t_token * n + t_expert * misses`` gives the model.
During generation :class:`OnlineCostModel` refits the same regression on the most
recent cycle records (cycle seconds, verified tokens, experts loaded), shrunk toward
the calibrated model so a few noisy cycles cannot swing it.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np
import torch
from scipy.optimize import nnls

from ..clock import clock
from .search import CostModel

__all__ = [
    "CostSample", "fit_cost_model", "OnlineCostModel", "calibrate", "mape", "mape_floors", "nonnegative_quadratic",
    "DecayedRidge",
    "nonnegative_ridge",
]

# (verified tokens incl. root, experts loaded, seconds[, new experts of the nodes in roots' worth])
CostSample = tuple[float, ...]


def fit_cost_model(samples: Iterable[Sequence[float]], prior: CostModel | None = None,
                   prior_weight: float = 0.0) -> CostModel:
    """Non-negative least squares fit of ``seconds = t0 + t_token * tokens + t_expert * misses [+ t_novel * novel]``.

    Samples of four values carry ``novel`` (the distinct experts the verified nodes computed
    beyond the root's, in roots' worth); with three, ``t_novel`` stays the prior's (0).

    ``prior_weight`` adds that many pseudo-samples pinning each coefficient to ``prior``
    (ridge toward the prior, scaled to the data) -- useful when few samples exist or a
    feature barely varies.  Rows are weighted by 1/seconds so the fit minimises relative
    error (what MAPE measures).
    """
    # one array call (a refit runs every few cycles inside generation: per-sample Python was most of it)
    try:
        data = np.array(samples if isinstance(samples, (list, tuple, deque)) else list(samples), dtype=np.float64)
    except (ValueError, TypeError) as err:  # ragged rows, or a row that is not numbers
        raise ValueError("cost samples are (tokens, misses, seconds) or (tokens, misses, seconds, novel), "
                         "all alike") from err
    if data.size == 0:
        data = data.reshape(0, 3)
    width = data.shape[-1]
    if data.ndim != 2 or width not in (3, 4):
        raise ValueError("cost samples are (tokens, misses, seconds) or (tokens, misses, seconds, novel), all alike")
    if data.shape[0] == 0 and prior is None:
        raise ValueError("fit_cost_model needs samples or a prior")
    n = len(data)
    pinned = prior is not None and prior_weight > 0
    # the design [1, tokens, misses(, novel)] weighted by 1 / seconds, and the prior's pseudo-rows below it, in one
    # array (a refit runs every few cycles inside generation: each array call here is host time)
    a = np.zeros((n + (width if pinned else 0), width))
    y = data[:, 2]
    w = 1.0 / np.maximum(y, 1e-9)
    a[:n, 0] = 1.0
    a[:n, 1:3] = data[:, :2]
    if width == 4:
        a[:n, 3] = data[:, 3]
    a[:n] *= w[:, None]
    b = y * w
    if pinned:
        p = np.array([prior.t0, prior.t_token, prior.t_expert, prior.t_novel][:width])
        # pin coefficient j with strength proportional to its typical contribution
        scale = np.maximum(np.abs(a[:n]).mean(axis=0) if n else np.ones(width), 1e-12) * np.sqrt(prior_weight)
        a[n + np.arange(width), np.arange(width)] = scale
        b = np.concatenate([b, scale * p])
    if a.shape[0] == 0:
        assert prior is not None
        return prior
    coef, _ = nnls(a, b)
    t0, t_tok, t_exp = (float(c) for c in coef[:3])
    t_novel = float(coef[3]) if width == 4 else (prior.t_novel if prior is not None else 0.0)
    if t0 + t_tok <= 0:
        t0 = float(max(np.min(y), 1e-6)) if len(y) else 1e-3
    return CostModel(t0=t0, t_token=t_tok, t_expert=t_exp, t_novel=t_novel)


def nonnegative_ridge(xtx: np.ndarray, xty: np.ndarray, prior: np.ndarray, ridge: float) -> np.ndarray:
    """argmin ``||X c - y||^2 + ridge ||c - prior||^2`` over ``c >= 0`` (two coefficients; normal equations)."""
    (a, b), (b2, d) = xtx.tolist()
    (r0, r1), (p0, p1) = xty.tolist(), prior.tolist()
    return np.array(_ridge_fit((a, b, b2, d), (r0, r1), float(ridge), (p0, p1)))


def _ridge_fit(xtx: tuple[float, ...], xty: tuple[float, float], ridge: float,
               prior: tuple[float, float]) -> list[float]:
    """:func:`nonnegative_ridge` on plain floats (``xtx`` row-major)."""
    a, b, c, d = xtx
    r = (xty[0] + ridge * prior[0], xty[1] + ridge * prior[1])
    return nonnegative_quadratic(((a + ridge, b), (c, d + ridge)), r)


class DecayedRidge:
    """Decayed normal equations of ``y ~ c0 x0 + c1 x1``, fitted on demand as :func:`nonnegative_ridge` fits them.

    The loads fits learn from every cycle; kept in plain floats, an update and a fit cost a few
    microseconds where numpy's per-call overhead on 2 x 2 arrays was most of a cycle's learning.  The
    arithmetic is numpy's, operation for operation, so the fitted coefficients are the same bits.

    Args:
        prior: the coefficients before data (what the ridge pulls toward).
        ridge: added to the normal equations' diagonal: pseudo-observations behind ``prior`` at unit
            regressors.  Against observations whose regressors are larger it weighs less (the gate's node
            loads fit, ``x1`` = new experts x root loads ~ 10: one cold observation outweighs it ~100-fold;
            scaled to the observations' own size it was tried and not kept, docs/acceptance).
    """

    __slots__ = ("xtx", "xty", "prior", "ridge", "_fit")

    def __init__(self, prior: tuple[float, float] = (0.0, 1.0), ridge: float = 1.0) -> None:
        self.xtx = (0.0, 0.0, 0.0, 0.0)  # row-major 2 x 2
        self.xty = (0.0, 0.0)
        self.prior = (float(prior[0]), float(prior[1]))
        self.ridge = float(ridge)
        self._fit: tuple[float, float] | None = self.prior

    def add(self, x0: float, x1: float, y: float, decay: float) -> None:
        """One observation ``y`` at ``(x0, x1)``; earlier ones weigh ``decay`` times what they did."""
        a, b, c, d = self.xtx
        self.xtx = (decay * a + x0 * x0, decay * b + x0 * x1, decay * c + x1 * x0, decay * d + x1 * x1)
        r0, r1 = self.xty
        self.xty = (decay * r0 + x0 * y, decay * r1 + x1 * y)
        self._fit = None

    @property
    def weight(self) -> float:
        """The decayed sum of ``x0 ** 2`` (the observations' count when ``x0`` is 1)."""
        return self.xtx[0]

    def fit(self) -> tuple[float, float]:
        """``(c0, c1) >= 0``: least squares with the ridge toward ``prior`` (the prior itself before data)."""
        if self._fit is None:
            c0, c1 = _ridge_fit(self.xtx, self.xty, self.ridge, self.prior)
            self._fit = (c0, c1)
        return self._fit


def nonnegative_quadratic(m: Sequence[Sequence[float]], r: Sequence[float]) -> list[float]:
    """argmin ``c' M c - 2 r' c`` over ``c >= 0`` for a positive semi-definite ``M`` of 1 to 3 rows.

    The normal equations of a non-negative least squares.  Active sets are tried in closed
    form (Cramer's rule on floats), the largest first, until one meets the KKT conditions
    (its coefficients >= 0, the gradient >= 0 on the ones held at 0): the drafting fits run
    after every drafting cycle, where a numpy solve costs more host time than the rest of it.
    """
    n = len(r)
    sol = _solve_small(m, r)  # every coefficient free (the usual case)
    if sol is not None and min(sol) >= 0:
        return sol
    for free in _ACTIVE_SETS[n][1:]:
        sol = _solve_small([[m[i][j] for j in free] for i in free], [r[i] for i in free])
        if sol is None or min(sol) < 0:
            continue
        c = [0.0] * n
        for i, v in zip(free, sol):
            c[i] = v
        if all(sum(m[i][j] * c[j] for j in range(n)) - r[i] >= -1e-12 * abs(r[i]) for i in range(n) if i not in free):
            return c
    return [0.0] * n


# per size, the subsets of coefficients left free, the largest first
_ACTIVE_SETS = {n: [s for k in range(n, 0, -1) for s in itertools.combinations(range(n), k)] for n in (1, 2, 3)}


def _solve_small(a: Sequence[Sequence[float]], b: Sequence[float]) -> list[float] | None:
    """``a x = b`` for 1x1 to 3x3 ``a`` by Cramer's rule (``None`` when singular)."""
    n = len(b)
    if n == 1:
        return [b[0] / a[0][0]] if a[0][0] > 0 else None
    if n == 2:
        det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
        if det <= 1e-30 * max(a[0][0] * a[1][1], 1e-300):
            return None
        return [(b[0] * a[1][1] - a[0][1] * b[1]) / det, (a[0][0] * b[1] - b[0] * a[1][0]) / det]

    # each determinant expanded along its first row, with column k replaced by b for the k-th unknown (the
    # operations of one 3 x 3 determinant helper, written out: this runs after every drafting cycle)
    (a00, a01, a02), (a10, a11, a12), (a20, a21, a22) = a
    b0, b1, b2 = b
    det = a00 * (a11 * a22 - a12 * a21) - a01 * (a10 * a22 - a12 * a20) + a02 * (a10 * a21 - a11 * a20)
    if det <= 1e-30 * max(a00 * a11 * a22, 1e-300):
        return None
    return [(b0 * (a11 * a22 - a12 * a21) - a01 * (b1 * a22 - a12 * b2) + a02 * (b1 * a21 - a11 * b2)) / det,
            (a00 * (b1 * a22 - a12 * b2) - b0 * (a10 * a22 - a12 * a20) + a02 * (a10 * b2 - b1 * a20)) / det,
            (a00 * (a11 * b2 - b1 * a21) - a01 * (a10 * b2 - b1 * a20) + b0 * (a10 * a21 - a11 * a20)) / det]


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent."""
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    ok = np.isfinite(p) & np.isfinite(m) & (m > 0)
    return float(100.0 * np.mean(np.abs(p[ok] - m[ok]) / m[ok])) if ok.any() else float("nan")


def mape_floors(shapes: Sequence[Hashable], loads: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """How much of a cycle-time MAPE is routing luck: two post-hoc references, in percent.

    Cycles are grouped by ``shapes`` (e.g. ``(levels drafted, nodes verified)``).

    * ``blind``: every cycle forecast by the mean time of its group, taken after the fact
      over the same cycles.  No forecast that does not know the cycle's own expert loads
      (its routing) and works at that granularity does much better.
    * ``loads_known``: per group, a least-squares line in the cycle's *realized* expert
      loads: what the cost model's form reaches when the loads are known.

    A forecast MAPE near ``blind`` and far above ``loads_known`` says the error is the
    routing's, not the cost model's.
    """
    ld = np.asarray(loads, dtype=np.float64)
    sec = np.asarray(seconds, dtype=np.float64)
    if not len(shapes) == ld.size == sec.size:
        raise ValueError(f"one shape and one load count per cycle: got {len(shapes)} shapes, {ld.size} loads, "
                         f"{sec.size} times")
    if not sec.size:
        return float("nan"), float("nan")
    groups: dict[Hashable, list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    blind = np.empty_like(sec)
    for idx in groups.values():
        blind[idx] = sec[idx].mean()
    known = blind.copy()  # a group too small for a line, or whose loads never vary, keeps its mean
    for idx in groups.values():
        x = ld[idx]
        if len(idx) >= 3 and np.ptp(x) > 0:
            design = np.column_stack([np.ones_like(x), x])
            known[idx] = design @ np.linalg.lstsq(design, sec[idx], rcond=None)[0]
    return mape(blind, sec), mape(known, sec)


_ANCHORS = 8  # one-token verifies kept in the fit past its window (OnlineCostModel.add)


class OnlineCostModel:
    """A cost model refined from measured cycles (least squares on a sliding window).

    Args:
        initial: the starting model (calibrated, or a default).
        window: most recent cycles used by the fit.
        min_samples: cycles before the first refit.
        prior_weight: pseudo-samples pinning the fit to ``initial``.
        refit_every: cycles between refits once ``min_samples`` are in.
    """

    def __init__(self, initial: CostModel, window: int = 64, min_samples: int = 4, prior_weight: float = 2.0,
                 refit_every: int = 4):
        self.initial = initial
        self._model = initial
        self._stale = False  # a refit is due (done when the model is next read)
        self.samples: deque[CostSample] = deque(maxlen=int(window))
        # the last few one-token verifies, kept past the window: see :meth:`add`
        self._anchors: deque[tuple[int, CostSample]] = deque(maxlen=_ANCHORS)
        self.min_samples = int(min_samples)
        self.prior_weight = float(prior_weight)
        self.refit_every = max(1, int(refit_every))
        self._added = 0
        self.predicted: list[float] = []
        self.measured: list[float] = []

    def add(self, tokens: float, misses: float, seconds: float, predicted: float | None = None,
            novel: float = 0.0) -> None:
        """Record one cycle and refit.  ``predicted`` (the policy's forecast) feeds :attr:`mape`;
        ``novel``: the distinct experts the verified nodes computed beyond the root's, in roots' worth.

        Where one kind of cycle runs (a 10-token chain, cycle after cycle) every sample verifies the
        same number of tokens, and the fixed cost and the cost per token cannot be told apart: the
        split came from the prior, whose default fixed cost is 5 ms (GH200 twin, CNN/DM: ``t0`` 50-75 ms
        and ``t_token`` 1.5-2.8 ms where a one-token verify costs 93 ms and each more token ~0.3 ms,
        so a 10-token lookup chain was forecast at 114-141 ms and measured at 96-98).  A one-token
        verify measures the fixed cost alone: the last :data:`_ANCHORS` of them stay in the fit after
        they leave the window, and the prior's fixed cost is theirs (:meth:`_prior`).
        """
        if not math.isfinite(seconds) or seconds <= 0:
            return
        sample = (float(tokens), float(misses), float(seconds), float(novel))
        self.samples.append(sample)
        if tokens <= 1:
            self._anchors.append((self._added, sample))
        if predicted is not None and math.isfinite(predicted):
            self.predicted.append(float(predicted))
            self.measured.append(float(seconds))
        self._added += 1
        # refit every few cycles: one cycle barely moves a 64-cycle fit, and the fit is host time
        if len(self.samples) >= self.min_samples and (self._added - self.min_samples) % self.refit_every == 0:
            self._stale = True  # refitted when read: cycles that never read it (plain, fixed chains) skip the fit

    @property
    def model(self) -> CostModel:
        """The current fit."""
        if self._stale:
            first = self._added - len(self.samples)  # the window holds the samples added from this index on
            left = [sample for index, sample in self._anchors if index < first]
            samples = [*self.samples, *left] if left else self.samples
            self._model = fit_cost_model(samples, prior=self._prior(), prior_weight=self.prior_weight)
            self._stale = False
        return self._model

    def _prior(self) -> CostModel:
        """:attr:`initial`, its fixed cost moved to what the one-token verifies measured (their median, less
        their loads and one token at the initial model's prices): the ridge then pulls the fixed cost toward
        this host's, not toward a default's (5 ms where a GH200 twin's verify costs 93)."""
        prior = self.initial
        if not self._anchors:
            return prior
        fixed = [s - prior.t_token * t - prior.t_expert * m for _, (t, m, s, _n) in self._anchors]
        t0 = float(statistics.median(fixed))  # numpy's median, without its host time for eight numbers
        return CostModel(t0=max(t0, 1e-9), t_token=prior.t_token, t_expert=prior.t_expert, t_novel=prior.t_novel)

    @property
    def last_fit(self) -> CostModel:
        """The fit as last made (no refit even if one is due)."""
        return self._model

    @model.setter
    def model(self, value: CostModel) -> None:
        self._model, self._stale = value, False

    @property
    def mape(self) -> float:
        """MAPE (%) of the forecasts passed to :meth:`add` against measured cycle seconds."""
        return mape(self.predicted, self.measured)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def calibrate(
    model: Any,
    draft: Any = None,
    runtime: Any = None,
    *,
    token_counts: Sequence[int] = (1, 2, 4, 8, 16, 32),
    repeats: int = 3,
    prefix_len: int = 16,
    clock: Callable[[], float] = clock,
    return_samples: bool = False,
) -> CostModel | tuple[CostModel, list[CostSample]]:
    """Profile ``t0``, ``t_token`` and ``t_expert`` on this host and link.

    For each ``n`` in ``token_counts`` the target runs ``n`` new tokens on a cached
    prefix of ``prefix_len`` random tokens, with the expert cache warm (after one
    unmeasured run) and cold (``runtime.flush()`` first), ``repeats`` times each; the
    misses of each run come from ``runtime.stats.total.misses``.  Without a runtime
    only ``t0`` and ``t_token`` are fitted (``t_expert = 0``).

    ``draft`` is accepted for API symmetry and not timed here: drafting a tree costs
    about the same whatever subtree is verified, so it belongs to ``t0``, which the
    policy refines online from measured cycles (:class:`OnlineCostModel`).

    Returns the fitted :class:`CostModel` (and the samples when ``return_samples``).
    """
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, prefix_len), generator=gen)
    out = model(input_ids=prefix.to(device), use_cache=True)
    base_cache = out.past_key_values
    samples: list[CostSample] = []

    def misses() -> float:
        return float(runtime.stats.total.misses) if runtime is not None else 0.0

    def run(n: int, cold: bool) -> CostSample:
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(device)
        cache = copy.deepcopy(base_cache)
        positions = torch.arange(prefix_len, prefix_len + n, device=device)[None]
        if cold and runtime is not None:
            runtime.flush()
        before = misses()
        _sync(device)
        start = clock()
        model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True)
        _sync(device)
        seconds = clock() - start
        return (float(n + 0), misses() - before, seconds)

    conditions = [False, True] if runtime is not None else [False]
    for n in token_counts:
        run(n, cold=False)  # warm-up: the experts this n touches become resident
        for _ in range(repeats):
            for cold in conditions:
                samples.append(run(int(n), cold))
    # a cycle verifies the root plus n nodes: tokens already count the root
    if runtime is None:
        tokens = np.array([s[0] for s in samples])
        seconds = np.array([s[2] for s in samples])
        coef, _ = nnls(np.column_stack([np.ones_like(tokens), tokens]), seconds)
        result = CostModel(t0=float(max(coef[0], 1e-9)), t_token=float(coef[1]), t_expert=0.0)
    else:
        result = fit_cost_model(samples)
    _ = draft
    return (result, samples) if return_samples else result
