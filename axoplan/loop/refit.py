"""`axoplan refit`: fit a few of the profile's documented corrections (machine.Corrections) to measured
runs, by re-evaluating the planner on the measured configurations with candidate corrections.

The fit is least squares on log(predicted / measured), so every run counts by its relative error,
over bounded parameters: the multiplicative scales in log space (1/20 .. 20), the fixed overheads
in seconds (0 .. the fastest measured step), the overlap efficiency in 0 .. 1. Which corrections are
fitted ("auto"): among those the measured runs can tell apart (choose_params), the subset the
Bayesian information criterion prefers (select_params); the leave-one-out error, never used to
choose, then says honestly how well the fit generalises. The result is a NEW
profile whose `corrections` section names the refit; the old profile is never touched.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from axoplan import progress
from axoplan.errors import UserError
from axoplan.loop.launch import pipeline_of
from axoplan.planner.pipeline import SCHEDULES
from axoplan.planner.space import PLACEMENTS
from axoplan.planner.machine import Corrections, MachineProfile
from axoplan.planner.profile_reader import load_profile

SCALE_PARAMS = ("gemm_scale", "elementwise_scale", "intra_bw_scale", "inter_bw_scale", "latency_scale",
                "kernel_overhead_scale")
ADD_PARAMS = ("step_overhead_s", "collective_overhead_s")
UNIT_PARAMS = ("overlap_efficiency",)  # shares, bounded to [0, 1]
PARAMS = SCALE_PARAMS + ADD_PARAMS + UNIT_PARAMS
DOC = {
    "gemm_scale": "multiplies GEMM and attention throughput",
    "elementwise_scale": "multiplies element-wise (memory-bound) bandwidth",
    "intra_bw_scale": "multiplies intra-node collective bandwidth",
    "inter_bw_scale": "multiplies inter-node collective bandwidth",
    "latency_scale": "multiplies per-ring-step collective latency",
    "step_overhead_s": "fixed seconds added to every step (Python, optimizer launch, barriers)",
    "kernel_overhead_scale": "multiplies the per-kernel launch cost",
    "collective_overhead_s": "seconds added to every collective call waited for as it is issued (dispatch, ranks "
                             "arriving late), a pair's: a group of p waits for the last of p, 2 (H_p - 1) times "
                             "it; not to the Z gathers and reduce-scatters issued ahead",
    "overlap_efficiency": "share of a background collective that hides behind the trainer's compute",
}
LOG_BOUND = np.log(20.0)


@dataclass
class RunSet:
    """Measured runs grouped by job, each group evaluated in one vectorised call."""

    groups: list  # (ModelSpec, Job, Candidates, positions into `measured`, Execution the runs ran)
    measured: np.ndarray
    labels: list
    # a subset's runs as positions in the set it was taken from (root), which predicts them all at once
    root: RunSet | None = field(default=None, repr=False, compare=False)
    at: np.ndarray | None = field(default=None, repr=False, compare=False)
    # (corrections) -> (profile, predicted times of every run): a fit and its leave-one-out fits start from
    # the same corrections and take the same finite-difference steps, so most of their predictions repeat
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.measured)

    def subset(self, keep: np.ndarray) -> RunSet:
        keep = np.asarray(keep)
        pos = np.nonzero(keep)[0] if keep.dtype == bool else keep
        remap = -np.ones(len(self.measured), dtype=np.int64)
        remap[pos] = np.arange(len(pos))
        groups = []
        for m, job, c, idx, ex in self.groups:
            sel = np.nonzero(remap[idx] >= 0)[0]
            if len(sel):
                groups.append((m, job, c.take(sel), remap[idx[sel]], ex))
        root = self.root if self.root is not None else self
        at = self.at[pos] if self.at is not None else pos
        return RunSet(groups, self.measured[pos], [self.labels[i] for i in pos], root, at)


def runs_from_results(df: pd.DataFrame, where: str = "results") -> RunSet:
    """The runs of a validate results table that finished ok, as planner candidates."""
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job, load_model

    need = {"model", "gpus", "global_batch", "seq_len", "gx", "gy", "gz", "gdata", "order", "micro_batch",
            "checkpointing", "measured_time_s", "status"}
    missing = sorted(need - set(df.columns))
    if missing:
        raise UserError(f"{where} lacks column(s) {', '.join(missing)} (write it with `axoplan validate`)")
    ok = df[df["status"] == "ok"].reset_index(drop=True)
    if len(ok) == 0:
        raise UserError(f"{where} has no run that finished ok: nothing to fit")
    seqs = _check_rows(ok, where)
    _check_runnable(ok, seqs, where)
    # a framework's run (emit --framework, read back) is predicted with the execution it ran
    execs = [execution_of(v) for v in (ok["execution"] if "execution" in ok else [None] * len(ok))]
    groups = []
    key = pd.Series([f"{m}\0{int(g)}\0{int(b)}\0{s}\0{e.name}\0{e.source}" for m, g, b, s, e in
                     zip(ok["model"], ok["gpus"], ok["global_batch"], seqs, execs)], index=ok.index)
    for _, g in ok.groupby(key, sort=False):
        first = g.iloc[0]
        m = load_model(str(first["model"]))
        seq = seqs[g.index[0]]
        job = Job(int(first["gpus"]), int(first["global_batch"]), seq or m.seq_len).validate()
        order_idx = np.array([PLACEMENTS.index(o) for o in g["order"]], dtype=np.int8)
        pipes = [pipeline_of(r) for _, r in g.iterrows()]  # older results (no pipeline columns): pp 1
        c = Candidates(*(g[k].to_numpy(np.int64) for k in ("gx", "gy", "gz", "gdata")), order_idx,
                       g["micro_batch"].to_numpy(np.int64), g["checkpointing"].to_numpy(bool),
                       np.array([p[0] for p in pipes], dtype=np.int64), np.array([p[1] for p in pipes], dtype=np.int64),
                       np.array([SCHEDULES.index(p[2]) for p in pipes], dtype=np.int8))
        groups.append((m, job, c, g.index.to_numpy(), execs[g.index[0]]))
    labels = list(ok["candidate"]) if "candidate" in ok else [str(i) for i in range(len(ok))]
    return RunSet(groups, ok["measured_time_s"].to_numpy(float), labels)


def execution_of(value):
    """A results row's execution: empty (the bundled trainer's), a preset name, or the JSON of its fields."""
    import json

    from axoplan.planner.execution import AXOPLAN, Execution, load_execution

    if value is None or (isinstance(value, float) and value != value) or str(value).strip() == "":
        return AXOPLAN
    s = str(value).strip()
    if s.startswith("{"):
        try:
            return load_execution(Execution(**json.loads(s)))
        except (TypeError, ValueError) as e:
            raise UserError(f"a results row's execution is not a set of execution fields: {e}") from None
    return load_execution(s)


def _check_rows(ok: pd.DataFrame, where: str) -> list:
    """Every ok row must describe a run the planner can evaluate: whole positive counts within the
    planner's bounds, a grid that multiplies to its GPU count, a finite positive measured time.
    A row that does not is refused (never silently fitted or dropped). Returns the rows' seq_len (None: the model's)."""
    from axoplan import inputs

    seqs = []
    for i, r in ok.iterrows():
        label = f"{where}, run {r.get('candidate', i)}"
        try:
            gpus = inputs.count(_num(r["gpus"]), "gpus", 1, inputs.MAX_GPUS)
            inputs.count(_num(r["global_batch"]), "global_batch", 1, inputs.MAX_GLOBAL_BATCH)
            grid = [inputs.count(_num(r[k]), k, 1, inputs.MAX_GPUS) for k in ("gx", "gy", "gz", "gdata")]
            inputs.count(_num(r["micro_batch"]), "micro_batch", 1, inputs.MAX_GLOBAL_BATCH)
            t = _num(r["measured_time_s"])
            if isinstance(t, float) and not np.isfinite(t):  # read_results keeps only positive finite times
                raw = r.get("measured_time_text", "")
                raise UserError(f"measured_time_s must be a positive number of seconds, got "
                                f"{inputs.show(raw) if raw else 'nothing'}")
            inputs.number(t, "measured_time_s", lo=0, hi=MAX_BATCH_S, lo_open=True)
            ck = str(r["checkpointing_text"] if "checkpointing_text" in r else r["checkpointing"]).strip().lower()
            if ck not in ("true", "false", "1", "0"):
                raise UserError(f"checkpointing must be true or false, got {inputs.show(ck)}")
            seq = r["seq_len"]
            seqs.append(None if pd.isna(seq) or str(seq).strip() == "" else
                        inputs.count(_num(seq), "seq_len", 1, inputs.MAX_SEQ_LEN))
        except UserError as e:
            raise UserError(f"{label}: {e}") from None
        try:
            pp, vpp, schedule = pipeline_of(r)
        except ValueError:
            raise UserError(f"{label}: pp and vpp must be whole numbers, got {r.get('pp')!r} and {r.get('vpp')!r}") from None
        if pp < 1 or vpp < 1 or schedule not in SCHEDULES:
            raise UserError(f"{label}: pp={pp}, vpp={vpp}, schedule {schedule!r} is not a pipeline axoplan plans")
        if int(np.prod(grid)) * pp != gpus:
            raise UserError(f"{label}: the grid {'x'.join(map(str, grid))}{f' x pp {pp}' if pp > 1 else ''} "
                            f"multiplies to {int(np.prod(grid)) * pp}, not its gpus {gpus}")
        if r["order"] not in PLACEMENTS:
            raise UserError(f"{label}: unknown placement order {r['order']!r}")
    return seqs


# a batch measured at more than this is a unit mistake (or 1e308): about 115 days
MAX_BATCH_S = 1e7


def _check_runnable(ok: pd.DataFrame, seqs: list, where: str) -> None:
    """Every ok row describes a run its own trainer could have made: the planner's divisibility rules
    (a micro-batch that does not divide its batch was never measured as written)."""
    from axoplan.planner.space import grid_problem
    from axoplan.planner.specs import load_model

    for (i, r), seq in zip(ok.iterrows(), seqs):
        m = load_model(str(r["model"]))
        why = grid_problem(m, int(r["gx"]), int(r["gy"]), int(r["gz"]), int(r["gdata"]), int(r["global_batch"]),
                           int(r["micro_batch"]), seq or m.seq_len)
        if why:
            raise UserError(f"{where}, run {r.get('candidate', i)}: no run of this layout can exist ({why})")


def check_same_machine(df: pd.DataFrame, profile: MachineProfile, where: str) -> None:
    """The runs were measured on the machine the profile describes: corrections fitted to another
    machine's runs describe neither. Compared by what the profile says the machine is (kind, device,
    GPUs per node), so a refit profile of the same machine qualifies."""
    names = sorted({str(x) for x in df.get("machine", pd.Series(dtype=str)).dropna() if str(x).strip()})
    for name in names:
        try:
            theirs = load_profile(name)
        except UserError:
            continue  # a profile moved since the sweep: nothing to compare against
        a = (theirs.kind, theirs.device, theirs.gpus_per_node)
        b = (profile.kind, profile.device, profile.gpus_per_node)
        if a != b:
            raise UserError(f"{where} was measured on machine '{name}' ({theirs.device}, {theirs.gpus_per_node} per "
                            f"node), not on the {profile.device} machine profile '{profile.name}' describes; fit the "
                            f"profile of the machine the runs were made on")


def _num(v):
    """A table cell as a number for the checks (NaN stays NaN and is refused there)."""
    if isinstance(v, str):
        v = v.strip()
        try:
            return float(v) if v else float("nan")
        except ValueError:
            return v
    return v


def check_results_file(path: str | Path) -> None:
    """Refuse, in one sentence, a results file refit cannot read: unreadable, binary, not UTF-8, or
    without the columns a validate sweep writes."""
    import csv
    import io

    from axoplan.yamlio import read_text

    where = f"results file '{path}'"
    body = read_text(path, where, 256 * 2**20)
    try:
        head = next(csv.reader(io.StringIO(body, newline="")), [])
    except csv.Error:
        head = []
    need = {"candidate", "model", "gpus", "global_batch", "seq_len", "gx", "gy", "gz", "gdata", "order",
            "micro_batch", "checkpointing", "measured_time_s", "status", "wall_s"}
    missing = sorted(need - set(head))
    if missing:
        raise UserError(f"{where} lacks column(s) {', '.join(missing)} (write it with `axoplan validate`)")


def predict(profile: MachineProfile, runs: RunSet, corrections: dict | None = None) -> np.ndarray:
    """Predicted time per batch of every run with the profile's corrections replaced by `corrections`."""
    from axoplan.planner.batch import evaluate

    base = runs.root if runs.root is not None else runs
    key = tuple(sorted((corrections or {}).items()))
    hit = base.memo.get(key)
    if hit is not None and hit[0] is profile:
        out = hit[1]
    else:
        p = profile.with_corrections(**corrections) if corrections else profile
        out = np.empty(len(base.measured))
        for m, job, c, idx, ex in base.groups:
            out[idx] = evaluate(m, p, job, c, execution=ex).batch_time
        if len(base.memo) < PREDICT_MEMO:
            base.memo[key] = (profile, out)
    return (out[runs.at] if runs.at is not None else out).copy()


