"""`axoplan dryrun`: one real step of the bundled trainer as rank 0 of N, under fake tensors and a
fake process group, beside what the planner predicts for it (memory per kind, every collective)."""
from __future__ import annotations

import functools
import json

import click
from rich.table import Table

from axoplan.cli.plan import _emit, _render, bundled_execution, execution_option, one_config, parse_grid, parse_pp, pipeline_options
from axoplan.errors import UserError


@click.command("dryrun")
@one_config
@functools.partial(pipeline_options, default_pp="1")
@execution_option
@click.option("--strict", is_flag=True, help="Exit 1 when the configuration does not fit (the verdict is printed either way).")
def dryrun(model, machine, gpus, global_batch, seq_len, no_overlap, grid, order, micro_batch, checkpointing, fmt,
           output, pp, vpp, pipeline_schedule, execution, strict):
    """Will it fit? Run one training step of the bundled trainer as rank 0 of GPUS with fake tensors (no GPU,
    almost no memory), tracking every allocation, and show the traced peak memory per GPU by kind and every
    collective of the step beside the planner's prediction. With --pp, the first and the last pipeline stage
    (the two that can hold the peak), each as its stage's first rank."""
    bundled_execution(execution, "dryrun")
    try:
        from axoplan.runtime.dryrun import compare, compare_pipeline
    except ImportError as e:
        raise UserError(f"'axoplan dryrun' runs the bundled trainer and needs torch, which is not installed "
                        f"({e.name or e}): pip install 'axoplan[runtime]'") from None
    if output:
        from axoplan.atomic import check_writable

        check_writable(output, "--output")  # before the trace, which takes seconds to minutes
    g = parse_grid(grid)
    pp = parse_pp(pp, allow_all=False)
    if g[0] * g[1] * g[2] * g[3] * pp != gpus:
        raise UserError(f"--grid {grid}{f' x --pp {pp}' if pp > 1 else ''} has {g[0] * g[1] * g[2] * g[3] * pp} GPUs, "
                        f"not the {gpus} of --gpus")
    ck = None if checkpointing == "best" else checkpointing == "on"
    from axoplan import progress

    if pp > 1 or vpp not in (None, 1):
        with progress.on_stderr("dryrun"):  # the stages of a large model take several seconds to trace
            progress.step(f"tracing one training step of the first and the last of {pp} pipeline stages")
            r = compare_pipeline(model, machine, gpus, global_batch, g, pp, vpp=vpp, schedule=pipeline_schedule,
                                 order=order, seq_len=seq_len, micro_batch=micro_batch, checkpointing=ck,
                                 overlap=not no_overlap)
        _emit(json.dumps(r, indent=1) + "\n" if fmt == "json" else _render(_pipeline_parts(model, gpus, r)), output)
        return
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
    m = _memory_table(f"peak memory per GPU ({unit}), by kind at the peak", r, unit, scale)
    err = 100 * (r["predicted_memory_gib"] / r["traced_memory_gib"] - 1) if r["traced_memory_gib"] else 0.0
    t, differ = _collective_table("collectives per step (all calls together)", r["collectives"])
    notes = [(f"peak: predicted {r['predicted_memory_gib'] * scale:.2f} {unit} at {r['predicted_peak_at']}; traced "
              f"{r['traced_memory_gib'] * scale:.2f} {unit} at {r['traced_peak_at']} ({err:+.1f}%)"),
             "collectives: " + ("every one equal in calls and bytes" if not differ else f"{differ} differ"),
             "tensors only: the CUDA context, NCCL buffers and allocator fragmentation are the profile's headroom"]
    if c["global_batch_traced"] != c["global_batch"]:
        notes.append(f"traced and predicted with global batch {c['global_batch_traced']} (two micro-batches per step): "
                     f"a step of more micro-batches holds the same peak and repeats their collectives")
    return [head, m, t] + notes + [verdict(r)]


