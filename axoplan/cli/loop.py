"""`axoplan emit | validate | refit`: the commands that close the loop from prediction to a running job
and back to the profile. No torch here: runs are started as subprocesses."""
from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path

import click

from axoplan import inputs
from axoplan.cli.plan import bundled_execution, execution_option, parse_grid, parse_pp, pipeline_options
from axoplan.errors import UserError
from axoplan.planner.space import PLACEMENTS


def _job_options(f):
    f = click.option("--model", "-m", type=inputs.TEXT, help="Preset name (axoplan models) or model YAML path.")(f)
    f = click.option("--machine", "-p", type=inputs.TEXT,
                     help="Profile name (axoplan profiles) or profile YAML path.")(f)
    f = click.option("--gpus", "-g", type=inputs.GPUS, help="Number of GPUs (processes on CPU).")(f)
    f = click.option("--global-batch", "-b", type=inputs.GLOBAL_BATCH, help="Global batch in sequences.")(f)
    f = click.option("--seq-len", "-s", type=inputs.SEQ_LEN, default=None,
                     help="Sequence length (default: the model's).")(f)
    return f


def _require(**kw):
    missing = [k for k, v in kw.items() if v is None]
    if missing:
        raise UserError("missing option(s) " + ", ".join("--" + m.replace("_", "-") for m in missing))


def _command_line() -> str:
    return "axoplan " + " ".join(shlex.quote(a) for a in sys.argv[1:])


# ---- emit -------------------------------------------------------------------------------------------
def choose(model, machine, gpus, global_batch, seq_len=None, rank_k: int | None = None, grid=None, order=None,
           micro_batch=None, checkpointing="both", execution=None, pp="all", vpp=None, schedule="all"):
    """(chosen row, runner-up row or None, ranking attrs): the rank_k-th row of the ranking, or the best
    row of one grid (and order). The runner-up is the best row with another grid or order. pp > 1: among
    the bundled trainer's pipelines of pp stages (the grid is each stage's)."""
    from axoplan.planner.rank import rank
    from axoplan.loop.validate import distinct_configs

    df = rank(model, machine, gpus, global_batch, seq_len=seq_len, micro_batch=micro_batch,
              checkpointing=checkpointing, execution=execution, pp=pp, vpp=vpp, schedule=schedule or "all")
    rows = df.to_dict("records")
    if grid is not None:
        gx, gy, gz, gd = grid
        stages = 1 if pp == "all" else pp
        if gx * gy * gz * gd * stages != gpus:
            raise UserError(f"--grid {gx},{gy},{gz},{gd}" + (f" with --pp {stages}" if stages > 1 else "")
                            + f" uses {gx * gy * gz * gd * stages} GPUs, not --gpus {gpus}")
        same = [r for r in rows if (r["gx"], r["gy"], r["gz"], r["gdata"]) == (gx, gy, gz, gd)
                and int(r.get("pp", 1)) == stages and (order is None or r["order"] == order)]
        if not same:
            from axoplan.planner.rank import explain

            ex = explain(model, machine, gpus, global_batch, grid, order=order or "xyz", seq_len=seq_len,
                         micro_batch=micro_batch, execution=execution, pp=stages, vpp=vpp,
                         schedule=None if schedule == "all" else schedule,
                         checkpointing=None if checkpointing == "both" else checkpointing == "on")
            reason = ex.summary["reason"][0]
            if reason:
                raise UserError(f"grid {gx},{gy},{gz},{gd} (order {order or 'xyz'}) is not feasible: {reason}")
            # an order equivalent to one already listed (axes of size 1 take no place): use that row
            same = [r for r in rows if (r["gx"], r["gy"], r["gz"], r["gdata"]) == (gx, gy, gz, gd)
                    and int(r.get("pp", 1)) == stages]
            if not same:
                raise UserError(f"grid {gx},{gy},{gz},{gd} is not among the ranked configurations")
        chosen = dict(same[0])
        if order is not None:
            chosen["order"] = order  # the equivalent placement the user asked for, by its name
    else:
        k = 1 if rank_k is None else rank_k  # --rank 0 is a mistake, not the first row
        if k <= 0:
            raise UserError(f"--rank must be a positive integer, got {k}")
        if k > len(rows):
            raise UserError(f"--rank {k}: only {len(rows)} feasible configurations exist")
        chosen = rows[k - 1]
    key = (chosen["gx"], chosen["gy"], chosen["gz"], chosen["gdata"], chosen["order"])
    others = [r for r in distinct_configs(df).to_dict("records")
              if (r["gx"], r["gy"], r["gz"], r["gdata"], r["order"]) != key]
    return chosen, (others[0] if others else None), df.attrs


