"""`axoplan models | profiles | rank | explain`: the planner's commands (no torch)."""
from __future__ import annotations

import dataclasses
import functools
import io
import re
import time

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from axoplan import inputs
from axoplan.allocator import keep_freed_memory
from axoplan.cli import tablefit
from axoplan.errors import UserError
from axoplan.planner.execution import PRESETS as EXECUTIONS
from axoplan.planner.pipeline import SCHEDULES
from axoplan.planner.space import PLACEMENTS
from axoplan.planner.profile_reader import load_profile, profile_paths
from axoplan.planner.rank import COLUMNS
from axoplan.planner.rank import explain as explain_api
from axoplan.planner.rank import ranking as rank_api
from axoplan.planner.specs import load_model, preset_names


def _console(buf: io.StringIO | None = None) -> Console:
    # emoji=False: a table of numbers and names never turns ':name:' into an emoji (nor loads rich's emoji codes)
    # one width for the terminal and for piped output: tablefit.width (the terminal's, $COLUMNS or 100)
    if buf is not None:
        return Console(file=buf, width=tablefit.width(), color_system=None, highlight=False, emoji=False)
    return Console(highlight=False, emoji=False, width=tablefit.width())


def _emit(text: str, output: str | None) -> None:
    if output:
        from axoplan.atomic import atomic_write_text

        atomic_write_text(output, text)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(text, nl=not text.endswith("\n"))


def _render(renderables) -> str:
    buf = io.StringIO()
    con = _console(buf)
    for r in renderables:
        con.print(r)
    return buf.getvalue()


@click.command("models")
def models():
    """List the bundled model presets."""
    t = Table(title="model presets (--model NAME, or a YAML path)")
    for col in ("name", "params", "layers", "hidden", "heads", "kv", "ffn", "vocab", "seq", "mlp", "description"):
        t.add_column(col)
    for n in preset_names():
        m = load_model(n)
        p = m.n_params
        params = f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.2f}M"
        t.add_row(n, params, str(m.n_layers), str(m.hidden), str(m.n_heads), str(m.kv_heads), str(m.ffn),
                  str(m.vocab), str(m.seq_len), m.mlp, m.description)
    _print_fitted(t, ["description", "mlp", "kv", "seq"])


def _print_fitted(t: Table, drop_first: list[str], wrap: tuple[str, ...] = ()) -> None:
    """Print a listing whose first column is the name to type: never cut, columns left out by priority."""
    cols = tablefit.width()
    tablefit.keep_whole(t, t.columns[0].header)
    note = tablefit.dropped_note(tablefit.fit(t, cols, drop_first, wrap), cols)
    con = _console()
    con.print(t)
    if note:
        con.print(note)


@click.command("profiles")
def profiles():
    """List the bundled machine profiles."""
    t = Table(title="machine profiles (--machine NAME, or a YAML path)")
    for col in ("name", "device", "GPUs/node", "memory GiB", "peak TFLOP/s", "GEMM ceiling", "GEMM table",
                "intra busbw GB/s", "inter busbw GB/s", "path"):
        t.add_column(col)
    for name, path in sorted(profile_paths().items()):
        try:
            p = load_profile(str(path))
        except UserError as e:
            t.add_row(name, "(invalid)", "", "", "", "", "", "", "", str(e))
            continue
        intra = ", ".join(f"{s}@{st}:{bw / 1e9:.0f}" for s, st, bw in p.intra_groups)
        t.add_row(name, p.device, str(p.gpus_per_node), f"{p.mem_capacity / 2**30:.0f}", f"{p.peak_tflops:.4g}",
                  f"{p.gemm_ceiling / 1e12:.4g}", "yes" if p.gemm_table is not None else "curve", intra,
                  f"{p.inter_busbw / 1e9:.1f}", str(path))
    _print_fitted(t, ["path", "GEMM table", "inter busbw GB/s", "GEMM ceiling", "intra busbw GB/s"],
                  wrap=("intra busbw GB/s", "path", "device"))


