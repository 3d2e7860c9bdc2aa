"""`axoplan calibrate`: measure this machine with the calibration microbenchmarks and write its profile.

The workers run under torchrun in a subprocess (so this process never holds a process group);
rank 0 streams progress lines that drive the progress bar. torch is imported inside the command."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.runtime.dist_env import cpu_threads


def _check_out(out: str | None) -> Path:
    if not out:
        raise UserError("--out is required: the profile to write, e.g. --out machine_profiles/mymachine.yaml")
    p = Path(out)
    if p.suffix not in (".yaml", ".yml"):
        raise UserError(f"--out must name a .yaml file, got '{out}'")
    if p.exists() and p.is_dir():
        raise UserError(f"--out '{out}' is a folder; give a file name ending in .yaml")
    from axoplan.atomic import check_writable

    check_writable(p, "--out")  # before minutes of measuring, and before the raw results are committed
    return p


# other work at more than this share of the cores, on average over the run, is reported as a busy machine
BUSY_SHARE = 0.25


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on this machine has run so far (user, nice and system time in /proc/stat;
    interrupts and steal left out: they are not other programs); None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return sum(int(x) for x in fields[1:4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (the workers, their torchrun)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def other_work_cores(busy_s: float | None, own_s: float, wall_s: float) -> float | None:
    """Cores' worth of CPU that programs other than the calibration ran, on average over wall_s."""
    if busy_s is None or wall_s <= 0:
        return None
    return max(busy_s - own_s, 0.0) / wall_s


def _run_workers(nproc: int, results: Path, quick: bool, models: str | None, device: str, command: str,
                 extra: list[str], log_path: Path | None = None, append: bool = False,
                 env_extra: dict | None = None) -> tuple[float, float | None]:
    """(wall seconds, cores' worth of other work beside the workers: other_work_cores)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    results.mkdir(parents=True, exist_ok=True)
    log_path = log_path or results / "worker.log"
    adding = append or "--add" in extra  # parts on top of an earlier run, or beside it: its log stays
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "axoplan.calibrate.worker", "--results", str(results), "--device", device, "--command", command]
    if quick:
        args.append("--quick")
    if models:
        args += ["--models", models]
    args += extra
    env = dict(os.environ)
    threads = cpu_threads(nproc)
    if threads is not None:  # torchrun would otherwise start every worker with OMP_NUM_THREADS=1
        env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a worker killed by a signal leaves its Python stack in the log
    env.update(env_extra or {})  # the marker by which a later calibration finds workers a killed one left
    meta_before = _meta(results)
    t0, busy0, own0 = time.time(), machine_busy_seconds(), own_cpu_seconds()
    with open(log_path, "a" if adding else "w") as log, Progress(TextColumn("[bold]calibrating[/bold] {task.description}"), BarColumn(),
                                              MofNCompleteColumn(), TimeElapsedColumn(), transient=False) as bar:
        task = bar.add_task("starting workers", total=None)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        part = None
        try:
            for line in proc.stdout:
                if line.startswith("AXOPLAN_PROGRESS "):
                    _, done, total, phase = line.rstrip("\n").split(" ", 3)
                    bar.update(task, completed=int(done), total=int(total), description=phase)
                    if phase.split(" ", 1)[0] != part:  # the log says which part a failure interrupted
                        part = phase.split(" ", 1)[0]
                        log.write(f"axoplan calibrate: measuring {part} ({done} of {total} done)\n")
                        log.flush()
                else:
                    log.write(line)
                    log.flush()
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait()
            raise
        except OSError as e:  # the log cannot take the workers' output (disk full): stop them, say so
            proc.terminate()
            proc.wait()
            raise UserError(f"cannot write the workers' log '{log_path}': {(e.strerror or str(e)).lower()}") from None
    if rc != 0:
        if not _complete(results, unlike=meta_before):
            last = _last_error_line(log_path)
            raise UserError(f"the calibration workers failed (exit code {rc}{': ' + last if last else ''}); "
                            f"their log is {log_path}")
        # every rank passed the last barrier and rank 0 marked the run complete: what failed was the teardown
        # (gloo can abort a process as its groups are destroyed), and the measurements are whole
        click.echo(f"warning: the calibration workers exited with code {rc} after finishing every measurement; "
                   f"the results are complete (their log is {log_path})", err=True)
    wall, busy1 = time.time() - t0, machine_busy_seconds()
    busy = None if busy0 is None or busy1 is None else busy1 - busy0
    return wall, other_work_cores(busy, own_cpu_seconds() - own0, wall)


STAGING_PREFIX = ".measuring-"


def _meta(results: Path) -> dict | None:
    """The results folder's meta.json as ResultsDir reads it (a FIFO or binary file refused), None if unreadable."""
    from axoplan.calibrate.results_io import ResultsDir, ResultsError

    try:
        return ResultsDir(results).meta()
    except ResultsError:
        return None


