"""Distinct rows of integer columns over candidates: the planner's candidates repeat each (grid,
micro-batch) across placement orders and checkpointing, so work that depends only on a few columns
is evaluated once per distinct row and handed back to every candidate."""
from __future__ import annotations

import numpy as np


def distinct_rows(*cols) -> tuple[np.ndarray, np.ndarray]:
    """(first, inverse) as np.unique gives them for the rows of the columns (broadcast together): the
    index of each distinct row's first candidate, and each candidate's row among them. The columns are
    packed into one int64 key (offset by their minimum; re-ranked when the key would grow too wide), so
    this is a 1-D unique, not a row-wise one."""
    cols = [c.reshape(-1) for c in np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in cols))]
    key = np.zeros(cols[0].size, dtype=np.int64)
    for c in cols:
        lo, hi = int(c.min(initial=0)), int(c.max(initial=0))
        if (hi - lo + 1) * (int(key.max(initial=0)) + 1) >= 2**62:  # too wide for one integer key: rank it first
            key = np.unique(key, return_inverse=True)[1].reshape(-1)
        key = key * (hi - lo + 1) + (c - lo)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def repeated_rows(*cols, min_size: int = 256):
    """distinct_rows of the columns where evaluating each distinct row once pays: one-dimensional columns of more
    than min_size candidates, fewer than half of them distinct (the planner's orders and checkpointing repeat each
    grid and micro-batch); None otherwise, the caller evaluating the columns as they are."""
    cols = np.broadcast_arrays(*(np.asarray(a) for a in cols))
    if cols[0].ndim != 1 or cols[0].size <= min_size:
        return None
    first, inverse = distinct_rows(*cols)
    return (first, inverse) if len(first) < cols[0].size // 2 else None


def on_rows(x, inverse, n: int):
    """x over n distinct rows (its last axis) as every candidate sees it (inverse: each candidate's row, None:
    x is the candidates' own); anything without that axis (a scalar, a broadcast axis) as it is."""
    if inverse is None or not np.ndim(x) or np.shape(x)[-1] != n:
        return x
    return np.take(x, inverse, axis=-1)  # several times faster than x[..., inverse], the same values
