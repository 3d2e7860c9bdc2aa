"""`axoplan dryrun`: one real step of the bundled trainer as rank 0 of N, under fake tensors and a
fake process group, beside what the planner predicts for it (memory per kind, every collective)."""
from __future__ import annotations

import json

import click
from rich.table import Table

from axoplan.cli.plan import _emit, _render, bundled_execution, execution_option, one_config, parse_grid
from axoplan.errors import UserError


@click.command("dryrun")
@one_config
@execution_option
@click.option("--strict", is_flag=True, help="Exit 1 when the configuration does not fit (the verdict is printed either way).")
def dryrun(model, machine, gpus, global_batch, seq_len, no_overlap, grid, order, micro_batch, checkpointing, fmt,
           output, execution, strict):
    """Will it fit? Run one training step of the bundled trainer as rank 0 of GPUS with fake tensors (no GPU,
    almost no memory), tracking every allocation, and show the traced peak memory per GPU by kind and every
    collective of the step beside the planner's prediction."""
    bundled_execution(execution, "dryrun")
    try:
        from axoplan.runtime.dryrun import compare
    except ImportError as e:
        raise UserError(f"'axoplan dryrun' runs the bundled trainer and needs torch, which is not installed "
                        f"({e.name or e}): pip install 'axoplan[runtime]'") from None
    if output:
        from axoplan.atomic import check_writable

        check_writable(output, "--output")  # before the trace, which takes seconds to minutes
    g = parse_grid(grid)
    if g[0] * g[1] * g[2] * g[3] != gpus:
        raise UserError(f"--grid {grid} has {g[0] * g[1] * g[2] * g[3]} GPUs, not the {gpus} of --gpus")
    ck = None if checkpointing == "best" else checkpointing == "on"
    from axoplan import progress

    with progress.on_stderr("dryrun"):  # a large model takes several seconds to trace
        progress.step(f"tracing one training step as rank 0 of {gpus} with fake tensors")
        r = compare(model, machine, gpus, global_batch, g, order=order, seq_len=seq_len, micro_batch=micro_batch,
                    checkpointing=ck, overlap=not no_overlap)
    if fmt == "json":
        _emit(json.dumps(r, indent=1) + "\n", output)
    else:
        _emit(_render(_report(model, gpus, r)), output)
    if strict and not r["fits"]:
        raise SystemExit(1)


def _gib(x: float) -> str:
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3g}"


def verdict(r: dict) -> str:
    """One line: does the traced step fit in what the profile leaves for tensors, and by how much (GiB)."""
    used, avail = r["traced_memory_gib"], r["available_gib"]
    budget = f"{_gib(avail)} GiB available ({r['capacity_gib']:.4g} capacity - {r['headroom_gib']:.3g} headroom)"
    if r["fits"]:
        return f"fits: traced {_gib(used)} GiB per GPU of the {budget}, {_gib(avail - used)} GiB left"
    return (f"does NOT fit: traced {_gib(used)} GiB per GPU, {_gib(used - avail)} GiB over the {budget}; try a "
            "larger gz, checkpointing or a smaller micro-batch")


def _report(model, gpus, r) -> list:
    c = r["config"]
    small = r["traced_memory_gib"] < 1  # small jobs read better in MiB
    unit, scale = ("MiB", 1024) if small else ("GiB", 1)
    head = (f"{model}: rank 0 of {gpus} ({c['gx']} x {c['gy']} x {c['gz']} x {c['gdata']}, order {c['order']}, "
            f"micro-batch {c['micro_batch']}, checkpointing {'on' if c['checkpointing'] else 'off'}, {c['dtype']}), "
            f"one training step traced with fake tensors")
    m = Table(title=f"peak memory per GPU ({unit}), by kind at the peak")
    for col in ("kind", "predicted", "traced"):
        m.add_column(col, justify="left" if col == "kind" else "right")
    for kind, v in r["memory_by_kind"].items():
        m.add_row(kind, f"{v['predicted'] * scale:.3f}", f"{v['traced'] * scale:.3f}")
    err = 100 * (r["predicted_memory_gib"] / r["traced_memory_gib"] - 1) if r["traced_memory_gib"] else 0.0
    m.add_row("total", f"{r['predicted_memory_gib'] * scale:.3f}", f"{r['traced_memory_gib'] * scale:.3f}")
    t = Table(title="collectives per step (all calls together)")
    for col in ("layer", "kind", "axis", "calls predicted", "calls traced", "MiB predicted", "MiB traced", ""):
        t.add_column(col, justify="left" if col in ("layer", "kind", "axis", "") else "right")
    differ = 0
    for x in r["collectives"]:
        same = x["predicted_calls"] == x["traced_calls"] and x["predicted_bytes"] == x["traced_bytes"]
        differ += not same
        t.add_row(x["layer"], x["kind"], x["axis"], str(x["predicted_calls"]), str(x["traced_calls"]),
                  f"{x['predicted_bytes'] / 2**20:.4g}", f"{x['traced_bytes'] / 2**20:.4g}", "" if same else "DIFFERS")
    notes = [(f"peak: predicted {r['predicted_memory_gib'] * scale:.2f} {unit} at {r['predicted_peak_at']}; traced "
              f"{r['traced_memory_gib'] * scale:.2f} {unit} at {r['traced_peak_at']} ({err:+.1f}%)"),
             "collectives: " + ("every one equal in calls and bytes" if not differ else f"{differ} differ"),
             "tensors only: the CUDA context, NCCL buffers and allocator fragmentation are the profile's headroom"]
    if c["global_batch_traced"] != c["global_batch"]:
        notes.append(f"traced and predicted with global batch {c['global_batch_traced']} (two micro-batches per step): "
                     f"a step of more micro-batches holds the same peak and repeats their collectives")
    return [head, m, t] + notes + [verdict(r)]