PREDICT_MEMO = 10_000  # predictions a RunSet keeps (each one float per run)
# the solver's xtol on log corrections: the fit a profile keeps converges onto a bound it presses against; the
# fits that only score a subset or leave one run out stop at a millionth, far below any run's error
FIT_TOL, SCORE_TOL = 1e-8, 1e-6


# ---- parameter vector <-> corrections ---------------------------------------------------------------
def _value(profile: MachineProfile, corr: Corrections, k: str) -> float:
    """A correction's effective value: an unset overlap efficiency is the profile's own."""
    v = getattr(corr, k)
    return profile.overlap_efficiency if v is None else v


def _to_x(profile: MachineProfile, corr: Corrections, params) -> np.ndarray:
    return np.array([np.log(_value(profile, corr, k)) if k in SCALE_PARAMS else _value(profile, corr, k)
                     for k in params], float)


def _to_corr(x: np.ndarray, params) -> dict:
    return {k: float(np.exp(v)) if k in SCALE_PARAMS else float(v) for k, v in zip(params, x)}


def _bounds(params, runs: RunSet):
    lo, hi = [], []
    for k in params:
        if k in SCALE_PARAMS:
            lo.append(-LOG_BOUND)
            hi.append(LOG_BOUND)
        elif k in UNIT_PARAMS:
            lo.append(0.0)
            hi.append(1.0)
        else:
            lo.append(0.0)
            hi.append(float(runs.measured.min()))
    return np.array(lo), np.array(hi)