def _framework_pipelines(framework: str, ex, pp, vpp, schedule) -> None:
    """A pipeline asked of a framework whose writer cannot run it, said in the framework's words: the execution
    planned with takes its pipeline from the framework (framework_execution), whatever execution named it."""
    from axoplan.loop.frameworks import EXECUTIONS, framework_execution

    runs = ex.pipeline_schedules
    interleaved = (vpp or 1) > 1 or schedule == "interleaved-1f1b"
    if not (interleaved or (pp != "all" and pp > 1)):
        return  # no pipeline asked for
    if runs and (not interleaved or "interleaved-1f1b" in runs):
        return  # the framework runs what was asked
    which = [f for f in EXECUTIONS if framework_execution(f).pipeline_schedules]
    what = "no pipeline" if not runs else f"no interleaved schedule (only {', '.join(runs)})"
    raise UserError(f"--framework {framework} runs {what}; choose " + ("--pp 1" if not runs else "--schedule 1f1b")
                    + f" or a framework that does ({', '.join(which)})")


@click.command("emit")
@_job_options
@click.option("--rank", "rank_k", type=inputs.Count(1), default=None,
              help="Emit the K-th ranked configuration (default 1).")
@click.option("--grid", default=None, help="Emit this grid GX,GY,GZ,GDATA instead (its best micro-batch).")
@click.option("--order", default=None, metavar="ORDER", type=click.Choice(list(PLACEMENTS)),
              help="Placement order with --grid (p among x, y, z places the pipeline axis).")
@click.option("--micro-batch", type=inputs.MICRO_BATCH, default=None, help="Fix the micro-batch size.")
@click.option("--checkpointing", type=click.Choice(["both", "on", "off"]), default="both", show_default=True)
@click.option("--steps", type=inputs.STEPS, default=10, show_default=True, help="Training steps in the emitted config.")
@click.option("--warmup", type=inputs.Count(0, inputs.MAX_STEPS), default=2, show_default=True,
              help="Steps left out of the summary's median.")
@click.option("--out", "-o", "out", required=True, type=inputs.SafePath(file_okay=False),
              help="Run directory to write.")
@click.option("--framework", "-f", type=click.Choice(["axoplan", "torchtitan", "megatron", "axonn"]),
              default="axoplan", show_default=True,
              help="Write the run for this framework (docs/frameworks.md); axoplan: the bundled trainer.")
@click.option("--execution", "-e", type=inputs.TEXT, default=None,
              help="Plan with this execution (default: the framework's own: axoplan, torchtitan, megatron-core, axonn).")
@pipeline_options
def emit(model, machine, gpus, global_batch, seq_len, rank_k, grid, order, micro_batch, checkpointing, steps,
         warmup, out, framework, execution, pp, vpp, pipeline_schedule):
    """Write a run folder for the best (or --rank K, or --grid) configuration: for the bundled trainer
    DIR/config.yaml, or for --framework its own files, with DIR/launch_torchrun.sh, DIR/launch_slurm.sbatch and
    DIR/README.txt."""
    from axoplan.loop.frameworks import framework_execution
    from axoplan.loop.launch import _pipe, config_from_row, write_run_dir
    from axoplan.planner.profile_reader import load_profile

    _require(model=model, machine=machine, gpus=gpus, global_batch=global_batch)
    if grid is not None and rank_k is not None:
        raise UserError("give either --rank or --grid, not both")
    if order is not None and grid is None:
        raise UserError("--order goes with --grid (a ranked row has its own order)")
    if steps <= 0 or warmup < 0:
        raise UserError(f"--steps must be positive and --warmup non-negative, got {steps} and {warmup}")
    if warmup >= steps:
        raise UserError(f"--warmup ({warmup}) must be smaller than --steps ({steps}): the summary's median is "
                        f"taken over the steps after warm-up")
    g = parse_grid(grid) if grid is not None else None
    from axoplan.loop.launch import check_layout

    check_layout(gpus, load_profile(machine))
    ex = framework_execution(framework, execution)
    _framework_pipelines(framework, ex, parse_pp(pp), vpp, pipeline_schedule)
    chosen, runner_up, attrs = choose(model, machine, gpus, global_batch, seq_len, rank_k, g, order, micro_batch,
                                      checkpointing, execution=ex, pp=parse_pp(pp), vpp=vpp,
                                      schedule=pipeline_schedule)
    profile = load_profile(machine)
    if framework != "axoplan":
        _emit_framework(framework, chosen, model, profile, gpus, global_batch, seq_len, ex, out, steps)
        return
    machine_ref = str(Path(profile.path).resolve()) if profile.path else machine
    cfg = config_from_row(chosen, model, global_batch, seq_len, machine=machine_ref, steps=steps,
                          timing_warmup_steps=warmup)
    files = write_run_dir(out, cfg, profile, chosen, runner_up, command=_command_line(),
                          candidates=attrs.get("candidates"), feasible=attrs.get("feasible"))
    click.echo(f"chose gx={cfg.grid.gx} gy={cfg.grid.gy} gz={cfg.grid.gz} gdata={cfg.grid.gdata} order {cfg.order}"
               f"{_pipe(cfg)}, "
               f"micro-batch {cfg.micro_batch}, checkpointing {'on' if cfg.checkpointing else 'off'}: "
               f"predicted {chosen['batch_time_s']:.4g} s per batch, {chosen['memory_gib']:.3g} GiB per GPU")
    for p in files.values():
        click.echo(f"wrote {p}")
    from axoplan.loop.launch import env_summary

    note = env_summary(profile)
    if note:
        click.echo(note)
    click.echo(f"run it: bash {shlex.quote(str(Path(out) / 'launch_torchrun.sh'))}")


