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
from axoplan.planner.pipeline import (SCHEDULES, rank_end_times, shared_rank_end_times, sharing_factor,
                                      sharing_factors, stage_blocks, walked)
from axoplan.planner.rows import distinct_rows, on_rows
from axoplan.planner.schedule import Schedule
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
    exact: np.ndarray  # walked; False: the batch is bound_time's lower bound (a candidate not worth walking)


def rank_blocks(n_layers: int, pp, vpp, rank) -> np.ndarray:
    """Blocks pipeline rank `rank` holds: vpp virtual stages of q blocks, plus one for each of its stages among
    the first L mod (pp * vpp)."""
    pp, vpp, rank = (np.asarray(x, dtype=np.int64) for x in (pp, vpp, rank))
    q, r = np.divmod(n_layers, np.maximum(pp * vpp, 1))
    extra = np.minimum(np.maximum(-((rank - r) // np.maximum(pp, 1)), 0), vpp)  # ceil((r - rank) / pp) in [0, vpp]
    return vpp * q + extra


def _stage_parts(sched: Schedule, side, overlap: bool) -> dict:
    """(kind, pass) -> (run_windows' parts, (compute of one block and one micro-batch's fixed windows, of a block),
    the same for the collectives, and for their switching seconds) of every stage kind; each window is timed once
    for all kinds."""
    out = {}
    for name, p in (("forward", sched.forward), ("backward", sched.backward),
                    ("backward_recompute", sched.backward_recompute)):
        cache = {id(w): timed(w, side, overlap) for w in p.prefix + p.block + p.suffix}
        t = (lambda w, cache=cache: cache[id(w)])  # noqa: E731
        block = _sums(p.block)
        memo: dict = {}  # the kinds share the block's windows: each timed once
        for kind, (first, last) in KINDS.items():
            st = p.stage(first, last)
            parts: dict = {}
            run_windows([t(w) for w in st.prefix], [t(w) for w in p.block], [t(w) for w in st.suffix], 1, overlap,
                        overlap, None, side, parts, memo)
            ends = _sums(st.prefix + st.suffix)
            out[kind, name] = (parts, *((e + b, b) for e, b in zip(ends, block)))
    return out


def _sums(windows) -> tuple:
    """The windows' compute, their collectives' seconds and those collectives' switching seconds, each summed."""
    calls = [c for w in windows for c in w.collectives()]
    return (sum(w.compute_s() for w in windows), sum(c.seconds for c in calls), sum(c.switching for c in calls))


def rank_states(params, model: ModelSpec, gx, blocks, first: bool, last: bool, seq_len: int):
    """(fp32 shard elements, replicated elements) a pipeline rank holding `blocks` blocks keeps: its blocks' Z
    shards (the embedding's on the first, the LM head's on the last), two norms per block (the final norm on the
    last) and the learned positions on the first, per X slice. params: comm.ParameterShards (or its rows)."""
    shard = params.block_shard * blocks + (params.emb_shard if first else 0) + (params.lm_shard if last else 0)
    hx = model.hidden / gx
    replicated = (2 * blocks + last) * hx + (seq_len * hx if first and model.position == "learned" else 0)
    return shard, replicated


def rank_step_collectives(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates,
                          ex: Execution, seq_len: int, blocks, first: bool, last: bool):
    """(the once-per-step collectives, the fp32 shard elements) of a pipeline rank holding `blocks` blocks (the
    embedding on the first, the LM head and final norm on the last): the blocking gradient reduction over
    its own shard, no buckets."""
    shard, replicated = rank_states(sched.params, model, c.gx, blocks, first, last, seq_len)
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
               seq_len: int, blocks, first: bool, last: bool, overlap: bool = False):
    """(seconds of the gradient reduction and other once-per-step collectives, optimizer seconds, of those the
    gradient reduction's and the weights' all-gather's where the execution runs them beside the pipeline's
    compute (Execution.pipeline_dp_overlap, with overlap on; else 0)) of a rank holding `blocks` blocks (the
    embedding on the first, the LM head and final norm on the last)."""
    step, shard = rank_step_collectives(profile, sched, model, c, ex, seq_len, blocks, first, last)
    hx = model.hidden / c.gx
    e = profile.dtype_bytes
    dp = sum(s.seconds * s.calls for s in step)
    beside = _dp_beside(ex, overlap)
    rs = sum(s.seconds * s.calls for s in step if s.layer == "gradients") if beside and ex.overlap_grad_reduce else 0.0
    ag = sum(s.seconds * s.calls for s in step if s.layer == "weights") if beside and ex.overlap_param_gather else 0.0
    stage_model = dataclasses.replace(model, n_layers=1)  # the replicated count follows `blocks` below
    w = work.step_work(stage_model, c.gx, c.gz, c.gdata, c.micro_batch, seq_len, sched.grad_acc, shard,
                       work.fused_optimizer(profile), ex, e)
    # step_work counts one block's replicated tensors: the rest are the per-tensor work of blocks - 1 more
    extra = work.Work(16 * 2 * hx * (blocks - 1), 0)
    return dp, work.optimizer_seconds(profile, w + extra), rs, ag


def _dp_beside(ex: Execution, overlap: bool) -> bool:
    """Whether a pipeline's D reduction or weight all-gather runs beside its compute (data_parallel_exposed)."""
    return overlap and ex.pipeline_dp_overlap and (ex.overlap_grad_reduce or ex.overlap_param_gather)


def data_parallel_exposed(rs, ag, fwd_t, bwd_t, pp: int, vpp: int, side_by_side) -> np.ndarray:
    """[pp, n]: the seconds each pipeline rank's gradient reduction (rs [pp, n]) and next weight all-gather
    (ag [pp, n]) add past the end of its last backward where they run beside the pipeline as Megatron-Core
    schedules them (Execution.pipeline_dp_overlap). fwd_t, bwd_t [pp * vpp, n]: one micro-batch's forward and
    backward of each virtual stage; side_by_side(a, b): compute a beside a collective b (timing).
    - Without interleaving the first rank reduces beside its last backward; every other rank after its own last
      backward, in the cooldown (nothing of its to hide behind).
    - Interleaved, each of a rank's vpp chunks reduces its share once its last backward is done, beside the pp
      backward passes of the chunk below it that follow; the lowest chunk's share after the rank's last backward.
    - The all-gather runs beside the rank's first forward of each chunk: each bucket's is waited for, and the
      next one's issued, by the forward pre-hook of the layers it holds (megatron/core/distributed)."""
    rs, ag = np.asarray(rs, dtype=np.float64), np.asarray(ag, dtype=np.float64)
    chunk = lambda x, r, k: x[r + k * pp]  # noqa: E731  a rank's k-th virtual stage
    out = []
    for r in range(pp):
        if vpp == 1:
            hide = bwd_t[0] if r == 0 else np.zeros_like(bwd_t[0])
            rs_beside, rs_after = (rs[r], 0.0) if r == 0 else (0.0, rs[r])
        else:
            hide = sum(pp * chunk(bwd_t, r, k - 1) for k in range(1, vpp))
            rs_beside, rs_after = rs[r] * (vpp - 1) / vpp, rs[r] / vpp
        exposed = side_by_side(hide, rs_beside) - hide + rs_after
        first = sum(chunk(fwd_t, r, k) for k in range(vpp))
        out.append(exposed + side_by_side(first, ag[r]) - first)
    return np.stack(out)


@dataclass
class BestOf:
    """Which pipelined candidates to walk when only the best `top` feasible ones need exact times: first the
    `top` with the smallest lower bounds; then every feasible one whose bound is within `slack` of the top-th
    best time known (the candidates evaluated without a pipeline, `known`, and those walked). The top-th best of
    a subset is never below the top-th best of all, so no candidate that can be among the best stays unwalked."""

    top: int
    known: np.ndarray
    feasible: np.ndarray
    slack: float
    bound_all: bool = True  # False: the infeasible ones get no bound either (NaN), where none is listed

    def first(self, bound: np.ndarray) -> np.ndarray:
        ok = np.asarray(self.feasible).reshape(-1)
        pick = np.zeros(len(bound), dtype=bool)
        cand = np.nonzero(ok)[0]
        if len(cand):
            pick[cand[np.argsort(bound[cand], kind="stable")[:self.top]]] = True
        return pick

    def then(self, time: np.ndarray, exact: np.ndarray) -> np.ndarray:
        ok = np.asarray(self.feasible).reshape(-1)
        pool = np.concatenate([np.asarray(self.known, dtype=np.float64).reshape(-1), time[ok & exact]])
        limit = np.inf if len(pool) < self.top else float(np.partition(pool, self.top - 1)[self.top - 1]) * self.slack
        return ok & (time <= limit)


def rank_transfer_seconds(per_boundary: np.ndarray, vpp: int) -> np.ndarray:
    """[pp, n]: the mean transfer of each pipeline rank, over its boundaries (per_boundary [pp, n], as
    comm.boundary_crosses numbers them) to the rank before and after it; the end ranks have one without
    interleaving."""
    pp = per_boundary.shape[0]
    r = np.arange(pp)
    before, after = ((r > 0) | (vpp > 1))[:, None], ((r < pp - 1) | (vpp > 1))[:, None]
    return (before * per_boundary[(r - 1) % pp] + after * per_boundary[r]) / (before + after.astype(np.float64))


def transfers_per_step(m, vpp):
    """Point-to-point transfers a pipeline rank makes per step: each micro-batch's send and receive at each of
    its virtual stages (the walk's transfers; explain's send/recv row)."""
    return 2 * m * vpp


def pipeline_step_time(profile: MachineProfile, sched: Schedule, model: ModelSpec, c: Candidates, ex: Execution,
                       seq_len: int, overlap: bool, walk: BestOf | None = None, distinct=None) -> PipelineTime:
    """The batch time of pipelined candidates (every one has pp > 1), by walking each structure's order.

    walk: which candidates to walk when only the best need exact times (BestOf); the others keep their lower
    bound (bound_time) and `exact` False. None: every candidate walked.
    distinct: (candidates, each of c's row among them) where sched was built for distinct candidates that
    differ from c's only in vpp and schedule (with the same blocks per rank); None: sched is c's own. The
    stage_seconds returned are then the distinct candidates'."""
    cs, rows = (c, None) if distinct is None else distinct
    nu = len(cs)

    def to_c(x):  # a schedule array on c
        return on_rows(x, rows, nu)

    timing = strategy(profile)
    timing.retime(profile, sched)
    parts = _stage_parts(sched, timing.side_by_side, overlap)
    ck = np.asarray(to_c(sched.checkpointing))
    grad_acc = to_c(sched.grad_acc)
    shape = np.broadcast(ck, c.gx, grad_acc).shape
    N = int(np.prod(shape))

    def flat(x):
        return np.broadcast_to(np.asarray(x), shape).reshape(-1)

    class Lazy:
        """An array as the flattened candidates see it, gathered only at the indices asked for (a broadcast
        [2, h] view flattened would be copied whole); indexed by an Index (the positions unravelled once)."""

        def __init__(self, x):
            self.raw = r = np.asarray(x)
            # on the distinct candidates' rows: indexed through each candidate's row
            self.mapped = rows is not None and r.ndim > 0 and r.shape[-1] == nu
            self.flat = self.row = None
            if self.mapped:
                self.row = r.reshape(-1) if r.size == nu else None
                return
            self.x = np.broadcast_to(self.raw, shape)
            # a 1-D take from the array itself (whole, or one row broadcast over the checkpointing axis) is
            # several times faster than fancy indexing of the broadcast view with the unravelled positions
            self.flat = r.reshape(-1) if r.shape == shape and r.flags.c_contiguous else None
            self.row = r.reshape(-1) if r.ndim and r.size == shape[-1] and r.shape[-1] == shape[-1] else None

        def full(self):
            """The array as c's candidates see it (broadcasting against them)."""
            return to_c(self.raw)

        def __getitem__(self, at):
            if self.mapped:
                if self.row is not None:
                    return self.row.take(at.row)
                return self.raw[at.where[:-1] + (at.row,)]
            if self.flat is not None:
                return self.flat.take(at.ids)
            if self.row is not None:
                return self.row.take(at.where[-1])
            return self.x[at.where]

    class Index(np.ndarray):
        """Flat candidate indices that carry their unravelled positions."""

        @staticmethod
        def of(idx):
            out = np.asarray(idx).view(Index)
            out.ids = np.asarray(idx)
            out.where = np.unravel_index(idx, shape)
            out.row = None if rows is None else rows[out.where[-1]]  # the distinct candidate's
            return out

    ckf = flat(ck)
    m_raw = _timed_micro_batches(c.schedule, c.pp, grad_acc)
    pp, vpp, sc, m = flat(c.pp), flat(c.vpp), flat(c.schedule), flat(m_raw)
    L = model.n_layers
    # the rank's once-per-step work: first, the heaviest middle rank (1), last
    ranks = {"first": 0, "middle": 1, "last": None}
    after, bound_after = {}, {}
    keep = timing.slow / (1.0 + timing.slow)  # of a collective beside compute, at least this share shows
    for kind, (first, last) in KINDS.items():  # (on the distinct candidates: their blocks per rank are c's)
        r = np.asarray(cs.pp) - 1 if last else ranks[kind]
        dp, opt, rs, ag = _rank_step(profile, sched, model, cs, ex, seq_len, rank_blocks(L, cs.pp, cs.vpp, r), first,
                                     last, overlap)
        after[kind] = (Lazy(dp), Lazy(opt), Lazy(rs), Lazy(ag))
        # the bounds' share: what no overlap hides (data_parallel_exposed shows at least keep x what runs beside)
        bound_after[kind] = (Lazy(dp - (1.0 - keep) * (np.asarray(rs) + np.asarray(ag))), Lazy(opt))
    beside = _dp_beside(ex, overlap)

    # per stage kind and pass, run_windows' parts and the compute and collective sums, flattened once
    flat_parts = {}
    for key, (pr, (c1, cb), (l1, lb), (s1, sb_)) in parts.items():
        flat_parts[key] = [Lazy(x) for x in (pr["prefix"], pr["block"], pr["last"], pr["suffix"], c1, cb, l1, lb,
                                             s1, sb_)]

    def stage(kind, n, idx):
        """One micro-batch's (window seconds, compute, collectives, switching) forward and backward on n blocks."""
        out = []
        for name in ("forward", "backward"):
            xs = [a[idx] for a in flat_parts[kind, name]]
            if name == "backward":
                ys = [a[idx] for a in flat_parts[kind, "backward_recompute"]]
                xs = [np.where(ckf[idx], y, x) for x, y in zip(xs, ys)]
            pre, blk, lst, suf, c1, cb, l1, lb, s1, sb_ = xs
            out.append((pre + blk * (n - 1) + lst + suf, c1 + cb * (n - 1), l1 + lb * (n - 1), s1 + sb_ * (n - 1)))
        return out

    near, far = flat(to_c(sched.p2p_near)), flat(to_c(sched.p2p_far))
    p_stride = flat(to_c(sched.groups.stride["p"]))
    gpus = int(np.ravel(c.gx * c.gy * c.gz * c.gdata * c.pp)[0])  # the job's: every candidate multiplies to it
    fastest = flat(to_c(sched.p2p_fastest(profile)))  # the bounds' transfer: none is faster
    walk_m = np.zeros_like(m)
    for s_, name in enumerate(SCHEDULES):
        walk_m = np.where(sc == s_, walked(name, pp, m), walk_m)
    first_of, inv = distinct_rows(pp, vpp, sc, walk_m)
    uniq = np.stack([pp, vpp, sc, walk_m], axis=1)[first_of]
    out = {k: np.zeros(N) for k in ("batch", "comp", "colls", "bubble", "crit")}
    exact = np.zeros(N, dtype=bool)

    def group(gi, idx):
        """The candidates idx of structure gi, walked."""
        idx = Index.of(idx)
        p_, v_, s_, _ = (int(x) for x in uniq[gi])
        V = p_ * v_
        q, r = divmod(L, V)
        # each virtual stage is one of at most four (kind, blocks): evaluate those, then index them per stage
        shapes, which = {}, np.empty(V, dtype=np.int64)
        for v in range(V):
            key = ("first" if v == 0 else ("last" if v == V - 1 else "middle"), max(q + (v < r), 1))
            which[v] = shapes.setdefault(key, len(shapes))
        per_shape = [stage(kind, n, idx) for kind, n in shapes]
        fwd_t = np.stack([f[0] for f, _ in per_shape])[which]
        bwd_t = np.stack([b[0] for _, b in per_shape])[which]
        # each boundary's transfer: inside a node or across one (boundary b joins ranks b and b + 1, pp - 1 the
        # last back to the first)
        cross = comm.boundary_crosses(profile.gpus_per_node, p_stride[idx], p_, gpus)
        sb = np.where(cross, far[idx], near[idx])  # [pp, n]
        if ex.pipeline_blocking_p2p:  # the sender busy for its transfer: activations forward, gradients back
            vs = np.arange(V)
            fwd_t = fwd_t + (vs < V - 1)[:, None] * sb[vs % p_]
            bwd_t = bwd_t + (vs > 0)[:, None] * sb[(vs - 1) % p_]
        comp_s = np.stack([f[1] + b[1] for f, b in per_shape])[which]
        coll_s = np.stack([f[2] + b[2] for f, b in per_shape])[which]
        seconds = np.concatenate([fwd_t, bwd_t])
        mm = m[idx].astype(np.float64)

        def per_rank(x):  # [V, n] -> [pp, n]: a rank's virtual stages v, v + pp, ...
            return x.reshape(v_, p_, -1).sum(axis=0)

        per_rank_work = per_rank(fwd_t + bwd_t)
        send = np.stack([sb, sb])
        rank_send = rank_transfer_seconds(sb, v_)
        share = 1.0  # each rank's seconds run over its seconds as timed: below 1 where waiting ranks free cores
        if shared is None:
            ends = rank_end_times(SCHEDULES[s_], p_, v_, m[idx], seconds, send)  # [pp, n]
        else:
            f = sharing_factors(p_, on_node, shared)
            # the part of each window that does not shrink while other ranks wait: its exposed communication, at
            # most its collectives' switching seconds
            waiting = np.concatenate([np.stack([np.minimum(np.maximum(x[0] - x[1], 0.0), x[3]) for x in passes])[which]
                                      for passes in zip(*per_shape)])
            ends, ran = shared_rank_end_times(SCHEDULES[s_], p_, v_, m[idx], seconds, send, f, waiting)
            share = ran / np.maximum(mm * per_rank_work, 1e-300)
        kinds = ["first"] + ["middle"] * (p_ - 2) + ["last"]
        order = [list(KINDS).index(k) for k in kinds]
        finish = ends + np.stack([after[k][0][idx] + after[k][1][idx] for k in KINDS])[order]
        if beside:  # the reduction and the all-gather run beside the pipeline: only what shows past each end
            rs_k, ag_k = (np.stack([after[k][j][idx] for k in KINDS])[order] for j in (2, 3))
            finish = finish - rs_k - ag_k + data_parallel_exposed(rs_k, ag_k, fwd_t, bwd_t, p_, v_,
                                                                  timing.side_by_side)
        rk = np.argmax(finish, axis=0)
        col = np.arange(len(idx))
        per_rank_comp = per_rank(comp_s)
        per_rank_coll = per_rank(coll_s)
        kind_idx = np.array([list(KINDS).index(k) for k in kinds])[rk]
        dp_c = np.choose(kind_idx, [after[k][0][idx] for k in KINDS])
        opt_c = np.choose(kind_idx, [after[k][1][idx] for k in KINDS])
        out["batch"][idx] = finish[rk, col]
        out["crit"][idx] = rk
        sh = share[rk, col] if np.ndim(share) else share
        out["bubble"][idx] = np.maximum(ends[rk, col] - sh * mm * per_rank_work[rk, col], 0.0)
        out["comp"][idx] = sh * mm * per_rank_comp[rk, col] + opt_c
        out["colls"][idx] = sh * mm * per_rank_coll[rk, col] + dp_c + transfers_per_step(mm, v_) * rank_send[rk, col]
        exact[idx] = True

    groups = [np.nonzero(inv == gi)[0] for gi in range(len(uniq))]
    overhead = profile.corrections.step_overhead_s
    shared = profile.shared_cores  # ranks sharing cores: their operations run faster while others wait
    on_node = min(profile.gpus_per_node, gpus)  # ranks per node
    if walk is None:
        for gi, idx in enumerate(groups):
            group(gi, idx)
    else:  # every bound, then the walk of the candidates that can be among the best, in two rounds
        # the stage parts' linear terms once on the schedule's own rows, then elementwise over the candidates
        terms = linear_terms({key: [a.raw for a in xs] for key, xs in flat_parts.items()}, np.asarray(sched.checkpointing))
        if walk.bound_all:
            lin = map_terms(terms, to_c)
            ends = {k: tuple(a.full() for a in bound_after[k]) for k in KINDS}
            for k, v in bounds_of_terms(lin, ends, c.pp, c.vpp, m_raw, np.asarray(to_c(sched.p2p_fastest(profile))),
                                        L, ex.pipeline_blocking_p2p).items():
                out[k][:] = np.broadcast_to(v, shape).reshape(-1)
        else:  # the feasible candidates' bounds, gathered
            at = Index.of(np.flatnonzero(np.asarray(walk.feasible).reshape(-1)))
            lin = map_terms(terms, lambda x: Lazy(x)[at])
            ends = {k: tuple(a[at] for a in bound_after[k]) for k in KINDS}
            for k, v in bounds_of_terms(lin, ends, pp[at], vpp[at], m[at], fastest[at], L,
                               ex.pipeline_blocking_p2p).items():
                out[k][:] = np.nan
                out[k][at] = v
        if shared is not None:  # every second at most as fast as with one stage computing: still a bound
            fastest = sharing_factor(1, pp, on_node, shared)
            for k in ("batch", "comp", "colls", "bubble"):
                out[k] *= fastest
        todo = walk.first(out["batch"] + overhead)
        for round_ in range(2):
            for gi, idx in enumerate(groups):
                sel = idx[todo[idx] & ~exact[idx]]
                if len(sel):
                    group(gi, sel)
            if round_ == 0:
                todo = walk.then(out["batch"] + overhead, exact)
    batch = out["batch"] + overhead
    comp, colls, bubble = out["comp"], out["colls"], out["bubble"]
    exposed = np.maximum(batch - comp - bubble - overhead, 0.0)
    stage_seconds = {k: v[0] for k, v in parts.items()}
    return PipelineTime(*(x.reshape(shape) for x in (batch, comp, colls, exposed, bubble)),
                        out["crit"].reshape(shape).astype(np.int64), stage_seconds, exact.reshape(shape))


def _timed_micro_batches(schedule, pp, m):
    """The micro-batches a step is timed with: an infeasible interleaved step (not a multiple of pp) at the next
    multiple."""
    return np.where(SCHEDULES.index("interleaved-1f1b") == schedule, np.maximum(-(-m // pp) * pp, pp), m)


def _linear(full: dict, kind: str, ck: np.ndarray) -> tuple:
    """(forward, backward) of one virtual stage of `kind` as (a, b) pairs of (seconds, compute, collectives):
    n blocks take a + b n (the backward recomputing where checkpointing is on)."""
    out = []
    for name in ("forward", "backward"):
        xs = full[kind, name]
        if name == "backward":
            xs = [np.where(ck, y, x) for x, y in zip(xs, full[kind, "backward_recompute"])]
        pre, blk, lst, suf, c1, cb, l1, lb = xs[:8]
        out.append(((pre + lst + suf - blk, blk), (c1 - cb, cb), (l1 - lb, lb)))
    return tuple(out)


def linear_terms(full: dict, ck) -> dict:
    """kind -> _linear: what bounds needs of the stage parts, before any candidate's pp, vpp or m."""
    return {k: _linear(full, k, ck) for k in KINDS}


def map_terms(lin: dict, f) -> dict:
    """linear_terms with f applied to each of its arrays."""
    return {k: tuple(tuple((f(a), f(b)) for a, b in ps) for ps in v) for k, v in lin.items()}


def bounds_of_terms(lin: dict, after: dict, pp, vpp, m, send, n_layers: int, blocking: bool = False) -> dict:
    """bound_time's batch (with each rank's gradient reduction and optimizer), critical rank, bubble, compute
    and collectives for every candidate at once, in closed form: its virtual stages of one kind differ only in
    their blocks, so a rank's path and work are linear in its rank r between the steps of its blocks (at b, the
    first rank without an extra block), and their maximum over the middle ranks lies at 1, b - 1, b or pp - 2
    (the first of equal ones at the left end of a piece).
    lin: linear_terms of the parts of _stage_parts (their arrays on the candidates); after: kind -> (gradient
    reduction, optimizer); blocking: each stage's sender busy for its transfer (Execution.pipeline_blocking_p2p),
    as the walk has it."""
    pp, vpp, m = (np.asarray(x) for x in (pp, vpp, m))
    lin = dict(lin)  # the blocking transfers below replace entries: the caller's stay as they were
    mm = m.astype(np.float64)
    V = pp * vpp
    q, rem = n_layers // V, n_layers % V
    b = rem % pp
    n0 = q + (rem > 0)  # blocks of virtual stage 0 (the last one never takes an extra)
    if blocking:  # a forward sends on unless its stage is the last, a backward back unless it is the first
        for k, (f_on, b_on) in {"first": (1, 0), "middle": (1, 1), "last": (0, 1)}.items():
            (fwd, *fr), (bwd, *br) = lin[k]
            lin[k] = (((fwd[0] + f_on * send, fwd[1]), *fr), ((bwd[0] + b_on * send, bwd[1]), *br))

    def excess(kind, ps, what, n):  # the first (last) virtual stage over a middle one, both of n blocks
        (a, s_), (a_mid, s_mid) = lin[kind][ps][what], lin["middle"][ps][what]
        return a - a_mid + (s_ - s_mid) * n

    # per quantity (seconds 0, compute 1, collectives 2) of one micro-batch forward and backward: a rank's vpp
    # middle stages' fixed part, per block, and what its first (last) stage adds
    rank_terms = {}
    for what in (0, 1, 2):
        (af, sf), (ab, sb) = lin["middle"][0][what], lin["middle"][1][what]
        rank_terms[what] = (vpp * (af + ab), sf + sb, excess("first", 0, what, n0) + excess("first", 1, what, n0),
                            excess("last", 0, what, q) + excess("last", 1, what, q))
    path_terms = [(excess("first", ps, 0, n0), lin["middle"][ps][0][0] + send, lin["middle"][ps][0][1])
                  for ps in (0, 1)]

    def rank_sum(what, r, blocks):  # blocks: rank_blocks of r
        fixed, per_block, first, last = rank_terms[what]
        return fixed + per_block * blocks + np.where(r == 0, first, 0.0) + np.where(r == pp - 1, last, 0.0)

    def path(ps, r):  # bound_time's prefix: the first virtual stages of the ranks before r, a transfer each
        first, step, per_block = path_terms[ps]
        before = r * q + np.minimum(r, rem)  # blocks of the virtual stages 0 .. r - 1
        return np.where(r >= 1, first + r * step + per_block * before, 0.0)

    one = np.ones_like(pp)
    ranks = [0 * pp] + [np.clip(x, 1, pp - 2) for x in (one, b - 1, b, pp - 2)] + [pp - 1]
    kinds = ["first"] + ["middle"] * 4 + ["last"]
    valid = [True] + [pp > 2] * 4 + [True]
    held = [rank_blocks(n_layers, pp, vpp, r) for r in ranks]  # each rank's blocks, once
    work = [rank_sum(0, r, nb) for r, nb in zip(ranks, held)]
    ends = [path(0, r) + mm * w for r, w in zip(ranks, work)]
    ends[0] = np.max(np.broadcast_arrays(*[np.where(ok, e + path(1, r), -np.inf) for ok, e, r in zip(valid, ends, ranks)]),
                     axis=0)
    finish = np.stack(np.broadcast_arrays(*[np.where(ok, e + after[k][0] + after[k][1], -np.inf)
                                            for ok, e, k in zip(valid, ends, kinds)]))
    j = np.argmax(finish, axis=0)  # the first of equal ends: the lowest rank, as bound_time's argmax

    def pick(xs):
        return np.choose(j, xs)

    r, nb = pick(ranks), pick(held)
    return {"batch": pick(list(finish)), "crit": r.astype(np.float64),
            "bubble": np.maximum(pick(ends) - mm * pick(work), 0.0),
            "comp": mm * rank_sum(1, r, nb) + pick([after[k][1] for k in kinds]),
            "colls": mm * rank_sum(2, r, nb) + pick([after[k][0] for k in kinds]) + transfers_per_step(mm, vpp) * send}


def bound_time(first_fwd, first_bwd, send, work) -> np.ndarray:
    """[pp, n]: a lower bound of each pipeline rank's end (rank_end_times) from paths of the walk's order: rank
    r starts once the first micro-batch's forward has crossed the ranks before it (their first virtual stages,
    first_fwd[:r], and a transfer each) and then does all its work (work[r]); the first rank's last backward
    also waits for rank r's last one to come back through them (first_bwd[:r]). Exact for identical stages
    without transfers: (m + pp - 1)(F + B), the textbook bubble."""
    pre_f = np.cumsum(np.concatenate([np.zeros((1,) + np.shape(send)), first_fwd[:-1] + send]), axis=0)
    pre_b = np.cumsum(np.concatenate([np.zeros((1,) + np.shape(send)), first_bwd[:-1] + send]), axis=0)
    ends = pre_f + work
    ends[0] = np.max(ends + pre_b, axis=0)
    return ends