def _common(f):
    f = click.option("--model", "-m", required=True, type=inputs.TEXT,
                     help="Preset name (axoplan models) or model YAML path.")(f)
    f = click.option("--machine", "-p", required=True, type=inputs.TEXT,
                     help="Profile name (axoplan profiles) or profile YAML path.")(f)
    f = click.option("--gpus", "-g", required=True, type=inputs.GPUS, help="Number of GPUs.")(f)
    f = click.option("--global-batch", "-b", required=True, type=inputs.GLOBAL_BATCH,
                     help="Global batch in sequences.")(f)
    f = click.option("--seq-len", "-s", type=inputs.SEQ_LEN, default=None,
                     help="Sequence length (default: the model's).")(f)
    f = click.option("--no-overlap", is_flag=True, help="Model the trainer with OAR/ORS/OAG off.")(f)
    return f


def execution_option(f):
    """--execution: how the framework runs the step (axoplan/planner/execution.py); planning commands only, as
    the bundled trainer (emit, validate, dryrun) runs its own."""
    return click.option("--execution", "-e", type=inputs.TEXT, default="axoplan", show_default=True,
                        help=f"Framework execution: {', '.join(EXECUTIONS)}, or a YAML file of its fields.")(f)


def bundled_execution(execution: str, command: str) -> None:
    """Commands that run the bundled trainer (validate, dryrun) take --execution for one vocabulary with the
    planning commands; another framework's execution is one sentence, not a run of the wrong trainer."""
    from axoplan.planner.execution import load_execution

    ex = load_execution(execution)
    if not ex.bundled:
        raise UserError(f"--execution {ex.name}: '{command}' runs the bundled trainer, whose execution is "
                        f"'axoplan'; rank, explain and scale plan for {ex.name}")


def _units(cols) -> tuple[float, str, float, str]:
    """MiB and GFLOP/s when every listed value is below 1 GiB / 1 TFLOP/s (CPU models), else GiB and TFLOP/s."""
    mem, tf = np.asarray(cols["memory_gib"], dtype=float), np.asarray(cols["tflops_per_gpu"], dtype=float)
    mem, tf = mem[np.isfinite(mem)], tf[np.isfinite(tf)]
    small_mem = mem.size > 0 and float(mem.max()) < 1
    small_tf = tf.size > 0 and float(tf.max()) < 1
    return ((1024.0, "mem MiB") if small_mem else (1.0, "mem GiB")) + (
        (1000.0, "GFLOP/s/GPU") if small_tf else (1.0, "TFLOP/s/GPU"))


# the rank table's columns left out first when it is wider than the terminal (csv/json keep them all)
RANK_DROP_FIRST = ["TFLOP/s/GPU", "GFLOP/s/GPU", "compute s", "order", "exposed comm s", "ckpt"]


def pipeline_label(pp, vpp, schedule) -> str:
    """A pipeline in one cell: '-' without one, '4' for 1f1b over 4 stages, '4 v2' interleaved with 2 per rank."""
    if pp == 1:
        return "-"
    return f"{pp}" if schedule == "1f1b" else f"{pp} v{vpp}"


def _table(cols, title: str) -> Table:
    """The rank columns (a Ranking's numpy columns or a DataFrame of COLUMNS) as a table; the pipeline's
    columns (pp, with vpp where interleaved, and its bubble) where a row has one."""
    t = Table(title=title)
    piped = bool(np.any(np.asarray(cols["pp"]) > 1))
    mem_scale, mem_head, fl_scale, fl_head = _units(cols)
    heads = ["rank", "gx x gy x gz x gdata", "order"] + (["pp"] if piped else []) + [
        "mbs", "ckpt", "batch s", "compute s", "exposed comm s"] + (["bubble s"] if piped else []) + [
        mem_head, fl_head, "% peak"]
    reasons = not np.all(cols["feasible"])
    if reasons:
        heads.append("reason")
    for col in heads:
        t.add_column(col, justify="right" if col not in ("order", "reason") else "left")
    names = ("rank", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s", "compute_s",
             "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak", "feasible", "reason", "pp", "vpp",
             "schedule", "bubble_s")
    tie = np.asarray(cols["tied"], dtype=bool) if "tied" in cols else np.zeros(len(cols["rank"]), dtype=bool)
    # times to 3 significant digits: the published evidence puts their error at several percent
    for (rk, gx, gy, gz, gdata, order, mbs, ckpt, bt, comp, exp, mem, tf, pct, ok, why, pp, vpp, sch,
         bub), tied in zip(zip(*(cols[n] for n in names)), tie):
        row = [(str(rk) + ("~" if tied and rk != 1 else "")) if ok else "-", f"{gx} x {gy} x {gz} x {gdata}", order] + (
            [pipeline_label(pp, vpp, sch)] if piped else []) + [
            str(mbs), "on" if ckpt else "off", f"{bt:.3g}", f"{comp:.3g}", f"{exp:.3g}"] + (
            [f"{bub:.3g}"] if piped else []) + [f"{mem * mem_scale:.1f}", f"{tf * fl_scale:.1f}", f"{pct:.1f}"]
        if reasons:
            row.append(why)
        t.add_row(*row)
    return t