def _emit_framework(framework, chosen, model, profile, gpus, global_batch, seq_len, ex, out, steps):
    from axoplan.loop.frameworks import SLURM_NAME, Plan, write_framework_dir
    from axoplan.loop.launch import portable_ref
    from axoplan.planner.specs import Job, load_model

    m = load_model(model)
    job = Job(gpus, global_batch, seq_len or m.seq_len).validate()
    plan = Plan.from_row(chosen)
    if ex.placement:  # an order equivalent to the framework's own (axes of size 1 take no place): named as its own
        plan = dataclasses.replace(plan, order=ex.placement)
    files = write_framework_dir(out, framework, plan, m, job, profile, ex, portable_ref(model), chosen=chosen,
                                command=_command_line(), steps=steps)
    click.echo(f"chose pp={plan.pp} gx={plan.gx} gy={plan.gy} gz={plan.gz} gdata={plan.gdata} order {plan.order}, "
               f"micro-batch {plan.micro_batch}, checkpointing {'on' if plan.checkpointing else 'off'} for {framework} "
               f"(execution {ex.name}): predicted {chosen['batch_time_s']:.4g} s per batch, "
               f"{chosen['memory_gib']:.3g} GiB per GPU")
    for p in files.values():
        click.echo(f"wrote {p}")
    click.echo(f"submit it: sbatch {shlex.quote(str(Path(out) / SLURM_NAME))}")


# ---- validate ---------------------------------------------------------------------------------------
MIN_TIED_RUNS = 3  # fewer cannot score a ranking (Kendall tau, best in top 3)


def _tied_count(model, machine, gpus, global_batch, seq_len, micro_batch, checkpointing, pp="all", vpp=None,
                schedule="all") -> int:
    """How many distinct grids/orders validate runs by default: those the ranking calls tied with the best
    (the evidence cannot order them), at least MIN_TIED_RUNS; said in one line."""
    from axoplan.loop.validate import distinct_configs
    from axoplan.planner.rank import ranking

    r = ranking(model, machine, gpus, global_batch, seq_len=seq_len, micro_batch=micro_batch,
                checkpointing=checkpointing, pp=pp, vpp=vpp, schedule=schedule)
    plan = distinct_configs(r.frame())
    tied = int(plan["tied"].astype(bool).sum())
    n = min(len(plan), max(MIN_TIED_RUNS, tied))
    err = r.uncertainty.expected_error if r.uncertainty else None
    within = f"within +/-{100 * err:.0f}%, the expected error," if err is not None else "(no expected error known)"
    click.echo(f"validating {n} grid(s)/order(s): the best, the {max(tied - 1, 0)} tied with it {within} and "
               f"the next ones up to {MIN_TIED_RUNS} (--top K or --all for more)")
    return n


@click.command("validate")
@_job_options
@click.option("--top", "--top-k", "-k", "top_k", type=inputs.Count(1), default=None,
              help="Run the K best distinct grids/orders (--top-k: the same). Default: those tied with the best "
                   "(within the expected error of its time), at least 3.")
