"""rank() and explain(): the public API behind `axoplan rank` and `axoplan explain`."""
from __future__ import annotations

import string

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from axoplan import inputs
from axoplan.planner import comm, stage_timing
from axoplan.planner.batch import MEMORY_REASON, Evaluation, evaluate
from axoplan.planner.compute import unaligned_dims
from axoplan.planner.execution import AXOPLAN, Execution, load_execution
from axoplan.planner.memory import KIND_NAMES
from axoplan.planner.memory import KINDS as MEMORY_KINDS
from axoplan.errors import UserError
from axoplan.planner.machine import GIB, MachineProfile
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.pipeline import SCHEDULES, stage_blocks
from axoplan.planner.schedule import Window
from axoplan.planner.space import (PLACEMENTS, Candidates, enumerate_space, layout, micro_batches, pipeline_choices,
                                   pipeline_masks, placement_error)
from axoplan.planner.specs import Job, ModelSpec, load_model
from axoplan.planner.uncertainty import Uncertainty, expected_error, tied

if TYPE_CHECKING:  # pandas is imported where a DataFrame is built: `axoplan rank` prints without it
    import pandas as pd

# with neither --top nor a limit: the pipelined candidates walked are those that can be among this many best
WALKED_BY_DEFAULT = 100

COLUMNS = ["rank", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s", "compute_s",
           "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak", "feasible", "reason",
           "pp", "vpp", "schedule", "bubble_s", "batch_time_exact",
           # added after the fixed ones: within the expected error of the best (the evidence cannot order
           # them), and that error (planner/uncertainty.py)
           "tied", "expected_error"]


def _reasons(ev: Evaluation, c: Candidates, idx: np.ndarray) -> list[str]:
    """Each row's reason ("" where feasible), formatted once per distinct value of the fields its template names."""
    out = np.full(len(idx), "", dtype=object)
    code = ev.reason_code[idx]
    m = np.broadcast_to(ev.micro_batches, np.shape(ev.batch_time))
    fields = {"gx": c.gx, "gy": c.gy, "gz": c.gz, "gdata": c.gdata, "micro_batch": c.micro_batch, "pp": c.pp,
              "vpp": c.vpp, "m": m, "mem": ev.memory.total / GIB}
    for k in np.flatnonzero(np.bincount(code[code >= 0])):  # np.unique would import numpy.ma (~10 ms)
        at = np.nonzero(code == k)[0]
        template = ev.reasons[k]
        names = sorted({f for _, f, _, _ in string.Formatter().parse(template) if f and f != "limit"})
        cols = [np.asarray(fields[f])[idx[at]] for f in names]
        first, inverse = (np.zeros(1, dtype=np.int64), np.zeros(len(at), dtype=np.int64)) if not cols else \
            np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)[1:]
        text = [template.format(limit=ev.memory_limit / GIB, **{f: col[i] for f, col in zip(names, cols)})
                for i in np.asarray(first).reshape(-1)]
        out[at] = np.asarray(text, dtype=object)[np.asarray(inverse).reshape(-1)]
    return out.tolist()


