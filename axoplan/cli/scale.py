"""`axoplan scale`: the best configuration, speed, efficiency and time to train across GPU counts."""
from __future__ import annotations

import json
import math
import sys

import click
import numpy as np
import pandas as pd

from axoplan import inputs, plots
from axoplan.atomic import atomic_write_text, check_writable, write_output
from axoplan.errors import UserError
from axoplan.cli.plan import execution_option, parse_pp, pipeline_label, pipeline_options, search_order_option
from axoplan.planner.execution import load_execution
from axoplan.studies.scale import (
    COLUMNS,
    parse_gpus,
    parse_pairs,
    parse_tokens,
    strong_scaling,
    weak_scaling,
)


def _table(df: pd.DataFrame) -> str:
    """A readable table: the columns people decide with, units in the header."""
    show = pd.DataFrame({
        "model": df["model"], "GPUs": df["gpus"],
        "grid x,y,z,d": [f"{int(a)},{int(b)},{int(c)},{int(d)}" if f else "-"
                         for a, b, c, d, f in zip(df["gx"].fillna(0), df["gy"].fillna(0), df["gz"].fillna(0),
                                                  df["gdata"].fillna(0), df["feasible"])],
        "order": df["order"].fillna("-"),
        "pp": [pipeline_label(int(p), int(v), sch) if f else "-"
               for p, v, sch, f in zip(df["pp"].fillna(1), df["vpp"].fillna(1), df["schedule"], df["feasible"])],
        "mb": [str(int(x)) if f else "-" for x, f in zip(df["micro_batch"].fillna(0), df["feasible"])],
        "ckpt": [("yes" if x else "no") if f else "-" for x, f in zip(df["checkpointing"], df["feasible"])],
        "s/batch": [f"{x:.3g}" if np.isfinite(x) else "-" for x in df["batch_time_s"].astype(float)],
        "PFLOP/s": [f"{x:.4g}" if np.isfinite(x) else "-" for x in df["pflops"].astype(float)],
        "% peak": [f"{x:.1f}" if np.isfinite(x) else "-" for x in df["pct_of_peak"].astype(float)],
        "efficiency": [f"{x:.3f}" if np.isfinite(x) else "-" for x in df["efficiency"].astype(float)],
    })
    if not (show["pp"] != "-").any():  # as rank: the pipeline's column only where a row has one
        show = show.drop(columns="pp")
    if df["time_to_train_s"].notna().any():
        show["time to train"] = [s or "-" for s in df["time_to_train"]]
    text = show.to_string(index=False)
    notes = [f"efficiency: useful model FLOP per GPU-second against {df.attrs.get('baseline_gpus')} GPUs"]
    bad = df[~df["feasible"].astype(bool)]
    for _, r in bad.iterrows():
        notes.append(f"{r['model']} on {r['gpus']} GPUs: {r['reason']}")
    return text + "\n" + "\n".join(notes)


def _json(df: pd.DataFrame) -> str:
    def clean(v):
        if isinstance(v, (np.integer,)):
            return int(v)
        if isinstance(v, (np.floating, float)):
            return None if not math.isfinite(float(v)) else float(v)
        if isinstance(v, np.bool_):
            return bool(v)
        if v is pd.NA:
            return None
        return v

    rows = [{c: clean(r[c]) for c in COLUMNS} for _, r in df.iterrows()]
    return json.dumps(rows, indent=1) + "\n"


def render(df: pd.DataFrame, fmt: str) -> str:
    if fmt == "csv":
        return df[COLUMNS].to_csv(index=False)
    if fmt == "json":
        return _json(df)
    return _table(df) + "\n"


def plot_png(df: pd.DataFrame, title: str) -> bytes:
    """Time per batch (with the ideal 1/GPUs line) and parallel efficiency against GPUs, log axes."""
    plt = plots.pyplot()
    from matplotlib.ticker import NullFormatter

    ok = df[df["feasible"].astype(bool)].sort_values("gpus")
    g = ok["gpus"].to_numpy(dtype=float)
    t = ok["batch_time_s"].to_numpy(dtype=float)
    eff = ok["efficiency"].to_numpy(dtype=float)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    a1.loglog(g, t, "o-", label="predicted (best configuration)")
    if len(g):
        i0 = int(np.argmin(g))
        weak = ok["model"].nunique() > 1
        ideal = t[i0] * (np.ones_like(g) if weak else g[i0] / g)
        a1.loglog(g, ideal, "--", color="gray", label="ideal (constant)" if weak else "ideal (1/GPUs)")
        for x, y, m in zip(g, t, ok["model"]):
            if weak:
                a1.annotate(m, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    a1.set_xlabel("GPUs")
    a1.set_ylabel("time per batch (s)")
    a1.set_title("time per batch")
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    a2.semilogx(g, eff, "o-", color="C1")
    a2.axhline(1.0, ls="--", color="gray")
    a2.set_ylim(0, max(1.1, float(np.nanmax(eff)) * 1.05 if len(eff) else 1.1))
    a2.set_xlabel("GPUs")
    a2.set_ylabel("parallel efficiency")
    a2.set_title(f"efficiency vs {df.attrs.get('baseline_gpus')} GPUs")
    a2.grid(True, which="both", alpha=0.3)
    for x, y, p in zip(g, eff, ok["pflops"].to_numpy(dtype=float)):
        a2.annotate(f"{p:.3g} PF/s", (x, y), textcoords="offset points", xytext=(0, -12), fontsize=7, ha="center")
    for ax in (a1, a2):  # tick at each planned count, written plainly (no 2x10^2 minor labels)
        ax.set_xticks(g)
        ax.set_xticklabels([f"{int(x)}" for x in g], rotation=45 if len(g) > 8 else 0, fontsize=8)
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title)
    fig.tight_layout()
    return plots.png_bytes(fig)