def _complete(results: Path, unlike: dict | None = None) -> bool:
    """Whether the folder's meta.json says the run is complete; with unlike (the meta an earlier run left, which
    a --parts run starts from), whether these workers wrote it so, which rank 0 does after the last barrier."""
    meta = _meta(results)
    return meta is not None and meta != unlike and meta.get("status") == "complete"


def _stage(results: Path, keep: bool) -> Path:
    """A folder inside results for a run that must not touch the complete run there until it is done:
    with keep (parts added on top), a copy of that run's tables and meta.json to add to. Folders of
    earlier runs that were killed (their pid is gone) are removed."""
    import shutil

    for old in results.glob(STAGING_PREFIX + "*"):
        pid = old.name[len(STAGING_PREFIX):]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    staging = results / f"{STAGING_PREFIX}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if keep:
            for f in results.iterdir():
                if f.is_file() and (f.suffix == ".csv" or f.name == "meta.json"):
                    # a hard link costs no space: the worker unlinks a table before measuring it again,
                    # and meta.json is replaced, so the complete run's files are never written through it
                    try:
                        os.link(f, staging / f.name)
                    except OSError:
                        shutil.copy2(f, staging / f.name)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"cannot prepare the measurement beside '{results}': {(e.strerror or str(e)).lower()}") from None
    return staging


def _on_terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_terminate() -> dict:
    """SIGTERM and SIGHUP stop a calibration as Ctrl-C does: its workers are ended, its folder removed."""
    handlers = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _on_terminate)
    except ValueError:  # not the main thread: signals stay as they are
        pass
    return handlers


def _commit(staging: Path, results: Path) -> None:
    """Move a finished run's files over the complete run, each by an atomic rename, meta.json last (it
    says the folder is complete); Ctrl-C and SIGTERM wait the few milliseconds this takes."""
    from axoplan.calibrate.results_io import ResultsDir

    try:
        done = ResultsDir(staging).meta().get("status") == "complete"
    except ValueError:  # no meta.json, or one cut short
        done = False
    if not done:
        raise UserError(f"the calibration workers exited without finishing; the earlier run in {results} is kept")
    files = sorted((f for f in staging.iterdir() if f.is_file() and f.name != "meta.json"), key=lambda f: f.name)
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        for f in [*files, staging / "meta.json"]:
            os.replace(f, results / f.name)
    except OSError as e:
        raise UserError(f"cannot move the new measurements into '{results}': {(e.strerror or str(e)).lower()}") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _last_error_line(log_path: Path) -> str:
    try:
        from axoplan.yamlio import read_bytes

        text = read_bytes(log_path, str(log_path), 16 << 20, tail=True).decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
    except (OSError, UserError):
        return ""
    # the first exception line a worker printed (torchrun's own ChildFailedError summary comes later)
    for line in lines:
        m = re.match(r"^(?:\[rank\d+\]:)?\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b:?.*)$", line)
        if m and "ChildFailedError" not in line:
            return m.group(1)[:200]
    return ""


def _validate_written(built, results: Path, out: Path) -> None:
    """Load the profile with the planner's own loader before it replaces anything (from a temporary
    copy, which no message names: it is gone when the user reads it)."""
    try:
        from axoplan.planner.profile_reader import load_profile
    except ImportError:  # the planner's loader is not there yet: nothing to check against
        return
    with tempfile.TemporaryDirectory() as d:
        try:
            for fname, text in built.files().items():
                (Path(d) / fname).write_text(text)
        except OSError as e:
            raise UserError(f"cannot check the profile fitted from '{results}' before writing it: "
                            f"{(e.strerror or str(e)).lower()}") from None
        tmp = Path(d) / f"{built.profile['name']}.yaml"
        try:
            load_profile(str(tmp))
        except UserError as e:
            why = str(e).replace(f"machine profile '{tmp}': ", "").replace(str(Path(d)), str(out.parent))
            raise UserError(f"the profile fitted from the results in '{results}' does not pass the planner's "
                            f"schema check ({why})") from None