def _columns(ev: Evaluation, c: Candidates, idx: np.ndarray, profile: MachineProfile,
             unc: Uncertainty | None = None) -> dict:
    """The rows `idx` as numpy columns, COLUMNS in order; `rank` counts rows from 1 and means
    nothing where `feasible` is false (the DataFrame holds NA there)."""
    err = unc.expected_error if unc is not None else None
    with np.errstate(all="ignore"):  # a non-finite result is refused below, by name
        tflops = ev.flops_per_gpu[idx] / ev.batch_time[idx] / 1e12
        cols = {
            "rank": np.arange(1, len(idx) + 1),
            "gx": c.gx[idx], "gy": c.gy[idx], "gz": c.gz[idx], "gdata": c.gdata[idx],
            "order": np.array(PLACEMENTS)[c.order[idx]], "micro_batch": c.micro_batch[idx],
            "checkpointing": c.checkpointing[idx], "batch_time_s": ev.batch_time[idx], "compute_s": ev.compute[idx],
            "comm_s": ev.comm[idx], "exposed_comm_s": ev.exposed_comm[idx], "memory_gib": ev.memory.total[idx] / GIB,
            "tflops_per_gpu": tflops, "pct_of_peak": 100 * tflops * 1e12 / profile.peak_flops,
            "feasible": ev.feasible[idx], "reason": _reasons(ev, c, idx),
            "pp": c.pp[idx], "vpp": c.vpp[idx], "schedule": np.array(SCHEDULES)[c.schedule[idx]],
            "bubble_s": np.broadcast_to(ev.bubble, np.shape(ev.batch_time))[idx],
            "batch_time_exact": np.broadcast_to(ev.exact, np.shape(ev.batch_time))[idx],
            "tied": tied(ev.batch_time[idx], ev.feasible[idx], err),
            "expected_error": np.full(len(idx), np.nan if err is None else err),
        }
    _check_finite(cols, profile)
    return cols


_PREDICTIONS = ("batch_time_s", "compute_s", "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak",
                "bubble_s")


def _check_finite(cols: dict, profile: MachineProfile) -> None:
    """Every number shown for a feasible configuration is finite (the evaluation's output boundary): an
    inf or nan comes from a profile number at an extreme, and is refused rather than ranked."""
    ok = cols["feasible"]
    for name in _PREDICTIONS:
        v = np.asarray(cols[name], dtype=np.float64)[ok]
        bad = ~np.isfinite(v) | ((v <= 0) if name in ("batch_time_s", "tflops_per_gpu") else False)
        if bad.any():
            i = int(np.nonzero(ok)[0][np.argmax(bad)])
            raise UserError(f"machine profile '{profile.name}' gives {name} = {v[np.argmax(bad)]!r} for grid "
                            f"{cols['gx'][i]}x{cols['gy'][i]}x{cols['gz'][i]}x{cols['gdata'][i]}: a number in it is at "
                            f"an extreme its model cannot compute with (a bandwidth, throughput or efficiency near "
                            f"zero, or a huge dim_half); check the profile")


def _frame(columns: dict) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame({k: v for k, v in columns.items() if k != "rank"})
    ranks = pd.Series(columns["rank"], dtype="Int64").where(df["feasible"].to_numpy(), pd.NA)
    df.insert(0, "rank", ranks)
    return df.reset_index(drop=True)


@dataclass
class Ranking:
    """rank()'s rows as numpy columns (`columns`: COLUMNS, in order) with what they were ranked for;
    frame() is the DataFrame rank() returns."""
    columns: dict
    model: ModelSpec
    profile: MachineProfile
    job: Job
    candidates: int  # in the space
    feasible: int  # in the space
    extrapolated_gemms: int  # listed feasible rows with GEMM shapes outside the profile's table
    execution: Execution = AXOPLAN  # how the framework runs the step
    detail: dict | None = None  # the evaluation's schedule and timing and the candidate (dryrun's per-stage view)
    uncertainty: Uncertainty | None = None  # the expected error of these times (planner/uncertainty.py)

    def __len__(self) -> int:
        return len(self.columns["rank"])

    def frame(self) -> pd.DataFrame:
        df = _frame(self.columns)
        df.attrs["extrapolated_gemms"] = self.extrapolated_gemms
        df.attrs["candidates"] = self.candidates
        df.attrs["feasible"] = self.feasible
        return df


def _nothing_feasible(ev: Evaluation, c: Candidates, model: ModelSpec, profile: MachineProfile, job: Job) -> UserError:
    codes = Counter(int(x) for x in ev.reason_code)
    mem_code = len(ev.reasons) - 1
    if codes.get(mem_code):
        need = ev.memory.total[ev.reason_code == mem_code].min() / GIB
        return UserError(f"nothing fits: {model.name} on {job.gpus} GPUs of {profile.name} needs at least {need:.1f} GiB "
                         f"per GPU in its smallest configuration, and {ev.memory_limit / GIB:.1f} GiB is available")
    code, _ = codes.most_common(1)[0]
    i = int(np.argmax(ev.reason_code == code))
    example = _reasons(ev, c, np.array([i]))[0]
    return UserError(f"no configuration of {model.name} on {job.gpus} GPUs is valid for global batch "
                     f"{job.global_batch}: e.g. {example}")


