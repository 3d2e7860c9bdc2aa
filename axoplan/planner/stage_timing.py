"""Timing of a pipelined step: each virtual stage's forward and backward of one micro-batch from the schedule's
windows (the embedding's on the first stage, the LM head's on the last), the walk of the pipeline's order over
them (pipeline.py), then each pipeline rank's data-parallel gradients and optimizer after its last backward.

batch = max over ranks (the end of its last backward + its gradient reduction + its optimizer) + the fixed
overhead; for the slowest rank, `bubble` is the time it waits for its inputs (warm-up, cool-down, imbalance and
transfers not hidden) and the rest splits into compute and exposed communication as without a pipeline.
A rank's gradient reduction is the step's blocking one over its own shard: the bucketed overlap with the last
backward is not modelled across stages (the middle ranks take the heaviest middle rank's).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from axoplan.planner import comm
from axoplan.planner import compute as work
from axoplan.planner.execution import Execution
from axoplan.planner.machine import MachineProfile
from axoplan.planner.pipeline import SCHEDULES, rank_end_times, stage_blocks, walked
from axoplan.planner.schedule import Schedule, Window
from axoplan.planner.space import Candidates
from axoplan.planner.specs import ModelSpec
from axoplan.planner.timing import run_windows, strategy, timed

KINDS = {"first": (True, False), "middle": (False, False), "last": (False, True)}


@dataclass
class PipelineTime:
    """Per candidate (the shape of the schedule's arrays): the batch, the slowest rank's compute, collectives,
    exposed communication and bubble; which rank that is; and per stage kind one micro-batch's seconds."""

    batch: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed: np.ndarray
    bubble: np.ndarray
    critical_rank: np.ndarray
    stage_seconds: dict  # (kind, pass) -> (prefix, block, last, suffix) seconds, as run_windows' parts


def rank_blocks(n_layers: int, pp, vpp, rank) -> np.ndarray:
    """Blocks pipeline rank `rank` holds: vpp virtual stages of q blocks, plus one for each of its stages among
    the first L mod (pp * vpp)."""
    pp, vpp, rank = (np.asarray(x, dtype=np.int64) for x in (pp, vpp, rank))
    V = np.maximum(pp * vpp, 1)
    q, r = n_layers // V, n_layers % V
    extra = np.clip(-(-(r - rank) // np.maximum(pp, 1)), 0, vpp)
    return vpp * q + extra


def _stage_parts(sched: Schedule, side, overlap: bool) -> dict:
    out = {}
    for kind, (first, last) in KINDS.items():
        for name, p in (("forward", sched.forward), ("backward", sched.backward),
                        ("backward_recompute", sched.backward_recompute)):
            st = p.stage(first, last)
            parts: dict = {}
            run_windows([timed(w, side, overlap) for w in st.prefix], [timed(w, side, overlap) for w in st.block],
                        [timed(w, side, overlap) for w in st.suffix], 1, overlap, overlap, None, side, parts)
            compute = (st.total(1, Window.compute_s), sum(w.compute_s() for w in st.block))
            colls = (st.total(1, lambda w: sum(c.seconds for c in w.collectives())),
                     sum(sum(c.seconds for c in w.collectives()) for w in st.block))
            out[kind, name] = (parts, compute, colls)
    return out


def rank_step_collectives(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates,
                          ex: Execution, seq_len: int, blocks, first: bool, last: bool):
    """(the once-per-step collectives, the fp32 shard elements) of a pipeline rank holding `blocks` blocks (the
    embedding on the first, the LM head and final norm on the last): the blocking gradient reduction over
    its own shard, no buckets."""
    ps = sched.params
    shard = ps.block_shard * blocks + (ps.emb_shard if first else 0) + (ps.lm_shard if last else 0)
    hx = model.hidden / c.gx
    replicated = (2 * blocks + last) * hx + (seq_len * hx if first and model.position == "learned" else 0)
    step = comm.data_parallel_collectives(profile, sched.groups, np.asarray(shard, dtype=np.float64), replicated,
                                          None, ex, profile.dtype_bytes)
    return step, shard


def rank_collective_rows(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates, ex: Execution,
                         seq_len: int, i: int, checkpointing: bool, rank: int) -> list[tuple]:
    """(collective, calls per step) of pipeline rank `rank` of candidate i: the windows of each of its
    virtual stages (Schedule.collective_rows per stage) and its once-per-step collectives, by (layer, phase,
    kind, axis, bytes) as explain's table; groups of one GPU left out."""
    pp, vpp = int(np.ravel(c.pp)[i]), int(np.ravel(c.vpp)[i])
    V = pp * vpp
    counts = stage_blocks(model.n_layers, pp, vpp)
    rows: dict = {}
    for v in range(rank, V, pp):
        for cl, calls in sched.collective_rows(i, checkpointing, stage=(int(counts[v]), v == 0, v == V - 1)):
            key = (cl.layer, cl.phase, cl.kind, cl.axis, float(np.ravel(cl.nbytes)[i]))
            rows[key] = (cl, rows[key][1] + calls) if key in rows else (cl, calls)
    blocks = int(sum(counts[rank::pp]))
    step, _ = rank_step_collectives(profile, sched, model, c, ex, seq_len, blocks, rank == 0, rank == pp - 1)
    for j, cl in enumerate(step):
        calls = int(np.ravel(cl.calls)[i]) if np.ndim(cl.calls) else int(cl.calls)
        if calls and int(np.ravel(sched.groups.size[cl.axis])[i]) > 1:
            rows["step", j] = (cl, calls)
    return list(rows.values())


def _rank_step(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates, ex: Execution,
               seq_len: int, blocks, first: bool, last: bool):
    """(seconds of the gradient reduction and other once-per-step collectives, optimizer seconds) of a rank
    holding `blocks` blocks (the embedding on the first, the LM head and final norm on the last)."""
    step, shard = rank_step_collectives(profile, sched, model, c, ex, seq_len, blocks, first, last)
    hx = model.hidden / c.gx
    e = profile.dtype_bytes
    dp = sum(s.seconds * s.calls for s in step)
    stage_model = dataclasses.replace(model, n_layers=1)  # the replicated count follows `blocks` below
    w = work.step_work(stage_model, c.gx, c.gz, c.gdata, c.micro_batch, seq_len, sched.grad_acc, shard,
                       work.fused_optimizer(profile), ex, e)
    # step_work counts one block's replicated tensors: the rest are the per-tensor work of blocks - 1 more
    extra = work.Work(16 * 2 * hx * (blocks - 1), 0)
    return dp, work.optimizer_seconds(profile, w + extra)


def pipeline_step_time(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates, ex: Execution,
                       seq_len: int, overlap: bool) -> PipelineTime:
    """The batch time of pipelined candidates (every one has pp > 1), by walking each structure's order."""
    timing = strategy(profile)
    timing.retime(profile, sched)
    parts = _stage_parts(sched, timing.side_by_side, overlap)
    ck = np.asarray(sched.checkpointing)
    shape = np.broadcast(ck, c.gx, sched.grad_acc).shape
    N = int(np.prod(shape))

    def flat(x):
        return np.broadcast_to(np.asarray(x), shape).reshape(-1)

    ckf = flat(ck)
    pp, vpp, sc, m = flat(c.pp), flat(c.vpp), flat(c.schedule), flat(sched.grad_acc)
    L = model.n_layers
    # the rank's once-per-step work: first, the heaviest middle rank (1), last
    ranks = {"first": 0, "middle": 1, "last": None}
    after = {}
    for kind, (first, last) in KINDS.items():
        r = np.asarray(c.pp) - 1 if last else ranks[kind]
        dp, opt = _rank_step(profile, sched, model, c, ex, seq_len, rank_blocks(L, c.pp, c.vpp, r), first, last)
        after[kind] = (flat(dp), flat(opt))

    # per stage kind and pass, run_windows' parts and the compute and collective sums, flattened once
    flat_parts = {}
    for key, (pr, (c1, cb), (l1, lb)) in parts.items():
        flat_parts[key] = [flat(x) for x in (pr["prefix"], pr["block"], pr["last"], pr["suffix"], c1, cb, l1, lb)]

    def stage(kind, n, idx):
        """One micro-batch's (window seconds, compute, collectives) forward and backward on n blocks."""
        out = []
        for name in ("forward", "backward"):
            xs = [a[idx] for a in flat_parts[kind, name]]
            if name == "backward":
                ys = [a[idx] for a in flat_parts[kind, "backward_recompute"]]
                xs = [np.where(ckf[idx], y, x) for x, y in zip(xs, ys)]
            pre, blk, lst, suf, c1, cb, l1, lb = xs
            out.append((pre + blk * (n - 1) + lst + suf, c1 + cb * (n - 1), l1 + lb * (n - 1)))
        return out

    batch, comp, colls, bubble, crit = (np.zeros(N) for _ in range(5))
    sends = flat(sched.p2p)
    # an infeasible interleaved step (micro-batches not a multiple of pp) is timed at the next multiple
    m = np.where(SCHEDULES.index("interleaved-1f1b") == sc, np.maximum(-(-m // pp) * pp, pp), m)
    walk_m = np.empty_like(m)
    for key in np.unique(np.stack([pp, sc], axis=1), axis=0):
        sel = (pp == key[0]) & (sc == key[1])
        walk_m[sel] = walked(SCHEDULES[int(key[1])], int(key[0]), m[sel])
    keys = np.stack([pp, vpp, sc, walk_m], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    for gi, (p_, v_, s_, _) in enumerate(uniq):
        idx = np.nonzero(inv == gi)[0]
        V = int(p_ * v_)
        q, r = divmod(L, V)
        fwd, bwd, fcomp, fcoll = [], [], [], []
        memo = {}
        for v in range(V):
            kind = "first" if v == 0 else ("last" if v == V - 1 else "middle")
            n = max(q + (v < r), 1)
            if (kind, n) not in memo:
                memo[kind, n] = stage(kind, n, idx)
            (ft, fc, fl), (bt, bc, bl) = memo[kind, n]
            fwd.append(ft), bwd.append(bt), fcomp.append(fc + bc), fcoll.append(fl + bl)
        seconds = np.stack(fwd + bwd)
        send = np.stack([sends[idx], sends[idx]])
        ends = rank_end_times(SCHEDULES[int(s_)], int(p_), int(v_), m[idx], seconds, send)  # [pp, n]
        kinds = ["first"] + ["middle"] * (int(p_) - 2) + ["last"]
        finish = np.stack([ends[k] + after[kind][0][idx] + after[kind][1][idx] for k, kind in enumerate(kinds)])
        rk = np.argmax(finish, axis=0)
        batch[idx] = finish[rk, np.arange(len(idx))]
        crit[idx] = rk
        per_rank_work = np.stack([sum(seconds[v] + seconds[V + v] for v in range(k, V, int(p_)))
                                  for k in range(int(p_))])
        per_rank_comp = np.stack([sum(fcomp[v] for v in range(k, V, int(p_))) for k in range(int(p_))])
        per_rank_coll = np.stack([sum(fcoll[v] for v in range(k, V, int(p_))) for k in range(int(p_))])
        mm = m[idx].astype(np.float64)
        col = np.arange(len(idx))
        kind_idx = np.array([list(KINDS).index(k) for k in kinds])[rk]
        dp_c = np.choose(kind_idx, [after[k][0][idx] for k in KINDS])
        opt_c = np.choose(kind_idx, [after[k][1][idx] for k in KINDS])
        bubble[idx] = ends[rk, col] - mm * per_rank_work[rk, col]
        comp[idx] = mm * per_rank_comp[rk, col] + opt_c
        colls[idx] = mm * per_rank_coll[rk, col] + dp_c + 2 * mm * int(v_) * sends[idx]
    batch = batch + profile.corrections.step_overhead_s
    exposed = np.maximum(batch - comp - bubble - profile.corrections.step_overhead_s, 0.0)
    stage_seconds = {k: v[0] for k, v in parts.items()}
    return PipelineTime(*(x.reshape(shape) for x in (batch, comp, colls, exposed, bubble)),
                        crit.reshape(shape).astype(np.int64), stage_seconds)
