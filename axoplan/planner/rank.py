"""rank() and explain(): the public API behind `axoplan rank` and `axoplan explain`."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from axoplan import inputs
from axoplan.planner.batch import Evaluation, evaluate
from axoplan.planner.execution import AXOPLAN, Execution, load_execution
from axoplan.planner.memory import KIND_NAMES
from axoplan.planner.memory import KINDS as MEMORY_KINDS
from axoplan.errors import UserError
from axoplan.planner.machine import GIB, MachineProfile, load_profile
from axoplan.planner.space import ORDERS, Candidates, enumerate_space
from axoplan.planner.specs import Job, ModelSpec, load_model
from axoplan.planner.uncertainty import Uncertainty, expected_error, tied

if TYPE_CHECKING:  # pandas is imported where a DataFrame is built: `axoplan rank` prints without it
    import pandas as pd

COLUMNS = ["rank", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s", "compute_s",
           "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak", "feasible", "reason",
           # added after the fixed ones: within the expected error of the best (the evidence cannot order
           # them), and that error (planner/uncertainty.py)
           "tied", "expected_error"]


def _reasons(ev: Evaluation, c: Candidates, idx: np.ndarray) -> list[str]:
    out = []
    mem = ev.memory.total
    for i in idx:
        code = ev.reason_code[i]
        if code < 0:
            out.append("")
            continue
        out.append(ev.reasons[code].format(gx=c.gx[i], gy=c.gy[i], gz=c.gz[i], gdata=c.gdata[i],
                                           micro_batch=c.micro_batch[i], mem=mem[i] / GIB, limit=ev.memory_limit / GIB))
    return out


def _columns(ev: Evaluation, c: Candidates, idx: np.ndarray, profile: MachineProfile,
             unc: Uncertainty | None = None) -> dict:
    """The rows `idx` as numpy columns, COLUMNS in order; `rank` counts rows from 1 and means
    nothing where `feasible` is false (the DataFrame holds NA there)."""
    tflops = ev.flops_per_gpu[idx] / ev.batch_time[idx] / 1e12
    err = unc.expected_error if unc is not None else None
    return {
        "rank": np.arange(1, len(idx) + 1),
        "gx": c.gx[idx], "gy": c.gy[idx], "gz": c.gz[idx], "gdata": c.gdata[idx],
        "order": np.array(ORDERS)[c.order[idx]], "micro_batch": c.micro_batch[idx],
        "checkpointing": c.checkpointing[idx], "batch_time_s": ev.batch_time[idx], "compute_s": ev.compute[idx],
        "comm_s": ev.comm[idx], "exposed_comm_s": ev.exposed_comm[idx], "memory_gib": ev.memory.total[idx] / GIB,
        "tflops_per_gpu": tflops, "pct_of_peak": 100 * tflops * 1e12 / profile.peak_flops,
        "feasible": ev.feasible[idx], "reason": _reasons(ev, c, idx),
        "tied": tied(ev.batch_time[idx], ev.feasible[idx], err),
        "expected_error": np.full(len(idx), np.nan if err is None else err),
    }


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
         blas_tuning: bool | None = None, max_micro_batch: int = 64, execution: str | Execution | None = None
         ) -> pd.DataFrame:
    """Every candidate configuration, fastest feasible first (columns: COLUMNS).

    top: keep only the best `top` feasible rows. include_infeasible: append every infeasible
    candidate with its reason. execution: how the framework runs the step (execution.py; the bundled
    trainer by default). Raises UserError when nothing is feasible and infeasible rows were not asked for.
    """
    return ranking(model, machine, gpus, global_batch, seq_len=seq_len, top=top,
                   include_infeasible=include_infeasible, order=order, micro_batch=micro_batch, overlap=overlap,
                   checkpointing=checkpointing, blas_tuning=blas_tuning, max_micro_batch=max_micro_batch,
                   execution=execution).frame()


def ranking(model: str | ModelSpec, machine: str | MachineProfile, gpus: int, global_batch: int,
            seq_len: int | None = None, top: int | None = None, include_infeasible: bool = False, order: str = "all",
            micro_batch: int | None = None, overlap: bool = True, checkpointing: str = "both",
            blas_tuning: bool | None = None, max_micro_batch: int = 64,
            execution: str | Execution | None = None) -> Ranking:
    """rank() before the DataFrame: the same rows as numpy columns (see rank for the arguments)."""
    if top is not None and top <= 0:
        raise UserError(f"top must be a positive integer, got {top}")
    m, p, job = _setup(model, machine, gpus, global_batch, seq_len, micro_batch)
    ex = load_execution(execution)
    c = enumerate_space(job.gpus, job.global_batch, order, micro_batch, checkpointing, max_micro_batch)
    ev = evaluate(m, p, job, c, overlap=overlap, blas_tuning=blas_tuning, execution=ex)
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


@dataclass
class Explanation:
    summary: pd.DataFrame  # one row, the rank columns
    collectives: pd.DataFrame  # per layer and collective: group, bytes, bandwidth, time per call, calls, total
    windows: pd.DataFrame  # per layer window: compute, window time, exposed communication
    memory: pd.DataFrame  # per memory kind, GiB
    notes: list
    execution: Execution = AXOPLAN  # how the framework runs the step
    uncertainty: Uncertainty | None = None  # the expected error of its time (planner/uncertainty.py)


def explain(model: str | ModelSpec, machine: str | MachineProfile, gpus: int, global_batch: int,
            grid: tuple[int, int, int, int], order: str = "xyz", seq_len: int | None = None,
            micro_batch: int | None = None, checkpointing: bool | None = None, overlap: bool = True,
            blas_tuning: bool | None = None, execution: str | Execution | None = None) -> Explanation:
    """Where the time and memory of one configuration go. Unset micro-batch or checkpointing: the
    fastest feasible choice for this grid and order."""
    import pandas as pd

    m, p, job = _setup(model, machine, gpus, global_batch, seq_len, micro_batch)
    ex = load_execution(execution)
    ck = "both" if checkpointing is None else ("on" if checkpointing else "off")
    c = enumerate_space(job.gpus, job.global_batch, order, micro_batch, ck, grid=tuple(grid))
    ev = evaluate(m, p, job, c, overlap=overlap, blas_tuning=blas_tuning, execution=ex)
    cand = np.nonzero(ev.feasible)[0]
    pool = cand if len(cand) else np.arange(len(c))
    best = pool[np.argmin(ev.batch_time[pool])]
    one = c.take(np.array([best]))
    ev1 = evaluate(m, p, job, one, overlap=overlap, blas_tuning=blas_tuning, explain=True, execution=ex)
    unc = expected_error(p, ex.name, job.gpus)
    summary = _frame(_columns(ev1, one, np.array([0]), p, unc))
    d = ev1.detail
    sched, st = d["schedule"], d["time"]
    ga = int(np.ravel(sched.grad_acc)[0])
    ckpt = bool(one.checkpointing[0])
    g = sched.groups

    # every collective of the step, from the schedule the batch time was computed on
    rows = [{"layer": cl.layer, "phase": cl.phase, "collective": cl.kind, "axis": cl.axis,
             "group_size": int(np.ravel(g.size[cl.axis])[0]), "stride": int(np.ravel(g.stride[cl.axis])[0]),
             "bytes": float(np.ravel(cl.nbytes)[0]), "busbw_gbs": float(np.ravel(g.busbw[cl.axis])[0]) / 1e9,
             "time_per_call_s": float(np.ravel(cl.seconds)[0]), "calls_per_step": calls,
             "total_s": float(np.ravel(cl.seconds)[0]) * calls}
            for cl, calls in sched.collective_rows(0, ckpt)]
    colls = pd.DataFrame(rows, columns=["layer", "phase", "collective", "axis", "group_size", "stride", "bytes",
                                        "busbw_gbs", "time_per_call_s", "calls_per_step", "total_s"])

    wrows = []
    for pass_name, rec in (("forward", st.records["forward"]),
                           ("backward", st.records["backward_recompute" if ckpt else "backward"])):
        for w, t, count in rec:
            comp = float(np.ravel(w.compute)[0]) * count
            total = float(np.ravel(t)[0]) * ga
            wrows.append({"pass": pass_name, "layer": w.name, "count_per_micro_batch": count,
                          "compute_s": comp * ga, "window_s": total, "exposed_comm_s": max(total - comp * ga, 0.0)})
    windows = pd.DataFrame(wrows)
    mem = ev1.memory
    where = mem.where(0)
    memory = pd.DataFrame({"kind": [KIND_NAMES[k] for k in MEMORY_KINDS] + ["total (peak)", "available (capacity - headroom)"],
                           "gib": [float(getattr(mem, k)[0]) / GIB for k in MEMORY_KINDS]
                           + [float(mem.total[0]) / GIB, ev1.memory_limit / GIB]})
    memory.attrs["peak_at"] = where
    notes = [f"memory peaks at: {where}",
             f"grad_acc={ga} micro-batches of {int(one.micro_batch[0])} sequences per GPU per step",
             (f"data-parallel gradients and replicated parameters: {float(np.ravel(st.data_parallel)[0]):.4g} "
              f"s per step exposed; optimizer: {float(np.ravel(sched.optimizer)[0]):.4g} s"),
             f"execution: {ex.name} ({ex.source})",
             "GEMM layouts: " + ("best of all layouts and forms (BLAS tuning)" if (p.blas_tuning if blas_tuning is None
                                                                                 else blas_tuning) else "as written (NN, NT, TN)")]
    if bool(ev1.extrapolated[0]):
        notes.append("some GEMM shapes fall outside the profile's measured table: their time is extrapolated")
    if not bool(ev1.feasible[0]):
        notes.append("this configuration is NOT feasible: " + summary["reason"][0])
    return Explanation(summary, colls, windows, memory, notes, ex, unc)
