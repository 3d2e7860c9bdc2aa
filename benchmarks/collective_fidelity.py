"""Collectives across nodes, predicted against published sweeps: time per call, per curve.

Every sweep in benchmarks/data/nccl_*.csv and pccl_*.csv (the leading `#` lines name its source) is a curve
of one machine, collective and node count over message sizes (or, where a source gives one size, over node
counts). Judged: rows from 1 MiB to 4 GiB on 2 to 64 nodes; error = |pred/meas - 1|, averaged per curve,
then over the curves of a machine, then over machines.

Four predictions side by side:
- 'before': the model before issue 24 -- the bundled profile where the machine has one (perlmutter and
  frontier: the AxoNN authors' per-step latency and bandwidth table, measured on those machines), else
  NCCL's latency sum plus the ring volume over a plateau from the NIC specification;
- 'nccl': NCCL's protocol-aware model (comm.protocol_time: ring or tree, LL, LL128 or Simple) with NCCL's
  own constants (gpu_physics.nccl_protocols for the GPU generation and host CPU; RCCL, a fork with the same
  tuning structure, is given the Ampere-on-AMD rows) and the plateau from the NIC specification x the one
  ring efficiency of the NCCL team's DGX A100 statement (192 GB/s over 8 x 200 Gb/s, NVIDIA/nccl #812):
  nothing from any sweep;
- 'lomo': the same with network.protocols.latency_scale (measured time over NCCL's modelled latency: a
  property of the network and its transport plugin) fitted, least squares in log time, to the judged rows of
  the other machines on the same network (NETWORK below); 1 (NCCL's own) where no other machine shares it:
  leave-one-machine-out;
- 'own': the same with the scale fitted to the machine's own rows (what `calibrate --emit-slurm` does on a
  user's cluster; in-sample, for reference).

    python benchmarks/collective_fidelity.py [--rows] [--fit-latency MACHINE]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from axoplan.planner import comm as C
from axoplan.planner import gpu_physics
from axoplan.planner.machine import GB, _Reader, load_profile

DATA = Path(__file__).resolve().parent / "data"
# 192 GB/s all-reduce busbw over 8 x 25 GB/s of HDR (NVIDIA/nccl issue #812, the NCCL team)
RING_EFFICIENCY = 192 / 200
# machine -> (bundled profile it extends, NIC line rate per node GB/s, (compute capability, host CPU) of the
# NCCL constants, whether the bundled profile is this machine's own, source of the NIC figure)
MACHINES = {
    "a3mega-h100": ("dgx-h100", 200.0, (90, "intel"), False,
                    "8 x 200 Gb/s GPUDirect-TCPXO NICs per A3 Mega node (vendor specification, data file header)"),
    "h20-ndr": ("dgx-h100", 400.0, (90, "intel"), False, "8 x 400 Gb/s NDR ConnectX-7 per node (the data file's header)"),
    "p4dn-a100": ("dgx-a100", 50.0, (80, "intel"), False, "4 x 100 Gb/s EFA per p4dn.24xlarge (AWS specification)"),
    "perlmutter-a100": ("perlmutter", 100.0, (80, "amd"), True,
                        "4 x Slingshot-11 at 25 GB/s per node (machine_facts.csv, Singh et al. SC24 Sec. VI-B)"),
    "frontier-mi250x": ("frontier", 100.0, (80, "amd"), True,
                        "4 x Slingshot-11 at 25 GB/s per node (machine_facts.csv, Singh et al. SC24 Sec. VI-B)"),
}
# the network and transport each machine's collectives ran on: latency_scale transfers only within one
NETWORK = {"a3mega-h100": "GPUDirect-TCPXO", "h20-ndr": "InfiniBand NDR", "p4dn-a100": "AWS EFA",
           "perlmutter-a100": "Slingshot-11", "frontier-mi250x": "Slingshot-11"}
LO, HI = 2**20, 2**32
NODES = (2, 64)


def load_rows() -> list[dict]:
    rows = []
    for path in sorted(DATA.glob("nccl_*.csv")) + sorted(DATA.glob("pccl_*.csv")):
        with open(path) as f:
            for r in csv.DictReader(line for line in f if not line.startswith("#")):
                rows.append(dict(r, file=path.name))
    return rows


def judged(rows: list[dict]) -> list[dict]:
    return [r for r in rows if LO <= float(r["bytes"]) <= HI and NODES[0] <= int(r["nodes"]) <= NODES[1]]


@functools.lru_cache(maxsize=None)
def _protocols(cap: int, cpu: str) -> gpu_physics.Protocols:
    return gpu_physics.parse({"network": {"protocols": gpu_physics.nccl_protocols(cap, cpu)}},
                             _Reader("NCCL's defaults")).protocols


@functools.lru_cache(maxsize=None)
def machine_profile(machine: str, gpus_per_node: int, model: str, latency_scale: float = 1.0):
    """model 'before' (the profile as it was) or 'protocols' (NCCL's defaults, the plateau from the NICs)."""
    name, nic_gbs, (cap, cpu), own, _ = MACHINES[machine]
    prof = load_profile(name).replace(gpus_per_node=gpus_per_node)
    if model == "before":
        flat = prof.replace(physics=dataclasses.replace(prof.physics, protocols=None))
        return flat if own else flat.replace(inter_busbw=nic_gbs * RING_EFFICIENCY * GB)
    pr = dataclasses.replace(_protocols(cap, cpu), latency_scale=latency_scale)
    return prof.replace(inter_busbw=nic_gbs * RING_EFFICIENCY * GB,
                        physics=dataclasses.replace(prof.physics, protocols=pr))


def predict(r: dict, model: str, latency_scale: float = 1.0) -> float:
    nodes, gpn = int(r["nodes"]), int(r["gpus_per_node"])
    prof = machine_profile(r["machine"], gpn, model, latency_scale)
    p, stride = np.array([nodes * gpn]), np.array([1])
    bw = prof.group_busbw(p, stride)
    kind, nb = r["collective"], float(r["bytes"])
    if model == "before":
        return float(C.ring_time(prof, kind, nb, p, bw, prof.group_latency(p, stride), False, stride)[0])
    m, n = C.group_nodes(prof, p, stride)
    return float(C.protocol_seconds(prof, kind, nb, p, m, n, bw)[0])


def fit_latency(rows: list[dict]) -> float:
    """network.protocols.latency_scale minimising the squared log error of the protocol model over rows."""
    from scipy.optimize import minimize_scalar

    meas = np.array([float(r["time_us"]) * 1e-6 for r in rows])

    def loss(x):
        s = round(float(np.exp(x)), 4)  # a cache key: the fit never needs more digits
        return float(np.mean(np.log(np.array([predict(r, "protocols", s) for r in rows]) / meas) ** 2))

    res = minimize_scalar(loss, bounds=(np.log(0.2), np.log(30.0)), method="bounded", options={"xatol": 1e-3})
    return round(float(np.exp(res.x)), 4)


def mean_err(rows: list[dict], model: str, scale: float = 1.0) -> float:
    return float(np.mean([abs(predict(r, model, scale) / (float(r["time_us"]) * 1e-6) - 1) for r in rows]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every judged row")
    ap.add_argument("--fit-latency", metavar="MACHINE", help="fit network.protocols.latency_scale to one machine")
    args = ap.parse_args(argv)
    rows = judged(load_rows())
    machines = sorted({r["machine"] for r in rows})
    if args.fit_latency:
        mine = [r for r in rows if r["machine"] == args.fit_latency]
        if not mine:
            print(f"error: no judged rows for machine {args.fit_latency!r} (known: {', '.join(machines)})",
                  file=sys.stderr)
            return 2
        s = fit_latency(mine)
        print(f"{args.fit_latency}: latency_scale {s:.3f} (mean error {mean_err(mine, 'protocols', s):.0%} "
              f"over its {len(mine)} judged rows)")
        return 0
    lomo = {}
    for m in machines:
        peers = [r for r in rows if r["machine"] != m and NETWORK[r["machine"]] == NETWORK[m]]
        lomo[m] = fit_latency(peers) if peers else 1.0
    own = {m: fit_latency([r for r in rows if r["machine"] == m]) for m in machines}
    print("published cross-node collective sweeps vs axoplan: time per call, 1 MiB-4 GiB on 2-64 nodes, "
          "error = |pred/meas - 1| (mean per curve)")
    print(f"{'machine':16s} {'network':16s} {'collective':14s} {'curves':>6s} {'rows':>5s} {'before':>7s} "
          f"{'nccl':>6s} {'lomo':>6s} {'own':>6s}  latency_scale lomo / own")
    per_machine = []
    for m in machines:
        mr = [r for r in rows if r["machine"] == m]
        errs = []
        for kind in sorted({r["collective"] for r in mr}):
            kr = [r for r in mr if r["collective"] == kind]
            curves = sorted({r["curve"] for r in kr})
            e = np.array([[mean_err([r for r in kr if r["curve"] == c], mod, s)
                           for mod, s in (("before", 1.0), ("protocols", 1.0), ("protocols", lomo[m]),
                                          ("protocols", own[m]))] for c in curves])
            errs.append(e)
            print(f"{m:16s} {NETWORK[m]:16s} {kind:14s} {len(curves):6d} {len(kr):5d} "
                  + " ".join(f"{x:6.0%}" for x in e.mean(0))
                  + f"  {lomo[m]:.2f} / {own[m]:.2f}")
            if args.rows:
                for r in kr:
                    meas = float(r["time_us"])
                    print(f"    {r['curve']:28s} {float(r['bytes']):>12.0f} B  measured {meas:10.1f} us  "
                          + "  ".join(f"{mod}{'' if s == 1.0 else f'x{s:.2f}'} {predict(r, mod, s) * 1e6:10.1f}"
                                      for mod, s in (("before", 1.0), ("protocols", 1.0),
                                                     ("protocols", lomo[m]))))
        per_machine.append(np.concatenate(errs).mean(0))
    print(f"{'mean over machines':16s} {'':16s} {'':14s} {'':6s} {'':5s} "
          + " ".join(f"{x:6.0%}" for x in np.mean(per_machine, axis=0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
