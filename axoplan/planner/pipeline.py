"""The pipeline axis: which blocks each stage holds, the order in which every pipeline rank runs its forward
and backward chunks, and the walk of that order that gives the step's time on every candidate at once.

Blocks are split over the pp * vpp virtual stages as evenly as the layer count allows; the first L mod (pp*vpp)
virtual stages take one block more (the last never does: it also holds the LM head). Virtual stage v runs on
pipeline rank v mod pp (the interleaved layout of Narayanan et al. 2021, as torch.distributed.pipelining places
multiple stages per rank); the embedding is on virtual stage 0, the final norm and LM head on the last.

The order of each rank's operations follows torch.distributed.pipelining (torch 2.13, schedules.py):
- `1f1b` (Schedule1F1B): rank s runs min(m, pp - s) forwards, then one backward and one forward alternately
  until every forward ran, then the remaining backwards. It needs m >= pp micro-batches.
- `interleaved-1f1b` (ScheduleInterleaved1F1B): vpp stages per rank, micro-batches in rounds of pp, forwards
  depth first over the rank's stages; rank s warms up with (vpp - 1) * pp + 2 * (pp - 1 - s) forwards. The
  planner asks m to be a multiple of pp (Megatron-LM's rule, and torch's when m >= pp).

The walk: an operation starts when the rank's previous one has ended and its input has arrived (the previous
virtual stage's forward of the same micro-batch, or the next one's backward, plus the point-to-point transfer
between them); it takes its stage's seconds. Warm-up, steady state, cool-down, the bubble and the stages'
imbalance all come out of it. It runs level by level (operations no path connects run as one numpy step) over
every candidate of the same structure. Past a few rounds the walk's increments are periodic (the steady
state), so for many micro-batches the walk runs `steady_cap` of them and continues the last round's increment.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("1f1b", "interleaved-1f1b")


def blocks_per_stage(n_layers: int, stages) -> tuple[np.ndarray, np.ndarray]:
    """(q, r): each of `stages` virtual stages holds q blocks, the first r one more."""
    stages = np.maximum(np.asarray(stages, dtype=np.int64), 1)
    return n_layers // stages, n_layers % stages


def stage_blocks(n_layers: int, pp: int, vpp: int = 1) -> np.ndarray:
    """Blocks of each virtual stage, in model order."""
    q, r = blocks_per_stage(n_layers, pp * vpp)
    return q + (np.arange(pp * vpp) < r)


def warmup_forwards(schedule: str, pp: int, vpp: int, m: int, rank: int) -> int:
    """Forwards rank `rank` runs before its first backward."""
    if schedule == "1f1b":
        return min(m, pp - rank)
    return min((vpp - 1) * pp + 2 * (pp - 1 - rank), m * vpp)


def _rank_1f1b(pp: int, m: int, s: int) -> list:
    w = warmup_forwards("1f1b", pp, 1, m, s)
    ops = [("F", s, i) for i in range(w)]
    for j in range(m):
        ops.append(("B", s, j))
        if w + j < m:
            ops.append(("F", s, w + j))
    return ops


def _rank_interleaved(pp: int, vpp: int, m: int, s: int) -> list:
    """Forwards depth first over the rank's stages in rounds of pp micro-batches, backwards the same in reverse
    stage order, one of each alternately after the warm-up."""
    per_round = pp if m >= pp else m
    w = warmup_forwards("interleaved-1f1b", pp, vpp, m, s)
    total = m * vpp
    done = {"F": {}, "B": {}}

    def op(kind: str, k: int) -> tuple:
        chunk = (k // per_round) % vpp
        v = (chunk if kind == "F" else vpp - 1 - chunk) * pp + s
        i = done[kind].get(v, 0)
        done[kind][v] = i + 1
        return (kind, v, i)

    ops = []
    for step in range(total + w):
        if step < total:
            ops.append(op("F", step))
        if step >= w:
            ops.append(op("B", step - w))
    return ops


@functools.lru_cache(maxsize=256)
def rank_orders(schedule: str, pp: int, vpp: int, m: int) -> tuple:
    """Per pipeline rank, its operations in order: ("F" | "B", virtual stage, micro-batch)."""
    if schedule == "1f1b":
        return tuple(tuple(_rank_1f1b(pp, m, s)) for s in range(pp))
    return tuple(tuple(_rank_interleaved(pp, vpp, m, s)) for s in range(pp))


def rank_transfers(schedule: str, pp: int, vpp: int, m: int, rank: int) -> list[tuple[str, str, int, int]]:
    """The point-to-point transfers of pipeline rank `rank`, in the order of its operations: (send | recv,
    activation | activation gradient, virtual stage, micro-batch). A forward receives its input from the
    previous virtual stage and sends its output to the next; a backward the same in reverse; the ends of the
    pipeline have no neighbour there. (torch's interleaved runtime posts each receive one operation early:
    the sends and the receives each keep this order.)"""
    V = pp * vpp
    out = []
    for kind, v, i in rank_orders(schedule, pp, vpp, m)[rank]:
        if kind == "F":
            out += [("recv", "activation", v, i)] * (v > 0) + [("send", "activation", v, i)] * (v < V - 1)
        else:
            out += [("recv", "activation gradient", v, i)] * (v < V - 1) + [("send", "activation gradient", v, i)] * (v > 0)
    return out


def peak_micro_batches(schedule: str, pp, m):
    """Micro-batches past which no rank holds more forwards in flight (the warm-up is complete): 1f1b's
    pp + 1, interleaved's 2 pp (m a multiple of pp)."""
    pp, m = np.asarray(pp), np.asarray(m)
    if schedule == "1f1b":
        return np.minimum(m, pp + 1)
    return np.minimum(np.maximum(-(-m // pp) * pp, pp), 2 * pp)


@dataclass(frozen=True)
class Walk:
    """One structure's operations in level order, as index arrays: for each operation (numbered in the
    order of `levels`) the rank's previous one and the one whose output it needs (n_ops: none), the row of
    its seconds (forward of virtual stage v: v; backward: V + v), whether a point-to-point transfer sits on
    its input (0 none, 1 an activation, 2 a gradient); and for each rank its last operation."""

    levels: tuple  # slices into the arrays below, one per level
    prev: np.ndarray
    dep: np.ndarray
    row: np.ndarray
    p2p: np.ndarray
    last: np.ndarray  # [pp] the index of each rank's last operation
    n_ops: int


@functools.lru_cache(maxsize=256)
def walk_plan(schedule: str, pp: int, vpp: int, m: int) -> Walk:
    orders = rank_orders(schedule, pp, vpp, m)
    V = pp * vpp
    where = {}  # (kind, v, i) -> (rank, position)
    for s, ops in enumerate(orders):
        for k, op in enumerate(ops):
            where[op] = (s, k)

    def dependency(op):
        kind, v, i = op
        if kind == "F":
            return ("F", v - 1, i) if v > 0 else None
        return ("B", v + 1, i) if v < V - 1 else ("F", v, i)

    level = {}
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:  # every rank advances while its next operation's input is already placed
        progressed = False
        for s, ops in enumerate(orders):
            while pos[s] < len(ops):
                op = ops[pos[s]]
                dep = dependency(op)
                if dep is not None and dep not in level:
                    break
                before = level[ops[pos[s] - 1]] if pos[s] else -1
                level[op] = 1 + max(before, level[dep] if dep is not None else -1)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} order of pp={pp}, vpp={vpp}, m={m} deadlocks")
    ordered = sorted(level, key=lambda op: level[op])
    index = {op: j for j, op in enumerate(ordered)}
    n = len(ordered)
    prev = np.full(n, n, dtype=np.int64)
    dep = np.full(n, n, dtype=np.int64)
    row = np.empty(n, dtype=np.int64)
    p2p = np.zeros(n, dtype=np.int64)
    for op, j in index.items():
        s, k = where[op]
        if k:
            prev[j] = index[orders[s][k - 1]]
        d = dependency(op)
        if d is not None:
            dep[j] = index[d]
            # a transfer where the input comes from another rank: always between stages when pp > 1
            p2p[j] = 0 if d[0] == "F" and op[0] == "B" else (1 if op[0] == "F" else 2)
        row[j] = op[1] + (V if op[0] == "B" else 0)
    bounds = np.searchsorted([level[op] for op in ordered], np.arange(max(level.values()) + 2))
    levels = tuple(slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a)
    last = np.array([index[ops[-1]] for ops in orders], dtype=np.int64)
    return Walk(levels, prev, dep, row, p2p, last, n)


def _walk(plan: Walk, seconds: np.ndarray, send: np.ndarray) -> np.ndarray:
    """Each rank's end time [pp, n]: seconds [2V, n] per operation row, send [3, n] per transfer kind."""
    n = seconds.shape[1]
    end = np.zeros((plan.n_ops + 1, n))
    for sl in plan.levels:
        ready = np.maximum(end[plan.prev[sl]], end[plan.dep[sl]] + send[plan.p2p[sl]])
        end[sl] = ready + seconds[plan.row[sl]]
    return end[plan.last]


def steady_cap(schedule: str, pp: int) -> tuple[int, int]:
    """(micro-batches walked at most, the period in micro-batches of the walk's increments past them)."""
    # the increments settle after a few rounds and then repeat with a period dividing 2 * pp (a cycle through
    # the transfers around the pipeline; measured: 1, 2 and pp micro-batches)
    return (6 if schedule == "1f1b" else 7) * pp + 4, 2 * pp


def walked(schedule: str, pp: int, m):
    """The micro-batches the walk runs for m: m itself up to steady_cap, past it m less whole periods."""
    cap, period = steady_cap(schedule, pp)
    m = np.asarray(m)
    return np.where(m <= cap, m, m - -(-(m - cap) // period) * period)


def rank_end_times(schedule: str, pp: int, vpp: int, m, seconds: np.ndarray, send: np.ndarray) -> np.ndarray:
    """[pp, n]: when each pipeline rank's last backward ends, for m micro-batches (per candidate; every one
    with the same walked(m)) of the given seconds ([2V, n]: forward then backward of each virtual stage) and
    transfers ([2, n]: activation, gradient). Past steady_cap the walk of walked(m) continues by whole periods."""
    send = np.concatenate([np.zeros((1, seconds.shape[1])), send])
    m = np.asarray(m)
    cap, period = steady_cap(schedule, pp)
    w = walked(schedule, pp, m)
    w0 = int(np.max(w))
    if np.any(w != w0):
        raise ValueError("rank_end_times walks one number of micro-batches at a time")
    full = _walk(walk_plan(schedule, pp, vpp, w0), seconds, send)
    if not np.any(m > cap):
        return full
    before = _walk(walk_plan(schedule, pp, vpp, w0 - period), seconds, send)
    return full + (m - w0) / period * (full - before)


@functools.lru_cache(maxsize=1024)
def peak_in_flight(schedule: str, pp: int, vpp: int, m: int) -> tuple:
    """Per rank, the forwards of each virtual stage whose activations are live at the rank's peak (the moment
    it has run the most forwards not yet back-propagated), as a tuple of V counts."""
    V = pp * vpp
    out = []
    for ops in rank_orders(schedule, pp, vpp, m):
        live, best, n, top = [0] * V, [0] * V, 0, 0
        for kind, v, _ in ops:
            if kind == "F":
                live[v] += 1
                n += 1
                if n > top:
                    top, best = n, list(live)
            else:
                live[v] -= 1
                n -= 1
        out.append(tuple(best))
    return tuple(out)