@click.option("--all", "run_all", is_flag=True, help="Run every feasible grid and order.")
@click.option("--steps", type=int, default=10, show_default=True, help="Training steps per run.")
@click.option("--warmup", type=int, default=3, show_default=True, help="Steps left out of the median.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Passes over the candidates (round robin); each candidate's time is the median of its runs.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Seconds before a run is killed and recorded as timeout.")
@click.option("--micro-batch", type=int, default=None, help="Fix the micro-batch size of every candidate.")
@click.option("--checkpointing", type=click.Choice(["both", "on", "off"]), default="both", show_default=True)
@click.option("--out", "-o", "out", default="validate-out", show_default=True, type=click.Path(file_okay=False))
@click.option("--resume", is_flag=True, help="Continue the sweep in --out, skipping recorded candidates.")
@click.option("--slurm", is_flag=True, help="Write a Slurm job array of the candidates instead of running them.")
@click.option("--collect", "collect_dir", default=None, type=click.Path(file_okay=False),
              help="Score a --slurm sweep's runs in this folder, or read back one emitted run folder "
                   "(any --framework) into its results.csv.")
@execution_option
@pipeline_options
def validate(model, machine, gpus, global_batch, seq_len, top_k, run_all, steps, warmup, repeats, timeout_s,
             micro_batch, checkpointing, out, resume, slurm, collect_dir, execution, pp, vpp, pipeline_schedule):
    """Run the top-k (or --all) candidates here with torchrun and score the ranking."""
    from axoplan.loop import validate as sweeps

    bundled_execution(execution, "validate")

    if collect_dir is not None:
        from axoplan.loop.run_logs import collect_run, is_run_folder

        if not Path(collect_dir).is_dir():
            raise UserError(f"--collect: '{collect_dir}' is not a folder")
        if is_run_folder(collect_dir) and not (Path(collect_dir) / sweeps.SWEEP_FILE).exists():
            collect_run(collect_dir, echo=click.echo)  # one run of `axoplan emit`, any framework
            return
        sweeps.collect(collect_dir, echo=click.echo)
        return
    _require(model=model, machine=machine, gpus=gpus, global_batch=global_batch)
    from axoplan.device import mismatch, warn
    from axoplan.planner.profile_reader import load_profile

    warn(mismatch(load_profile(machine)))  # the runs measure this machine, the ranking is the profile's
    pp = parse_pp(pp)
    if top_k is None and not run_all:
        top_k = _tied_count(model, machine, gpus, global_batch, seq_len, micro_batch, checkpointing, pp, vpp,
                            pipeline_schedule)
    sw = sweeps.Sweep(model=model, machine=machine, gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                 top_k=None if run_all else top_k, all=run_all, steps=steps, warmup_steps=warmup, timeout_s=timeout_s,
                 micro_batch=micro_batch, checkpointing=checkpointing, repeats=repeats, pp=pp, vpp=vpp,
                 schedule=pipeline_schedule)
    if slurm:
        path = sweeps.write_slurm_array(sw, out)
        click.echo(f"wrote {path} and one run directory per candidate under {Path(out) / 'runs'}")
        click.echo(f"submit: sbatch {shlex.quote(str(path))}; then: axoplan validate --collect {shlex.quote(str(out))}")
        return
    sweeps.run_sweep(sw, out, resume=resume, echo=click.echo)


# ---- refit ------------------------------------------------------------------------------------------
@click.command("refit")
@click.option("--results", "-r", required=True, multiple=True, type=inputs.SafePath(),
              help="results.csv of axoplan validate, or a run folder of axoplan emit (any framework) after its run; "
                   "repeat it to fit several.")
@click.option("--machine", "-p", required=True, type=inputs.TEXT, help="The profile to correct (name or YAML path).")
@click.option("--out", "-o", "out", required=True, type=inputs.SafePath(dir_okay=False),
              help="New profile YAML to write.")
@click.option("--params", default="auto", show_default=True,
              help="Corrections to fit, comma-separated (gemm_scale, elementwise_scale, intra_bw_scale, "
                   "inter_bw_scale, latency_scale, kernel_overhead_scale, step_overhead_s, "
                   "collective_overhead_s, overlap_efficiency), or auto.")
@click.option("--no-loo", is_flag=True, help="Skip the leave-one-out check.")
def refit(results, machine, out, params, no_loo):
    """Fit the profile's corrections to measured runs; report error before, after and leave-one-out."""
    from axoplan.loop.refit import format_report
    from axoplan.loop.refit import refit as refit_api

    ps = "auto" if params.strip() == "auto" else [p.strip() for p in params.split(",") if p.strip()]
    from axoplan import progress

    with progress.on_stderr("refit"):
        r = refit_api(list(results), machine, out, ps, loo=not no_loo)
    click.echo(format_report(r))
    click.echo(f"wrote {out}")
