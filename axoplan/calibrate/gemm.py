"""GEMM microbenchmark: the shapes the planner asks about, in every layout the BLAS tuning picks from.

C[m, n] = A[m, k] · B[k, n]. A layout names the storage of A then B, as the trainer keys its BLAS
tuning (axoplan/runtime/blas_tuning.py) and the cost model reads the table:
  NN  A stored [m, k] and B stored [k, n], both contiguous          (forward:  I · W)
  NT  B transposed-contiguous: B is the transpose of a contiguous [n, k] tensor  (dI = dO · Wᵀ)
  TN  A transposed-contiguous: A is the transpose of a contiguous [k, m] tensor  (dW = Iᵀ · dO)
The transposed form C^T = B^T·A^T of shape (m, n, k) is the GEMM (n, m, k) with the operand roles
swapped, so a cartesian grid with the same values for m and n holds both forms of every shape.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

LAYOUTS = ("NN", "NT", "TN")
# the GEMM that brings a GPU to its loaded clock before the sweep (mamf-finder settles with 8192^3 too)
SETTLE_SHAPE = 8192


def pow2_values(lo: int, hi: int, step: int = 1) -> list[int]:
    """Powers of two from lo to hi (both rounded to powers of two), every `step`-th exponent;
    hi is always included so the grid covers the largest shape."""
    e_lo, e_hi = max(0, (lo - 1).bit_length()), max(0, (hi - 1).bit_length())
    exps = list(range(e_lo, e_hi + 1, step))
    if exps[-1] != e_hi:
        exps.append(e_hi)
    return [2**e for e in exps]


def cartesian_grid(values: list[int]) -> list[tuple[int, int, int]]:
    return list(itertools.product(values, values, values))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_shapes(models: Iterable, ranks: int, micro_batches: Iterable[int]) -> set[tuple[int, int, int]]:
    """Exact local GEMM shapes (m, n, k) of the given ModelSpecs on grids of `ranks` GPUs (every
    Gx·Gy dividing ranks), micro-batches of the model's sequence length, forward and both backward
    GEMMs, in both forms. Gz and Gdata change only how many tokens a GPU holds, which the
    micro-batch already sets."""
    shapes: set[tuple[int, int, int]] = set()
    for model in models:
        layers = list(model.block_linears()) + [model.lm_head()]
        for gx in _divisors(ranks):
            for gy in _divisors(ranks // gx):
                for layer in layers:
                    split_in, split_out = (gy, gx) if layer.transposed else (gx, gy)
                    if layer.k % split_in or layer.n % split_out:
                        continue
                    k, n = layer.k // split_in, layer.n // split_out
                    for mb in micro_batches:
                        t = mb * model.seq_len
                        for s in ((t, n, k), (t, k, n), (k, n, t)):  # forward, dI = dO·Wᵀ, dW = Iᵀ·dO
                            shapes.add(s)
                            shapes.add((s[1], s[0], s[2]))
    return shapes


def operands(m: int, n: int, k: int, layout: str, dtype, device):
    import torch

    def rand(*shape):
        # random values (not constants: on GPUs the data changes power draw and so the clock);
        # uniform_ in place is several times cheaper than randn for the large operands
        return torch.empty(*shape, device=device, dtype=dtype).uniform_(-1, 1)

    if layout == "NN":
        return rand(m, k), rand(k, n)
    if layout == "NT":
        return rand(m, k), rand(n, k).t()
    if layout == "TN":
        return rand(k, m).t(), rand(k, n)
    raise ValueError(f"unknown layout {layout!r}")


@dataclass(frozen=True)
class GemmResult:
    m: int
    n: int
    k: int
    layout: str
    seconds: float  # mean over ranks of each rank's median seconds per call
    seconds_min_rank: float
    seconds_max_rank: float

    @property
    def tflops(self) -> float:
        return 2.0 * self.m * self.n * self.k / self.seconds / 1e12


def windows(items: list[tuple[int, int, int, str]], max_items: int = 16, max_flop: float = 2e10) -> list[list]:
    """Consecutive measurements grouped into timing windows (see timing.time_window). The rule depends
    on the shapes only, so every rank forms the same windows."""
    out, cur, flop = [], [], 0.0
    for it in items:
        f = 2.0 * it[0] * it[1] * it[2]
        if cur and (len(cur) >= max_items or flop + f > max_flop):
            out.append(cur)
            cur, flop = [], 0.0
        cur.append(it)
        flop += f
    if cur:
        out.append(cur)
    return out


def run(shapes: list[tuple[int, int, int]], dtype, device, combine: Callable[[list[float]], list[list[float]]],
        on_result: Callable[[GemmResult], None], repeats: int = 5, min_batch_s: float = 2e-3,
        max_total_s: float = 1.0, barrier=None) -> None:
    """Time every shape in every layout. `combine(seconds)` is collective across ranks and returns
    every rank's list; the ranks compute at the same time, as in training."""
    import torch

    from axoplan.calibrate.timing import settle_clock, time_window

    if device.type == "cuda":  # time at the clock the GPU holds under full load, not the boost an idle one starts at
        a, b = operands(SETTLE_SHAPE, SETTLE_SHAPE, SETTLE_SHAPE, "NN", dtype, device)
        settle_clock(lambda: torch.matmul(a, b), cuda=True)
        del a, b
    items = [(m, n, k, layout) for (m, n, k) in shapes for layout in LAYOUTS]
    for win in windows(items):
        fns = []
        for (m, n, k, layout) in win:
            a, b = operands(m, n, k, layout, dtype, device)
            out = torch.empty(m, n, dtype=dtype, device=device)
            fns.append(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out))
        ts = time_window(fns, cuda=device.type == "cuda", warmup=1, repeats=repeats, min_batch_s=min_batch_s,
                         max_total_s=max_total_s, barrier=barrier)
        per_rank = combine([t.seconds for t in ts])  # [rank][item]
        for i, (m, n, k, layout) in enumerate(win):
            v = [r[i] for r in per_rank]
            on_result(GemmResult(m, n, k, layout, sum(v) / len(v), min(v), max(v)))
