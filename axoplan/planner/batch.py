"""evaluate(): every candidate's batch time, compute, communication, memory and feasibility, as arrays: the
step's schedule (schedule.py) timed by the profile's strategy (timing.py), its memory (memory.py)."""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

import numpy as np

from axoplan.planner import comm, pipeline, schedule, stage_timing, timing
from axoplan.planner.execution import AXOPLAN, Execution
from axoplan.planner.machine import MachineProfile
from axoplan.planner.memory import KINDS as MEMORY_KINDS
from axoplan.planner.memory import Memory, PipelineBuffers, memory, pipeline_buffers
from axoplan.planner.rows import distinct_rows, on_rows
from axoplan.planner.space import CANDIDATE_FIELDS, Candidates, divisibility_masks, micro_batches
from axoplan.planner.specs import Job, ModelSpec


@dataclass
class Evaluation:
    batch_time: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed_comm: np.ndarray
    memory: Memory
    memory_limit: float
    feasible: np.ndarray
    reason_code: np.ndarray  # -1 feasible, 0.. index into reasons
    reasons: list  # templates
    flops_per_gpu: np.ndarray  # FLOP per step per GPU, the paper's accounting (recompute included)
    extrapolated: np.ndarray
    detail: dict = field(default_factory=dict)
    bubble: np.ndarray | float = 0.0  # seconds the pipeline's slowest rank waits for its inputs
    memory_rank: np.ndarray | int = 0  # the pipeline rank whose memory is the job's (0 without a pipeline)
    micro_batches: np.ndarray | int = 1  # per step (per pipeline, or per GPU without one)
    # the batch time walked (every candidate without a pipeline); False: a lower bound of it, for a pipelined
    # candidate that cannot be among the best (evaluate's top)
    exact: np.ndarray | bool = True


# walked: every pipelined candidate whose lower bound is within this factor of the top-th best time (a margin
# for the walk's continuation past steady_cap, a mean increment within a few per cent of the walk's own)
TOP_SLACK = 1.05


def evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, overlap: bool = True,
             blas_tuning: bool | None = None, explain: bool = False, execution: Execution = AXOPLAN,
             top: int | None = None, bound_infeasible: bool = True) -> Evaluation:
    """Batch time, compute, communication, memory and feasibility of every candidate, as arrays.

    top: only the best `top` feasible candidates need an exact time: a pipelined candidate is walked when its
    lower bound (stage_timing.bound_time) is within TOP_SLACK of the top-th best time walked or computed, else
    it keeps the bound and `exact` False (it cannot be among them). None: every candidate walked.
    bound_infeasible: with top, False leaves the pipelined candidates out of memory untimed (NaN), for a
    ranking that lists only feasible ones."""
    parts = _parts(model, profile, job, c, overlap, blas_tuning, explain, execution, (top, bound_infeasible))
    if len(parts) == 1:
        return parts[0][1]
    return _merge_many([ev for _, ev in parts], [at for at, _ in parts])


# candidates (pairs of checkpointing off and on) evaluated at once: a chunk's arrays are reused by the allocator
# from one chunk to the next, where the whole of a 65,536-GPU space at once is ~600 MB of fresh pages
CHUNK = 32768


def _parts(model, profile, job, c, overlap, blas_tuning, explain, execution, walk) -> list:
    """(rows of c, their Evaluation) that make up evaluate(): the candidates without a pipeline; the pipelined
    ones in chunks, each walked where the best times before it leave it among the best (BestOf: a limit from
    fewer candidates is never tighter); and the pipelined ones a rule excludes (not timed, _excluded)."""
    pipe = c.pp > 1
    rows = np.arange(len(c))
    rules = plan_rules(model, job, c, execution)
    code = _rule_codes(rules, np.shape(c.gx))  # every rule before memory, once for all the parts
    templates = [t for _, t in rules]
    excluded = pipe & (code >= 0) if not explain else np.zeros(len(c), dtype=bool)
    top = walk[0]
    parts = []
    flat = rows[~pipe]
    if len(flat):
        one = c if len(flat) == len(c) else c.take(flat)
        parts.append((flat, _evaluate_paired(model, profile, job, one, overlap, blas_tuning, explain, execution, walk,
                                             (code[flat], templates))))
    known = parts[0][1].batch_time[parts[0][1].feasible] if parts else np.zeros(0)
    walked = rows[pipe & ~excluded]
    if len(walked):
        cw = c if len(walked) == len(c) else c.take(walked)
        for at in _chunks(cw, explain):
            ev = _evaluate_paired(model, profile, job, cw.take(at) if len(at) < len(cw) else cw, overlap,
                                  blas_tuning, explain, execution, walk, (code[walked[at]], templates), known)
            parts.append((walked[at], ev))
            if top is not None:  # the best `top` exact times so far are all a later chunk's limit needs
                known = np.concatenate([known, ev.batch_time[ev.feasible & np.broadcast_to(ev.exact, len(at))]])
                known = np.partition(known, top - 1)[:top] if len(known) > top else known
    if excluded.any():
        at = rows[excluded]
        parts.append((at, _excluded(model, job, c.take(at), code[at], templates, execution,
                                    parts[0][1] if parts else None, profile)))
    return parts


