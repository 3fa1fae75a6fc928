"""Minimum s-t cut for the search's maximum-weight closures (OR-Tools' int64 max-flow).

The capacities are floats (weights in tokens); OR-Tools' ``SimpleMaxFlow`` is integral with
64-bit capacities, so they are scaled so the largest is 2^52 and floored.  The largest is
the search's "infinite" edge (4x the total positive weight, more than any flow), so every
capacity and every flow stays below 2^52, far from int64 overflow, and flooring moves each
capacity by less than one unit, about 1e-15 of the total weight: one solve gives a cut
within float precision of the minimum (the search then evaluates the chosen set exactly).
An earlier int32 max-flow needed rounds of refinement and overflowed near 2^31.

Where OR-Tools is not installed (a prepared GPU image, a platform without its wheel), the cut
comes from scipy's int32 max-flow instead, with a warning: capacities scaled so the largest
is 2^30, so every flow (at most the total positive weight, a quarter of that) fits int32, and
flooring moves a capacity by about 1e-9 of the total weight -- a cut within that of the minimum.
"""

from __future__ import annotations

import warnings

import numpy as np

try:
    from ortools.graph.python import max_flow
except ImportError:  # pragma: no cover - depends on the environment; tests force this path
    max_flow = None
    warnings.warn("OR-Tools is not installed: specfit_hf's subtree search uses scipy's int32 max-flow instead "
                  "(cuts within ~1e-9 of the minimum); `pip install ortools` for the exact int64 solver",
                  RuntimeWarning, stacklevel=2)

__all__ = ["min_cut"]

_SCALE_BITS = 52  # the largest scaled capacity: exact integers, no overflow anywhere


def min_cut(rows: np.ndarray, cols: np.ndarray, caps: np.ndarray, size: int, src: int, sink: int) -> np.ndarray:
    """Source side (``[size]`` bool) of a minimum ``src``-``sink`` cut of the edges ``(rows, cols, caps)``."""
    largest = float(np.max(caps, initial=0.0))
    side = np.zeros(size, dtype=bool)
    side[src] = True
    if largest <= 0:
        return side
    if max_flow is None:
        return _scipy_min_cut(rows, cols, caps, size, src, sink, side, largest)
    scale = 2.0**_SCALE_BITS / largest
    solver = max_flow.SimpleMaxFlow()
    solver.add_arcs_with_capacity(rows.astype(np.int64), cols.astype(np.int64),
                                  np.floor(caps * scale).astype(np.int64))
    status = solver.solve(src, sink)
    if status != solver.OPTIMAL:  # pragma: no cover - OR-Tools reports overflow or a bad input
        raise RuntimeError(f"max-flow failed with status {status}")
    side[np.asarray(solver.get_source_side_min_cut(), dtype=np.int64)] = True
    return side


_SCIPY_SCALE_BITS = 30  # int32: the largest capacity 2^30, every flow below it


def _scipy_min_cut(rows: np.ndarray, cols: np.ndarray, caps: np.ndarray, size: int, src: int, sink: int,
                   side: np.ndarray, largest: float) -> np.ndarray:
    """The same cut from scipy's max-flow: the nodes reachable from ``src`` in the residual graph."""
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    scaled = np.floor(caps * (2.0**_SCIPY_SCALE_BITS / largest)).astype(np.int32)
    graph = csr_array((scaled, (rows, cols)), shape=(size, size), dtype=np.int32)
    graph.sum_duplicates()  # scipy's max-flow misreads parallel edges and stored zeros
    graph.eliminate_zeros()
    flow = maximum_flow(graph, src, sink).flow  # antisymmetric: a reverse pair's residual is its flow
    residual = csr_array(graph - flow)
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    side[breadth_first_order(residual, src, directed=True, return_predecessors=False)] = True
    return side
