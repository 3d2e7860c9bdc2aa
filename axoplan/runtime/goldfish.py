"""Goldfish loss mask (Hans et al. 2024, reference §6), the "hashed" variant, in numpy (torch-free).

For every target position i >= h-1 of a sequence, the h target ids ending at i are multiplied
modulo 1,000,003 and the product indexes a table of uniform random floats made once with a
fixed seed; the target is dropped from the loss when that float is below 1/k. The first h-1
positions are never dropped, and the same context always gives the same mask.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

HASH_MODULUS = 1_000_003
TABLE_SEED = 1234567  # fixed: the mask must not depend on the run's seed


@lru_cache(maxsize=1)
def _table() -> np.ndarray:
    return np.random.default_rng(TABLE_SEED).random(HASH_MODULUS)


def goldfish_keep(targets: np.ndarray, k: int, h: int) -> np.ndarray:
    """Boolean keep-mask with the shape of `targets` ([..., S] integer ids): True = counts in the loss."""
    t = np.asarray(targets, dtype=np.int64)
    s = t.shape[-1]
    keep = np.ones(t.shape, dtype=bool)
    if s < h:
        return keep
    n = s - h + 1  # windows ending at positions h-1 .. s-1
    prod = np.ones(t.shape[:-1] + (n,), dtype=np.int64)
    for j in range(h):  # ids < 2^31 and the running product < 1,000,003: no int64 overflow
        prod = (prod * (t[..., j:j + n] % HASH_MODULUS)) % HASH_MODULUS
    keep[..., h - 1:] = _table()[prod] >= 1.0 / k
    return keep
