"""Does a collective run faster while the ranks of another pipeline stage wait, as compute does? Measured on gloo
ranks sharing this machine's cores, in one run.

The planner's processor-sharing walk (planner/pipeline.py shared_rank_end_times) runs a stage's compute faster
while the other stage's ranks wait for their inputs, since they free their cores. This measures whether the
stage's collectives speed up too. Half the ranks (stage A) repeat a fixed compute burst then an all-reduce in
groups of `size`; the other half (stage B) either do the same (every rank busy: how the calibration times both)
or sleep (A alone: a pipeline's warm-up, cool-down and bubbles). Printed per group size: A's compute per burst
and its time per call under both, and their ratios (alone / all busy). The conditions alternate (ABAB) so that
drift shows.

    python benchmarks/cpu_stage_collectives.py [--ranks 8] [--sizes 2 4] [--bytes 65536] [--calls 60]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from axoplan.planner.pipeline import sharing_factor
from axoplan.runtime.selfcheck import _free_port, spawn_world


def _loop(group, x, a, calls: int, matmuls: int) -> tuple[float, float]:
    """Median seconds of a compute burst and of the all-reduce after it, over `calls` repetitions."""
    comp, coll = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        for _ in range(matmuls):
            a @ a
        t1 = time.perf_counter()
        dist.all_reduce(x, group=group)
        t2 = time.perf_counter()
        comp.append(t1 - t0)
        coll.append(t2 - t1)
    return statistics.median(comp), statistics.median(coll)


def _worker(rank, world, port, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    half = world // 2
    rows = []
    x = torch.ones(args["bytes"] // 4)
    a = torch.randn(args["dim"], args["dim"])
    for size, matmuls in ((s, n) for s in args["sizes"] for n in args["matmuls"]):
        mine = None
        for start in range(0, world, size):  # every rank takes part in creating every group
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                mine = g
        _loop(mine, x, a, 5, matmuls)  # warm-up, every rank busy
        for rep in range(2):
            for cond in ("all busy", "A alone"):
                dist.barrier()
                if rank < half or cond == "all busy":
                    comp, coll = _loop(mine, x, a, args["calls"], matmuls)
                else:
                    comp = coll = float("nan")
                t = torch.tensor([comp, coll], dtype=torch.float64)
                # the barrier's own wait is B's sleep: a blocked gloo recv uses no core
                dist.barrier()
                got = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
                dist.all_gather(got, t)
                if rank == 0:
                    a_comp = statistics.mean(float(v[0]) for v in got[:half])
                    a_coll = statistics.mean(float(v[1]) for v in got[:half])
                    rows.append({"size": size, "matmuls": matmuls, "rep": rep, "condition": cond,
                                 "compute_s": a_comp, "call_s": a_coll})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8, help="gloo ranks on this machine (even)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="all-reduce group sizes inside a stage")
    ap.add_argument("--bytes", type=int, default=65536, help="bytes per all-reduce")
    ap.add_argument("--calls", type=int, default=60, help="bursts and calls per condition")
    ap.add_argument("--matmuls", type=int, nargs="+", default=[0, 40],
                    help="matrix products per compute burst (0: calls back to back, the calibration's burst 0)")
    ap.add_argument("--dim", type=int, default=192, help="their square size")
    a = ap.parse_args(argv)
    if a.ranks < 2 or a.ranks % 2 or any(s < 1 or a.ranks // 2 % s for s in a.sizes) or min(a.matmuls) < 0:
        print("error: --ranks must be even, each of --sizes must divide half of it, and --matmuls must not be "
              "negative.", file=sys.stderr)
        return 2
    args = {"sizes": a.sizes, "bytes": a.bytes, "calls": a.calls, "matmuls": a.matmuls, "dim": a.dim}
    port = _free_port()
    print(f"{a.ranks} gloo ranks, one thread each, on {os.cpu_count()} cores; load average before "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; stage A = ranks 0-{a.ranks // 2 - 1}; "
          f"bursts of {a.matmuls} products of {a.dim}x{a.dim}, all-reduce of {a.bytes} B")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "r.json")
        spawn_world(_worker, (a.ranks, port, args, out), a.ranks, timeout=1800)
        rows = json.loads(Path(out).read_text())
    print(f"{'size':>4} {'products':>8} {'rep':>3} {'condition':10} {'compute ms':>10} {'call ms':>8}")
    for r in rows:
        print(f"{r['size']:4d} {r['matmuls']:8d} {r['rep']:3d} {r['condition']:10} {r['compute_s'] * 1e3:10.3f} "
              f"{r['call_s'] * 1e3:8.3f}")
    print("ratios A alone / all busy (the planner's sharing factor for one of two stages computing: "
          f"{float(sharing_factor(1, 2, a.ranks, os.cpu_count() or 1)):.2f}):")
    for size, n in ((s, n) for s in a.sizes for n in a.matmuls):
        for rep in range(2):
            alone, busy = ({r["condition"]: r for r in rows if (r["size"], r["matmuls"], r["rep"]) == (size, n, rep)}[c]
                           for c in ("A alone", "all busy"))
            comp = f"compute {alone['compute_s'] / busy['compute_s']:.2f}, " if n else ""
            print(f"  groups of {size}, {n:3d} products, pass {rep + 1}: {comp}"
                  f"all-reduce {alone['call_s'] / busy['call_s']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