def _differences(profile: MachineProfile, runs: RunSet, params, base: np.ndarray,
                 hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One-sided finite differences of log(predicted) at the profile's corrections, x in the fit's
    units: (differences [runs, params], signed steps [params]). A step is 0.05 for a scale (log),
    0.1 for a share, 10% of the median measured step for an overhead, taken downwards where upwards
    would pass hi."""
    x0 = _to_x(profile, profile.corrections, params)
    D = np.empty((len(runs), len(params)))
    steps = np.empty(len(params))
    for j, k in enumerate(params):
        h = 0.05 if k in SCALE_PARAMS else 0.1 if k in UNIT_PARAMS else 0.1 * float(np.median(runs.measured))
        if x0[j] + h > hi[j]:
            h = -h
        x = x0.copy()
        x[j] += h
        D[:, j] = np.log(predict(profile, runs, _to_corr(x, params))) - base
        steps[j] = h
    return D, steps


def sensitivity(profile: MachineProfile, runs: RunSet, params=PARAMS) -> np.ndarray:
    """d log(predicted) per unit of each parameter at the profile's corrections: per e-fold for the
    scales, per (10% of the median measured step) for the overheads, per 0.1 for the shares. [runs, params]."""
    # only a share has a bound the step must respect here: [0, 1]
    hi = np.array([1.0 if k in UNIT_PARAMS else np.inf for k in params])
    D, h = _differences(profile, runs, params, np.log(predict(profile, runs)), hi)
    return D / np.where([k in SCALE_PARAMS for k in params], h, np.sign(h))


def choose_params(profile: MachineProfile, runs: RunSet, candidates=PARAMS, min_effect: float = 0.02) -> list[str]:
    """The corrections these runs can determine: a parameter is kept when changing it moves some run's
    prediction (by >= min_effect in log time per e-fold, per 10% of the median step, per 0.1 of a
    share) AND, after removing what the parameters already kept explain, still varies the runs
    differently (else it is degenerate with them). Most influential first."""
    J = sensitivity(profile, runs, candidates)
    order = np.argsort(-np.abs(J).max(axis=0), kind="stable")
    kept: list[int] = []
    for j in order:
        col = J[:, j]
        if np.abs(col).max() < min_effect:
            continue
        if kept:
            A = J[:, kept]
            resid = col - A @ np.linalg.lstsq(A, col, rcond=None)[0]
            if np.linalg.norm(resid) < 0.1 * np.linalg.norm(col):
                continue
        kept.append(int(j))
    return [candidates[j] for j in kept]


def max_params(n_runs: int) -> int:
    """At most this many corrections are fitted to n runs, so each fitted number rests on >= 3 runs."""
    return max(1, (n_runs - 1) // 3)


def _bic(n: int, rms: float, k: int) -> float:
    return n * np.log(max(rms, 1e-12) ** 2) + k * np.log(n)


def select_params(profile: MachineProfile, runs: RunSet, candidates=PARAMS, screen: int = 12
                  ) -> tuple[list[str], Fit | None]:
    """(subset, its fit; None for the empty set). Best subset by the Bayesian information criterion on the
    log errors, n*log(mean squared log error) + k*log(n), among the corrections these runs can determine (choose_params), at most
    max_params of them. Every subset is scored first by its linearised fit (the planner's Jacobian at
    the profile, bounded least squares: cheap), the `screen` best and the empty set then by a real fit.
    Corrections that only help together (one moves the runs one way, another corrects what it
    overshoots) are found, which forward selection misses. The leave-one-out error is not used here,
    so it stays an honest estimate for the set chosen."""
    from itertools import combinations

    from scipy.optimize import lsq_linear

    pool = choose_params(profile, runs, candidates)
    n = len(runs)
    base = np.log(predict(profile, runs))
    r0 = base - np.log(runs.measured)
    empty = _bic(n, float(np.sqrt(np.mean(r0**2))), 0)
    if not pool:
        return [], None
    x0 = _to_x(profile, profile.corrections, pool)
    lo, hi = _bounds(pool, runs)
    D, h = _differences(profile, runs, pool, base, hi)
    J = D / h  # d log(predicted) / dx, x in the fit's own units
    progress.step("choosing the corrections: linearised fits of every subset")
    scored = []
    for k in range(1, min(max_params(n), len(pool)) + 1):
        for sub in combinations(range(len(pool)), k):
            idx = list(sub)
            lo_d, hi_d = lo[idx] - x0[idx], hi[idx] - x0[idx]
            sol = lsq_linear(J[:, idx], -r0, bounds=(np.minimum(lo_d, -1e-12), np.maximum(hi_d, 1e-12)))
            rms = float(np.sqrt(np.mean((r0 + J[:, idx] @ sol.x) ** 2)))
            names = [pool[i] for i in idx]
            scored.append((_bic(n, rms, k), k, names, _to_corr(x0[idx] + sol.x, names)))
    scored.sort(key=lambda t: (t[0], t[1]))
    best, chosen, chosen_fit = empty, [], None
    for i, (_, k, params, linear) in enumerate(scored[:screen]):
        progress.step("choosing the corrections: full fits of the best subsets", i + 1, min(screen, len(scored)))
        f = fit(profile, runs, params, start=linear, tol=SCORE_TOL)  # from the linearised optimum: only refined
        v = _bic(n, f.rms_log_error, k)
        if v < best - 1e-9:
            best, chosen, chosen_fit = v, params, f
    return chosen, chosen_fit


@dataclass
class Fit:
    params: list
    corrections: dict  # fitted values of `params`
    rms_log_error: float
    success: bool
    message: str


def fit(profile: MachineProfile, runs: RunSet, params, start: dict | None = None, tol: float = FIT_TOL) -> Fit:
    """Least squares on log(predicted/measured) over the given corrections, from the profile's values
    (or from `start`, e.g. the full fit when leaving one run out); tol: the solver's xtol (ftol and gtol a
    hundredth of it)."""
    from scipy.optimize import least_squares

    params = list(params)
    if not params:
        r = np.log(predict(profile, runs) / runs.measured)
        return Fit([], {}, float(np.sqrt(np.mean(r**2))), True, "nothing to fit")
    lo, hi = _bounds(params, runs)
    x0 = np.clip(_to_x(profile, dataclasses.replace(profile.corrections, **(start or {})), params), lo, hi)
    logm = np.log(runs.measured)

    def resid(x):
        return np.log(predict(profile, runs, _to_corr(x, params))) - logm

    scale = np.array([1.0 if k in SCALE_PARAMS else 0.1 if k in UNIT_PARAMS else
                      max(float(np.median(runs.measured)), 1e-9) * 0.1 for k in params])
    sol = least_squares(resid, x0, bounds=(lo, hi), x_scale=scale, method="trf", xtol=tol, ftol=tol / 100,
                        gtol=tol / 100, max_nfev=200)
    # the solver stops a hair inside a bound it presses against (an overlap of 4e-26 or 2e-7): the bound is the answer
    edge = 1e-6 * (hi - lo)
    x = np.where(sol.x - lo <= edge, lo, np.where(hi - sol.x <= edge, hi, sol.x))
    return Fit(params, _to_corr(x, params), float(np.sqrt(np.mean(sol.fun**2))), bool(sol.success),
               str(sol.message))


def abs_pct_errors(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return 100.0 * np.abs(pred - meas) / meas


@dataclass
class Report:
    params: list
    before: dict  # corrections of the input profile
    after: dict  # all corrections of the new profile
    n_runs: int
    mape_before: float
    max_ape_before: float
    mape_after: float
    max_ape_after: float
    mape_loo: float | None  # leave-one-out: each run predicted by a fit without it
    max_ape_loo: float | None
    per_run: pd.DataFrame = field(repr=False)
    fit: Fit = field(repr=False)


def refit_profile(profile: MachineProfile, runs: RunSet, params="auto", loo: bool = True,
                  candidates=PARAMS) -> Report:
    """`params` "auto": the best subset of `candidates` (select_params)."""
    chosen_fit = None  # the selection's own fit of the subset it chose: where the fit starts
    if params == "auto":
        progress.step("choosing the corrections: the planner's sensitivities")
        params, chosen_fit = select_params(profile, runs, candidates)
    else:
        params = list(params)
        unknown = [p for p in params if p not in PARAMS]
        if unknown:
            raise UserError(f"unknown correction '{unknown[0]}' (known: {', '.join(PARAMS)})")
    before_pred = predict(profile, runs)
    if not np.all(np.isfinite(before_pred)):
        raise UserError(f"machine profile '{profile.name}' predicts a non-finite time for a measured run; "
                        f"check its numbers")
    progress.step(f"fitting {', '.join(params) or 'nothing'}")
    try:
        f = fit(profile, runs, params, start=chosen_fit.corrections if chosen_fit else None)
    except (np.linalg.LinAlgError, ValueError, FloatingPointError) as e:
        raise UserError(f"the fit of {', '.join(params)} to these runs does not converge with machine profile "
                        f"'{profile.name}' ({' '.join(str(e).split())[:80]}); check the profile's numbers") from None
    after_pred = predict(profile, runs, f.corrections)
    loo_pred = None
    if loo and not params:
        loo_pred = before_pred  # nothing fitted: every run is predicted without itself already
    if loo and len(runs) >= 3 and params:
        loo_pred = np.empty(len(runs))
        for i in range(len(runs)):
            progress.step("leave-one-out fits", i + 1, len(runs))
            keep = np.ones(len(runs), dtype=bool)
            keep[i] = False
            fi = fit(profile, runs.subset(keep), params, start=f.corrections, tol=SCORE_TOL)
            loo_pred[i] = predict(profile, runs.subset(np.array([i])), fi.corrections)[0]
    eb, ea = abs_pct_errors(before_pred, runs.measured), abs_pct_errors(after_pred, runs.measured)
    el = abs_pct_errors(loo_pred, runs.measured) if loo_pred is not None else None
    per = pd.DataFrame({"run": runs.labels, "measured_s": runs.measured, "before_s": before_pred,
                        "after_s": after_pred, "loo_s": loo_pred if loo_pred is not None else np.nan})
    before = {k: _value(profile, profile.corrections, k) for k in PARAMS}
    after = dict(before)
    after.update(f.corrections)
    return Report(params, before, after, len(runs), float(eb.mean()), float(eb.max()),
                  float(ea.mean()), float(ea.max()), None if el is None else float(el.mean()),
                  None if el is None else float(el.max()), per, f)


def format_report(r: Report) -> str:
    lines = [f"{r.n_runs} measured runs; fitted: {', '.join(r.params) or 'nothing (no correction the runs determine lowers the information criterion: they support none)'}"]
    for k in PARAMS:
        mark = "  (fitted)" if k in r.params else ""
        lines.append(f"  {k:21s} {r.before[k]:10.4g} -> {r.after[k]:10.4g}{mark}   {DOC[k]}")
    lines.append(f"mean abs error  before {r.mape_before:6.1f}%   after {r.mape_after:6.1f}%"
                 + (f"   leave-one-out {r.mape_loo:6.1f}%" if r.mape_loo is not None else "   leave-one-out n/a"))
    lines.append(f"max abs error   before {r.max_ape_before:6.1f}%   after {r.max_ape_after:6.1f}%"
                 + (f"   leave-one-out {r.max_ape_loo:6.1f}%" if r.max_ape_loo is not None else ""))
    if r.mape_loo is not None and r.mape_loo > 1.5 * r.mape_after + 2:
        lines.append("note: leave-one-out error is well above the in-sample error: the fit memorises more than it "
                     "generalises (more runs, or fewer --params)")
    return "\n".join(lines)


def new_profile_dict(profile: MachineProfile, r: Report, out: Path, results: str) -> dict:
    """The old profile's YAML mapping with refitted corrections and the new name; its table paths are still the
    old file's (refit copies the tables beside the new one: profile_copy.with_tables)."""
    if not profile.path:
        raise UserError("refit needs a profile read from a YAML file")
    src = Path(profile.path)
    from axoplan.yamlio import load_yaml

    d = load_yaml(src, f"machine profile '{src}'")  # read again as the user wrote it: the same checked reader
    name = out.stem
    today = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d")
    d["name"] = name
    d["description"] = f"{d.get('description', '')} [corrections refit {today} by axoplan refit]".strip()
    loo = f"{r.mape_loo:.1f}%" if r.mape_loo is not None else "n/a"
    src_text = (f"axoplan refit {today}: least squares on log time of {r.n_runs} ok runs in {results} "
                f"against profile '{profile.name}' ({src}); fitted {', '.join(r.params) or 'nothing'} "
                f"(others kept); mean abs error {r.mape_before:.1f}% before, {r.mape_after:.1f}% after, "
                f"{loo} leave-one-out")
    # an overlap efficiency neither fitted nor set before stays the profile's measured one
    corr = {k: float(f"{r.after[k]:.6g}") for k in PARAMS
            if not (k in UNIT_PARAMS and k not in r.params and getattr(profile.corrections, k) is None)}
    corr["source"] = src_text
    d["corrections"] = corr
    return d


