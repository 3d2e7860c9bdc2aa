"""One real training step of the bundled trainer as rank 0 of N, on no GPU and almost no memory.

Tensors are fake (torch's FakeTensorMode: shapes, dtypes and storages, no data) and so is the
process group (backend "fake": every collective returns at once), so the trainer runs its own
code path, the same allocations, frees and collectives, for a job of any size. A MemoryTracer
records the live bytes by kind and the moment of the peak; the Runtime records every collective.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from axoplan.runconfig import LaunchConfig
from axoplan.runtime.grid import build_grid, stage_first_rank
from axoplan.runtime.memtrace import KINDS, MemoryTracer
from axoplan.runtime.train import DTYPES, Resolved, Trainer


@dataclass
class Trace:
    peak_bytes: int
    peak_by_kind: dict  # kind -> bytes live at the peak
    peak_where: str  # the layer and phase of the peak
    collectives: dict  # (layer, kind, axis) -> [calls, bytes]
    max_inflight_rs: int  # the most reduce-scatters in flight at once
    extra: dict = field(default_factory=dict)


def _fake_world(world_size: int, rank: int = 0) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def trace_step(cfg: LaunchConfig, dtype: str = "bf16", modes: tuple = (), fused_optimizer: bool = True,
               rank: int = 0) -> Trace:
    """cfg: the run (grid, order, micro-batch, checkpointing, overlap); dtype: the compute and
    collective dtype of the run being traced (bf16 as on GPUs); modes: more dispatch modes to run the
    step under (each may have attach(trainer), and reset() called where the steady step starts);
    fused_optimizer: AdamW as one fused kernel (GPU runs) or per tensor (the CPU trainer); rank: the world
    rank traced (grid.stage_first_rank gives a pipeline stage's first)."""
    g = cfg.grid
    _fake_world(cfg.world, rank)
    try:
        grid = build_grid(g.gx, g.gy, g.gz, g.gdata, cfg.order, pp=cfg.pp)
        res = Resolved(torch.device("cpu"), "fake", DTYPES[dtype], DTYPES[dtype], blas_tuning=False,
                       fused_optimizer=fused_optimizer)
        tracer = MemoryTracer("states")
        with contextlib.ExitStack() as stack:
            for m in (FakeTensorMode(allow_non_fake_inputs=True), tracer, *modes):
                stack.enter_context(m)
            trainer = Trainer.for_grid(cfg, grid, res)
            trainer.rt.tracer = tracer
            trainer.rt.calls = []
            for m in modes:
                getattr(m, "attach", lambda _: None)(trainer)
            with tracer.kind("transients"):
                trainer.train_step(0)  # creates AdamW's moments: the steady state starts after it
                trainer.rt.calls.clear()
                pipe = getattr(trainer, "pipeline", None)
                ops, transfers = (pipe.log, pipe.transfers) if pipe else ([], [])
                ops.clear()
                transfers.clear()
                trainer.rt.max_inflight_seen = 0
                tracer.reset_peak()
                for m in modes:
                    getattr(m, "reset", lambda: None)()
                trainer.train_step(1)
                trainer._sync()
        counts: dict = collections.defaultdict(lambda: [0, 0])
        for c in trainer.rt.calls:
            counts[c.layer, c.kind, c.axis][0] += 1
            counts[c.layer, c.kind, c.axis][1] += c.nbytes
        by_kind = {k: tracer.peak_by_kind.get(k, 0) for k in KINDS}
        return Trace(tracer.peak, by_kind, tracer.peak_where, dict(counts), trainer.rt.max_inflight_seen,
                     {"moments": tracer.moments, "calls": list(trainer.rt.calls), "ops": list(ops),
                      "transfers": list(transfers)})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def compare(model: str, machine: str, gpus: int, global_batch: int, grid: tuple[int, int, int, int],
            order: str = "xyz", seq_len: int | None = None, micro_batch: int | None = None,
            checkpointing: bool | None = None, overlap: bool = True) -> dict:
    """Trace the configuration and put the planner's prediction beside it: peak memory per GPU by
    kind and every collective of the step by (layer, kind, axis). Unset micro-batch or checkpointing:
    the planner's fastest choice for this grid, as `axoplan explain` takes it."""
    from axoplan.planner.memory import KIND_NAMES
    from axoplan.planner.memory import KINDS as MODEL_KINDS
    from axoplan.errors import UserError
    from axoplan.runconfig import Grid, Overlap
    from axoplan.planner.machine import GIB
    from axoplan.planner.rank import explain

    ex = explain(model, machine, gpus, global_batch, grid, order=order, seq_len=seq_len, micro_batch=micro_batch,
                 checkpointing=checkpointing, overlap=overlap)
    row = ex.summary.iloc[0]
    if not (int(row.gx), int(row.gy), int(row.gz), int(row.gdata)) == tuple(grid):
        raise UserError(f"--grid {','.join(map(str, grid))} is not a configuration of {gpus} GPUs")
    why = ex.summary["reason"][0]
    if why and "GiB" not in why:  # out of memory is worth tracing; a grid the model cannot split is not
        raise UserError(f"grid {','.join(map(str, grid))} cannot run {model}: {why}")
    # a step of many micro-batches repeats the second one: its peak and per-micro-batch collectives are
    # those of two, so trace (and predict) two and keep the time and memory of the tool bounded
    mb, ck = int(row.micro_batch), bool(row.checkpointing)
    traced_batch = min(global_batch, grid[2] * grid[3] * mb * 2)
    if traced_batch != global_batch:
        ex = explain(model, machine, gpus, traced_batch, grid, order=order, seq_len=seq_len, micro_batch=mb,
                     checkpointing=ck, overlap=overlap)
    ov = Overlap(all_reduce=overlap, reduce_scatter=overlap, all_gather=overlap, data_parallel=overlap)
    cfg = LaunchConfig(model=model, grid=Grid(*map(int, grid)), order=order, global_batch=traced_batch,
                       micro_batch=mb, seq_len=seq_len, checkpointing=ck, overlap=ov, metrics=None)
    from axoplan.planner.profile_reader import load_profile

    prof = load_profile(machine)
    dtype = "bf16" if prof.dtype_bytes == 2 else "fp32"
    tr = trace_step(cfg, dtype, fused_optimizer=prof.kind == "gpu")  # the optimizer the run on that machine uses
    mem = {KIND_NAMES[k]: {"predicted": float(v) / GIB, "traced": tr.peak_by_kind.get(KIND_NAMES[k], 0) / GIB}
           for k, v in zip(MODEL_KINDS, ex.memory.gib[:len(MODEL_KINDS)] * GIB)}
    predicted = collections.defaultdict(lambda: [0, 0.0])
    for r in ex.collectives.itertuples(index=False):
        key = (r.layer, r.collective, r.axis)
        predicted[key][0] += int(r.calls_per_step)
        predicted[key][1] += float(r.bytes) * int(r.calls_per_step)
    colls = []
    for key in sorted(set(predicted) | set(tr.collectives)):
        p, t = predicted.get(key, [0, 0.0]), tr.collectives.get(key, [0, 0])
        colls.append({"layer": key[0], "kind": key[1], "axis": key[2], "predicted_calls": p[0], "traced_calls": t[0],
                      "predicted_bytes": p[1], "traced_bytes": float(t[1])})
    available = (prof.mem_capacity - prof.mem_headroom) / GIB  # what the planner's feasibility allows
    return {"predicted_memory_gib": float(ex.memory.gib[len(MODEL_KINDS)]), "traced_memory_gib": tr.peak_bytes / GIB,
            "fits": bool(tr.peak_bytes / GIB <= available), "available_gib": available,
            "capacity_gib": prof.mem_capacity / GIB, "headroom_gib": prof.mem_headroom / GIB,
            "memory_by_kind": mem, "collectives": colls,
            "predicted_peak_at": ex.memory.attrs.get("peak_at", ""), "traced_peak_at": tr.peak_where,
            "config": {"gx": cfg.grid.gx, "gy": cfg.grid.gy, "gz": cfg.grid.gz, "gdata": cfg.grid.gdata, "order": order,
                       "micro_batch": cfg.micro_batch, "checkpointing": cfg.checkpointing, "dtype": dtype,
                       "global_batch": global_batch, "global_batch_traced": traced_batch,
                       "max_inflight_reduce_scatters_traced": tr.max_inflight_rs}}


def compare_pipeline(model: str, machine: str, gpus: int, global_batch: int, grid: tuple[int, int, int, int],
                     pp: int, vpp: int | None = None, schedule: str | None = None, order: str = "xyz",
                     seq_len: int | None = None, micro_batch: int | None = None, checkpointing: bool | None = None,
                     overlap: bool = True) -> dict:
    """compare() for a pipeline of pp stages of `grid` each: the first and the last pipeline rank (the two that
    can hold the peak: the embedding and the most forwards in flight on the first, the LM head and its logits
    on the last) are each traced as its stage's first rank, beside the planner's model of that rank: its
    memory, its collectives (its virtual stages' windows and its once-per-step ones,
    stage_timing.rank_collective_rows) and its transfers (pipeline.rank_transfers), and the order it ran."""
    from axoplan.errors import UserError
    from axoplan.planner.machine import GIB
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.memory import KIND_NAMES
    from axoplan.planner.memory import KINDS as MODEL_KINDS
    from axoplan.planner.pipeline import SCHEDULES, peak_micro_batches, rank_orders, rank_transfers
    from axoplan.planner.rank import explain
    from axoplan.planner.stage_timing import rank_collective_rows
    from axoplan.runconfig import Grid, Overlap

    from axoplan.planner.execution import AXOPLAN

    ex_obj = AXOPLAN

    def plan(batch, mb, ck):
        return explain(model, machine, gpus, batch, grid, order=order, seq_len=seq_len, micro_batch=mb,
                       checkpointing=ck, overlap=overlap, execution=ex_obj, pp=pp, vpp=vpp, schedule=schedule)

    ex = plan(global_batch, micro_batch, checkpointing)
    row = ex.summary.iloc[0]
    if not (int(row.gx), int(row.gy), int(row.gz), int(row.gdata)) == tuple(grid):
        raise UserError(f"--grid {','.join(map(str, grid))} x --pp {pp} is not a configuration of {gpus} GPUs")
    why = ex.summary["reason"][0]
    if why and "GiB" not in why:
        raise UserError(f"grid {','.join(map(str, grid))} with pp={pp} cannot run {model}: {why}")
    one = ex.detail["candidate"]
    mb, ck = int(one.micro_batch[0]), bool(one.checkpointing[0])
    vpp_, sched_name = int(one.vpp[0]), SCHEDULES[int(one.schedule[0])]
    m = global_batch // (grid[2] * grid[3] * mb)
    # past the warm-up no rank holds more in flight and the steady state repeats: trace as many micro-batches
    traced_m = int(peak_micro_batches(sched_name, pp, m))
    traced_batch = grid[2] * grid[3] * mb * traced_m
    if traced_batch != global_batch:
        ex = plan(traced_batch, mb, ck)
        one = ex.detail["candidate"]
    d = ex.detail
    sched, spec, prof = d["schedule"], d["model"], d["profile"]
    ov = Overlap(all_reduce=overlap, reduce_scatter=overlap, all_gather=overlap, data_parallel=overlap)
    cfg = LaunchConfig(model=model, grid=Grid(*map(int, grid)), order=order, global_batch=traced_batch,
                       micro_batch=mb, seq_len=seq_len, checkpointing=ck, overlap=ov, metrics=None, pp=pp,
                       vpp=vpp_, schedule=sched_name)
    profile = load_profile(machine)
    dtype = "bf16" if profile.dtype_bytes == 2 else "fp32"
    p2p_bytes = float(np.ravel(sched.p2p_bytes)[0])
    stages = []
    for kind, s in (("first", 0), ("last", pp - 1)):
        first = stage_first_rank(*map(int, grid), order, pp, s)
        tr = trace_step(cfg, dtype, fused_optimizer=profile.kind == "gpu", rank=first)
        mem = d["stage_memory"][kind]
        by_kind = {KIND_NAMES[k]: {"predicted": float(np.ravel(getattr(mem, k))[0]) / GIB,
                                   "traced": tr.peak_by_kind.get(KIND_NAMES[k], 0) / GIB} for k in MODEL_KINDS}
        predicted = collections.defaultdict(lambda: [0, 0.0])
        for cl, calls in rank_collective_rows(prof, sched, spec, one, ex.execution, d["seq_len"], 0, ck, s):
            key = (cl.layer, cl.kind, cl.axis)
            predicted[key][0] += int(calls)
            predicted[key][1] += float(np.ravel(cl.nbytes)[0]) * int(calls)
        expected = rank_transfers(sched_name, pp, vpp_, traced_m, s)
        for t in expected:
            predicted[t[1], t[0], "p"][0] += 1
            predicted[t[1], t[0], "p"][1] += p2p_bytes
        colls = []
        for key in sorted(set(predicted) | set(tr.collectives)):
            p, t = predicted.get(key, [0, 0.0]), tr.collectives.get(key, [0, 0])
            colls.append({"layer": key[0], "kind": key[1], "axis": key[2], "predicted_calls": p[0],
                          "traced_calls": t[0], "predicted_bytes": p[1], "traced_bytes": float(t[1])})
        got = tr.extra["transfers"]
        ops = tr.extra["ops"]
        position = {op: k for k, op in enumerate(ops)}
        order_ok = {
            # the chunks in the planner's order (pipeline.rank_orders)
            "chunks": tuple(ops) == rank_orders(sched_name, pp, vpp_, traced_m)[s],
            # the sends in order; the receives the same ones, each posted before its chunk runs
            "sends": [t[:4] for t in got if t[0] == "send"] == [t for t in expected if t[0] == "send"],
            "receives": (sorted(t[:4] for t in got if t[0] == "recv") == sorted(t for t in expected if t[0] == "recv")
                         and all(t[4] <= position.get(("F" if t[1] == "activation" else "B", t[2], t[3]), -1)
                                 for t in got if t[0] == "recv")),
        }
        stages.append({"stage": kind, "pipeline_rank": s, "world_rank": first,
                       "predicted_memory_gib": float(np.ravel(mem.total)[0]) / GIB,
                       "traced_memory_gib": tr.peak_bytes / GIB, "memory_by_kind": by_kind,
                       "predicted_peak_at": mem.where(0), "traced_peak_at": tr.peak_where,
                       "collectives": colls, "order": order_ok, "chunks_run": len(ops)})
    return {"stages": stages,
            "predicted_memory_gib": float(ex.memory.gib[len(MODEL_KINDS)]),
            "config": {"gx": grid[0], "gy": grid[1], "gz": grid[2], "gdata": grid[3], "order": order, "pp": pp,
                       "vpp": vpp_, "schedule": sched_name, "micro_batch": mb, "checkpointing": ck, "dtype": dtype,
                       "global_batch": global_batch, "global_batch_traced": traced_batch,
                       "micro_batches_traced": traced_m}}