def _setup(model, machine, gpus, global_batch, seq_len, micro_batch=None):
    """The validated inputs of one planning call (a seq_len of 0 is a mistake, not "the model's")."""
    job = Job(inputs.count(gpus, "--gpus", 1, inputs.MAX_GPUS),
              inputs.count(global_batch, "--global-batch", 1, inputs.MAX_GLOBAL_BATCH),
              1 if seq_len is None else inputs.count(seq_len, "--seq-len", 1, inputs.MAX_SEQ_LEN))
    if micro_batch is not None:
        inputs.count(micro_batch, "--micro-batch", 1, inputs.MAX_GLOBAL_BATCH)
    m = load_model(model)
    p = load_profile(machine)
    if seq_len is None:
        job = Job(job.gpus, job.global_batch, m.seq_len)
    return m, p, job.validate()


def rank(model: str | ModelSpec, machine: str | MachineProfile, gpus: int, global_batch: int,
         seq_len: int | None = None, top: int | None = None, include_infeasible: bool = False, order: str = "all",
         micro_batch: int | None = None, overlap: bool = True, checkpointing: str = "both",
         blas_tuning: bool | None = None, max_micro_batch: int = 64, execution: str | Execution | None = None,
         pp="all", vpp: int | None = None, schedule: str = "all") -> pd.DataFrame:
    """Every candidate configuration, fastest feasible first (columns: COLUMNS).

    top: keep only the best `top` feasible rows. include_infeasible: append every infeasible
    candidate with its reason. execution: how the framework runs the step (execution.py; the bundled
    trainer by default). pp: pipeline stages, "all" (every degree the execution can run) or one; vpp and
    schedule restrict the pipelines (pipeline.py). order: "all" (every distinct order of x, y, z, the pipeline
    outermost), "every" (the pipelines inside data too) or one of space.PLACEMENTS. Raises UserError when
    nothing is feasible and infeasible rows were not asked for.
    """
    return ranking(model, machine, gpus, global_batch, seq_len=seq_len, top=top,
                   include_infeasible=include_infeasible, order=order, micro_batch=micro_batch, overlap=overlap,
                   checkpointing=checkpointing, blas_tuning=blas_tuning, max_micro_batch=max_micro_batch,
                   execution=execution, pp=pp, vpp=vpp, schedule=schedule).frame()


def ranking(model: str | ModelSpec, machine: str | MachineProfile, gpus: int, global_batch: int,
            seq_len: int | None = None, top: int | None = None, include_infeasible: bool = False, order: str = "all",
            micro_batch: int | None = None, overlap: bool = True, checkpointing: str = "both",
            blas_tuning: bool | None = None, max_micro_batch: int = 64,
            execution: str | Execution | None = None, pp="all", vpp: int | None = None,
            schedule: str = "all") -> Ranking:
    """rank() before the DataFrame: the same rows as numpy columns (see rank for the arguments)."""
    if top is not None and top <= 0:
        raise UserError(f"top must be a positive integer, got {top}")
    m, p, job = _setup(model, machine, gpus, global_batch, seq_len, micro_batch)
    ex = load_execution(execution)
    c = enumerate_space(job.gpus, job.global_batch, order, micro_batch, checkpointing, max_micro_batch,
                        pipelines=_pipelines(ex, job, m, pp, vpp, schedule))
    # a pipelined candidate's walk only where it can be among the best listed (the others keep its lower bound)
    ev = evaluate(m, p, job, c, overlap=overlap, blas_tuning=blas_tuning, execution=ex, top=top or WALKED_BY_DEFAULT,
                  bound_infeasible=include_infeasible)
    feas = np.nonzero(ev.feasible)[0]
    if len(feas) == 0 and not include_infeasible:
        raise _nothing_feasible(ev, c, m, p, job)
    t = ev.batch_time[feas]
    if top is not None and top < len(feas):
        part = np.argpartition(t, top - 1)[:top]
        feas = feas[part]
        t = ev.batch_time[feas]
    feas = feas[np.argsort(t, kind="stable")]
    idx = feas
    if include_infeasible:
        inf = np.nonzero(~ev.feasible)[0]
        idx = np.concatenate([feas, inf[np.argsort(ev.batch_time[inf], kind="stable")]])
    unc = expected_error(p, ex.name, job.gpus)
    return Ranking(_columns(ev, c, idx, p, unc), m, p, job, candidates=len(c), feasible=int(ev.feasible.sum()),
                   extrapolated_gemms=int(ev.extrapolated[feas].sum()), execution=ex, uncertainty=unc)