def _chunks(c: Candidates, explain: bool) -> list:
    """Rows of c in chunks of CHUNK candidates (of CHUNK pairs where the second half is the first with
    checkpointing on, so that each chunk is evaluated once over both)."""
    if explain:
        return [np.arange(len(c))]
    pairs = _paired(c)
    n = len(c) // 2 if pairs else len(c)
    size = CHUNK if pairs else 2 * CHUNK
    if n <= size:
        return [np.arange(len(c))]
    out = []
    for lo in range(0, n, size):
        idx = np.arange(lo, min(lo + size, n))
        out.append(np.concatenate([idx, idx + n]) if pairs else idx)
    return out


def _paired(c: Candidates) -> bool:
    """The second half of c is the first with checkpointing on."""
    h = len(c) // 2
    return (h > 0 and len(c) == 2 * h and not c.checkpointing[:h].any() and c.checkpointing[h:].all()
            and all(np.array_equal(getattr(c, f)[:h], getattr(c, f)[h:]) for f in CANDIDATE_FIELDS[:-1]))


def _evaluate_paired(model, profile, job, c, overlap, blas_tuning, explain, execution, walk, rules, known=()):
    """_evaluate, once over both halves where the second is the first with checkpointing on. rules: (the first
    rule before memory each candidate violates, -1 none; the rules' reason templates)."""
    h = len(c) // 2
    paired = not explain and _paired(c)
    with np.errstate(divide="ignore", invalid="ignore"):  # rows with a zero-sized shard are infeasible anyway
        if not paired:
            return _evaluate(model, profile, job, c, c.checkpointing, overlap, blas_tuning, explain, execution, walk,
                             rules, known)
        # the second half is the first with checkpointing on: evaluate once, broadcast over [off, on]
        ev = _evaluate(model, profile, job, c.take(slice(0, h)), np.array([[False], [True]]), overlap, blas_tuning,
                       False, execution, walk, (rules[0][:h], rules[1]), known)

    def flat(x):
        return np.broadcast_to(x, (2, h)).reshape(-1)

    mem = ev.memory.map(flat)
    return Evaluation(flat(ev.batch_time), flat(ev.compute), flat(ev.comm), flat(ev.exposed_comm), mem,
                      ev.memory_limit, flat(ev.feasible), flat(ev.reason_code), ev.reasons, flat(ev.flops_per_gpu),
                      flat(ev.extrapolated), {}, flat(ev.bubble), flat(ev.memory_rank), flat(ev.micro_batches),
                      flat(ev.exact))


def _merge_many(evs: list, at: list) -> Evaluation:
    """One Evaluation of the candidates whose rows at[i] evs[i] evaluated (the same rules, so the same reasons)."""
    n = sum(len(a) for a in at)

    def put(get):
        vs = [np.broadcast_to(get(e), (len(a),)) for e, a in zip(evs, at)]
        out = np.empty(n, dtype=np.result_type(*vs))
        for a, v in zip(at, vs):
            out[a] = v
        return out

    names = ()
    for e in evs:
        names += tuple(m for m in e.memory.moments if m not in names)
    remaps = [np.array([names.index(m) for m in e.memory.moments], dtype=np.int64) for e in evs]
    kinds = {k: None if getattr(evs[0].memory, k) is None else put(lambda e, k=k: getattr(e.memory, k))
             for k in MEMORY_KINDS}
    moment = np.empty(n, dtype=np.int64)
    for a, e, r in zip(at, evs, remaps):
        moment[a] = r[e.memory.moment]
    mem = Memory(put(lambda e: e.memory.total), moment, names, **kinds)
    fields = ("batch_time", "compute", "comm", "exposed_comm", "feasible", "reason_code", "flops_per_gpu",
              "extrapolated", "bubble", "memory_rank", "micro_batches", "exact")
    cols = {f: put(lambda e, f=f: getattr(e, f)) for f in fields}
    return Evaluation(cols["batch_time"], cols["compute"], cols["comm"], cols["exposed_comm"], mem,
                      evs[0].memory_limit, cols["feasible"], cols["reason_code"], evs[0].reasons,
                      cols["flops_per_gpu"], cols["extrapolated"], {}, cols["bubble"], cols["memory_rank"],
                      cols["micro_batches"], cols["exact"])


