"""Least-squares fits of measured times to the planner's models.

Collectives: t = steps·α + volume/β (ring: steps = p−1 for all-gather and reduce-scatter,
2(p−1) for all-reduce; volume = the bytes each rank sends, so β is nccl-tests' bus bandwidth).
Element-wise work: t = overhead + bytes/bandwidth, the same two-term line.

Times span orders of magnitude (1 KiB to hundreds of MiB), so the fit weighs every point by
1/t: it minimises the relative error, otherwise the largest message alone would decide α.
Both terms are constrained to be non-negative (scipy's NNLS) -- a negative latency is noise."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from axoplan.planner.comm import ring_steps, ring_volume

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def busbw(collective: str, p: int, nbytes: float, seconds: float) -> float:
    """nccl-tests bus bandwidth in bytes/s."""
    return ring_volume(collective, p, nbytes) / seconds


@dataclass(frozen=True)
class LineFit:
    """t = a·x0 + b·x1 fitted with a, b >= 0, plus the relative error of the fit."""

    a: float
    b: float
    rms_rel_err: float
    max_rel_err: float
    points: int


def fit_line(x0: Sequence[float], x1: Sequence[float], t: Sequence[float]) -> LineFit:
    from scipy.optimize import nnls

    x0 = np.asarray(x0, float)
    x1 = np.asarray(x1, float)
    t = np.asarray(t, float)
    if len(t) < 2 or np.any(t <= 0):
        raise ValueError("a fit needs at least two positive times")
    w = 1.0 / t
    A = np.stack([x0 * w, x1 * w], axis=1)
    (a, b), _ = nnls(A, np.ones_like(t))
    pred = a * x0 + b * x1
    rel = (pred - t) / t
    return LineFit(float(a), float(b), float(np.sqrt(np.mean(rel**2))), float(np.max(np.abs(rel))), len(t))


@dataclass(frozen=True)
class AlphaBeta:
    alpha_s: float  # latency per ring step, seconds
    beta_bps: float  # bus bandwidth, bytes per second (inf if the data showed no bandwidth term)
    rms_rel_err: float
    max_rel_err: float
    points: int

    def predict(self, collective: str, p: int, nbytes: float) -> float:
        return ring_steps(collective, p) * self.alpha_s + ring_volume(collective, p, nbytes) / self.beta_bps


def fit_alpha_beta(collective: str, p: int, nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    steps = [ring_steps(collective, p)] * len(nbytes)
    vol = [ring_volume(collective, p, b) for b in nbytes]
    f = fit_line(steps, vol, seconds)
    beta = 1.0 / f.b if f.b > 0 else math.inf
    return AlphaBeta(f.a, beta, f.rms_rel_err, f.max_rel_err, f.points)


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    if not xs:
        raise ValueError("geometric mean of no positive values")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def fit_dim_half(m, n, k, tflops, ceiling_tflops: float) -> tuple[float, float]:
    """The parametric GEMM curve: throughput = ceiling · Π d/(d + dim_half) over d in (m, n, k).
    Returns (dim_half, rms error of log throughput) fitted to measured throughputs."""
    from scipy.optimize import minimize_scalar

    dims = np.stack([np.asarray(m, float), np.asarray(n, float), np.asarray(k, float)], axis=1)
    logt = np.log(np.asarray(tflops, float) / ceiling_tflops)

    def loss(log_h):
        h = math.exp(log_h)
        pred = np.sum(np.log(dims / (dims + h)), axis=1)
        return float(np.mean((pred - logt) ** 2))

    r = minimize_scalar(loss, bounds=(math.log(1e-3), math.log(1e5)), method="bounded")
    return math.exp(r.x), math.sqrt(r.fun)


@dataclass(frozen=True)
class ProtocolFit:
    """NCCL's protocol model fitted to collectives that cross nodes: the plateau busbw of one ring leaving a
    node (bytes/s), a scale on every latency of NCCL's defaults, and the fit's relative error."""

    busbw: float
    latency_scale: float
    rms_rel_err: float
    max_rel_err: float
    points: int


def fit_protocols(protocols, rows: Sequence[dict], ranks_per_node: int, busbw0: float) -> ProtocolFit:
    """The two numbers of the protocol model a cluster sets (comm.protocol_time with NCCL's default rows):
    the plateau and a latency scale, fitted to the measured size x node-count curves of every group shape
    that crosses nodes (rows: collective, size, stride, bytes, seconds), each group's plateau shared by the
    groups whose rings leave a node at once (machine.rings_per_node), as the planner shares it. Least squares
    in log time (every size counts alike), from busbw0 and NCCL's own latencies."""
    from scipy.optimize import minimize

    from axoplan.planner.comm import protocol_time
    from axoplan.planner.machine import rings_per_node

    if len(rows) < 2:
        raise ValueError("a fit needs at least two measurements")
    kinds = [r["collective"] for r in rows]
    p = np.array([r["size"] for r in rows], float)
    s = np.array([r["stride"] for r in rows], float)
    nb = np.array([r["bytes"] for r in rows], float)
    t = np.array([r["seconds"] for r in rows], float)
    per_node = np.clip(np.floor(ranks_per_node / s), 1.0, p)
    nodes = np.ceil(p / per_node)
    share = rings_per_node(p.astype(np.int64), s.astype(np.int64), ranks_per_node)  # as the planner shares it

    def pred(x):
        bw, lat = math.exp(x[0]), math.exp(x[1])
        return np.array([float(protocol_time(protocols, k, nb[i], p[i], per_node[i], nodes[i], bw / share[i], lat))
                         for i, k in enumerate(kinds)])

    def loss(x):
        return float(np.mean((np.log(pred(x)) - np.log(t)) ** 2))

    r = minimize(loss, np.array([math.log(busbw0), 0.0]), method="Nelder-Mead",
                 options={"xatol": 1e-4, "fatol": 1e-10, "maxiter": 2000})
    rel = pred(r.x) / t - 1
    return ProtocolFit(math.exp(r.x[0]), math.exp(r.x[1]), float(np.sqrt(np.mean(rel**2))),
                       float(np.max(np.abs(rel))), len(t))


# a call slower than this many times a larger message's call on its curve is a stall: no model of the library
# lets a larger message take less time, so the library did something its tuning model does not say
STALL_RATIO = 1.25


def stalled(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Per (bytes, seconds) point of one curve: slower than STALL_RATIO x a larger message's call on it."""
    return [any(t > STALL_RATIO * t2 for b2, t2 in points if b2 > b) for b, t in points]


def part_bin(nbytes: float, size: int) -> int:
    """log2 of each rank's part of a collective's buffer (bytes / members), rounded: the unit of a stall band."""
    return round(math.log2(max(nbytes / max(size, 1), 1.0)))


@dataclass(frozen=True)
class StallFit:
    """A band of each rank's part of the buffer where a collective's calls across nodes stalled (network.stalls):
    lo..hi bytes per rank, the median seconds per ring step of every row in it, and how many of them stalled."""

    collective: str
    lo: float
    hi: float
    step: float
    stalled: int
    rows: int
    curves: int
    members: tuple = field(default=(), repr=False, compare=False)  # the band's rows: their indices in find_stalls' rows


def find_stalls(rows: Sequence[dict]) -> list[StallFit]:
    """The stall band of each collective in measurements of groups crossing nodes (rows: collective, size (members),
    curve (what names one group shape's sweep), bytes, seconds): the parts per rank (bytes / size, by power of two)
    stalled on at least two curves and on two thirds of the curves that measured them; the band is the longest run
    of such parts among those measured, its step the median seconds per ring step over every row in it (those that
    did not stall too). A part stalled on one curve alone is noise, not a band."""
    out = []
    index = {id(r): i for i, r in enumerate(rows)}
    for kind in sorted({r["collective"] for r in rows}):
        kr = [r for r in rows if r["collective"] == kind]
        by_curve = defaultdict(list)
        for r in kr:
            by_curve[r["curve"]].append(r)
        flags = {}
        for rs in by_curve.values():
            for r, f in zip(rs, stalled([(r["bytes"], r["seconds"]) for r in rs])):
                flags[id(r)] = f
        part = {id(r): part_bin(r["bytes"], r["size"]) for r in kr}
        seen, hit = defaultdict(set), defaultdict(set)
        for r in kr:
            seen[part[id(r)]].add(r["curve"])
            if flags[id(r)]:
                hit[part[id(r)]].add(r["curve"])
        best, run = [], []
        for b in sorted(seen):
            run = run + [b] if len(hit[b]) >= 2 and 3 * len(hit[b]) >= 2 * len(seen[b]) else []
            best = run if len(run) > len(best) else best
        if best:
            band = [r for r in kr if part[id(r)] in best]
            out.append(StallFit(kind, 2.0 ** best[0], 2.0 ** best[-1],
                                float(np.median([r["seconds"] / max(r["size"] - 1, 1) for r in band])),
                                sum(flags[id(r)] for r in band), len(band), len({r["curve"] for r in band}),
                                tuple(index[id(r)] for r in band)))
    return out
