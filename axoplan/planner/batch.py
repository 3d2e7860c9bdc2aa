"""evaluate(): every candidate's batch time, compute, communication, memory and feasibility, as arrays: the
step's schedule (schedule.py) timed by the profile's strategy (timing.py), its memory (memory.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from axoplan.planner import comm, schedule, timing
from axoplan.planner.execution import AXOPLAN, Execution
from axoplan.planner.machine import MachineProfile
from axoplan.planner.memory import Memory, memory
from axoplan.planner.rows import distinct_rows
from axoplan.planner.space import CANDIDATE_FIELDS, Candidates, divisibility_masks
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


def evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, overlap: bool = True,
             blas_tuning: bool | None = None, explain: bool = False, execution: Execution = AXOPLAN) -> Evaluation:
    """Batch time, compute, communication, memory and feasibility of every candidate, as arrays."""
    h = len(c) // 2
    paired = (not explain and h > 0 and len(c) == 2 * h and not c.checkpointing[:h].any()
              and c.checkpointing[h:].all()
              and all(np.array_equal(getattr(c, f)[:h], getattr(c, f)[h:]) for f in CANDIDATE_FIELDS[:-1]))
    with np.errstate(divide="ignore", invalid="ignore"):  # rows with a zero-sized shard are infeasible anyway
        if not paired:
            return _evaluate(model, profile, job, c, c.checkpointing, overlap, blas_tuning, explain, execution)
        # the second half is the first with checkpointing on: evaluate once, broadcast over [off, on]
        ev = _evaluate(model, profile, job, c.take(slice(0, h)), np.array([[False], [True]]), overlap, blas_tuning,
                       False, execution)

    def flat(x):
        return np.broadcast_to(x, (2, h)).reshape(-1)

    mem = ev.memory.map(flat)
    return Evaluation(flat(ev.batch_time), flat(ev.compute), flat(ev.comm), flat(ev.exposed_comm), mem,
                      ev.memory_limit, flat(ev.feasible), flat(ev.reason_code), ev.reasons, flat(ev.flops_per_gpu),
                      flat(ev.extrapolated), {})


def _evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, ck, overlap: bool,
              blas_tuning: bool | None, explain: bool, execution: Execution = AXOPLAN) -> Evaluation:
    """ck broadcasts against the candidate arrays: c.checkpointing itself, or [[False], [True]] for both."""
    tuning = profile.blas_tuning if blas_tuning is None else blas_tuning
    S = job.seq_len
    e = profile.dtype_bytes
    gx, gy, gz, mb = c.gx, c.gy, c.gz, c.micro_batch
    T = (mb * S).astype(np.float64)
    sched = schedule.build(model, profile, job, c, ck, overlap, tuning, comm.place(profile, c), execution)
    timed_step = timing.step_time(profile, sched, overlap, explain)
    batch = timed_step.batch
    compute_total = sched.grad_acc * sched.compute_per_micro_batch() + sched.optimizer
    comm_total = sched.grad_acc * sched.comm_per_micro_batch() + sum(s.seconds * s.calls for s in sched.step)
    exposed = np.maximum(batch - compute_total - profile.corrections.step_overhead_s, 0.0)
    shard, replicated = sched.params.total, sched.replicated_elems

    # ---- memory ------------------------------------------------------------------------------------
    # memory depends on (gx, gy, gz, micro-batch, checkpointing) only (gdata follows from the first three):
    # evaluated once per distinct row
    ck_rows = np.broadcast_to(ck, np.shape(gx)) if np.ndim(ck) <= 1 else np.zeros(np.shape(gx), dtype=bool)
    first, inverse = distinct_rows(gx, gy, gz, mb, ck_rows)

    def pick(x):
        return x[first] if np.ndim(x) else x

    mem = memory(model, pick(gx), pick(gy), pick(gz), pick(T), ck if np.ndim(ck) > 1 else pick(ck),
                 pick(shard.astype(np.float64)), pick(replicated), [pick(b) for b in sched.params.blocks],
                 pick(sched.params.lm_head), pick(sched.params.embedding), e, prefetch=overlap,
                 max_inflight_rs=schedule.MAX_INFLIGHT_RS if overlap else 0,
                 passes=(sched.forward, sched.backward),
                 gdata=pick(c.gdata), execution=execution, seq_len=S,
                 breakdown=explain)
    mem = mem.map(lambda a: a[..., inverse])
    limit = profile.mem_capacity - profile.mem_headroom

    # ---- feasibility, first failing rule wins -----------------------------------------------
    # what the framework cannot express first: no divisibility or memory would make it run there
    rules = execution.capability_masks(c) + divisibility_masks(model, job.global_batch, S, c)
    reasons = [t for _, t in rules] + ["needs {mem:.1f} GiB per GPU, more than {limit:.1f} GiB available"]
    code = np.full(np.broadcast(ck, gx).shape, -1, dtype=np.int64)
    for i, (mask, _) in reversed(list(enumerate(rules + [(mem.total > limit, "")]))):
        code = np.where(mask, i, code)
    feasible = code < 0

    once = model.flops_per_token(S, recompute=False)
    flops_token = np.where(ck, once + execution.recomputed_flops_per_token(model, S), once)
    flops_gpu = flops_token * job.tokens_per_batch / job.gpus

    detail = {"schedule": sched, "time": timed_step} if explain else {}
    return Evaluation(batch, compute_total, comm_total, exposed, mem, limit, feasible, code, reasons, flops_gpu,
                      sched.extrapolated, detail)
