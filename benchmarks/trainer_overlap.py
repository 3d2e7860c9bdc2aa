"""Exposed communication of the 4D trainer with overlap (OAR, ORS, OAG) on against off, G = 4 on
CPU (gloo), measured in one run: four spawned ranks alternate steps with the flags on and off.

Exposed communication = host time blocked waiting on collectives (Runtime.blocked_s), which on
CPU/gloo is the communication that no computation hid. Printed per setting with the batch time.

    python benchmarks/trainer_overlap.py [--model gpt-small] [--grid 1 2 2 1] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from axoplan.runtime.selfcheck import _free_port


def _worker(rank, world, port, args, out):
    from axoplan.runconfig import Grid, LaunchConfig, Overlap
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Resolved, Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    gx, gy, gz, gd = args["grid"]
    grid = build_grid(gx, gy, gz, gd)
    res = Resolved(torch.device("cpu"), "gloo", torch.float32, torch.float32, False)
    trainers = {}
    for on in (True, False):
        cfg = LaunchConfig(model=args["model"], grid=Grid(gx, gy, gz, gd), global_batch=args["global_batch"],
                           micro_batch=args["micro_batch"], overlap=Overlap(on, on, on), metrics=None)
        trainers[on] = Trainer(cfg, grid, res)
    rows = {True: [], False: []}
    for step in range(args["steps"] + 1):
        for on in (True, False):
            tr = trainers[on]
            dist.barrier()
            tr.rt.blocked_s = 0.0
            t0 = time.perf_counter()
            tr.train_step(step)
            dist.barrier()
            if step > 0:  # the first step warms up
                rows[on].append((time.perf_counter() - t0, tr.rt.blocked_s))
    # the slowest rank decides, as for the batch
    summary = {}
    for on in (True, False):
        t = torch.tensor([statistics.median(r[0] for r in rows[on]), statistics.median(r[1] for r in rows[on])],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        summary["on" if on else "off"] = t.tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(summary))
    grid.destroy()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--grid", type=int, nargs=4, default=[1, 2, 2, 1], metavar=("GX", "GY", "GZ", "GDATA"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    a = ap.parse_args()
    world = a.grid[0] * a.grid[1] * a.grid[2] * a.grid[3]
    args = {"model": a.model, "grid": a.grid, "steps": a.steps, "global_batch": a.global_batch,
            "micro_batch": a.micro_batch}
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        mp.spawn(_worker, args=(world, port, args, out), nprocs=world)
        r = json.loads(Path(out).read_text())
    (t_on, e_on), (t_off, e_off) = r["on"], r["off"]
    print(f"model {a.model}, grid x{a.grid[0]} y{a.grid[1]} z{a.grid[2]} d{a.grid[3]}, G={world}, gloo on CPU")
    print(f"overlap on : batch {t_on * 1e3:8.1f} ms, exposed communication {e_on * 1e3:8.1f} ms")
    print(f"overlap off: batch {t_off * 1e3:8.1f} ms, exposed communication {e_off * 1e3:8.1f} ms")
    print(f"exposed communication on/off ratio {e_on / e_off:.3f}; batch time on/off ratio {t_on / t_off:.3f}")


if __name__ == "__main__":
    main()