def _memory_table(title: str, r: dict, unit: str, scale: float) -> Table:
    m = Table(title=title)
    for col in ("kind", "predicted", "traced"):
        m.add_column(col, justify="left" if col == "kind" else "right")
    for kind, v in r["memory_by_kind"].items():
        m.add_row(kind, f"{v['predicted'] * scale:.3f}", f"{v['traced'] * scale:.3f}")
    m.add_row("total", f"{r['predicted_memory_gib'] * scale:.3f}", f"{r['traced_memory_gib'] * scale:.3f}")
    return m


def _collective_table(title: str, colls: list) -> tuple[Table, int]:
    t = Table(title=title)
    for col in ("layer", "kind", "axis", "calls predicted", "calls traced", "MiB predicted", "MiB traced", ""):
        t.add_column(col, justify="left" if col in ("layer", "kind", "axis", "") else "right")
    differ = 0
    for x in colls:
        same = x["predicted_calls"] == x["traced_calls"] and x["predicted_bytes"] == x["traced_bytes"]
        differ += not same
        t.add_row(x["layer"], x["kind"], x["axis"], str(x["predicted_calls"]), str(x["traced_calls"]),
                  f"{x['predicted_bytes'] / 2**20:.4g}", f"{x['traced_bytes'] / 2**20:.4g}", "" if same else "DIFFERS")
    return t, differ


def _pipeline_parts(model: str, gpus: int, r: dict) -> list:
    """Per traced stage (the first and the last): memory by kind and every collective and transfer of its
    step beside the planner's, and whether it ran the planner's order."""
    c = r["config"]
    small = max(s["traced_memory_gib"] for s in r["stages"]) < 1
    unit, scale = ("MiB", 1024) if small else ("GiB", 1)
    pipe = f"pp {c['pp']}, {c['schedule']}" + (f", vpp {c['vpp']}" if c["vpp"] > 1 else "")
    parts = [f"{model}: {gpus} GPUs as {pipe} stages of {c['gx']} x {c['gy']} x {c['gz']} x {c['gdata']} "
             f"(order {c['order']}), micro-batch {c['micro_batch']}, checkpointing "
             f"{'on' if c['checkpointing'] else 'off'}, {c['dtype']}; one training step traced with fake tensors "
             f"on the first rank of the first and of the last stage"]
    for s in r["stages"]:
        name = f"{s['stage']} stage (pipeline rank {s['pipeline_rank']}, world rank {s['world_rank']})"
        parts.append(_memory_table(f"{name}: peak memory per GPU ({unit}), by kind at the peak", s, unit, scale))
        t, differ = _collective_table(f"{name}: collectives and transfers per step (all calls together)",
                                      s["collectives"])
        parts.append(t)
        err = 100 * (s["predicted_memory_gib"] / s["traced_memory_gib"] - 1) if s["traced_memory_gib"] else 0.0
        o = s["order"]
        parts += [f"{s['stage']} stage peak: predicted {s['predicted_memory_gib'] * scale:.2f} {unit} at "
                  f"{s['predicted_peak_at']}; traced {s['traced_memory_gib'] * scale:.2f} {unit} at "
                  f"{s['traced_peak_at']} ({err:+.1f}%)",
                  f"{s['stage']} stage collectives and transfers: "
                  + ("every one equal in calls and bytes" if not differ else f"{differ} differ")
                  + f"; its {s['chunks_run']} chunks in the planner's order: {'yes' if o['chunks'] else 'NO'}, "
                  f"sends in order: {'yes' if o['sends'] else 'NO'}, "
                  f"receives the modelled ones, each before its chunk: {'yes' if o['receives'] else 'NO'}"]
    parts.append(f"the job's peak (the planner's worse stage): {r['predicted_memory_gib'] * scale:.2f} {unit}")
    if c["global_batch_traced"] != c["global_batch"]:
        parts.append(f"traced and predicted with global batch {c['global_batch_traced']} "
                     f"({c['micro_batches_traced']} micro-batches per step, past the warm-up): a step of more "
                     f"micro-batches holds the same peak and repeats the steady state")
    parts.append("tensors only: the CUDA context, NCCL buffers and allocator fragmentation are the profile's headroom")
    return parts
