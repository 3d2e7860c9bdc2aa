"""Memory fidelity: the planner's peak memory per GPU against the bundled trainer's own, traced.

Fake tensors and a fake process group (`axoplan dryrun`): one real training step as rank 0 of
the full job, every allocation counted. For every grid the model divides (order xyz, activation
checkpointing on, micro-batch B/(gz*gdata)) of GPT-20B on 32 and GPT-40B on 64 perlmutter GPUs and
Llama-3 8B on 64: predicted / traced peak, and whether every collective agrees in calls and bytes.
`--real` adds gloo runs of gpt-small on 1, 2, 4 and 8 ranks: the trainer's tracked peak of live
tensor bytes (not RSS) against the model.

`--pipeline` runs pipelined grids instead (dryrun.compare_pipeline): GPT-20B on 32 and Llama-3 70B on 64
perlmutter GPUs with pp 2, 4 and 8 (1F1B, micro-batch 1, checkpointing on, order xyz), each pipeline rank
that can hold the peak (the first and the last) traced as its stage's first rank. Per pp the grids are the
planner's fastest and the ones splitting each axis the most (gx, gy, gz, gdata), so that states, gathered
weights, activations and the pipeline's buffers each lead somewhere.

    python benchmarks/memory_fidelity.py [--cases gpt-20b:32:32,...] [--real] [--json out.json]
    python benchmarks/memory_fidelity.py --pipeline [--pipeline-cases gpt-20b:32:64,...] [--pp 2,4,8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from axoplan.planner.space import ORDERS
from axoplan.runtime.dryrun import compare
from axoplan.planner.space import enumerate_space

CASES = "gpt-20b:32:32,gpt-40b:64:64,llama3-8b:64:64"


def grids(model: str, gpus: int, batch: int) -> list[tuple[int, int, int, int]]:
    """Grids the model divides, order xyz, micro-batch B/(gz*gdata), checkpointing on."""
    from axoplan.planner.batch import evaluate
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import Job, load_model

    m = load_model(model)
    c = enumerate_space(gpus, batch, "xyz", None, "on")
    ev = evaluate(m, load_profile("perlmutter"), Job(gpus, batch, m.seq_len), c)
    mem_code = len(ev.reasons) - 1
    out = set()
    for i in range(len(c)):
        ok = ev.reason_code[i] < 0 or ev.reason_code[i] == mem_code
        if ok and c.micro_batch[i] * c.gz[i] * c.gdata[i] == batch and ORDERS[c.order[i]] == "xyz":
            out.add((int(c.gx[i]), int(c.gy[i]), int(c.gz[i]), int(c.gdata[i])))
    return sorted(out)


PIPELINE_CASES = "gpt-20b:32:64,llama3-70b:64:64"


def pipeline_grids(model: str, gpus: int, batch: int, pp: int, machine: str = "perlmutter"
                   ) -> list[tuple[int, int, int, int]]:
    """Of the grids of gpus / pp the planner can run with this pipeline (1F1B, micro-batch 1, checkpointing
    on, order xyz; out of memory included): the fastest feasible one and, for each axis, the one splitting
    it the most (ties: the fastest)."""
    from axoplan.planner.batch import evaluate
    from axoplan.planner.execution import trainer_execution
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.pipeline import SCHEDULES
    from axoplan.planner.specs import Job, load_model

    m = load_model(model)
    c = enumerate_space(gpus, batch, "xyz", 1, "on", pipelines=((pp, 1, SCHEDULES.index("1f1b")),))
    ev = evaluate(m, load_profile(machine), Job(gpus, batch, m.seq_len), c, execution=trainer_execution())
    mem_code = len(ev.reasons) - 1
    ok = [i for i in range(len(c)) if (ev.reason_code[i] < 0 or ev.reason_code[i] == mem_code)
          and ORDERS[c.order[i]] == "xyz" and c.pp[i] == pp]
    if not ok:
        return []
    grid = {i: (int(c.gx[i]), int(c.gy[i]), int(c.gz[i]), int(c.gdata[i])) for i in ok}
    by_time = sorted(ok, key=lambda i: float(ev.batch_time[i]))
    feasible = [i for i in by_time if ev.reason_code[i] < 0]
    out = [grid[feasible[0]]] if feasible else []
    for axis in range(4):
        out.append(grid[max(by_time, key=lambda i: (grid[i][axis], -by_time.index(i)))])
    return list(dict.fromkeys(out))


def pipeline_runs(cases: str, pps: list[int], machine: str) -> list[dict]:
    """Predicted against traced peak per pipeline stage (first and last rank) of every pipelined grid."""
    from axoplan.runtime.dryrun import compare_pipeline

    rows = []
    for case in filter(None, cases.split(",")):
        model, gpus, batch = case.split(":")
        gpus, batch = int(gpus), int(batch)
        t0 = time.perf_counter()
        errs = []
        print(f"\n{model} on {gpus} x {machine}, global batch {batch}, 1F1B, micro-batch 1, checkpointing on, order xyz")
        print(f"{'pp':>3} {'grid':>10} {'stage':>5} {'predicted GiB':>13} {'traced GiB':>10} {'error':>7} {'colls':>6} "
              f"{'buffers':>8}  peak (predicted | traced)")
        for pp in pps:
            for g in pipeline_grids(model, gpus, batch, pp, machine):
                r = compare_pipeline(model, machine, gpus, batch, g, pp, micro_batch=1, checkpointing=True,
                                     schedule="1f1b")
                for st in r["stages"]:
                    err = st["predicted_memory_gib"] / st["traced_memory_gib"] - 1
                    same = all(c["predicted_calls"] == c["traced_calls"] and c["predicted_bytes"] == c["traced_bytes"]
                               for c in st["collectives"]) and all(st["order"].values())
                    errs.append(abs(err))
                    buf = st["memory_by_kind"].get("pipeline buffers", {"predicted": 0.0, "traced": 0.0})
                    rows.append({"model": model, "gpus": gpus, "grid": g, "pp": pp, "stage": st["stage"],
                                 "predicted_gib": st["predicted_memory_gib"], "traced_gib": st["traced_memory_gib"],
                                 "error": err, "collectives_equal": same, "memory_by_kind": st["memory_by_kind"],
                                 "predicted_at": st["predicted_peak_at"], "traced_at": st["traced_peak_at"],
                                 "config": r["config"]})
                    print(f"{pp:>3} {'x'.join(map(str, g)):>10} {st['stage']:>5} {st['predicted_memory_gib']:13.2f} "
                          f"{st['traced_memory_gib']:10.2f} {100 * err:+6.1f}% {'equal' if same else 'DIFFER':>6} "
                          f"{buf['predicted']:4.2f}|{buf['traced']:4.2f}  {st['predicted_peak_at']} | {st['traced_peak_at']}")
                    sys.stdout.flush()
        mine = [r for r in rows if r["model"] == model]
        print(f"{model}: {len(errs)} stages of {len(errs) // 2} pipelined grids, |error| mean "
              f"{100 * statistics.mean(errs):.2f}%, max {100 * max(errs):.2f}%, collectives and order equal in "
              f"{sum(r['collectives_equal'] for r in mine)}/{len(mine)} ({time.perf_counter() - t0:.0f} s)")
    return rows


REAL_CASES = [  # (gx, gy, gz, gdata), checkpointing: gpt-small, global batch 16, two micro-batches where possible
    ((1, 1, 1, 1), False), ((1, 1, 1, 1), True), ((2, 1, 1, 1), False), ((1, 2, 1, 1), True), ((1, 1, 2, 1), False),
    ((1, 1, 1, 2), True), ((2, 2, 1, 1), False), ((1, 1, 4, 1), True), ((1, 2, 2, 1), False), ((4, 1, 1, 1), True),
    ((2, 2, 2, 1), False), ((1, 1, 8, 1), True), ((2, 1, 2, 2), False), ((1, 2, 4, 1), True)]


def _real_worker(rank, world, port, cases, out_path):
    """One gloo rank: the real trainer (fp32 on CPU, as `axoplan train` runs here) with the tracer
    attached; the peak of live tensor bytes over the second step (the first creates AdamW's state)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from axoplan.runconfig import Grid, LaunchConfig
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.memtrace import MemoryTracer
    from axoplan.runtime.train import Trainer, resolve

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    out = []
    for grid, ck in cases:
        cfg = LaunchConfig(model="gpt-small", grid=Grid(*grid), global_batch=16,
                           micro_batch=max(1, 16 // (grid[2] * grid[3]) // 2), checkpointing=ck, metrics=None)
        tracer = MemoryTracer("states")
        with tracer:
            tr = Trainer(cfg, build_grid(*grid, "xyz"), resolve(cfg))
            tr.rt.tracer = tracer
            with tracer.kind("transients"):
                tr.train_step(0)
                tracer.reset_peak()
                tr.train_step(1)
        tr.close()
        out.append({"grid": grid, "checkpointing": ck, "micro_batch": cfg.micro_batch, "peak": tracer.peak,
                    "where": tracer.peak_where})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def real_runs() -> list[dict]:
    """gpt-small on 1, 2, 4 and 8 gloo ranks: the traced peak of the real trainer against the model."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    from axoplan.planner.machine import GIB
    from axoplan.planner.rank import explain

    rows = []
    for world in (1, 2, 4, 8):
        cases = [(g, ck) for g, ck in REAL_CASES if g[0] * g[1] * g[2] * g[3] == world]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/out.json"
            mp.start_processes(_real_worker, args=(world, port, cases, path), nprocs=world, start_method="spawn")
            with open(path) as f:
                traced = json.load(f)
        for t in traced:
            g = tuple(t["grid"])
            ex = explain("gpt-small", "localhost-cpu", world, 16, g, micro_batch=t["micro_batch"],
                         checkpointing=t["checkpointing"])
            pred = float(ex.memory.gib[ex.memory.kind == "total (peak)"].iloc[0])
            rows.append({"grid": g, "checkpointing": t["checkpointing"], "predicted_gib": pred,
                         "traced_gib": t["peak"] / GIB, "error": pred / (t["peak"] / GIB) - 1,
                         "predicted_at": ex.memory.attrs["peak_at"], "traced_at": t["where"]})
            r = rows[-1]
            print(f"{'x'.join(map(str, g)):>9} ckpt {'on ' if r['checkpointing'] else 'off'} "
                  f"{r['predicted_gib'] * 1024:9.2f} {r['traced_gib'] * 1024:9.2f} MiB {100 * r['error']:+6.1f}%  "
                  f"{r['predicted_at']} | {r['traced_at']}")
            sys.stdout.flush()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="model:gpus:batch,...")
    ap.add_argument("--machine", default="perlmutter")
    ap.add_argument("--json", default=None)
    ap.add_argument("--real", action="store_true", help="also gloo runs of gpt-small on 1, 2, 4 and 8 ranks")
    ap.add_argument("--only-real", action="store_true", help="only the gloo runs")
    ap.add_argument("--pipeline", action="store_true", help="pipelined grids (pp 2, 4, 8) instead, per stage")
    ap.add_argument("--pipeline-cases", default=PIPELINE_CASES, help="model:gpus:batch,... for --pipeline")
    ap.add_argument("--pp", default="2,4,8", help="pipeline degrees for --pipeline")
    args = ap.parse_args(argv)
    rows = []
    if args.pipeline:
        print("predicted (planner, bundled trainer's execution) vs traced (dryrun: fake tensors, fake process group) "
              "peak per pipeline stage; buffers: the pipeline's receive buffers, predicted|traced GiB")
        rows = pipeline_runs(args.pipeline_cases, [int(p) for p in args.pp.split(",")], args.machine)
        errs = [abs(r["error"]) for r in rows]
        print(f"\nall: {len(errs)} stages, |error| mean {100 * statistics.mean(errs):.2f}%, max {100 * max(errs):.2f}%, "
              f"within 2%: {sum(e <= 0.02 for e in errs)}/{len(errs)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1, default=list)
        return 0
    if args.real or args.only_real:
        print("gpt-small, real gloo runs (fp32, localhost-cpu model), global batch 16: predicted vs traced peak")
        real = real_runs()
        errs = [abs(r["error"]) for r in real]
        print(f"real runs: {len(real)}, |error| mean {100 * statistics.mean(errs):.2f}%, max {100 * max(errs):.2f}%")
        rows += [{"real": True, **r} for r in real]
        if args.only_real:
            args.cases = ""
    for case in filter(None, args.cases.split(",")):
        model, gpus, batch = case.split(":")
        gpus, batch = int(gpus), int(batch)
        errs = []
        t0 = time.perf_counter()
        print(f"\n{model} on {gpus} x {args.machine}, global batch {batch}, checkpointing on, order xyz")
        print(f"{'grid':>14} {'predicted GiB':>13} {'traced GiB':>10} {'error':>7} {'colls':>6}  peak (predicted | traced)")
        for g in grids(model, gpus, batch):
            r = compare(model, args.machine, gpus, batch, g, micro_batch=batch // (g[2] * g[3]), checkpointing=True)
            err = r["predicted_memory_gib"] / r["traced_memory_gib"] - 1
            same = all(c["predicted_calls"] == c["traced_calls"] and c["predicted_bytes"] == c["traced_bytes"]
                       for c in r["collectives"])
            errs.append(abs(err))
            rows.append({"model": model, "gpus": gpus, "grid": g, **r, "error": err, "collectives_equal": same})
            print(f"{'x'.join(map(str, g)):>14} {r['predicted_memory_gib']:13.2f} {r['traced_memory_gib']:10.2f} "
                  f"{100 * err:+6.1f}% {'equal' if same else 'DIFFER':>6}  {r['predicted_peak_at']} | {r['traced_peak_at']}")
            sys.stdout.flush()
        print(f"{model}: {len(errs)} grids, |error| mean {100 * statistics.mean(errs):.2f}%, max {100 * max(errs):.2f}%, "
              f"collectives equal in {sum(r['collectives_equal'] for r in rows if r.get('model') == model)}/{len(errs)} "
              f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