def busy_warning(meta: dict, other_cores: float | None) -> str | None:
    """The warning that other work slowed a CPU calibration, or None. other_cores (measured beside workers
    this process ran): other programs' CPU over the run; without it (fitting earlier results), the load
    average at the start, before any worker ran (at the end it also counts the workers' own threads: gloo's
    and torch's, several per rank, so it cannot tell other work from the measurement's)."""
    if meta.get("cuda"):
        return None
    cores = meta.get("cpu_count") or 1
    if other_cores is not None:
        if other_cores > BUSY_SHARE * cores:
            return (f"warning: the machine was busy during calibration (other programs used {other_cores:.1f} of "
                    f"its {cores} cores on average): they slowed the measurements; rerun on a quiet machine")
        return None
    start = (meta.get("loadavg_start") or [0])[0] or 0
    if start > cores:  # a load average lags and counts waiting threads: only a clear excess
        return (f"warning: the machine was busy when calibration started (load average {start:.1f} on {cores} "
                f"cores): other work slowed the measurements; rerun on a quiet machine")
    return None


def _print_summary(out: Path, built, wall_s: float | None, meta: dict, added: bool = False,
                   fit_s: float | None = None, other_cores: float | None = None) -> None:
    s = built.summary
    if added:  # this command measured only the added parts: their loads and time are the ones to show
        from axoplan.calibrate.profile_writer import added_runs

        meta = {**meta, **(added_runs(meta) or [{}])[-1]}
    warning = busy_warning(meta, other_cores)
    if warning:
        click.echo(warning, err=True)
    click.echo(f"wrote {out} (GEMM table {out.parent / built.profile['compute']['gemm']['table']['path']})")
    if wall_s is not None:
        click.echo(f"  calibration took {wall_s:.0f} s (workers {meta.get('elapsed_s')} s"
                   + (f", parts {', '.join(meta.get('parts', []))})" if added else ")")
                   + (f", fitting {fit_s:.0f} s" if fit_s is not None else ""))
    click.echo(f"  GEMM ceiling      {s['gemm_ceiling_tflops'] * 1e3:.1f} GFLOP/s per rank "
               f"({s['gemm_ceiling_shape']}), "
               f"dim_half {s['dim_half']:.0f}")
    click.echo(f"  memory bandwidth  {s['bandwidth_gbs']:.1f} GB/s per rank, element-wise efficiency "
               f"{s['elementwise_efficiency']:.2f}")
    if "bare_op_us" in s:
        click.echo(f"  kernel overhead   {s['kernel_overhead_us']:.1f} us per kernel in the trainer "
                   f"(a bare op: {s['bare_op_us']:.1f} us)")
    else:
        click.echo(f"  op overhead       {s['kernel_overhead_us']:.1f} us")
    click.echo(f"  attention         {s['attention_tflops'] * 1e3:.1f} GFLOP/s, causal/full time "
               f"{s['causal_ratio']:.2f}, backward/forward {s['backward_factor']:.2f}")
    click.echo(f"  ring latency      {s['latency_us']:.0f} us per step")
    if "overlap_efficiency" in s:
        click.echo(f"  overlap           {s['overlap_efficiency']:.2f} of a background collective hides behind compute")
    if "trainer_runs" in s:
        fitted = ", ".join(f"{k} {v:.4g}" for k, v in s["trainer_params"].items()) or "none needed"
        loo = f", {s['trainer_mape_loo']:.1f}% leave-one-out" if s.get("trainer_mape_loo") is not None else ""
        click.echo(f"  trainer on grids  {s['trainer_runs']} steps; corrections: {fitted} (error "
                   f"{s['trainer_mape_before']:.1f}% -> {s['trainer_mape_after']:.1f}%{loo})")
    bw = ", ".join(f"{k}: {v:.2f}" for k, v in s["busbw_gbs"].items())
    click.echo(f"  busbw (size x stride, GB/s)  {bw}")
    click.echo(f"  network model fit error      rms {s['network_model_rms_rel_err']:.0%}, "
               f"max {s['network_model_max_rel_err']:.0%}")


