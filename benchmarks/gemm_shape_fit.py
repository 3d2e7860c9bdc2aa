"""The H100 GEMM model against a published per-shape table: XLA's measured sm_90 bf16 throughputs
(benchmarks/data/xla_sm90_matmul_table.csv, 125 shapes of b = 1, every dimension 256 to 4096).

Prints, as ratios measured in one run:
- the dgx-h100 profile's GEMM time (its curve: ceiling x prod d/(d + dim_half), the memory roofline and the
  per-kernel cost) against the table: median predicted/measured throughput and rms log error, on all shapes
  and on those with every dimension >= 512;
- the same curve form refitted (ceiling and dim_half free), with and without wave quantization at a fixed
  tile (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, sec. 3.2: a GEMM runs
  ceil(tiles / SMs) waves; 132 SMs on the H100 SXM): whether the measured table supports that mechanism;
- with --published: benchmarks/published_fidelity.py's H100 datasets with the profile's curve replaced by the
  table itself (interpolated, clamped at its edges), to show what the table would change.

    python benchmarks/gemm_shape_fit.py [--published]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import minimize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from axoplan.planner.profile_tables import LAYOUTS, GemmTable
from axoplan.planner.profile_reader import load_profile

DATA = Path(__file__).resolve().parent / "data"
H100_SMS = 132  # H100 SXM5 streaming multiprocessors (NVIDIA H100 datasheet)


def table() -> pd.DataFrame:
    d = pd.read_csv(DATA / "xla_sm90_matmul_table.csv", comment="#")
    return d[(d.dtype == "bf16xbf16->bf16") & (d.b == 1)].reset_index(drop=True)


def waves(m, n, tile: tuple[int, int], sms: int = H100_SMS):
    """Share of the SMs busy over the GEMM's waves, the better of the tile's two orientations."""
    def one(tm, tn):
        tiles = np.ceil(m / tm) * np.ceil(n / tn)
        return tiles / (np.ceil(tiles / sms) * sms)
    return np.maximum(one(*tile), one(tile[1], tile[0]))


def refit(d: pd.DataFrame, tile=None) -> tuple[float, float, float]:
    """(rms log error, ceiling TFLOP/s, dim_half) of the curve form, optionally times the wave share."""
    m, n, k, y = d.m.values, d.n.values, d.k.values, np.log(d.flops.values)

    def pred(p):
        ceil, half = np.exp(p)
        eff = (m / (m + half)) * (n / (n + half)) * (k / (k + half))
        if tile is not None:
            eff = eff * waves(m, n, tile)
        return np.log(ceil * 1e12 * eff)

    r = minimize(lambda p: np.mean((pred(p) - y) ** 2), [np.log(800.0), np.log(300.0)], method="Nelder-Mead")
    return float(np.sqrt(r.fun)), *map(float, np.exp(r.x))


def as_profile_table(d: pd.DataFrame) -> GemmTable:
    """The table as a profile's measured grid (the same time for every layout: XLA lists one per shape)."""
    ms, ns, ks = (np.array(sorted(d[c].unique()), dtype=float) for c in "mnk")
    grid = np.full((len(ms), len(ns), len(ks)), np.nan)
    for r in d.itertuples():
        grid[np.searchsorted(ms, r.m), np.searchsorted(ns, r.n), np.searchsorted(ks, r.k)] = np.log(r.flops)
    return GemmTable(ms, ns, ks, {lay: grid for lay in LAYOUTS}, {}, "xla_sm90_matmul_table.csv")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--published", action="store_true", help="also the published runs with the table as the profile's")
    args = ap.parse_args(argv)
    d = table()
    prof = load_profile("dgx-h100")
    t, _ = prof.gemm_seconds(d.m.values, d.n.values, d.k.values)
    ratio = 2.0 * d.m * d.n * d.k / t / d.flops
    big = (d.m >= 512) & (d.n >= 512) & (d.k >= 512)
    print(f"XLA sm_90 bf16, b=1: {len(d)} shapes ({int(big.sum())} with every dimension >= 512)")
    print(f"dgx-h100 profile (curve with dim_half {prof.gemm_half:.0f}, the memory-traffic rule; memory roofline, "
          f"kernel cost) / measured throughput:")
    for name, sel in (("all shapes", slice(None)), ("dims >= 512", big)):
        r = ratio[sel]
        print(f"  {name:12} median {np.median(r):.2f}  rms log error {np.sqrt(np.mean(np.log(r) ** 2)):.3f}  "
              f"at 4096^3 {float(ratio[(d.m == 4096) & (d.n == 4096) & (d.k == 4096)].iloc[0]):.2f}")
    print("the curve form refitted to the table (ceiling and dim_half free), rms log error:")
    for tile in (None, (128, 256), (128, 128)):
        rms, ceil, half = refit(d, tile)
        what = "no wave quantization" if tile is None else f"x wave share, {tile[0]}x{tile[1]} tiles on {H100_SMS} SMs"
        print(f"  {what:44} {rms:.3f}  (ceiling {ceil:.0f} TFLOP/s, dim_half {half:.0f})")
    if args.published:
        import published_fidelity as pf

        profiles = pf.machine_profiles()
        runs = [r for load in pf.LOADERS for r in load()[0] if profiles[r.dataset].name == "dgx-h100"]
        for label, tab in (("profile curve", None), ("XLA table", as_profile_table(d))):
            rows = []
            for r in runs:
                p = profiles[r.dataset] if tab is None else dataclasses.replace(profiles[r.dataset], gemm_table=tab)
                rows.append(pf.judged(r, p))
            for ds in sorted({x["dataset"] for x in rows}):
                s = pf.summarise([x for x in rows if x["dataset"] == ds])
                print(f"  {label:14} {ds:22} mean error {s['mean_err_pct']:.0f}%  median pred/meas {s['median_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