def refit(results, machine: str, out: str | Path, params="auto", loo: bool = True) -> Report:
    """What `axoplan refit` does: read results (a results.csv, an emitted run folder, or a list of them), fit,
    write the new profile atomically."""
    from axoplan.atomic import atomic_write_bytes, atomic_write_text, check_writable

    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"--out must name a .yaml file for the new profile, got '{out}'")
    profile = load_profile(machine)
    if profile.path and out.resolve() == Path(profile.path).resolve():
        raise UserError(f"--out '{out}' is the input profile itself; refit writes a new profile and never edits the old one")
    check_writable(out, "--out")  # before the fit, which can take a while
    from axoplan.loop.run_logs import results_frame

    df = results_frame(results)
    names = [str(results)] if isinstance(results, (str, Path)) else [str(r) for r in results]
    where = f"results file '{names[0]}'" if len(names) == 1 else f"results ({', '.join(names)})"
    check_same_machine(df, profile, where)
    runs = runs_from_results(df, where)
    r = refit_profile(profile, runs, params, loo)
    d = new_profile_dict(profile, r, out, ", ".join(names))
    from axoplan.loop.profile_copy import with_tables

    # the measured tables are written beside the new profile: it can be moved, or the old one deleted
    d, tables = with_tables(d, Path(profile.path), out.resolve().parent, prefix=f"{out.stem}_")
    text = ("# Machine profile written by `axoplan refit` from "
            f"'{profile.path}' (schema: machine_profiles/README.md)\n" + yaml.safe_dump(d, sort_keys=False))
    for name, (data, _) in tables.items():
        atomic_write_bytes(out.resolve().parent / name, data)
    atomic_write_text(out, text)
    load_profile(str(out))  # the new file must load: a bug here is ours, not the user's
    return r


__all__ = [
    "DOC",
    "PARAMS",
    "Fit",
    "Report",
    "RunSet",
    "choose_params",
    "fit",
    "format_report",
    "predict",
    "refit",
    "refit_profile",
    "runs_from_results",
]