def _parts_args(parts: str, results: Path, nproc: int | None, from_results, emit_slurm) -> tuple[int, list[str]]:
    """--parts: which parts, checked against the earlier run they are added to; the worker's arguments."""
    from axoplan.calibrate.results_io import ResultsDir
    from axoplan.calibrate.worker import PARTS

    if from_results or emit_slurm is not None:
        raise UserError("--parts measures here; it goes with neither --from-results nor --emit-slurm")
    names = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in names if p not in PARTS]
    if not names or bad:
        raise UserError(f"--parts takes a comma-separated list of {', '.join(PARTS)}; got '{parts}'")
    try:
        meta = ResultsDir(results).meta()
    except (OSError, ValueError):
        meta = {}
    if meta.get("status") != "complete":
        raise UserError(f"--parts adds to a complete earlier calibration, and {results} holds none "
                        f"(run a whole calibration first, or name its folder with --results)")
    if meta.get("nodes", 1) > 1:
        raise UserError(f"--parts re-measures on this node only, and the run in {results} spans {meta['nodes']} nodes")
    ranks = meta.get("ranks_per_node")
    if nproc is not None and nproc != ranks:
        raise UserError(f"--nproc {nproc} differs from the {ranks} ranks of the earlier run in {results}; "
                        f"parts of one profile are measured with the same ranks")
    return ranks, ["--only", ",".join(names), "--add"]


@click.command("calibrate")
@click.option("--nproc", type=inputs.Count(1, inputs.MAX_GPUS_PER_NODE), default=None,
              help="Ranks per node to measure with (default: the GPUs here, else the CPU cores).")
@click.option("--out", type=str, default=None, help="Profile to write, e.g. machine_profiles/NAME.yaml.")
@click.option("--quick", is_flag=True,
              help="A coarser sweep (under 3 minutes on a 2-core machine with the default --nproc; ranks beyond "
                   "the cores share them: --nproc 8 on 2 cores took 23 minutes).")
@click.option("--results", type=str, default=None,
              help="Folder for the raw measurements (default: NAME_results beside the profile --out names).")
@click.option("--models", type=str, default=None,
              help="Comma-separated model presets whose exact GEMM and attention shapes to add "
                   "(default: gpt-tiny,gpt-small on CPU, gpt-5b,gpt-20b on GPUs).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--from-results", "from_results", type=str, default=None,
              help="Fit and write the profile from an earlier run's results folder (by default that run "
                   "wrote NAME_results beside its profile); measure nothing.")
@click.option("--parts", type=str, default=None,
              help="Measure only these parts again (comma-separated: gemm, collectives, memory, attention, "
                   "framework, trainer, overlap) on top of the complete earlier run in the results folder, "
                   "keeping the others, and write the profile from all of them.")
@click.option("--emit-slurm", "emit_slurm", type=inputs.Count(1, inputs.MAX_GPUS), default=None, metavar="NODES",
              help="Write an sbatch script that calibrates across NODES nodes, instead of measuring here.")
@click.option("--script", type=str, default=None, help="Where --emit-slurm writes (default: calibrate-NAME.sbatch).")
@click.option("--worker-arg", "worker_args", multiple=True, hidden=True,
              help="Extra argument for axoplan.calibrate.worker (tests use it to shrink the sweep).")