def pipeline_options(f, default_pp="all"):
    """--pp, --vpp and --schedule: the pipeline axis (planner/pipeline.py)."""
    for opt in reversed((
            click.option("--pp", default=default_pp, show_default=True,
                         help="Pipeline stages: N, or all (every degree the execution runs)." if default_pp == "all"
                         else "Pipeline stages (the grid is each stage's: gx*gy*gz*gdata*pp = --gpus)."),
            click.option("--vpp", type=inputs.Count(1), default=None,
                         help="Virtual stages per pipeline rank (interleaved-1f1b)."),
            click.option("--schedule", "pipeline_schedule", type=click.Choice(["all", *SCHEDULES]),
                         default="all" if default_pp == "all" else None,
                         help="Pipeline schedule" + (" (default: all)." if default_pp == "all" else
                                                     " (default: interleaved-1f1b with --vpp > 1, else 1f1b).")))):
        f = opt(f)
    return f


# the placements a search covers (rank, scale): one, or every distinct one
search_order_option = click.option(
    "--order", default="all", show_default=True, metavar="ORDER", type=click.Choice(list(PLACEMENTS) + ["all", "every"]),
    help="Placement order of x, y, z, innermost first, data outside them (all: every distinct one, the pipeline axis "
         "outermost); with p among them (e.g. xyzp) the pipeline axis sits there, inside data; every: all, and each "
         "pipeline inside data too.")


def parse_pp(pp, allow_all: bool = True):
    if allow_all and str(pp) == "all":
        return "all"
    return inputs.count(pp, "--pp", 1, inputs.MAX_GPUS)


_STAGE = re.compile(r"stage (\d+) \(rank \d+, (\d+) blocks?\)")


def _window_rows(windows) -> list[tuple]:
    """explain's window rows as printed; a pipeline's consecutive (virtual) stages that print the same times and
    hold as many blocks are one row per pass ("stages 1-38, 2 blocks each"), the forward's runs before the
    backward's, so that a deep pipeline's table stays readable."""
    rows = [(str(r[0]), r.layer, str(r.count_per_micro_batch), f"{r.compute_s:.4g}", f"{r.window_s:.4g}",
             f"{r.exposed_comm_s:.4g}") for r in windows.itertuples(index=False)]
    stages = [_STAGE.fullmatch(r[1]) for r in rows]
    if not rows or not all(stages):
        return rows
    out = []
    for pass_name in dict.fromkeys(r[0] for r in rows):
        runs = []  # [first stage, last stage, the first stage's row, its blocks and printed numbers]
        for r, m in zip(rows, stages):
            if r[0] != pass_name:
                continue
            v, key = int(m.group(1)), (m.group(2), r[2:])
            if runs and runs[-1][3] == key and runs[-1][1] == v - 1:
                runs[-1][1] = v
            else:
                runs.append([v, v, r, key])
        for a, b, first, (n, numbers) in runs:
            label = first[1] if a == b else f"stages {a}-{b}, {n} block{'s' if n != '1' else ''} each"
            out.append((pass_name, label, *numbers))
    return out


