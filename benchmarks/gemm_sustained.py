"""A GPU's GEMM rate in short bursts against the rate it holds under full load, measured in one run.

The profiles' GEMM ceilings are burst measurements (mamf-finder's MAMF, the mean of 100 iterations after 50
warm-up). A GPU at full load drops to the clock its power limit allows, and training runs there; the H100 and
H200 profiles say so with `compute.gemm.sustained_fraction` 0.88, the H200's MSMF / MAMF as mamf-finder measured it
(stas00/ml-engineering compute/accelerator/benchmarks/README.md). This measures the same ratio on the machine at
hand, so that the fraction is checked wherever a GPU is lent (benchmarks/gpu_check.sh runs it):

- burst: after 0.25 s idle (the clock climbs back to boost) 10 back-to-back calls, queued and synchronised once;
  5 such bursts, the median rate;
- sustained: once `calibrate.timing.settle_clock` has run 8192^3 GEMMs until their rate stops falling, the shape
  back to back for `--window` seconds.

    python benchmarks/gemm_sustained.py [--profile dgx-h200] [--shapes 8192x8192x8192,4096x14336x4096]
                                        [--window 2] [--out FILE.json]

On a CPU it runs the same steps in fp32 on small shapes (a smoke run: CPUs boost too, but no profile models it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from axoplan.atomic import atomic_write_text
from axoplan.calibrate.gemm import operands
from axoplan.calibrate.timing import _cpu_batch, _cuda_batch, settle_clock
from axoplan.planner.profile_reader import load_profile

GPU_SHAPES = "8192x8192x8192,4096x14336x4096,4096x4096x14336"
CPU_SHAPES = "512x512x512,256x1024x256"


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="dgx-h200", help="profile whose sustained_fraction is printed beside")
    ap.add_argument("--shapes", default=None, help="MxNxK,... (default: three training-sized GEMMs)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds of the sustained window per shape")
    ap.add_argument("--out", default=None, help="also write the result here (JSON)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batch = _cuda_batch if cuda else _cpu_batch
    shapes = [tuple(int(x) for x in s.split("x")) for s in (a.shapes or (GPU_SHAPES if cuda else CPU_SHAPES)).split(",")]
    window = a.window if cuda else min(a.window, 0.2)

    def rate(m, n, k, seconds, calls):
        return 2.0 * m * n * k * calls / seconds / 1e12

    def gemm(m, n, k):
        x, y = operands(m, n, k, "NN", dtype, device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        return lambda: torch.matmul(x, y, out=out)

    fns = [gemm(*shape) for shape in shapes]
    rows = []
    for (m, n, k), fn in zip(shapes, fns):
        fn()
        bursts = []
        for _ in range(5):
            time.sleep(0.25)  # idle: the clock climbs back to boost
            bursts.append(rate(m, n, k, batch(fn, 10), 10))
        rows.append({"shape": f"{m}x{n}x{k}", "burst_tflops": statistics.median(bursts)})
    settle = gemm(*((8192,) * 3 if cuda else (512,) * 3))
    settled = settle_clock(settle, cuda=cuda, window_s=1.0 if cuda else 0.05, max_s=20.0 if cuda else 0.5)
    for row, (m, n, k), fn in zip(rows, shapes, fns):
        one = batch(fn, 1)
        calls = max(2, int(window / max(one, 1e-9)))
        row["sustained_tflops"] = rate(m, n, k, batch(fn, calls), calls)
        row["sustained_over_burst"] = row["sustained_tflops"] / row["burst_tflops"]
    prof = load_profile(a.profile)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "torch": torch.__version__, "settle_rates_per_s": [round(r, 2) for r in settled], "shapes": rows,
           "median_sustained_over_burst": statistics.median(r["sustained_over_burst"] for r in rows),
           "profile": a.profile, "profile_sustained_fraction": prof.gemm_sustained}
    text = json.dumps(res, indent=1)
    if a.out:
        atomic_write_text(a.out, text + "\n")
    print(text)
    print(f"sustained / burst, median over {len(rows)} shapes: {res['median_sustained_over_burst']:.3f} on {res['device']} "
          f"(profile {a.profile}: {prof.gemm_sustained:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