def _pipelines(ex: Execution, job: Job, model: ModelSpec, pp, vpp, schedule) -> list:
    """The (pp, vpp, schedule) the execution can run: "all" gives only pp 1 where it runs no pipeline."""
    if pp == "all" and not ex.pipeline_schedules:
        return [(1, 1, 0)]
    choices = pipeline_choices(job.gpus, model.n_layers, pp, vpp, schedule, uneven=not ex.pipeline_even_split)
    runs = [ch for ch in choices if ch[0] == 1 or SCHEDULES[ch[2]] in ex.pipeline_schedules]
    if not runs:
        raise UserError(f"execution '{ex.name}' runs no pipeline"
                        + (f" with the {schedule} schedule" if ex.pipeline_schedules else "")
                        + (f"; its schedules: {', '.join(ex.pipeline_schedules)}" if ex.pipeline_schedules else
                           "; choose --pp 1 or an execution that pipelines (axoplan, megatron-core, megatron-lm, torchtitan)"))
    return runs


def _stage_rows(st, sched, one: Candidates, n_layers: int, ckpt: bool) -> list[dict]:
    """explain's windows table for a pipeline: one row per virtual stage and pass, one micro-batch's seconds."""
    npp, nv = int(one.pp[0]), int(one.vpp[0])
    blocks = stage_blocks(n_layers, npp, nv)
    ga = int(np.ravel(sched.grad_acc)[0])
    rows = []
    for v, n in enumerate(blocks):
        kind = "first" if v == 0 else ("last" if v == len(blocks) - 1 else "middle")
        for name in ("forward", "backward_recompute" if ckpt else "backward"):
            parts = st.stage_seconds[kind, name]
            t = float(np.ravel(parts["prefix"] + parts["block"] * (n - 1) + parts["last"] + parts["suffix"])[0])
            comp = float(np.ravel(sched.forward.stage(v == 0, v == len(blocks) - 1).total(n, Window.compute_s)
                                  if name == "forward" else
                                  sched.passes(ckpt)[1].stage(v == 0, v == len(blocks) - 1).total(n, Window.compute_s)
                                  )[0])
            rows.append({"pass": name.split("_")[0], "layer": f"stage {v} (rank {v % npp}, {n} block{'s' if n != 1 else ''})",
                         "count_per_micro_batch": 1, "compute_s": comp * ga, "window_s": t * ga,
                         "exposed_comm_s": max(t - comp, 0.0) * ga})
    return rows


@dataclass
class Explanation:
    summary: pd.DataFrame  # one row, the rank columns
    collectives: pd.DataFrame  # per layer and collective: group, bytes, bandwidth, time per call, calls, total
    windows: pd.DataFrame  # per layer window: compute, window time, exposed communication
    memory: pd.DataFrame  # per memory kind, GiB
    notes: list
    execution: Execution = AXOPLAN  # how the framework runs the step
    detail: dict | None = None  # the evaluation's schedule and timing and the candidate (dryrun's per-stage view)
    uncertainty: Uncertainty | None = None  # the expected error of its time (planner/uncertainty.py)


