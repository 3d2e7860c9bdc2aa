"""Timing one operation: warm-up, then the median of repeated batches of calls.

A batch holds enough calls to last `min_batch_s`, so microsecond-sized work is timed above the
clock's resolution and the per-call dispatch cost is included, as the trainer pays it. On CUDA the
batch is bracketed by CUDA events (device time, not host time)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Timing:
    seconds: float  # median seconds per call
    calls_per_batch: int
    batches: int


def _cpu_batch(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def _cuda_batch(fn: Callable[[], object], calls: int) -> float:
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def keep_busy(fn: Callable[[], object], handle) -> None:
    """Run `fn` until a non-blocking barrier across the ranks (`handle.is_completed()`) completes.

    Ranks that share cores must all be busy while any of them is timed: a rank that started early
    or finished early would otherwise leave its core to the others, and they would look faster than
    they are when the whole node trains at once."""
    while not handle.is_completed():
        fn()
    handle.wait()


def settle_clock(fn: Callable[[], object], cuda: bool = False, window_s: float = 1.0, max_s: float = 20.0,
                 tol: float = 0.01, batch: Callable[[Callable[[], object], int], float] | None = None) -> list[float]:
    """Run `fn` back to back in windows of about `window_s` until a window's calls per second are no more than `tol`
    below the previous window's, or `max_s` has passed; each window's rate, in order. An idle GPU runs large GEMMs
    at its boost clock and, within seconds at full load, drops to the clock its power limit allows, which training
    runs at (mamf-finder's settle-clock step: on an H200 the sustained rate is 0.88 of the burst one,
    stas00/ml-engineering compute/accelerator/benchmarks/README.md); timed before that, a sweep reads fast."""
    batch = batch or (_cuda_batch if cuda else _cpu_batch)
    first = batch(fn, 1)
    calls = max(1, int(window_s / max(first, 1e-9)))
    rates, spent = [], first
    while spent < max_s:
        t = batch(fn, calls)
        spent += t
        rates.append(calls / max(t, 1e-12))
        if len(rates) >= 2 and rates[-1] >= rates[-2] * (1.0 - tol):
            break
    return rates


def time_call(fn: Callable[[], object], cuda: bool = False, warmup: int = 1, repeats: int = 5,
              min_batch_s: float = 2e-3, max_total_s: float | None = None,
              barrier: Callable[[], object] | None = None) -> Timing:
    """Median seconds per call of `fn`. `max_total_s` caps the timed batches for slow calls
    (at least 2 are always taken, so the median is never a single sample). With `barrier` (a
    function starting a non-blocking barrier across the ranks) every rank stays busy with `fn`
    from before the first timed batch of any rank until after the last one of all."""
    return time_window([fn], cuda, warmup, repeats, min_batch_s, max_total_s, barrier)[0]


@dataclass
class _Sized:
    fn: Callable[[], object]
    calls: int
    batches: int


def _size(fn, batch, warmup, repeats, min_batch_s, max_total_s) -> _Sized:
    for _ in range(warmup):
        fn()
    first = batch(fn, 1)
    calls = max(1, int(min_batch_s / max(first, 1e-9)))
    if calls > 1:
        probe = batch(fn, min(calls, 8)) / min(calls, 8)
        calls = max(1, int(min_batch_s / max(probe, 1e-9)))
    n = repeats
    if max_total_s is not None:
        n = max(2, min(repeats, int(max_total_s / max(first * calls, 1e-9))))
    return _Sized(fn, calls, n)


def time_window(fns: list[Callable[[], object]], cuda: bool = False, warmup: int = 1, repeats: int = 5,
                min_batch_s: float = 2e-3, max_total_s: float | None = None,
                barrier: Callable[[], object] | None = None) -> list[Timing]:
    """`time_call` for several operations in one busy window: each is warmed up and its batch sized
    first, then all are timed back to back, with one barrier before and one after (a barrier under
    full load costs tens of milliseconds, so one per operation would dominate a sweep of small ones)."""
    batch = _cuda_batch if cuda else _cpu_batch
    sized = [_size(fn, batch, warmup, repeats, min_batch_s, max_total_s) for fn in fns]
    if barrier is not None:
        keep_busy(fns[0], barrier())
    out = []
    for s in sized:
        samples = [batch(s.fn, s.calls) / s.calls for _ in range(s.batches)]
        out.append(Timing(statistics.median(samples), s.calls, s.batches))
    if barrier is not None:
        keep_busy(fns[-1], barrier())
    return out
