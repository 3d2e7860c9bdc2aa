"""Collectives across nodes, predicted against published nccl-tests sweeps: time per call, per curve.

Every sweep in benchmarks/data/nccl_*.csv (the leading `#` lines name its source) is predicted from facts
that do not come from any sweep here: the NCCL tuning-model constants of the bundled profile of the same GPU
generation (network.protocols, NVIDIA/nccl src/graph/tuning.cc), the machine's NIC line rate from its vendor
specification (MACHINES below), and one ring efficiency, the NCCL team's DGX A100 statement (192 GB/s of
all-reduce busbw over 8 x 200 Gb/s, NVIDIA/nccl issue #812): so every curve is predicted leave-one-machine-out
(nothing is fitted at all). Rows from 1 MB to 4 GB on 2 or more nodes are judged; error = |pred/meas - 1|.

Two models side by side: 'alpha-beta' (the model before issue 24: NCCL's latency sum plus the buffer's
ring volume over the plateau) and 'protocols' (NCCL's protocol-aware choice of ring or tree and LL, LL128
or Simple, comm.protocol_seconds).

    python benchmarks/collective_fidelity.py [--rows]
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
    "p4dn-a100": ("dgx-a100", 50.0, "4 x 100 Gb/s EFA per p4dn.24xlarge (AWS specification, see the data file's header)"),
}
LO, HI = 2**20, 2**32


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


def predict(prof, kind: str, nbytes, nodes: int, gpn: int, protocols: bool) -> np.ndarray:
    p = np.array([nodes * gpn])
    stride = np.array([1])
    bw = prof.group_busbw(p, stride)
    if protocols:
        m, n = C.group_nodes(prof, p, stride)
        return C.protocol_seconds(prof, kind, nbytes, p, m, n, bw)
    flat = prof.replace(physics=dataclasses.replace(prof.physics, protocols=None))
    return C.ring_time(flat, kind, nbytes, p, bw, flat.group_latency(p, stride), False, stride)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every judged row")
    args = ap.parse_args(argv)
    curves: dict = {}
    for r in load_rows():
        nb, nodes, gpn = float(r["bytes"]), int(r["nodes"]), int(r["gpus_per_node"])
        if not (LO <= nb <= HI and nodes >= 2):
            continue
        prof = machine_profile(r["machine"], gpn)
        meas = float(r["time_us"]) * 1e-6
        old, new = (float(predict(prof, r["collective"], nb, nodes, gpn, pr)[0]) for pr in (False, True))
        curves.setdefault((r["curve"], r["machine"], r["file"]), []).append((nb, nodes, meas, old, new))
    print("published cross-node collective sweeps vs axoplan (time per call; error = |pred/meas - 1|; "
          "no constant from any sweep here)")
    print(f"{'curve':18s} {'machine':12s} {'rows':>4s} {'nodes':>6s} {'alpha-beta':>10s} {'protocols':>10s} "
          f"{'med p/m':>8s}")
    errs_old, errs_new = [], []
    for (curve, machine, _), pts in curves.items():
        a = np.array([(m, o, n) for _, _, m, o, n in pts])
        eo, en = np.abs(a[:, 1] / a[:, 0] - 1), np.abs(a[:, 2] / a[:, 0] - 1)
        errs_old.append(eo.mean())
        errs_new.append(en.mean())
        nodes = sorted({x[1] for x in pts})
        print(f"{curve:18s} {machine:12s} {len(pts):4d} {'-'.join(map(str, (nodes[0], nodes[-1]))):>6s} "
              f"{eo.mean():9.0%} {en.mean():9.0%} {np.median(a[:, 2] / a[:, 0]):8.2f}")
        if args.rows:
            for nb, n, m, o, p in pts:
                print(f"    {nb:>12.0f} B  {n:3d} nodes  measured {m * 1e6:9.1f} us  alpha-beta {o * 1e6:9.1f}  "
                      f"protocols {p * 1e6:9.1f}")
    print(f"{'mean over curves':18s} {'':12s} {'':4s} {'':6s} {np.mean(errs_old):9.0%} {np.mean(errs_new):9.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
