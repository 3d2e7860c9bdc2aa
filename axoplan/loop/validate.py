"""`axoplan validate`: run ranked candidates for real, record each run as it finishes, and score how
well the prediction ranked them (Kendall tau, Spearman rho, top-1/top-3, regret, error), with a plot
in the manner of the AxoNN paper's Figure 2.

One sweep lives in one folder OUT:
    OUT/sweep.json          the sweep's arguments (a resumed sweep must match them)
    OUT/plan.csv            the candidates in predicted order (rank columns + candidate id)
    OUT/runs/<id>/          each candidate's run directory, written by launch.write_run_dir, + run.log
    OUT/results.csv         one line per finished run, appended as it finishes
    OUT/summary.json        the scores; OUT/ranking.png the plot
    OUT/sweep.lock          held (flock) by the live sweep: its pid and the run under way (validate_proc)
Torch is never imported here: candidates run as `bash launch_torchrun.sh` in their own process group.
Split by job: validate_files reads and writes the sweep's files, validate_proc starts and ends the
processes (and holds the lock), validate_score scores and plots; this module plans and runs the sweep.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from axoplan import inputs
from axoplan.loop import validate_proc as P
from axoplan.atomic import atomic_write_text, write_files
from axoplan.errors import UserError
from axoplan.loop.launch import (
    CONFIG_NAME,
    TORCHRUN_NAME,
    _env_lines,
    check_layout,
    config_from_row,
    env_summary,
    pipeline_of,
    is_cpu_profile,
    launch_env,
    python_default,
    write_run_dir,
)
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import COLUMNS
from axoplan.loop.validate_files import (
    FINAL_STATUSES,
    INFRA,
    RESULT_COLUMNS,
    STATUSES,
    append_result,
    read_plan,
    read_results,
    read_sweep_json,
)
from axoplan.loop.validate_files import csv_line as _csv_line
from axoplan.loop.validate_files import header as _header
from axoplan.loop.validate_proc import kill_tree
from axoplan.loop.validate_score import format_score, plot, plot_png, score

SWEEP_FILE, PLAN_FILE, RESULTS_FILE, SUMMARY_FILE, PLOT_FILE = (
    "sweep.json", "plan.csv", "results.csv", "summary.json", "ranking.png")
ARRAY_FILE = "validate_array.sbatch"
LOG_NAME = "run.log"
LOCK_FILE = P.LOCK_FILE


@dataclass
class Sweep:
    """The arguments of one validate sweep."""

    model: str
    machine: str
    gpus: int
    global_batch: int
    seq_len: int | None = None
    top_k: int | None = 5  # None with all=True
    all: bool = False  # every feasible grid and order
    steps: int = 10
    warmup_steps: int = 3
    timeout_s: float = 600.0
    micro_batch: int | None = None
    checkpointing: str = "both"
    repeats: int = 1  # passes over the candidates, round robin; a candidate's time is the median
    # the pipelines the candidates may have, as rank's: pp "all" or a stage count, vpp, schedule "all" or one
    pp: int | str = "all"
    vpp: int | None = None
    schedule: str = "all"

    def check(self) -> Sweep:
        if self.repeats < 1:
            raise UserError(f"--repeats must be a positive integer, got {self.repeats}")
        if self.top_k is not None and self.top_k <= 0:
            raise UserError(f"--top must be a positive integer, got {self.top_k}")
        if self.steps <= self.warmup_steps:
            raise UserError(f"--steps ({self.steps}) must be larger than --warmup ({self.warmup_steps}): "
                            f"the median is taken over the steps after warm-up")
        if self.warmup_steps < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup_steps}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not math.isfinite(self.timeout_s) or not 0 < self.timeout_s <= 7 * 86400:
            raise UserError(f"--timeout must be a number of seconds above 0 and at most a week (604800), "
                            f"got {self.timeout_s}")
        if self.steps > 10**7:
            raise UserError(f"--steps must be at most 10000000, got {self.steps}")
        if self.repeats > 1000:
            raise UserError(f"--repeats must be at most 1000, got {self.repeats}")
        return self


# ---- which candidates ------------------------------------------------------------------------
def distinct_configs(df: pd.DataFrame) -> pd.DataFrame:
    """The best-predicted row of every (grid, order), in predicted order: a sweep measures grids and
    placements, with the micro-batch and checkpointing the planner would pick for each."""
    feas = df[df["feasible"].astype(bool)]
    pipe = [k for k in ("pp", "vpp", "schedule") if k in feas.columns]  # a pipeline is a placement of its own
    return feas.drop_duplicates(subset=["gx", "gy", "gz", "gdata", "order", *pipe], keep="first").reset_index(drop=True)


def candidate_id(i: int, row) -> str:
    ck = "-ckpt" if bool(row["checkpointing"]) else ""
    pp, vpp, schedule = pipeline_of(row)
    pipe = "" if pp == 1 else f"pp{pp}{f'v{vpp}' if schedule == 'interleaved-1f1b' else ''}-"
    return (f"c{i:02d}-{pipe}{int(row['gx'])}x{int(row['gy'])}x{int(row['gz'])}x{int(row['gdata'])}-{row['order']}"
            f"-mb{int(row['micro_batch'])}{ck}")


def plan_candidates(sw: Sweep) -> pd.DataFrame:
    from axoplan.planner.rank import rank

    df = rank(sw.model, sw.machine, sw.gpus, sw.global_batch, seq_len=sw.seq_len, micro_batch=sw.micro_batch,
              checkpointing=sw.checkpointing, pp=sw.pp, vpp=sw.vpp, schedule=sw.schedule)
    plan = distinct_configs(df)
    if not sw.all and sw.top_k is not None:
        plan = plan.head(sw.top_k)
    plan = plan.copy()
    plan.insert(0, "candidate", [candidate_id(i + 1, r) for i, r in enumerate(plan.to_dict("records"))])
    plan.attrs.update(df.attrs)
    return plan


# ---- running one candidate ---------------------------------------------------------------------
@dataclass
class RunResult:
    measured_time_s: float | None
    status: str
    error: str
    wall_s: float
    summary: dict | None = None


_OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory|Signal 9 \(SIGKILL\)|"
                  r"exitcode\s*:\s*-9\b", re.IGNORECASE)
_TIME_LIMIT = re.compile(r"DUE TO TIME LIMIT", re.IGNORECASE)
_PREEMPTED = re.compile(r"DUE TO (PREEMPTION|NODE FAIL)", re.IGNORECASE)  # Slurm took the nodes: not the candidate
# failures that are not the candidate's: the disk, the file system, the launcher, a signal from outside
# (SIGTERM, SIGHUP, SIGINT; SIGKILL of a worker stays oom: the kernel's OOM killer sends it)
_INFRA = re.compile(r"No space left on device|Errno 28\b|Disk quota exceeded|Errno 122\b|Read-only file system|"
                    r"Errno 30\b|Address already in use|EADDRINUSE|No module named '?torch|"
                    r"got signal: (1|2|15)\b|Signal (1|2|15) \(SIG(HUP|INT|TERM)\)|"
                    r"exitcode\s*:\s*-(1|2|15)\b|command not found|Permission denied", re.IGNORECASE)
_TRAILER = "# axoplan validate:"  # the line the sweep appends to run.log after a run


def parse_log(text: str) -> RunResult:
    """Status and measured time of one run from its output: the trainer's last line with
    "summary": true gives the median time per batch after warm-up."""
    summary = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"summary"' in line:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("summary") is True:
                summary = rec
    if summary is not None and isinstance(summary.get("median_batch_time_s"), (int, float)):
        return RunResult(float(summary["median_batch_time_s"]), "ok", "", 0.0, summary)
    if _TIME_LIMIT.search(text):
        return RunResult(None, "timeout", "the scheduler stopped it at its time limit", 0.0)
    if _PREEMPTED.search(text):
        return RunResult(None, INFRA, f"the scheduler took its nodes: {error_line(text)}", 0.0)
    m = _INFRA.search(text)
    if m:
        return RunResult(None, INFRA, f"not the candidate's failure ({m.group(0)}): {error_line(text)}", 0.0)
    status = "oom" if _OOM.search(text) else "failed"
    return RunResult(None, status, error_line(text), 0.0)


def error_line(text: str, limit: int = 300) -> str:
    """The most telling line of a failed run's output, one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith(_TRAILER)]
    pick = None
    for pat in (r"^error: ", r"(Error|Exception)\b.*:", r"error", r"Signal \d+"):
        hits = [line for line in lines if re.search(pat, line, re.IGNORECASE)]
        if hits:
            pick = hits[-1] if pat != r"^error: " else hits[0]
            break
    if pick is None:
        pick = lines[-1] if lines else "no output"
    pick = inputs.printable(" ".join(pick.split()))  # a run's output may hold terminal escapes
    return pick if len(pick) <= limit else pick[:limit - 3] + "..."