def _evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, ck, overlap: bool,
              blas_tuning: bool | None, explain: bool, execution: Execution, walk: tuple, rules: tuple,
              known=()) -> Evaluation:
    """ck broadcasts against the candidate arrays: c.checkpointing itself, or [[False], [True]] for both.
    walk: (top, bound_all) as evaluate's top and bound_infeasible; rules: as _evaluate_paired's."""
    tuning = profile.blas_tuning if blas_tuning is None else blas_tuning
    S = job.seq_len
    e = profile.dtype_bytes
    gx, gy, gz, mb = c.gx, c.gy, c.gz, c.micro_batch
    T = (mb * S).astype(np.float64)
    piped = c.pipelined  # evaluate() hands over all pipelined candidates or none
    cs, rows_s, ck_s = c, None, ck  # the candidates the schedule is built for, each candidate's row among them
    if piped and not explain:
        # vpp and the pipeline schedule change neither a step's windows nor (with the same blocks per rank) a
        # rank's once-per-step work: the schedule is built once per distinct rest (~2.4x fewer on GPT-1T)
        ck_key = ck if np.ndim(ck) == 1 else False
        held = [stage_timing.rank_blocks(model.n_layers, c.pp, c.vpp, r) for r in (0, 1, c.pp - 1)]
        u_first, u_inv = distinct_rows(gx, gy, gz, c.gdata, c.order, mb, c.pp, ck_key, *held)
        if len(u_first) < len(c):
            cs, rows_s = c.take(u_first), u_inv
            ck_s = ck if np.ndim(ck) != 1 else np.asarray(ck)[u_first]
    sched = schedule.build(model, profile, job, cs, ck_s, overlap, tuning, comm.place(profile, cs), execution)

    def to_c(x):  # a schedule array on the candidates
        return on_rows(x, rows_s, len(cs))
    shard, replicated = sched.params.total, sched.replicated_elems

    # ---- memory ------------------------------------------------------------------------------------
    # memory depends on (gx, gy, gz, micro-batch, checkpointing) only (gdata follows from the first three):
    # evaluated once per distinct row
    ck_rows = np.broadcast_to(ck, np.shape(gx)) if np.ndim(ck) <= 1 else np.zeros(np.shape(gx), dtype=bool)
    m_rows = to_c(sched.grad_acc) if piped else 0
    first, inverse = distinct_rows(gx, gy, gz, mb, ck_rows, c.pp, c.vpp, c.schedule, m_rows)

    def pick(x):
        return x[first] if np.ndim(x) else x

    def stage_memory(rank_kind: str) -> Memory:
        """The peak of a pipeline's first or last rank (the middle ones hold no more than the first), or of
        the whole model without a pipeline."""
        kw, sh, rep = {}, shard, replicated
        if piped:
            kw, sh, rep = _stage_memory_args(model, sched, c, job, first, rank_kind, S, execution, to_c)
        return memory(model, pick(gx), pick(gy), pick(gz), pick(T), ck if np.ndim(ck) > 1 else pick(ck),
                      pick(sh.astype(np.float64)) if not piped else sh, pick(rep) if not piped else rep,
                      [pick(to_c(b)) for b in sched.params.blocks],
                      pick(to_c(sched.params.lm_head)), pick(to_c(sched.params.embedding)), e, prefetch=overlap,
                      max_inflight_rs=schedule.MAX_INFLIGHT_RS if overlap else 0,
                      passes=kw.pop("passes", (sched.forward, sched.backward)),
                      gdata=pick(c.gdata), execution=execution, seq_len=S,
                      breakdown=explain, **kw)
    memory_rank = 0
    if piped:
        head, tail = stage_memory("first"), stage_memory("last")
        worse = tail.total > head.total
        memory_rank = np.where(worse, pick(c.pp) - 1, 0)
        names = tuple(f"first pipeline stage: {n}" for n in head.moments) + tuple(
            f"last pipeline stage: {n}" for n in tail.moments)
        kinds = {k: None if getattr(head, k) is None else np.where(worse, getattr(tail, k), getattr(head, k))
                 for k in MEMORY_KINDS}
        mem = Memory(np.where(worse, tail.total, head.total),
                     np.where(worse, tail.moment + len(head.moments), head.moment), names, **kinds)
        memory_rank = np.take(np.broadcast_to(memory_rank, mem.total.shape), inverse, axis=-1)
    else:
        mem = stage_memory("only")
    mem = mem.map(lambda a: np.take(a, inverse, axis=-1))  # take: several times faster than a[..., inverse]
    limit = profile.mem_capacity - profile.mem_headroom

    # ---- feasibility, first failing rule wins -----------------------------------------------
    # then what the framework cannot express (execution.capability_masks), before memory
    before, templates = rules
    reasons = templates + [MEMORY_REASON]
    code = np.where(before >= 0, before, np.where(mem.total > limit, len(templates), -1))
    code = np.broadcast_to(code, np.broadcast(ck, gx, code).shape)
    feasible = code < 0

    # ---- time: the schedule's windows, walked through the pipeline's order where there is one ---------
    bubble, exact = 0.0, True
    if piped:
        top, bound_all = walk
        best = None if top is None else stage_timing.BestOf(top, known, np.broadcast_to(feasible, np.shape(code)),
                                                             TOP_SLACK, bound_all)
        pt = stage_timing.pipeline_step_time(profile, sched, model, c, execution, S, overlap, best,
                                             None if rows_s is None else (cs, rows_s))
        timed_step = pt
        batch, compute_total, comm_total, exposed, bubble = pt.batch, pt.compute, pt.comm, pt.exposed, pt.bubble
        exact = pt.exact
    else:
        timed_step = timing.step_time(profile, sched, overlap, explain)
        batch = timed_step.batch
        compute_total = sched.grad_acc * sched.compute_per_micro_batch() + sched.optimizer
        comm_total = sched.grad_acc * sched.comm_per_micro_batch() + sum(s.seconds * s.calls for s in sched.step)
        exposed = np.maximum(batch - compute_total - profile.corrections.step_overhead_s, 0.0)

    flops_gpu = _flops_per_gpu(model, job, ck, execution)

    detail = {"schedule": sched, "time": timed_step} if explain else {}
    if explain and piped:  # each end of the pipeline's own peak (dryrun traces both)
        detail["stage_memory"] = {"first": head.map(lambda a: np.take(a, inverse, axis=-1)),
                                  "last": tail.map(lambda a: np.take(a, inverse, axis=-1))}
    return Evaluation(batch, compute_total, comm_total, exposed, mem, limit, feasible, code, reasons, flops_gpu,
                      to_c(sched.extrapolated), detail, np.broadcast_to(bubble, np.shape(batch)),
                      np.broadcast_to(memory_rank, np.shape(batch)), np.broadcast_to(to_c(sched.grad_acc), np.shape(batch)),
                      np.broadcast_to(exact, np.shape(batch)))


