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


def _interleave(fwd: np.ndarray, bwd: np.ndarray, warmup: int) -> np.ndarray:
    """A rank's order from its forwards and backwards in their own orders: `warmup` forwards, then one forward
    and one backward alternately, then the remaining backwards."""
    total = len(fwd)
    pairs = np.stack([fwd[warmup:], bwd[:total - warmup]], axis=1).reshape(-1)
    return np.concatenate([fwd[:warmup], pairs, bwd[total - warmup:]])


def rank_sequences(schedule: str, pp: int, vpp: int, m: int) -> list:
    """Per pipeline rank, its operations in order as ids: kind * V * m + v * m + i (kind 0 forward, 1 backward,
    virtual stage v, micro-batch i).

    1f1b: the rank's stage, micro-batches in order. interleaved: step k of the rank's forwards is micro-batch
    (k // (r * vpp)) * r + k % r of its stage number (k // r) % vpp, r micro-batches a round (pp, or m when
    fewer); its backwards the same over the stages in reverse."""
    V = pp * vpp
    out = []
    for s in range(pp):
        if schedule == "1f1b":
            i = np.arange(m)
            fwd, bwd = s * m + i, V * m + s * m + i
        else:
            r = pp if m >= pp else m
            k = np.arange(m * vpp)
            chunk, mb = (k // r) % vpp, (k // (r * vpp)) * r + k % r
            fwd = (chunk * pp + s) * m + mb
            bwd = V * m + ((vpp - 1 - chunk) * pp + s) * m + mb
        w = warmup_forwards(schedule, pp, vpp, m, s)
        # Schedule1F1B runs its w-th forward, then a backward first in each pair: w - 1 forwards, then pairs
        out.append(_interleave(fwd, bwd, w - 1 if schedule == "1f1b" else w))
    return out


@functools.lru_cache(maxsize=256)
def rank_orders(schedule: str, pp: int, vpp: int, m: int) -> tuple:
    """Per pipeline rank, its operations in order: ("F" | "B", virtual stage, micro-batch)."""
    V = pp * vpp
    return tuple(tuple(("B" if o >= V * m else "F", int(o % (V * m) // m), int(o % m)) for o in seq)
                 for seq in rank_sequences(schedule, pp, vpp, m))


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
    its seconds (forward of virtual stage v: v; backward: V + v), the transfer on its input (send_rows: 0
    none, 1 + b an activation over boundary b, 1 + pp + b a gradient); and for each rank its last operation."""

    levels: tuple  # slices into the arrays below, one per level
    prev: np.ndarray
    dep: np.ndarray
    row: np.ndarray
    p2p: np.ndarray
    last: np.ndarray  # [pp] the index of each rank's last operation
    n_ops: int
    # per level (its slice, its inputs then its previous operations, how many inputs): one gather a level,
    # the walk's loop reads no attribute
    steps: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "steps", tuple((sl, np.concatenate([self.dep[sl], self.prev[sl]]), sl.stop - sl.start)
                                               for sl in self.levels))  # frozen: set once, here


@functools.lru_cache(maxsize=256)
def walk_plan(schedule: str, pp: int, vpp: int, m: int) -> Walk:
    """The walk's index arrays: an operation's level is one more than the larger of its rank's previous one's
    and its input's, found by advancing every rank whose next input is placed, all ranks at once."""
    V = pp * vpp
    n = 2 * V * m
    ids = np.arange(n)
    kind, v = ids // (V * m), ids % (V * m) // m
    dep = np.where(kind == 0, np.where(v > 0, ids - m, -1), np.where(v < V - 1, ids + m, ids - V * m))
    seqs = rank_sequences(schedule, pp, vpp, m)
    lens = np.array([len(q) for q in seqs])
    if max(int(q.max()) for q in seqs) >= n:  # an interleaved m that is not a multiple of pp names no operation
        raise RuntimeError(f"the {schedule} order of pp={pp}, vpp={vpp}, m={m} deadlocks")
    width = int(lens.max()) + 1
    none, never = n, n + 1  # a missing input (done, level -1) and past a rank's last operation (never done)
    table = np.full((pp, width), never, dtype=np.int64)
    for s, q in enumerate(seqs):
        table[s, :len(q)] = q
    table = table.reshape(-1)
    deps = np.append(np.where(dep >= 0, dep, none), [none, never])[table]
    # an operation's level once placed (the missing input's -1), NOT_YET before: placed is level >= -1
    not_yet = -2
    level = np.full(n + 2, not_yet, dtype=np.int64)
    level[none] = -1
    last = np.full(pp, -1, dtype=np.int64)  # each rank's previous operation's level
    pos = np.arange(pp) * width  # each rank's next operation, in the flat table
    end = pos + lens
    while True:
        lev_d = level[deps[pos]]
        ready = lev_d > not_yet
        if not ready.any():
            if np.array_equal(pos, end):
                break
            raise RuntimeError(f"the {schedule} order of pp={pp}, vpp={vpp}, m={m} deadlocks")
        lev = np.maximum(last, lev_d)
        lev += 1
        level[table[pos[ready]]] = lev[ready]
        np.copyto(last, lev, where=ready)
        pos += ready
    level = level[:n]
    ordered = np.argsort(level, kind="stable")
    index = np.empty(n, dtype=np.int64)
    index[ordered] = ids
    prev_id = np.full(n, -1, dtype=np.int64)
    for q in seqs:
        prev_id[q[1:]] = q[:-1]
    o = ordered
    prev = np.where(prev_id[o] >= 0, index[np.maximum(prev_id[o], 0)], n)
    dp = np.where(dep[o] >= 0, index[np.maximum(dep[o], 0)], n)
    # a transfer where the input comes from another rank: a forward's from the stage before, a backward's from
    # the stage after (the last stage's backward reads its own forward)
    # boundary b joins ranks b and b + 1 (pp - 1: the last rank back to the first): a forward of v reads over
    # boundary (v - 1) mod pp, a backward over v mod pp
    p2p = np.where(kind[o] == 0, np.where(v[o] > 0, 1 + (v[o] - 1) % pp, 0),
                   np.where(v[o] < V - 1, 1 + pp + v[o] % pp, 0))
    row = v[o] + V * kind[o]
    bounds = np.searchsorted(level[o], np.arange(int(level.max()) + 2))
    levels = tuple(slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a)
    last = index[np.array([q[-1] for q in seqs])]
    return Walk(levels, prev, dp, row, p2p, last, n)


def send_rows(send: np.ndarray, pp: int) -> np.ndarray:
    """[1 + 2 pp, n], the walk's transfer rows: none, then the activation over each boundary, then the
    gradient, from send [2, n] (every boundary alike) or [2, pp, n] (boundary b between ranks b and b + 1,
    pp - 1 the last rank back to the first)."""
    send = np.asarray(send, dtype=np.float64)
    per = send[:, None, :] if send.ndim == 2 else send
    per = np.broadcast_to(per, (2, pp, per.shape[-1])).reshape(2 * pp, -1)
    return np.concatenate([np.zeros((1, per.shape[1])), per])


def _walk(plan: Walk, seconds: np.ndarray, send: np.ndarray) -> np.ndarray:
    """Each rank's end time [pp, n]: seconds [2V, n] per operation row, send [1 + 2 pp, n] (send_rows)."""
    n = seconds.shape[1]
    end = np.zeros((plan.n_ops + 1, n))
    # what does not depend on the walk, gathered once: each operation's seconds and its input's transfer
    own, over = seconds[plan.row], send[plan.p2p]
    for sl, inputs, k in plan.steps:
        got = end[inputs]
        ready = got[:k]
        ready += over[sl]
        np.maximum(ready, got[k:], out=ready)
        np.add(ready, own[sl], out=end[sl])
    return end[plan.last]


def steady_cap(schedule: str, pp: int) -> tuple[int, int]:
    """(micro-batches walked at most, the period in micro-batches over which the walk's increment is taken)."""
    # the increments settle after a few rounds and then repeat with a period dividing 2 * pp (a cycle through
    # the transfers around the pipeline; measured: 1, 2 and pp micro-batches); interleaved walks whole rounds
    return (6 * pp + 4 if schedule == "1f1b" else 7 * pp), 2 * pp


def walked(schedule: str, pp, m):
    """The micro-batches the walk runs for m: m itself up to steady_cap, past it the cap (pp and m per
    candidate, or one)."""
    return np.minimum(m, steady_cap(schedule, pp)[0])


def rank_end_times(schedule: str, pp: int, vpp: int, m, seconds: np.ndarray, send: np.ndarray) -> np.ndarray:
    """[pp, n]: when each pipeline rank's last backward ends, for m micro-batches (per candidate; every one
    with the same walked(m)) of the given seconds ([2V, n]: forward then backward of each virtual stage) and
    transfers (activation, gradient: [2, n], or [2, pp, n] per boundary as send_rows). Past steady_cap the walk
    of the cap continues by the mean increment of its last period: within one period's spread of the increments
    of the walk itself (tested)."""
    send = send_rows(send, pp)
    m = np.asarray(m)
    cap, period = steady_cap(schedule, pp)
    w = walked(schedule, pp, m)
    w0 = int(np.max(w))
    if np.any(w != w0):
        raise ValueError("rank_end_times walks one number of micro-batches at a time")
    full = _walk(walk_plan(schedule, pp, vpp, w0), seconds, send)
    if not np.any(m > cap):
        return full
    before = _walk(walk_plan(schedule, pp, vpp, cap - period), seconds, send)
    return full + (m - cap) / period * (full - before)


@functools.lru_cache(maxsize=1024)
def peak_in_flight(schedule: str, pp: int, vpp: int, m: int) -> tuple:
    """Per rank, the forwards of each virtual stage whose activations are live at the rank's peak (the first
    moment it has run the most forwards not yet back-propagated), as a tuple of V counts."""
    V = pp * vpp
    out = []
    for seq in rank_sequences(schedule, pp, vpp, m):
        fwd = seq < V * m
        live = np.cumsum(np.where(fwd, 1, -1))
        upto = seq[:int(np.argmax(live)) + 1]
        v = upto % (V * m) // m
        count = np.bincount(v[upto < V * m], minlength=V) - np.bincount(v[upto >= V * m], minlength=V)
        out.append(tuple(count.tolist()))
    return tuple(out)


def sharing_factor(k, pp, ranks_on_node: int, cores: int) -> np.ndarray:
    """The time of a calibrated second of work while k of the pp pipeline ranks compute, where the node's ranks
    share `cores` and the profile's rates hold with all of them busy: each busy rank gets min(1, cores / busy)
    of a core (one thread: at most one), busy = k of every pp ranks on the node (k and pp broadcast)."""
    busy = np.maximum(np.asarray(k) * ranks_on_node / np.asarray(pp, dtype=np.float64), 1.0)
    return min(1.0, cores / ranks_on_node) / np.minimum(1.0, cores / busy)


def sharing_factors(pp: int, ranks_on_node: int, cores: int) -> np.ndarray:
    """[pp + 1]: sharing_factor for k = 0 .. pp ranks computing."""
    return sharing_factor(np.arange(pp + 1), pp, ranks_on_node, cores)


def shared_rank_end_times(schedule: str, pp: int, vpp: int, m, seconds: np.ndarray, send: np.ndarray,
                          factors: np.ndarray, waiting: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """rank_end_times for ranks that share cores (MachineProfile.shared_cores): the same order and inputs, each
    operation's seconds (as measured with every rank busy) run at factors[k] per second while k pipeline ranks
    compute, k changing as ranks start and finish (processor sharing, an event at each), except its `waiting`
    seconds ([2V, n] as seconds, None: none), which run at the wall's pace (a collective whose members cannot all
    run at once: timing.switching_seconds); an operation spreads the two evenly over its run. Walked in full (m per
    candidate, or one), one candidate at a time (a cpu space is small). Returns ([pp, n] end times, [pp, n]
    seconds each rank ran)."""
    V = pp * vpp
    n = seconds.shape[1]
    ms = np.broadcast_to(np.asarray(m), (n,))
    rows = send_rows(send, pp)
    wait = np.zeros_like(seconds) if waiting is None else np.minimum(np.broadcast_to(waiting, seconds.shape), seconds)
    ends, ran = np.zeros((pp, n)), np.zeros((pp, n))
    for j in range(n):
        mj = int(ms[j])
        ends[:, j], ran[:, j] = _shared_walk(rank_sequences(schedule, pp, vpp, mj), V, mj, seconds[:, j].tolist(),
                                             wait[:, j].tolist(), rows[:, j].tolist(), factors.tolist())
    return ends, ran


def _shared_walk(seqs, V: int, m: int, seconds: list, wait: list, send: list, factors: list) -> tuple[list, list]:
    """One candidate's processor-sharing walk (shared_rank_end_times)."""
    pp = len(seqs)
    done: dict = {}  # operation id -> end time
    ptr, rem, start, cur = [0] * pp, [0.0] * pp, [None] * pp, [0] * pp
    ran, end = [0.0] * pp, [0.0] * pp
    t = 0.0

    def needs(o):  # (the operation o waits for, the transfer on it, its row of seconds); send as send_rows
        kind, v = o // (V * m), o % (V * m) // m
        row = v + V * kind
        if kind == 0:
            return ((o - m, send[1 + (v - 1) % pp]) if v > 0 else (None, 0.0)) + (row,)
        return ((o + m, send[1 + pp + v % pp]) if v < V - 1 else (o - V * m, 0.0)) + (row,)

    while True:
        arrivals = []
        for r in range(pp):  # start every rank whose next input has arrived
            if start[r] is None and ptr[r] < len(seqs[r]):
                o = int(seqs[r][ptr[r]])
                d, lag, row = needs(o)
                at = 0.0 if d is None else (done[d] + lag if d in done else None)
                if at is not None and at <= t + 1e-15:
                    start[r], rem[r], cur[r] = t, 1.0, row
                elif at is not None:
                    arrivals.append(at)
        busy = [r for r in range(pp) if start[r] is not None]
        if not busy:
            if not arrivals:
                break
            t = min(arrivals)
            continue
        f = factors[len(busy)]
        # an operation's computing runs at the sharing factor, its waiting in collectives at the wall's pace
        cost = {r: (seconds[cur[r]] - wait[cur[r]]) * f + wait[cur[r]] for r in busy}
        step = min(rem[r] * cost[r] for r in busy)
        if arrivals:
            step = min(step, min(arrivals) - t)
        t += step
        for r in busy:
            rem[r] = rem[r] - step / cost[r] if cost[r] > 0 else 0.0
            if rem[r] <= 1e-12:
                o = int(seqs[r][ptr[r]])
                done[o] = t
                ran[r] += t - start[r]
                end[r] = t
                start[r] = None
                ptr[r] += 1
    return end, ran
