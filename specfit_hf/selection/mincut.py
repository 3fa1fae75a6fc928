"""Minimum s-t cut for the search's maximum-weight closures (OR-Tools' int64 max-flow).

The capacities are floats (weights in tokens); OR-Tools' ``SimpleMaxFlow`` is integral with
64-bit capacities, so they are scaled so the largest is 2^52 and floored.  The largest is
the search's "infinite" edge (4x the total positive weight, more than any flow), so every
capacity and every flow stays below 2^52, far from int64 overflow, and flooring moves each
capacity by less than one unit, about 1e-15 of the total weight: one solve gives a cut
within float precision of the minimum (the search then evaluates the chosen set exactly).
An earlier int32 max-flow needed rounds of refinement and overflowed near 2^31.
"""

from __future__ import annotations

import numpy as np
from ortools.graph.python import max_flow

__all__ = ["min_cut"]

_SCALE_BITS = 52  # the largest scaled capacity: exact integers, no overflow anywhere


def min_cut(rows: np.ndarray, cols: np.ndarray, caps: np.ndarray, size: int, src: int, sink: int) -> np.ndarray:
    """Source side (``[size]`` bool) of a minimum ``src``-``sink`` cut of the edges ``(rows, cols, caps)``."""
    largest = float(np.max(caps, initial=0.0))
    side = np.zeros(size, dtype=bool)
    side[src] = True
    if largest <= 0:
        return side
    scale = 2.0**_SCALE_BITS / largest
    solver = max_flow.SimpleMaxFlow()
    solver.add_arcs_with_capacity(rows.astype(np.int64), cols.astype(np.int64),
                                  np.floor(caps * scale).astype(np.int64))
    status = solver.solve(src, sink)
    if status != solver.OPTIMAL:  # pragma: no cover - OR-Tools reports overflow or a bad input
        raise RuntimeError(f"max-flow failed with status {status}")
    side[np.asarray(solver.get_source_side_min_cut(), dtype=np.int64)] = True
    return side