def calibrate(nproc, out, quick, results, models, device, from_results, parts, emit_slurm, script, worker_args):
    """Measure this machine (GEMMs, memory, collectives per group shape) and write its profile."""
    out_p = _check_out(out)
    name = out_p.stem
    # beside the profile, named like its tables (NAME_gemm.csv, ...): the raw data goes where the profile goes
    results_p = Path(results) if results else out_p.parent / f"{name}_results"
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {nproc}")
    if models:
        from axoplan.planner.specs import load_model

        for m in models.split(","):
            load_model(m.strip())  # an unknown preset fails here, not in the workers

    add_args: list[str] = []
    if parts is not None:
        nproc, add_args = _parts_args(parts, results_p, nproc, from_results, emit_slurm)
    if emit_slurm is not None:
        from axoplan.calibrate.slurm import sbatch_script

        from axoplan.atomic import atomic_write_text

        if emit_slurm < 1:
            raise UserError(f"--emit-slurm needs a positive number of nodes, got {emit_slurm}")
        if nproc is None:
            raise UserError("--emit-slurm needs --nproc: the GPUs (ranks) per node")
        text = sbatch_script(emit_slurm, nproc, str(out_p), str(results_p), quick, models, device=device)
        dest = Path(script or f"calibrate-{name}.sbatch")
        atomic_write_text(dest, text)
        os.chmod(dest, 0o755)
        click.echo(f"wrote {dest}: submit it with `sbatch {dest}`; it writes {out_p} (raw results in {results_p})")
        return

    wall = None
    if from_results:
        results_p = Path(from_results)
        if not results_p.is_dir():
            raise UserError(f"--from-results '{from_results}' is not a folder")
    else:
        try:
            import torch
        except ImportError:
            raise UserError("'axoplan calibrate' needs torch (pip install 'axoplan[runtime]')") from None
        cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but torch sees no CUDA device")
        if nproc is None:
            nproc = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
        if cuda and nproc > torch.cuda.device_count():
            raise UserError(f"--nproc {nproc} is more than the {torch.cuda.device_count()} GPUs here")
        if nproc < 2:
            raise UserError("--nproc must be at least 2: collectives need two ranks")
        cores = os.cpu_count() or 1
        if not cuda and nproc > 16 * cores:  # each rank is a process with torch loaded: thousands would swamp the node
            raise UserError(f"--nproc {nproc} is more than 16 ranks per core on this {cores}-core machine")
        command = f"axoplan calibrate --nproc {nproc} --out {out_p}" + (" --quick" if quick else "") + (
            f" --models {models}" if models else "") + (f" --device {device}" if device != "auto" else "") + (
            f" --parts {parts}" if parts else "")
        from axoplan.loop.validate_proc import FolderLock

        with FolderLock(results_p, "axoplan calibrate", "AXOPLAN_CALIBRATE_RESULTS",
                        "name another folder with --results") as lock:
            # workers a killed calibration left running would share the cores with ours and write its folder
            lock.end_orphans(click.echo)
            if parts is not None:  # under the lock: a refusal above stays the one line on stderr
                from axoplan.device import results_mismatch, warn

                warn(results_mismatch(results_p, cuda))
            run = {"env_extra": lock.env()}
            if parts is not None or _complete(results_p):
                # the complete run there stays whole until this one has finished: measured beside it, then
                # moved over it file by file (an interrupted run leaves it usable by --parts and --from-results)
                import shutil

                staging = _stage(results_p, keep=parts is not None)
                handlers = _stop_on_terminate()
                try:
                    wall, other = _run_workers(nproc, staging, quick, models, device, command, add_args + list(worker_args),
                                        log_path=results_p / "worker.log", append=True, **run)
                    _commit(staging, results_p)
                finally:
                    for sig, h in handlers.items():
                        signal.signal(sig, h)
                    shutil.rmtree(staging, ignore_errors=True)
            else:
                handlers = _stop_on_terminate()
                try:
                    wall, other = _run_workers(nproc, results_p, quick, models, device, command,
                                        add_args + list(worker_args), **run)
                finally:
                    for sig, h in handlers.items():
                        signal.signal(sig, h)
            _write_profile(results_p, name, out_p, wall, parts, other)  # still under the lock: no other run moves files in

        return
    from axoplan.loop.validate_proc import FolderLock

    with FolderLock(results_p, "axoplan calibrate", "AXOPLAN_CALIBRATE_RESULTS", ""):
        _write_profile(results_p, name, out_p, wall, parts)  # never from a folder a calibration is moving files into


def _write_profile(results_p: Path, name: str, out_p: Path, wall: float | None, parts: str | None,
                   other_cores: float | None = None) -> None:
    """Fit the measurements in results_p and write the profile and its tables beside out_p (other_cores: the
    other programs' CPU beside the workers just run, other_work_cores)."""
    from axoplan.calibrate import profile_writer
    from axoplan.calibrate.profile_writer import CalibrationError, fits_csv
    from axoplan.calibrate.results_io import ResultsDir

    from axoplan import progress

    rd = ResultsDir(results_p)
    t0 = time.perf_counter()
    try:
        with progress.on_stderr("fitting the profile"):
            built = profile_writer.build(rd, name, f"{name}_gemm.csv")
    except CalibrationError as e:
        raise UserError(f"cannot make a profile from {results_p}: {e}") from None
    _validate_written(built, results_p, out_p)
    from axoplan.atomic import atomic_write_text

    try:
        atomic_write_text(rd.path / "fits.csv", fits_csv(built.fits))
        for fname, text in built.files().items():  # the tables first, the profile that names them last
            atomic_write_text(out_p if fname == f"{name}.yaml" else out_p.parent / fname, text)
    except OSError as e:
        if isinstance(e, UserError):  # already one sentence naming the file
            raise
        raise UserError(f"cannot write '{e.filename or out_p}': {(e.strerror or str(e)).lower()}") from None
    _print_summary(out_p, built, wall, rd.meta(), added=bool(parts), fit_s=time.perf_counter() - t0,
                   other_cores=other_cores)