def default_launcher(run_dir: Path, gpus: int) -> tuple[list[str], dict]:
    """The emitted torchrun script itself, on this one node with all ranks here."""
    env = {"NNODES": "1", "NPROC_PER_NODE": str(gpus), "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    return ["bash", str(run_dir / TORCHRUN_NAME)], env


def _infra(msg: str, wall: float = 0.0) -> RunResult:
    return RunResult(None, INFRA, msg, wall)


def no_space(folder: Path) -> str | None:
    """Why folder cannot take writes now (disk full, read-only, quota), or None: a run that failed with
    no room for its output did not fail by itself."""
    probe = folder / f".axoplan-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return (e.strerror or str(e)).lower()
    finally:
        try:
            os.unlink(probe)
        except OSError:
            pass
    return None


def _stop_pending_dropped() -> None:
    # the sweep is stopping already: a further Ctrl-C during the clean-up is not raised again
    P._stop["pending"] = None
    P.defer_stops(False)


def _read_tail(path: Path, cap: int = 16 << 20) -> str:
    """The last cap bytes of a log (the summary is its last line): a log grown huge, or a device in
    its place, is never read whole."""
    from axoplan.yamlio import read_bytes

    return read_bytes(path, f"the run log '{path}'", cap, tail=True).decode(errors="replace")


def run_one(run_dir: Path, gpus: int, timeout_s: float,
            launcher: Callable[[Path, int], tuple[list[str], dict]] = default_launcher) -> RunResult:
    """Run one candidate, its output in run_dir/run.log; a run past timeout_s is killed (whole tree).
    A failure of what runs it (run.log not writable, disk full, the launcher not starting, a signal
    from outside) is status infra: not the candidate's result."""
    argv, extra = launcher(run_dir, gpus)
    env = dict(os.environ, **extra, **P.marker_env())
    log_path = run_dir / LOG_NAME
    lock = P.active()
    t0 = time.monotonic()
    try:
        # the run folder is the sweep's own: a FIFO, device or link in run.log's place (which would block
        # the open or send the log elsewhere) is removed, and the log is a new regular file
        if os.path.lexists(log_path) and not stat.S_ISREG(os.lstat(log_path).st_mode):
            os.unlink(log_path)
        # unbuffered: nothing of ours is left to flush at close, where a full disk would raise
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        return _infra(f"cannot write {LOG_NAME}: {(e.strerror or str(e)).lower()}")
    try:
        P.defer_stops(True)  # a stop between starting the run and holding its handle would orphan it
        try:
            proc = subprocess.Popen(argv, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            P.defer_stops(False)
            return _infra(f"the launcher could not start ({argv[0]}): {(e.strerror or str(e)).lower()}")
        except BaseException:
            P.defer_stops(False)
            raise
        try:
            if lock is not None:
                lock.started(proc.pid, run_dir.name)
            P.defer_stops(False)  # raises a stop that came meanwhile, here, where the run is ended
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc, folder=lock.folder.resolve() if lock else None)
            wall = time.monotonic() - t0
            return RunResult(None, "timeout", f"no result after {timeout_s:.0f} s; killed", wall)
        except BaseException:  # Ctrl-C: leave nothing running behind us
            P.defer_stops(True)  # a second Ctrl-C must not cut the clean-up short
            try:
                kill_tree(proc, grace_s=3.0, folder=lock.folder.resolve() if lock else None)
            finally:
                _stop_pending_dropped()
            raise
        finally:
            if lock is not None:
                lock.finished()
        wall = time.monotonic() - t0
        try:  # the log must take our own line too: a run whose output did not fit was not its own failure
            os.write(log, f"\n{_TRAILER} exit code {rc} after {wall:.1f} s\n".encode())
            os.fsync(log)
            log_error = None
        except OSError as e:
            log_error = (e.strerror or str(e)).lower()
    finally:
        try:
            os.close(log)
        except OSError:
            pass
    try:
        text = _read_tail(log_path)
    except OSError as e:
        return _infra(f"cannot read {LOG_NAME} back: {(e.strerror or str(e)).lower()}", wall)
    res = parse_log(text)
    res.wall_s = wall
    if res.status == "ok" and rc != 0:
        return RunResult(res.measured_time_s, "failed", f"exit code {rc} after its summary: {error_line(text)}", wall,
                         res.summary)
    if res.status == "ok":
        return res
    if log_error is not None:
        return _infra(f"cannot write {LOG_NAME}: {log_error}", wall)
    if rc < 0:  # torchrun (exec'd by the script) itself was signalled, and not by us
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        return _infra(f"killed by {name} from outside the sweep", wall)
    if rc in (126, 127):  # the shell could not run the launcher
        return _infra(f"the launcher could not start (exit code {rc}): {error_line(text)}", wall)
    full = no_space(run_dir)
    if full is not None:
        return _infra(f"the run folder cannot take writes ({full}): {res.error}", wall)
    if rc != 0 and not any(line.strip() and not line.startswith(_TRAILER) for line in text.splitlines()):
        # torchrun and the trainer always say why they fail: a failure without a word lost its output
        return _infra(f"exit code {rc} with no output at all (its output was lost)", wall)
    if rc == 0:
        res.error = "exited 0 without a summary line: " + res.error
    return res


# ---- the sweep -----------------------------------------------------------------------------------
def _sweep_title(sw: Sweep) -> str:
    return f"{sw.model} on {sw.gpus} x {Path(sw.machine).stem}, global batch {sw.global_batch}"


def _check_existing(sw: Sweep, out: Path, resume: bool, plan: pd.DataFrame) -> None:
    """Refuse, before anything is written, a folder whose sweep this one must not overwrite or
    cannot continue; every sweep file that cannot be read is named in one sentence."""
    sweep_path, plan_path, res_path = out / SWEEP_FILE, out / PLAN_FILE, out / RESULTS_FILE
    has_results = res_path.exists() and res_path.stat().st_size > 0
    if not resume:
        if has_results:
            raise UserError(f"'{out}' already holds a sweep's results: pass --resume to continue it, or choose "
                            f"another --out")
        return
    if sweep_path.exists():
        theirs = asdict(read_sweep_json(sweep_path, Sweep))
        mine = asdict(sw)
        if theirs != mine:
            diff = sorted(k for k in mine if theirs.get(k) != mine[k])
            raise UserError(f"--resume: the sweep in '{out}' was started with other arguments "
                            f"({', '.join(diff)}); use the same ones or another --out")
    if plan_path.exists():
        old = read_plan(plan_path, need_rows=False)
        if list(old["candidate"]) != list(plan["candidate"]):
            raise UserError(f"--resume: the planner now ranks other candidates than the sweep in '{out}' "
                            f"(the profile or model changed); start a new sweep with another --out")
        changed = _changed_prediction(old, plan)
        if changed:
            # results measured against one prediction must not be scored against another
            raise UserError(f"--resume: the model or machine profile changed since the sweep in '{out}' began "
                            f"({changed}); start a new sweep with another --out")
    if has_results:
        read_results(res_path, per_run=True)  # a file that is not results.csv stops us here, named


_PREDICTED = ("batch_time_s", "compute_s", "comm_s", "exposed_comm_s", "memory_gib")


def _changed_prediction(old: pd.DataFrame, new: pd.DataFrame) -> str | None:
    """The first prediction of plan.csv the planner no longer makes (csv keeps floats to 1e-12), or None."""
    for (_, a), (_, b) in zip(old.iterrows(), new.iterrows()):
        for c in _PREDICTED:
            x, y = float(pd.to_numeric(a[c], errors="coerce")), float(b[c])
            if not (abs(x - y) <= 1e-9 * max(abs(x), abs(y))):
                return f"candidate {b['candidate']}: {c} {x:.6g} then, {y:.6g} now"
    return None


def _write_sweep(sw: Sweep, out: Path, plan: pd.DataFrame) -> None:
    """Write sweep.json, plan.csv and the run directories (each file atomically)."""
    from axoplan.planner.profile_reader import load_profile

    profile = load_profile(sw.machine)
    machine_ref = str(Path(profile.path).resolve()) if profile.path else sw.machine
    try:
        atomic_write_text(out / SWEEP_FILE, json.dumps(asdict(sw), indent=1) + "\n")
        atomic_write_text(out / PLAN_FILE, plan[["candidate"] + COLUMNS].to_csv(index=False))
        recs = plan.to_dict("records")
        for i, row in enumerate(recs):
            cfg = config_from_row(row, sw.model, sw.global_batch, sw.seq_len, machine=machine_ref, steps=sw.steps,
                                  timing_warmup_steps=sw.warmup_steps)
            runner_up = recs[1] if i == 0 and len(recs) > 1 else recs[0] if i > 0 else None
            write_run_dir(out / "runs" / row["candidate"], cfg, profile, row, runner_up,
                          command=f"axoplan validate (candidate {i + 1} of {len(recs)})",
                          candidates=plan.attrs.get("candidates"), feasible=plan.attrs.get("feasible"),
                          slurm_time_s=sw.timeout_s)
    except OSError as e:
        raise _write_error(out, e) from None


def _write_error(out: Path, e: OSError) -> UserError:
    if isinstance(e, UserError):  # already one sentence naming the file
        return e
    where = f"'{e.filename}'" if e.filename else f"the sweep folder '{out}'"
    return UserError(f"cannot write {where}: {(e.strerror or str(e)).lower()}")


def _result_row(sw: Sweep, row: dict, res: RunResult, repeat: int = 0) -> dict:
    d = {c: row.get(c) for c in COLUMNS}
    d.update(candidate=row["candidate"], model=sw.model, machine=sw.machine, gpus=sw.gpus,
             global_batch=sw.global_batch, seq_len=sw.seq_len, measured_time_s=res.measured_time_s,
             status=res.status, error=res.error, steps=sw.steps, warmup_steps=sw.warmup_steps,
             wall_s=round(res.wall_s, 3), repeat=repeat)
    return d


def finish(out: Path, title: str = "", echo: Callable[[str], None] = print) -> dict:
    """Score results.csv, save summary.json and ranking.png, print the scores."""
    res = read_results(out / RESULTS_FILE)
    s = score(res)
    png = plot_png(res, title=title + (f"  (Kendall tau {s['kendall_tau']:.2f}, regret {100 * s['regret']:.1f}%)"
                                       if s.get("kendall_tau") is not None else ""))
    try:
        # the scores and their plot replace the last ones together, or neither does
        write_files(out, {SUMMARY_FILE: (json.dumps(s, indent=1) + "\n", None), PLOT_FILE: (png, None)})
    except OSError as e:
        raise _write_error(out, e) from None
    echo(format_score(s))
    echo(f"wrote {out / RESULTS_FILE}, {out / SUMMARY_FILE}, {out / PLOT_FILE}")
    return s


def run_sweep(sw: Sweep, out: str | Path, resume: bool = False, echo: Callable[[str], None] = print,
              launcher: Callable[[Path, int], tuple[list[str], dict]] = default_launcher,
              runner: Callable[..., RunResult] = run_one) -> dict:
    """Plan, emit and run every candidate not yet recorded, appending to results.csv as each run
    finishes; then score. With repeats, the candidates run in passes (round robin, so a machine that
    drifts during the sweep shifts every candidate alike); a candidate whose first run did not finish
    ok is not run again. The sweep holds OUT/sweep.lock while it lives: a second sweep on OUT is
    refused, and one that finds runs a killed sweep left behind ends them before it starts. A run that
    failed for a reason outside the candidate (status infra) stops the sweep; --resume runs it again.
    Returns the summary dict."""
    sw.check()
    out = Path(out)
    plan = plan_candidates(sw)  # before the folder is touched: a bad model or machine writes nothing
    note = env_summary(load_profile(sw.machine))
    if note:
        echo(note)
    with P.SweepLock(out) as lock:
        lock.end_orphans(echo)
        _check_existing(sw, out, resume, plan)
        _write_sweep(sw, out, plan)
        handlers = P.catch_stops()
        P.set_active(lock)
        try:
            _run_all(sw, out, plan, echo, launcher, runner)
        finally:
            P.set_active(None)
            P.restore_stops(handlers)
        return finish(out, _sweep_title(sw), echo)


def _run_all(sw, out, plan, echo, launcher, runner) -> None:
    res_path = out / RESULTS_FILE
    recorded = read_results(res_path, per_run=True) if res_path.exists() and res_path.stat().st_size else None
    if recorded is not None and _header(res_path) != RESULT_COLUMNS:
        # a sweep begun by an older axoplan: rewrite its records in today's columns before appending
        try:
            atomic_write_text(res_path, "".join(_csv_line(v) for v in [RESULT_COLUMNS] + recorded.reindex(
                columns=RESULT_COLUMNS).values.tolist()))
        except OSError as e:
            raise _write_error(out, e) from None
    # only a candidate's own outcome is final: runs stopped by the machine (infra) are run again
    status = {} if recorded is None else {(c, int(r)): s for c, r, s in
                                         zip(recorded["candidate"], recorded["repeat"], recorded["status"])
                                         if s in FINAL_STATUSES}
    retry = 0 if recorded is None else int((recorded["status"] == INFRA).sum())
    total = len(plan) * sw.repeats
    if status or retry:
        echo(f"resuming: {len(status)} of {total} runs already recorded"
             + (f"; {retry} stopped by the machine, not the candidate, run again" if retry else ""))
    else:
        passes = f" x {sw.repeats} passes" if sw.repeats > 1 else ""
        echo(f"{len(plan)} candidates{passes} of {_sweep_title(sw)}; runs in {out / 'runs'}")
    n = len(status)
    for rep in range(sw.repeats):
        for row in plan.to_dict("records"):
            c = row["candidate"]
            if (c, rep) in status or (rep > 0 and status.get((c, 0)) not in (None, "ok")):
                continue
            run_dir = (out / "runs" / c).resolve()
            res = runner(run_dir, sw.gpus, sw.timeout_s, launcher=launcher)
            try:
                append_result(res_path, _result_row(sw, row, res, rep))
            except OSError as e:
                raise UserError(f"cannot record run {c} in '{res_path}' ({_write_error(out, e)}); the sweep "
                                f"stopped, and --resume runs it again") from None
            n += res.status != INFRA
            meas = f"{res.measured_time_s:.4g} s" if res.measured_time_s is not None else "-"
            tag = f" (pass {rep + 1})" if sw.repeats > 1 else ""
            echo(f"[{n}/{total}] {c}{tag}: {res.status:7s} measured {meas:>10s}  predicted "
                 f"{row['batch_time_s']:.4g} s  ({res.wall_s:.0f} s)" + (f"  {res.error}" if res.error else ""))
            if res.status == INFRA:
                raise UserError(f"the sweep stopped: run {c} failed for a reason outside the candidate "
                                f"({res.error}); fix that, then continue with --resume, which runs it again")
            status[(c, rep)] = res.status


# ---- Slurm: a job array of the candidates, then --collect ------------------------------------
def write_slurm_array(sw: Sweep, out: str | Path) -> Path:
    """Emit every candidate and one sbatch job array that runs them (each array task one candidate,
    its output in runs/<id>/run.log); `axoplan validate --collect OUT` scores what came back."""

    sw.check()
    if sw.repeats > 1:
        raise UserError("--repeats is for sweeps run here: a Slurm array runs each candidate once")
    out = Path(out).resolve()
    check_layout(sw.gpus, load_profile(sw.machine))  # each array task starts this many ranks on whole nodes
    plan = plan_candidates(sw)
    with P.SweepLock(out):
        _check_existing(sw, out, (out / SWEEP_FILE).exists(), plan)
        _write_sweep(sw, out, plan)
        return _write_array(sw, out, plan)


def _write_array(sw: Sweep, out: Path, plan: pd.DataFrame) -> Path:
    from axoplan import shell, slurm
    from axoplan.planner.profile_reader import load_profile

    profile = load_profile(sw.machine)
    nodes, per = check_layout(sw.gpus, profile)
    ids = list(plan["candidate"])
    where = "the sweep folder"
    about = [shell.comment(f"axoplan validate: {len(ids)} candidates of {_sweep_title(sw)}, one per array task."),
             shell.comment(f"Submit: sbatch {ARRAY_FILE}; when the array has finished: axoplan validate --collect "
                           f"{shell.quote(str(out), where)}")]
    lines = slurm.header(job_name="axoplan-validate", array=len(ids), nodes=nodes, ntasks=sw.gpus,
                         ntasks_per_node=per, gpus_per_node=None if is_cpu_profile(profile) else per,
                         time_s=sw.timeout_s, log_dir=out / "runs", log_name="slurm-%A_%a.out", about=about,
                         exclusive=True, site=slurm.site_options(profile))
    lines += ["# shellcheck disable=SC2016  # quoted paths are literal on purpose",
              f"OUT={shell.quote(str(out), where)}",
              "RUNS=(" + shell.join(ids, "a candidate name") + ")",
              'RUN_DIR="$OUT/runs/${RUNS[$SLURM_ARRAY_TASK_ID]}"',
              'cd "$RUN_DIR"',
              python_default(),
              slurm.head_node("MASTER_ADDR"),
              "export MASTER_ADDR",
              "# array tasks may share a node: one port each",
              'export MASTER_PORT="$((29500 + SLURM_ARRAY_TASK_ID % 1000))"',
              *_env_lines(launch_env(profile)),
              f'srun --ntasks={sw.gpus} --ntasks-per-node={per} --kill-on-bad-exit=1 \\',
              f'  "$PYTHON" -m axoplan.cli train --config "$RUN_DIR/{CONFIG_NAME}" > "$RUN_DIR/{LOG_NAME}" 2>&1']
    path = atomic_write_text(out / ARRAY_FILE, slurm.script(lines, "the Slurm array"))
    os.chmod(path, 0o755)
    return path


def collect(out: str | Path, echo: Callable[[str], None] = print) -> dict:
    """Score a Slurm sweep: read each candidate's run.log (and the array's slurm-*.out for time
    limits), rewrite results.csv atomically, then score as a local sweep."""
    out = Path(out)
    if not (out / SWEEP_FILE).exists() and not (out / PLAN_FILE).exists():
        raise UserError(f"'{out}' holds no validate sweep (no {SWEEP_FILE} or {PLAN_FILE})")
    with P.SweepLock(out):
        sw = read_sweep_json(out / SWEEP_FILE, Sweep)
        plan = read_plan(out / PLAN_FILE)
        return _collect(sw, plan, out, echo)


def _collect(sw: Sweep, plan: pd.DataFrame, out: Path, echo: Callable[[str], None]) -> dict:
    lines = [_csv_line(RESULT_COLUMNS)]
    missing = []
    for i, row in enumerate(plan.to_dict("records")):
        run_dir = out / "runs" / row["candidate"]
        text = ""
        for p in [run_dir / LOG_NAME] + sorted((out / "runs").glob(f"slurm-*_{i}.out")):
            try:
                text += _read_tail(p) + "\n"  # a FIFO or /dev/zero in its place is refused, not read
            except FileNotFoundError:
                pass
        if not text.strip():
            missing.append(row["candidate"])
            res = RunResult(None, INFRA, "no run log: not run yet, or its output was lost", 0.0)
        else:
            res = parse_log(text)
        lines.append(_csv_line([_result_row(sw, row, res).get(c) for c in RESULT_COLUMNS]))
    try:
        atomic_write_text(out / RESULTS_FILE, "".join(lines))
    except OSError as e:
        raise _write_error(out, e) from None
    if missing:
        echo(f"{len(missing)} of {len(plan)} candidates have no log yet: {', '.join(missing[:5])}"
             + (" ..." if len(missing) > 5 else ""))
    return finish(out, _sweep_title(sw), echo)


__all__ = [
    "RESULT_COLUMNS",
    "STATUSES",
    "RunResult",
    "Sweep",
    "append_result",
    "collect",
    "distinct_configs",
    "finish",
    "parse_log",
    "plan_candidates",
    "plot",
    "read_results",
    "run_one",
    "run_sweep",
    "score",
    "write_slurm_array",
]