def _format(df, fmt: str) -> str:
    import json

    if fmt == "csv":
        return df[COLUMNS].to_csv(index=False)
    recs = json.loads(df[COLUMNS].to_json(orient="records"))
    return json.dumps(recs, indent=1) + "\n"


@click.command("rank")
@_common
@click.option("--top", "-k", type=inputs.Count(1), default=10, show_default=True, help="Show the best K feasible configurations.")
@click.option("--all", "show_all", is_flag=True, help="Every candidate, infeasible ones too (with their reason).")
@search_order_option
@click.option("--micro-batch", type=inputs.MICRO_BATCH, default=None, help="Fix the micro-batch size (sequences per GPU).")
@click.option("--checkpointing", type=click.Choice(["both", "on", "off"]), default="both", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--output", "-o", type=inputs.SafePath(dir_okay=False), default=None, help="Write to this file (atomically).")
@execution_option
@pipeline_options
def rank(model, machine, gpus, global_batch, seq_len, no_overlap, top, show_all, order, micro_batch, checkpointing,
         fmt, output, execution, pp, vpp, pipeline_schedule):
    """Rank every configuration: pipeline (pp, vpp, schedule) x grid (gx, gy, gz, gdata) x order x micro-batch x
    checkpointing."""
    if top is not None and top <= 0:
        raise UserError(f"--top must be a positive integer, got {top}")
    keep_freed_memory()
    t0 = time.perf_counter()
    r = rank_api(model, machine, gpus, global_batch, seq_len=seq_len, top=None if show_all else top,
                 include_infeasible=show_all, order=order, micro_batch=micro_batch, overlap=not no_overlap,
                 checkpointing=checkpointing, execution=execution, pp=parse_pp(pp), vpp=vpp,
                 schedule=pipeline_schedule)
    dt = time.perf_counter() - t0
    if fmt != "table":
        _emit(_format(r.frame(), fmt), output)
        return
    title = (f"{r.model.name} on {gpus} x {r.profile.name} GPUs, global batch {global_batch} x {r.job.seq_len} tokens: "
             f"{r.candidates} candidates, {r.feasible} feasible, ranked in {dt * 1e3:.0f} ms")
    table = _table(r.columns, title)
    width = tablefit.width()
    parts = [table]
    note = tablefit.dropped_note(tablefit.fit(table, width, RANK_DROP_FIRST, wrap=("reason",)), width,
                                 ", --format csv all")
    if note:
        parts.append(note)
    if r.uncertainty is not None:
        n_tied = int(np.sum(np.asarray(r.columns["tied"], dtype=bool))) - 1
        parts.append(r.uncertainty.show() + (
            f"; ~ marks the {n_tied} listed configuration{'s' * (n_tied != 1)} within it of the best (tied: the "
            "evidence cannot order them; validate runs them)" if n_tied > 0 else ""))
    if r.extrapolated_gemms:
        parts.append(f"note: {r.extrapolated_gemms} listed configurations use GEMM shapes outside the "
                     f"profile's measured table (extrapolated)")
    if no_overlap:
        parts.append("overlap (OAR/ORS/OAG) modelled as off")
    if not r.execution.bundled:
        parts.append(f"execution {r.execution.name}: {r.execution.differences()} (explain gives its sources); "
                     f"the bundled trainer runs only 'axoplan'; emit --framework writes a run for torchtitan, "
                     f"megatron or axonn (docs/frameworks.md)")
    _emit(_render(parts), output)


def parse_grid(grid: str) -> tuple[int, int, int, int]:
    try:
        vals = tuple(inputs.count(v, "--grid", 1, inputs.MAX_GPUS) for v in grid.split(","))
    except UserError:
        vals = ()
    if len(vals) != 4:
        raise UserError(f"--grid must be four positive integers GX,GY,GZ,GDATA (each at most {inputs.MAX_GPUS:,}), "
                        f"got '{grid}'")
    return vals


def one_config(f):
    """The options of commands about one configuration (explain, dryrun), on top of _common's."""
    for opt in reversed((
            click.option("--grid", required=True, help="GX,GY,GZ,GDATA"),
            click.option("--order", default="xyz", show_default=True, metavar="ORDER", type=click.Choice(list(PLACEMENTS)),
                         help="x, y, z innermost first, data outside them; p among them places the pipeline axis "
                              "(else outermost)."),
            click.option("--micro-batch", type=inputs.MICRO_BATCH, default=None,
                         help="Default: the fastest feasible for this grid (where none fits, the one needing the least memory)."),
            click.option("--checkpointing", type=click.Choice(["best", "on", "off"]), default="best",
                         show_default=True),
            click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True),
            click.option("--output", "-o", type=inputs.SafePath(dir_okay=False), default=None))):
        f = opt(f)
    return _common(f)


