"""Collectives across nodes, predicted against published nccl-tests sweeps: time per call, per curve.

Every sweep in benchmarks/data/nccl_*.csv (the leading `#` lines name its source) is predicted from facts
that do not come from any sweep here: the NCCL tuning-model constants of the bundled profile of the same GPU
generation (network.protocols, NVIDIA/nccl src/graph/tuning.cc), the machine's NIC line rate from its vendor
specification (MACHINES below), and one ring efficiency, the NCCL team's DGX A100 statement (192 GB/s of
all-reduce busbw over 8 x 200 Gb/s, NVIDIA/nccl issue #812): so every curve is predicted leave-one-machine-out
(nothing is fitted at all). Rows from 1 MB to 4 GB on 2 or more nodes are judged; error = |pred/meas - 1|.

Three models side by side: 'alpha-beta' (the model before issue 24: NCCL's latency sum plus the buffer's
ring volume over the plateau), 'nccl' (NCCL's protocol-aware choice of ring or tree and LL, LL128 or Simple,
comm.protocol_seconds, with NCCL's own latencies: nothing from any sweep) and 'profile' (the same with the
bundled profile's network.protocols.latency_scale, which --fit-latency h20-ndr measured on the one
InfiniBand sweep here: in-sample for that curve, marked *, out-of-sample for the others).

    python benchmarks/collective_fidelity.py [--rows] [--fit-latency MACHINE]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from axoplan.planner import comm as C
from axoplan.planner.machine import GB, load_profile

DATA = Path(__file__).resolve().parent / "data"
# 192 GB/s all-reduce busbw over 8 x 25 GB/s of HDR (NVIDIA/nccl issue #812, the NCCL team)
RING_EFFICIENCY = 192 / 200
# machine -> (bundled profile with its GPU generation's NCCL constants, NIC line rate per node GB/s, source)
MACHINES = {
    "a3mega-h100": ("dgx-h100", 200.0, "8 x 200 Gb/s GPUDirect-TCPXO NICs per A3 Mega node (vendor specification, "
                                        "see the data file's header)"),
    "h20-ndr": ("dgx-h100", 400.0, "8 x 400 Gb/s NDR ConnectX-7 per node (the data file's header, from the issue)"),
    "p4dn-a100": ("dgx-a100", 50.0, "4 x 100 Gb/s EFA per p4dn.24xlarge (AWS specification, see the data file's header)"),
}
LO, HI = 2**20, 2**32
IN_SAMPLE = "h20-ndr"  # the sweep the bundled DGX profiles' network.protocols.latency_scale comes from


def load_rows():
    rows = []
    for path in sorted(DATA.glob("nccl_*.csv")):
        with open(path) as f:
            for r in csv.DictReader(line for line in f if not line.startswith("#")):
                rows.append(dict(r, file=path.name))
    return rows


def machine_profile(machine: str, gpus_per_node: int):
    name, nic_gbs, _ = MACHINES[machine]
    prof = load_profile(name)
    return prof.replace(gpus_per_node=gpus_per_node, inter_busbw=nic_gbs * RING_EFFICIENCY * GB)


def predict(prof, kind: str, nbytes, nodes: int, gpn: int, protocols: bool, nccl_latency: bool = False) -> np.ndarray:
    """nccl_latency: NCCL's own latencies (the profile's network.protocols.latency_scale set aside)."""
    if nccl_latency:
        prof = prof.replace(physics=dataclasses.replace(
            prof.physics, protocols=dataclasses.replace(prof.physics.protocols, latency_scale=1.0)))
    p = np.array([nodes * gpn])
    stride = np.array([1])
    bw = prof.group_busbw(p, stride)
    if protocols:
        m, n = C.group_nodes(prof, p, stride)
        return C.protocol_seconds(prof, kind, nbytes, p, m, n, bw)
    flat = prof.replace(physics=dataclasses.replace(prof.physics, protocols=None))
    return C.ring_time(flat, kind, nbytes, p, bw, flat.group_latency(p, stride), False, stride)


def fit_latency(machine: str) -> tuple[float, float]:
    """(latency scale, mean error) of NCCL's protocol model on one machine's judged rows, its plateau from
    the NIC specification: least squares in log time over the scale."""
    from scipy.optimize import minimize_scalar

    rows = [r for r in load_rows() if r["machine"] == machine and LO <= float(r["bytes"]) <= HI
            and int(r["nodes"]) >= 2]
    if not rows:
        raise SystemExit(f"error: no judged rows for machine {machine!r}")

    def times(scale):
        out = []
        for r in rows:
            prof = machine_profile(r["machine"], int(r["gpus_per_node"]))
            prof = prof.replace(physics=dataclasses.replace(
                prof.physics, protocols=dataclasses.replace(prof.physics.protocols, latency_scale=scale)))
            out.append(float(predict(prof, r["collective"], float(r["bytes"]), int(r["nodes"]),
                                     int(r["gpus_per_node"]), True)[0]))
        return np.array(out)

    meas = np.array([float(r["time_us"]) * 1e-6 for r in rows])
    res = minimize_scalar(lambda x: float(np.mean(np.log(times(np.exp(x)) / meas) ** 2)),
                          bounds=(np.log(0.2), np.log(20.0)), method="bounded")
    scale = float(np.exp(res.x))
    return scale, float(np.mean(np.abs(times(scale) / meas - 1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every judged row")
    ap.add_argument("--fit-latency", metavar="MACHINE", help="fit network.protocols.latency_scale to one machine")
    args = ap.parse_args(argv)
    if args.fit_latency:
        scale, err = fit_latency(args.fit_latency)
        print(f"{args.fit_latency}: latency_scale {scale:.3f} (mean error {err:.0%} over its judged rows)")
        return 0
    curves: dict = {}
    for r in load_rows():
        nb, nodes, gpn = float(r["bytes"]), int(r["nodes"]), int(r["gpus_per_node"])
        if not (LO <= nb <= HI and nodes >= 2):
            continue
        prof = machine_profile(r["machine"], gpn)
        meas = float(r["time_us"]) * 1e-6
        old, nccl, new = (float(predict(prof, r["collective"], nb, nodes, gpn, pr, nl)[0])
                          for pr, nl in ((False, False), (True, True), (True, False)))
        curves.setdefault((r["curve"], r["machine"], r["file"]), []).append((nb, nodes, meas, old, nccl, new))
    print("published cross-node collective sweeps vs axoplan (time per call, 1 MiB-4 GiB, 2+ nodes; error = "
          "|pred/meas - 1|)")
    print(f"{'curve':18s} {'machine':12s} {'rows':>4s} {'nodes':>6s} {'alpha-beta':>10s} {'nccl':>6s} {'profile':>8s} "
          f"{'med p/m':>8s}")
    errs = []
    for (curve, machine, _), pts in curves.items():
        a = np.array([x[2:] for x in pts])
        e = [np.abs(a[:, i] / a[:, 0] - 1).mean() for i in (1, 2, 3)]
        errs.append(e)
        nodes = sorted({x[1] for x in pts})
        mark = "*" if machine == IN_SAMPLE else " "
        print(f"{curve:18s} {machine:12s} {len(pts):4d} {'-'.join(map(str, (nodes[0], nodes[-1]))):>6s} "
              f"{e[0]:9.0%} {e[1]:5.0%} {e[2]:6.0%}{mark} {np.median(a[:, 3] / a[:, 0]):8.2f}")
        if args.rows:
            for nb, n, m, o, c, p in pts:
                print(f"    {nb:>12.0f} B  {n:3d} nodes  measured {m * 1e6:9.1f} us  alpha-beta {o * 1e6:9.1f}  "
                      f"nccl {c * 1e6:9.1f}  profile {p * 1e6:9.1f}")
    m = np.mean(errs, axis=0)
    print(f"{'mean over curves':18s} {'':12s} {'':4s} {'':6s} {m[0]:9.0%} {m[1]:5.0%} {m[2]:6.0%}")
    print(f"(* in-sample: the bundled DGX profiles' latency_scale was fitted to this curve, --fit-latency {IN_SAMPLE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