def _pipeline_mistake(model: ModelSpec, global_batch: int, c: Candidates) -> str | None:
    """The pipeline rule that every candidate breaks, as a sentence for the first candidate that breaks it, or
    None where some candidate keeps every pipeline rule. Only candidates whose micro-batch divides the batch count:
    a micro-batch that does not is the row's own reason (its 'micro-batches per step' would be a remainder)."""
    divides = global_batch % (c.gdata * c.gz * c.micro_batch) == 0
    if not divides.any():
        return None
    c = c.take(np.nonzero(divides)[0])
    masks = pipeline_masks(model, global_batch, c)
    if not np.logical_or.reduce([mk for mk, _ in masks]).all():
        return None
    for mask, template in masks:
        if mask.any():
            i = int(np.argmax(mask))
            return template.format(pp=int(c.pp[i]), vpp=int(c.vpp[i]),
                                   m=int(micro_batches(global_batch, c.take(np.array([i])))[0]))
    return None


def explain(model: str | ModelSpec, machine: str | MachineProfile, gpus: int, global_batch: int,
            grid: tuple[int, int, int, int], order: str = "xyz", seq_len: int | None = None,
            micro_batch: int | None = None, checkpointing: bool | None = None, overlap: bool = True,
            blas_tuning: bool | None = None, execution: str | Execution | None = None, pp: int = 1,
            vpp: int | None = None, schedule: str | None = None) -> Explanation:
    """Where the time and memory of one configuration go. Unset micro-batch or checkpointing: the
    fastest feasible choice for this grid and order; where none fits, the runnable one needing the least memory
    (shown as not feasible, with its memory). pp > 1: the grid is each stage's (gx*gy*gz*gdata*pp =
    gpus), schedule by default interleaved-1f1b where vpp > 1, else 1f1b; "all": the fastest feasible schedule
    and vpp the execution runs."""
    import pandas as pd

    m, p, job = _setup(model, machine, gpus, global_batch, seq_len, micro_batch)
    ex = load_execution(execution)
    if (why := placement_error(order, pp, "--order", "--pp")) is not None:
        raise UserError(why)
    ck = "both" if checkpointing is None else ("on" if checkpointing else "off")
    sched_name = schedule or ("interleaved-1f1b" if vpp is not None and vpp > 1 else "1f1b")
    # schedule "all": the fastest feasible of the schedules (and virtual stages) the execution runs at this pp
    pipes = _pipelines(ex, job, m, pp, vpp, sched_name) if pp != 1 or vpp not in (None, 1) else [(1, 1, 0)]
    c = enumerate_space(job.gpus, job.global_batch, order, micro_batch, ck, grid=tuple(grid), pipelines=pipes)
    ev = evaluate(m, p, job, c, overlap=overlap, blas_tuning=blas_tuning, execution=ex)
    cand = np.nonzero(ev.feasible)[0]
    if pp > 1 and not len(cand):
        # a pipeline rule every candidate breaks (too few micro-batches, more virtual stages than blocks) is the
        # user's mistake, not a configuration to explain, even where a micro-batch also fails to divide first
        if (why := _pipeline_mistake(m, job.global_batch, c)) is not None:
            raise UserError(f"--pp {pp}: {why}")
    if len(cand):
        best = cand[np.argmin(ev.batch_time[cand])]
    elif len(lean := np.nonzero(np.asarray(ev.reason_code) == ev.reasons.index(MEMORY_REASON))[0]):
        # nothing fits: the shape-valid choice closest to fitting (its memory the reason), not a micro-batch or
        # schedule the job cannot run at all
        best = lean[np.argmin(np.broadcast_to(ev.memory.total, np.shape(ev.batch_time))[lean])]
    else:
        best = int(np.argmin(ev.batch_time))
    one = c.take(np.array([best]))
    ev1 = evaluate(m, p, job, one, overlap=overlap, blas_tuning=blas_tuning, explain=True, execution=ex)
    unc = expected_error(p, ex.name, job.gpus)
    summary = _frame(_columns(ev1, one, np.array([0]), p, unc))
    d = ev1.detail
    sched, st = d["schedule"], d["time"]
    ga = int(np.ravel(sched.grad_acc)[0])
    ckpt = bool(one.checkpointing[0])
    g = sched.groups
    pipelined = bool(one.pp[0] > 1)
    critical = int(np.ravel(st.critical_rank)[0]) if pipelined else 0
    if pipelined:  # which of its boundaries cross nodes, and one transfer inside a node and across
        npp, stride_p = int(one.pp[0]), int(np.ravel(g.stride["p"])[0])
        crosses = comm.boundary_crosses(p.gpus_per_node, np.array([stride_p]), npp, np.array([job.gpus]))[:, 0]
        near, far = float(np.ravel(sched.p2p_near)[0]), float(np.ravel(sched.p2p_far)[0])

    # every collective of the step, from the schedule the batch time was computed on; with a pipeline those
    # of its slowest rank (whose end is the batch time): its virtual stages' windows, its gradient reduction
    # and its point-to-point transfers
    listed = (stage_timing.rank_collective_rows(p, sched, m, one, ex, job.seq_len, 0, ckpt, critical) if pipelined
              else sched.collective_rows(0, ckpt))
    rows = [{"layer": cl.layer, "phase": cl.phase, "collective": cl.kind, "axis": cl.axis,
             "group_size": int(np.ravel(g.size[cl.axis])[0]), "stride": int(np.ravel(g.stride[cl.axis])[0]),
             "bytes": float(np.ravel(cl.nbytes)[0]), "busbw_gbs": float(np.ravel(g.bw(cl.axis, cl.kind))[0]) / 1e9,
             "time_per_call_s": float(np.ravel(cl.seconds)[0]), "calls_per_step": calls,
             "total_s": float(np.ravel(cl.seconds)[0]) * calls}
            for cl, calls in listed]
    if pipelined:  # each micro-batch's send and receive at every virtual stage (the walk's transfers)
        sends = stage_timing.transfers_per_step(ga, int(one.vpp[0]))
        # the listed rank's mean transfer over its boundaries (inside a node or across), as its comm_s has it
        per_boundary = np.where(crosses, far, near)[:, None]
        sec = float(stage_timing.rank_transfer_seconds(per_boundary, int(one.vpp[0]))[critical, 0])
        nb_p2p = float(np.ravel(sched.p2p_bytes)[0])
        rows.append({"layer": "pipeline", "phase": "fwd+bwd", "collective": "send/recv", "axis": "p",
                     "group_size": 2, "stride": stride_p,
                     # nccl-tests' sendrecv convention: a transfer's bus bandwidth is its bytes over its time
                     "bytes": nb_p2p, "busbw_gbs": nb_p2p / sec / 1e9,
                     "time_per_call_s": sec, "calls_per_step": sends, "total_s": sec * sends})
    colls = pd.DataFrame(rows, columns=["layer", "phase", "collective", "axis", "group_size", "stride", "bytes",
                                        "busbw_gbs", "time_per_call_s", "calls_per_step", "total_s"])

    wrows = []
    if pipelined:
        wrows = _stage_rows(st, sched, one, m.n_layers, ckpt)
    else:
        for pass_name, rec in (("forward", st.records["forward"]),
                               ("backward", st.records["backward_recompute" if ckpt else "backward"])):
            for w, t, count in rec:
                comp = float(np.ravel(w.compute)[0]) * count
                total = float(np.ravel(t)[0]) * ga
                wrows.append({"pass": pass_name, "layer": w.name, "count_per_micro_batch": count, "compute_s": comp * ga,
                              "window_s": total, "exposed_comm_s": max(total - comp * ga, 0.0)})
    windows = pd.DataFrame(wrows)
    mem = ev1.memory
    where = mem.where(0)
    memory = pd.DataFrame({"kind": [KIND_NAMES[k] for k in MEMORY_KINDS] + ["total (peak)", "available (capacity - headroom)"],
                           "gib": [float(getattr(mem, k)[0]) / GIB for k in MEMORY_KINDS]
                           + [float(mem.total[0]) / GIB, ev1.memory_limit / GIB]})
    memory.attrs["peak_at"] = where
    if pipelined:
        npp = int(one.pp[0])
        mrank = int(np.ravel(ev1.memory_rank)[0])
        step_notes = [f"pipeline: {npp} stages, {SCHEDULES[int(one.schedule[0])]}, vpp={int(one.vpp[0])}, "
                      f"{ga} micro-batches per step; blocks per virtual stage "
                      f"{', '.join(map(str, stage_blocks(m.n_layers, npp, int(one.vpp[0]))))}",
                      f"the slowest pipeline rank is {critical}: it waits "
                      f"{float(np.ravel(st.bubble)[0]):.4g} s for its inputs (bubble)",
                      f"memory: the job's is pipeline rank {mrank}'s ({'last' if mrank else 'first'} stage); "
                      f"collectives listed: pipeline rank {critical}'s (its stages' windows, its gradient "
                      f"reduction and its transfers)"]
        placed = PLACEMENTS[int(one.order[0])]
        walked = crosses if int(one.vpp[0]) > 1 else crosses[:-1]  # the wrap only where stages interleave
        k = int(walked.sum())
        step_notes.append(f"ranks placed {layout(placed)} (innermost first): the pipeline axis "
                          + ("outermost" if "p" not in placed else "inside data") + ", neighbouring stages "
                          f"{stride_p} rank{'s' * (stride_p != 1)} apart; {k} of its {len(walked)} stage boundaries "
                          f"cross{'es' * (k == 1)} nodes ({near:.3g} s a transfer inside a node, {far:.3g} s across)")
    else:
        step_notes = [(f"data-parallel gradients and replicated parameters: {float(np.ravel(st.data_parallel)[0]):.4g} "
                       f"s per step exposed; optimizer: {float(np.ravel(sched.optimizer)[0]):.4g} s")]
    notes = [f"memory peaks at: {where}",
             f"grad_acc={ga} micro-batches of {int(one.micro_batch[0])} sequences per GPU per step",
             *step_notes,
             f"execution: {ex.name} ({ex.source})",
             "GEMM layouts: " + ("best of all layouts and forms (BLAS tuning)" if (p.blas_tuning if blas_tuning is None
                                                                                 else blas_tuning) else "as written (NN, NT, TN)")]
    if bool(ev1.extrapolated[0]):
        notes.append("some GEMM shapes fall outside the profile's measured table: their time is extrapolated")
    if p.gemm_table is None and p.gemm_sustained < 1.0:
        notes.append(f"GEMMs at the rate the GPU holds at its power limit under load: a ceiling of "
                     f"{p.gemm_ceiling / 1e12:.4g} TFLOP/s, {p.gemm_sustained:g} of its burst "
                     f"{p.gemm_ceiling / p.gemm_sustained / 1e12:.4g} (compute.gemm.sustained_fraction)")
    if off := unaligned_dims(p, m, int(one.gx[0]), int(one.gy[0]), int(one.micro_batch[0]) * job.seq_len,
                             ex.attention == "unfused"):
        notes.append("GEMM dimensions that are not a whole number of 16-byte vectors ("
                     + ", ".join(f"{name} {d:g}" for name, d in off) + f"): those GEMMs run at most "
                     f"{p.gemm_unaligned / 1e12:.3g} TFLOP/s (compute.gemm.unaligned_tflops)")
    if not bool(ev1.feasible[0]):
        notes.append("this configuration is NOT feasible: " + summary["reason"][0])
    return Explanation(summary, colls, windows, memory, notes, ex, {**d, "candidate": one, "model": m, "profile": p,
                                                                 "seq_len": job.seq_len}, unc)