@click.command("explain")
@one_config
@execution_option
@functools.partial(pipeline_options, default_pp="1")
def explain(model, machine, gpus, global_batch, seq_len, no_overlap, grid, order, micro_batch, checkpointing, fmt,
            output, execution, pp, vpp, pipeline_schedule):
    """Where the time and memory of one configuration go: per layer (per pipeline stage), per collective, per
    memory kind."""
    ck = None if checkpointing == "best" else checkpointing == "on"
    ex = explain_api(model, machine, gpus, global_batch, parse_grid(grid), order=order, seq_len=seq_len,
                     micro_batch=micro_batch, checkpointing=ck, overlap=not no_overlap, execution=execution,
                     pp=parse_pp(pp, allow_all=False), vpp=vpp, schedule=pipeline_schedule)
    if fmt == "json":
        import json

        out = {"summary": json.loads(ex.summary[COLUMNS].to_json(orient="records"))[0],
               "collectives": json.loads(ex.collectives.to_json(orient="records")),
               "windows": json.loads(ex.windows.to_json(orient="records")),
               "memory": json.loads(ex.memory.to_json(orient="records")), "notes": ex.notes,
               "execution": dataclasses.asdict(ex.execution)}
        _emit(json.dumps(out, indent=1) + "\n", output)
        return
    width = tablefit.width()
    conf = _table(ex.summary, "configuration")
    parts = [conf]
    left = tablefit.fit(conf, width, RANK_DROP_FIRST)
    t = Table(title="collectives per step (time per call from bytes / bus bandwidth + latency)")
    for col in ("layer", "phase", "collective", "axis", "group", "stride", "MiB/call", "busbw GB/s", "ms/call",
                "calls", "total s"):
        t.add_column(col, justify="left" if col in ("layer", "phase", "collective", "axis") else "right")
    for r in ex.collectives.itertuples(index=False):
        t.add_row(r.layer, r.phase, r.collective, r.axis, str(r.group_size), str(r.stride), f"{r.bytes / 2**20:.3g}",
                  f"{r.busbw_gbs:.1f}", f"{r.time_per_call_s * 1e3:.3g}", str(r.calls_per_step), f"{r.total_s:.4g}")
    left += tablefit.fit(t, width, ["stride", "busbw GB/s", "MiB/call", "axis"])
    parts.append(t)
    w = Table(title="layer windows per step (compute vs window time; the difference is exposed communication)")
    for col in ("pass", "layer", "x per micro-batch", "compute s", "window s", "exposed comm s"):
        w.add_column(col, justify="left" if col in ("pass", "layer") else "right")
    shown = _window_rows(ex.windows)
    for row in shown:
        w.add_row(*row)
    parts.append(w)
    mtab = Table(title="memory per GPU")
    mtab.add_column("kind")
    mtab.add_column("GiB", justify="right")
    for r in ex.memory.itertuples(index=False):
        mtab.add_row(r.kind, f"{r.gib:.2f}")
    parts.append(mtab)
    parts += [f"note: {n}" for n in ex.notes]
    if len(shown) < len(ex.windows):
        parts.append(f"note: consecutive pipeline stages with the same times are one row ({len(ex.windows)} "
                     f"stage rows as {len(shown)}; --format json lists every stage)")
    note = tablefit.dropped_note(left, width, ", --format json all")
    if note:
        parts.append(note)
    if ex.uncertainty is not None:
        parts.append(ex.uncertainty.show())
    _emit(_render(parts), output)
