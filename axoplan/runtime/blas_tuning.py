"""BLAS tuning (reference §4): for each GEMM shape and operand layout, time C = A·B against the
equivalent C = (Bᵀ·Aᵀ)ᵀ (5 warm-up and 20 timed runs each) and cache the faster form.

Both forms give the same numbers up to summation order; only the BLAS call (and so its kernel
choice) differs. The layout of an operand is part of the key: a transposed view (NT / TN) can
pick a different kernel than a contiguous one.
"""
from __future__ import annotations

import time

import torch

WARMUP = 5
TIMED = 20


def _layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "N"
    if t.t().is_contiguous():
        return "T"
    return "S"  # strided: neither layout; still timed, just keyed apart


def _direct(a, b):
    return a @ b


def _swapped(a, b):
    return (b.t() @ a.t()).t()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, a, b) -> float:
    for _ in range(WARMUP):
        fn(a, b)
    _sync(a.device)
    if a.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED):
            fn(a, b)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(TIMED):
        fn(a, b)
    return time.perf_counter() - t0


class GemmTuner:
    """Picks, per (shapes, layouts, dtype, device), the faster of the two equivalent GEMM forms."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.choice: dict[tuple, bool] = {}  # key -> True if the swapped form won

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return a @ b
        key = (tuple(a.shape), tuple(b.shape), _layout(a), _layout(b), a.dtype, a.device.type)
        swapped = self.choice.get(key)
        if swapped is None:
            with torch.no_grad():
                swapped = _time(_swapped, a, b) < _time(_direct, a, b)
            self.choice[key] = swapped
        return _swapped(a, b) if swapped else a @ b

    def summary(self) -> dict:
        return {"shapes_tuned": len(self.choice), "swapped_wins": sum(self.choice.values())}