def _progress(i, n, row):
    if sys.stderr.isatty():
        click.echo(f"\r  planned {row['model']} on {row['gpus']} GPUs ({i}/{n})", err=True, nl=(i == n))


@click.command("scale", help="Predict strong or weak scaling: best configuration, time per batch, PFLOP/s, "
                              "parallel efficiency and time to train, per GPU count.")
@click.option("--model", default=None, type=inputs.TEXT, help="Preset name or model YAML (strong scaling).")
@click.option("--machine", required=True, type=inputs.TEXT, help="Machine profile name or YAML path.")
@click.option("--gpus", "gpus_spec", default=None, help="Counts: 128,256,512 or a range 128..8192 (doubling), "
                                                         "96..768x2, 8..64+8.")
@click.option("--weak", "weak_spec", default=None, help="Weak scaling: MODEL:GPUS pairs, e.g. gpt-5b:512,gpt-10b:1024.")
@click.option("--global-batch", type=inputs.GLOBAL_BATCH, required=True,
              help="Sequences per optimizer step (the same at every count).")
@click.option("--seq-len", type=inputs.SEQ_LEN, default=None, help="Tokens per sequence (default: the model's).")
@click.option("--tokens", "tokens_spec", default=None, help="Token budget for time to train, e.g. 2T, 300B.")
@search_order_option
@click.option("--micro-batch", type=inputs.MICRO_BATCH, default=None, help="Fix the micro-batch size.")
@click.option("--no-overlap", is_flag=True, help="Model no communication overlap.")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--output", type=inputs.SafePath(dir_okay=False), default=None,
              help="Write the result here (atomically).")
@click.option("--plot", type=inputs.SafePath(dir_okay=False), default=None, help="Write a PNG plot here.")
@execution_option
@pipeline_options
def scale(model, machine, gpus_spec, weak_spec, global_batch, seq_len, tokens_spec, order, micro_batch, no_overlap,
          fmt, output, plot, execution, pp, vpp, pipeline_schedule):
    if global_batch <= 0:
        raise UserError(f"--global-batch must be a positive integer (sequences), got {global_batch}")
    if seq_len is not None and seq_len <= 0:
        raise UserError(f"--seq-len must be a positive integer, got {seq_len}")
    if micro_batch is not None and micro_batch <= 0:
        raise UserError(f"--micro-batch must be a positive integer, got {micro_batch}")
    if plot is not None and not plot.lower().endswith(".png"):
        raise UserError(f"--plot writes a PNG; give a file name ending in .png, got '{plot}'")
    for path, what in ((output, "--output"), (plot, "--plot")):
        if path is not None:
            check_writable(path, what)  # before the planning, so a bad path loses nothing
    tokens = parse_tokens(tokens_spec) if tokens_spec is not None else None
    kw = {"order": order, "micro_batch": micro_batch, "overlap": not no_overlap,
          "execution": load_execution(execution), "pp": parse_pp(pp), "vpp": vpp, "schedule": pipeline_schedule}
    if weak_spec is not None:
        if model is not None or gpus_spec is not None:
            raise UserError("--weak takes MODEL:GPUS pairs; leave out --model and --gpus")
        df = weak_scaling(parse_pairs(weak_spec), machine, global_batch, seq_len, tokens, progress=_progress, **kw)
        title = f"weak scaling on {df.attrs['machine']}, batch {global_batch}"
    else:
        if model is None or gpus_spec is None:
            raise UserError("give --model and --gpus (strong scaling) or --weak MODEL:GPUS,... (weak scaling)")
        df = strong_scaling(model, machine, parse_gpus(gpus_spec), global_batch, seq_len, tokens,
                            progress=_progress, **kw)
        title = f"{df['model'].iloc[0]} on {df.attrs['machine']}, batch {global_batch}"
    text = render(df, fmt)
    if fmt == "table" and not kw["execution"].bundled:
        text += f"execution {kw['execution'].name}: {kw['execution'].differences()}\n"
    png = plot_png(df, title) if plot else None  # made before either output is written: both or neither
    if output:
        atomic_write_text(output, text)
    else:
        click.echo(text, nl=False)
    if plot:
        write_output(plot, png)
        click.echo(f"plot written to {plot}", err=True)