MEMORY_REASON = "needs {mem:.1f} GiB per GPU, more than {limit:.1f} GiB available"


def plan_rules(model: ModelSpec, job: Job, c: Candidates, execution: Execution) -> list:
    """(violated mask, reason template) of every rule before memory, in the order reasons are reported: the
    divisibility and pipeline rules, then what the framework cannot express (execution.capability_masks); the
    one rule set rank applies and emit's check_plan refuses a plan by."""
    return divisibility_masks(model, job.global_batch, job.seq_len, c) + [
        (execution.pipeline_even_split & (model.n_layers % (c.pp * c.vpp) != 0),
         f"{execution.name} needs the {model.n_layers} blocks divisible by pp x vpp = {{pp}} x {{vpp}}")] + \
        execution.capability_masks(c)


def _rule_codes(rules: list, shape) -> np.ndarray:
    """Per candidate the index of the first rule it violates, -1 for none."""
    code = np.full(shape, -1, dtype=np.int64)
    for i, (mask, _) in reversed(list(enumerate(rules))):
        code = np.where(mask, i, code)
    return code


def _flops_per_gpu(model: ModelSpec, job: Job, ck, execution: Execution) -> np.ndarray:
    """FLOP per step per GPU, the paper's accounting (the recomputed forward included under checkpointing)."""
    once = model.flops_per_token(job.seq_len, recompute=False)
    flops_token = np.where(ck, once + execution.recomputed_flops_per_token(model, job.seq_len), once)
    return flops_token * job.tokens_per_batch / job.gpus


def _excluded(model: ModelSpec, job: Job, c: Candidates, code: np.ndarray, templates: list, execution: Execution,
              like: Evaluation | None, profile: MachineProfile) -> Evaluation:
    """The Evaluation of pipelined candidates a rule excludes (code: the rule of `templates`, the reasons before
    memory): infeasible with its reason, neither timed nor their memory walked (NaN), with the memory kinds of
    `like` (the others' evaluation) to merge with it."""
    n = len(c)
    nan = np.full(n, np.nan)
    kinds = {k: None if like is None or getattr(like.memory, k) is None else nan for k in MEMORY_KINDS}
    moments = like.memory.moments if like is not None else ("not evaluated",)
    mem = Memory(nan, np.zeros(n, dtype=np.int64), moments, **kinds)
    return Evaluation(nan, nan, nan, nan, mem, profile.mem_capacity - profile.mem_headroom, np.zeros(n, dtype=bool),
                      code, templates + [MEMORY_REASON], _flops_per_gpu(model, job, c.checkpointing, execution), np.zeros(n, dtype=bool),
                      {}, nan, np.zeros(n, dtype=np.int64), micro_batches(job.global_batch, c),
                      np.zeros(n, dtype=bool))


def _stage_memory_args(model: ModelSpec, sched, c: Candidates, job: Job, first: np.ndarray, rank_kind: str,
                       seq_len: int, execution: Execution = AXOPLAN, to_c=lambda x: x):
    """memory()'s stage arguments for the distinct rows `first`: the rank's blocks, the blocks whose activations
    are saved when its backward starts (its forwards in flight, pipeline.peak_in_flight), the blocks of its other
    micro-batches still saved when its first virtual stage's backward ends, its stage boundaries' buffers
    (memory.pipeline_buffers), its embedding or LM head, its passes and its states (shard and replicated
    elements)."""
    pp, vpp, sc = c.pp[first], c.vpp[first], c.schedule[first]
    steps = np.broadcast_to(to_c(sched.grad_acc), np.shape(c.gx))[first]
    L = model.n_layers
    last = rank_kind == "last"
    rank = pp - 1 if last else np.zeros_like(pp)
    blocks = stage_timing.rank_blocks(L, pp, vpp, rank)
    live = np.empty(len(first), dtype=np.float64)
    others = np.zeros(len(first))
    chunk = blocks.astype(np.float64)
    bufs = {f: np.zeros(len(first)) for f in ("recv", "received_inputs", "outputs", "logits")}
    # the peak's forwards in flight stop growing after the warm-up: one walk of the order per structure
    m = np.where(sc == 0, pipeline.peak_micro_batches("1f1b", pp, steps),
                 pipeline.peak_micro_batches("interleaved-1f1b", pp, steps))
    at, inv = distinct_rows(pp, vpp, sc, m, steps)
    for j, (p_, v_, s_, m_, steps_) in enumerate(np.stack([pp, vpp, sc, m, steps], axis=1)[at].tolist()):
        sel = inv == j
        q, r = divmod(L, p_ * v_)
        n_v = q + (np.arange(p_ * v_) < r)
        if p_ * v_ > L or m_ < 1:
            live[sel] = blocks[sel]
            continue
        k = p_ - 1 if last else 0
        flight = np.asarray(pipeline.peak_in_flight(pipeline.SCHEDULES[s_], p_, v_, m_)[k])
        live[sel] = float(flight @ n_v)
        others[sel] = live[sel] - n_v[k]  # all but the blocks of its first virtual stage's micro-batch in backward
        chunk[sel] = n_v[k + (v_ - 1) * p_]  # its first backward is of its last virtual stage
        b = pipeline_buffers(execution, p_, v_, k, steps_, flight)
        for f in bufs:
            bufs[f][sel] = getattr(b, f)
    ps = sched.params

    def pick(x):
        return np.asarray(x)[first] if np.ndim(x) else x

    rows = dataclasses.replace(ps, block_shard=pick(to_c(ps.block_shard)), emb_shard=pick(to_c(ps.emb_shard)),
                               lm_shard=pick(to_c(ps.lm_shard)))
    shard, replicated = stage_timing.rank_states(rows, model, c.gx[first], blocks, not last, last, seq_len)
    passes = (sched.forward.stage(not last, last), sched.backward.stage(not last, last))
    return ({"n_blocks": blocks, "live_blocks": np.maximum(live, blocks * 0 + 1), "embedding": not last,
             "head": last, "passes": passes, "buffers": PipelineBuffers(**bufs), "others_blocks": others,
             "received_gradient": not last, "chunk_blocks": chunk}, shard.astype(np.float64), replicated)
