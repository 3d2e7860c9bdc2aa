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
  own constants (gpu_physics.nccl_protocols for the GPU generation, host CPU and GPU-to-NIC path: no LL128
  across nodes beyond PXB; RCCL gets its own tuning model's rows, gpu_physics.rccl_protocols: Frontier's node
  is RCCL's rome_model_63, tuning model 3) and the plateau from the NIC specification x the one
  ring efficiency of the NCCL team's DGX A100 statement (192 GB/s over 8 x 200 Gb/s, NVIDIA/nccl #812),
  NVLSTree for the all-reduce on the Hopper boards whose NVSwitch does multicast (NVLS below), and the
  latency the network plugin reports to NCCL (NET_LATENCY_US below):
  nothing from any sweep;
- 'lomo': the same with two measured properties, network.protocols.latency_scale (measured time over
  NCCL's modelled latency: a property of the network and the library, LIBRARY below) and the plateau's share
  of the NIC line rate (inter_node.busbw_gbs over the NICs: a property of the network, NETWORK below), each
  from the judged rows of the other machines that share what it is a property of (the plateau from their
  rows of 256 MiB and more; the latency scale from every other machine on the network, whatever its library,
  where its libraries share one transport, SHARED_TRANSPORT below); on a network no other sweep ran on (or whose
  other sweeps have no latency-bound row), the median of the latency scales the library's other machines fit to
  their own rows, and NCCL's 0.96 (or those sweeps' plateau share): leave-one-machine-out;
- 'own': the same two fitted to the machine's own rows (what `calibrate --emit-slurm` does on a user's
  cluster; in-sample, for reference).
Both fits minimise the mean absolute log error: the sweeps are means of 20 calls and some hold stalls of
10x their neighbours (the Frontier logs), which a squared loss lets decide the fit.
Each machine's error is printed as the mean over its curves (the target) and the median over its rows.
--rows prints every judged row with pred/meas for each prediction; --diagnose, per curve, the median
pred/meas at 1-16 MiB (latency-bound) and at 256 MiB and more (bandwidth-bound) for 'nccl' and 'own';
--steady judges only the steady state, leaving out (and listing) every call slower than STALL x a larger
message's call on its curve (the target is stated over all rows; this shows how much the stalls weigh).

--scale prints each sweep's time per ring step at one share per rank over its node counts (congestion at scale).

    python benchmarks/collective_fidelity.py [--rows] [--diagnose] [--steady] [--fit-latency MACHINE [--share S]]
    python benchmarks/collective_fidelity.py --scale
    python benchmarks/collective_fidelity.py --stalls
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

from axoplan.calibrate.fit import STALL_RATIO, find_stalls, stalled
from axoplan.planner import comm as C
from axoplan.planner import gpu_physics
from axoplan.planner.machine import GB
from axoplan.planner.profile_reader import _Reader, load_profile

DATA = Path(__file__).resolve().parent / "data"
# 192 GB/s all-reduce busbw over 8 x 25 GB/s of HDR (NVIDIA/nccl issue #812, the NCCL team)
RING_EFFICIENCY = 192 / 200
# machine -> (bundled profile it extends, NIC line rate per node GB/s, (compute capability, host CPU, GPU-to-NIC
# path) of the NCCL constants, whether the bundled profile is this machine's own, source of the NIC figure)
MACHINES = {
    "a3mega-h100": ("dgx-h100", 200.0, (90, "intel", "PXB"), False,
                    "8 x 200 Gb/s GPUDirect-TCPXO NICs per A3 Mega node (vendor specification, data file header)"),
    "h20-ndr": ("dgx-h100", 400.0, (90, "intel", "PXB"), False,
                "8 x 400 Gb/s NDR ConnectX-7 per node (the data file's header)"),
    "p4dn-a100": ("dgx-a100", 50.0, (80, "intel", "PXB"), False, "4 x 100 Gb/s EFA per p4dn.24xlarge (AWS specification)"),
    "p4de-a100": ("dgx-a100", 50.0, (80, "intel", "PXB"), False,
                  "4 x 100 Gb/s EFA per p4de.24xlarge, Intel Xeon hosts (AWS p4d/p4de specification, data file header)"),
    "p5-h100": ("dgx-h100", 400.0, (90, "amd", "PXB"), False,
                "3,200 Gb/s of EFA per p5.48xlarge, AMD EPYC hosts (AWS p5 specification, data file header)"),
    "xe9680-h100-ndr": ("dgx-h100", 400.0, (90, "intel", "PXB"), False,
                        "8 x ConnectX-7 InfiniBand 400 Gb/s per Dell XE9680 (NVIDIA/nccl-tests #309, the reporter's "
                        "setup; the XE9680 is an Intel Xeon server)"),
    "vm-h100-ndr": ("dgx-h100", 400.0, (90, "intel", "PXB"), False,
                    "8 GPU-NIC pairs per VM, 'With 8 400 Gbps NICs your peak would be at 400 GB/s' (the NCCL team, "
                    "NVIDIA/nccl-tests #309); host CPU assumed Intel as the reporter's bare-metal XE9680s"),
    "h100-ndr-8node": ("dgx-h100", 400.0, (90, "intel", "PXB"), False,
                       "'IB 400G', 400 GB/s 'the IB limit of our network' (gj-aion, NVIDIA/nccl-tests #309); host CPU "
                       "not stated: Intel assumed (it sets only NCCL's 1 us net overhead against AMD's 2)"),
    "oci-gpu4-a100": ("dgx-a100", 200.0, (80, "amd", "PXB"), False,
                      "16 x 100 Gb/s RoCE per OCI BM.GPU4.8, AMD hosts, GPU and NIC under one PCIe switch "
                      "(oracle-quickstart/oci-hpc-oke manifests/topology/BM.GPU4.8.xml @1402938)"),
    "abci-a100-hdr": ("dgx-a100", 100.0, (80, "intel", "PXB"), False,
                      "4 x InfiniBand HDR 200 Gb/s per ABCI 2.0 Compute Node (A), 2 GPUs per NIC, 2 x Intel Xeon "
                      "Platinum 8360Y (aistabci/abci-docs en/docs/system-overview.md, the data file header)"),
    "a3ultra-h200-roce": ("dgx-h200", 400.0, (90, "intel", "PXB"), False,
                          "8 x 400 Gb/s ConnectX-7 per a3-ultragpu-8g for GPU traffic, 3,200 Gbps (Google's "
                          "'Networking and GPU machines' page, the data file headers); host CPU assumed Intel as "
                          "the A3 family"),
    "perlmutter-a100": ("perlmutter", 100.0, (80, "amd", "PHB"), True,
                        "4 x Slingshot-11 at 25 GB/s per node (machine_facts.csv, Singh et al. SC24 Sec. VI-B)"),
    "alps-gh200": ("alps", 100.0, (90, "arm", "P2C"), True,
                   "4 x Slingshot-11 at 25 GB/s per node (machine_facts.csv 'Alps node', Singh et al. SC24 Sec. VI-B); Grace "
                   "(Arm) hosts"),
    "frontier-mi250x": ("frontier", 100.0, ("rccl", 3, "PXB"), True,
                        "4 x Slingshot-11 at 25 GB/s per node (machine_facts.csv, Singh et al. SC24 Sec. VI-B)"),
}
# the GPU-to-NIC path (gpu_physics.NIC_PATHS) decides whether NCCL runs LL128 across nodes
NIC_PATH_SOURCE = {
    "PXB": "documented assumption: 8-GPU HGX/DGX-class boards (and the p4dn, p4de, p5, A3 Mega and XE9680 nodes built on "
           "them; OCI BM.GPU4.8 by its topology file) put "
           "each GPU and its NIC under one PCIe switch; on Frontier RCCL's own rows, which have no LL128 (its NICs hang "
           "off the MI250X packages)",
    "P2C": "NCCL's path type for a Grace Hopper GPU, which reaches the Slingshot NICs on its Grace's PCIe through "
           "the C2C link (NVIDIA/nccl src/graph/topo.h PATH_P2C); Hopper runs LL128 across it (NCCL_LL128_C2C, default 1)",
    "PHB": "inferred for Perlmutter's GPU nodes: jobs there set NCCL_NET_GDR_LEVEL=PHB, the sweep's own script "
           "among them (axonn-ai/sc2025-pccl-reproducer scripts/perlmutter/run_raw_collectives_benchmark.sh "
           "@624c30f; also NVlabs/FourCastNet submit_batch.sh @7595ba6), which changes NCCL's behaviour (GPUDirect "
           "RDMA up to PXB by default) only where the GPU reaches its NIC through the CPU's host bridge",
}
# Hopper nodes whose NVSwitch does multicast, so that NCCL may run an all-reduce as NVLSTree
# (gpu_physics.nvls_tree_row): every HGX H100/H200/H20 board here, NCCL's default NCCL_NVLS_ENABLE=2 (on where
# the driver reports multicast: NVIDIA/nccl src/transport/nvls.cc) and no source setting it to 0
NVLS = {
    "xe9680-h100-ndr": "bare-metal HGX H100, NCCL 2.26.2, no NCCL_NVLS_ENABLE in the printed env (NVIDIA/nccl-tests #309)",
    "vm-h100-ndr": "HGX H100 passed through whole to VMs, same NCCL 2.26.2 and env as the XE9680s (NVIDIA/nccl-tests #309)",
    "h100-ndr-8node": "HGX H100 nodes with no NCCL env (NVIDIA/nccl-tests #309); their default all-reduce on 2 nodes "
                      "beats the 392.69 GB/s of a forced ring, which no ring over 400 GB/s of NICs can",
    "h20-ndr": "'NVL sharp' available on the 2 H20 nodes (NVIDIA/nccl issue #1244, its title)",
    "p5-h100": "HGX H100 in p5.48xlarge, NCCL 2.18.5 / 2.20.3, no NCCL_NVLS_ENABLE in the scripts (data file header)",
    "a3mega-h100": "HGX H100 in A3 Mega; Google's TCPXO NCCL profile sets NCCL_NVLSTREE_MAX_CHUNKSIZE "
                   "(nccl-env-profile.sh for the TCPXO stack, public index id 32323449514)",
    "a3ultra-h200-roce": "HGX H200 in A3 Ultra (all-gather only here: NVLSTree is an all-reduce algorithm)",
}
# the latency (us) a network plugin reports to NCCL, which NCCL adds to every network step (twice for Simple):
# aws-ofi-nccl's platform table, 75 us on p4d, p4de and p5 since v1.7 (aws/aws-ofi-nccl d87d61e 'Variable
# internode latency reported to NCCL', in v1.7.0-aws and later: the sweeps ran v1.7.3 and v1.8.1; src/platform-aws.cpp
# @2daf7d3); NCCL's own InfiniBand and socket transports report 0 (NVIDIA/nccl src/transport/net_ib/init.cc)
NET_LATENCY_US = {m: 75.0 for m in ("p4dn-a100", "p4de-a100", "p5-h100")}
# the network and transport each machine's collectives ran on: latency_scale transfers only within one. On EFA
# the transport is aws-ofi-nccl's protocol, which its platform table sets per instance: SENDRECV on p4d and
# p4de, RDMA write on p5 (aws/aws-ofi-nccl src/platform-aws.cpp @2daf7d3, default_protocol)
NETWORK = {"alps-gh200": "Slingshot-11", "a3mega-h100": "GPUDirect-TCPXO", "h20-ndr": "InfiniBand NDR", "p4dn-a100": "AWS EFA (SENDRECV)",
           "perlmutter-a100": "Slingshot-11", "frontier-mi250x": "Slingshot-11", "p4de-a100": "AWS EFA (SENDRECV)",
           "p5-h100": "AWS EFA (RDMA)", "xe9680-h100-ndr": "InfiniBand NDR", "vm-h100-ndr": "InfiniBand NDR",
           "h100-ndr-8node": "InfiniBand NDR", "oci-gpu4-a100": "RoCE (OCI)", "abci-a100-hdr": "InfiniBand HDR",
           "a3ultra-h200-roce": "RoCE (gIB)"}
# the communication library: its per-step latencies are its own (RCCL's tuning tables are not NCCL's), so a
# latency scale transfers only between machines sharing network and library; the plateau, a property of the
# NICs and the fabric, between machines sharing the network
LIBRARY = {"alps-gh200": "NCCL", "a3mega-h100": "NCCL", "h20-ndr": "NCCL", "p4dn-a100": "NCCL", "perlmutter-a100": "NCCL",
           "frontier-mi250x": "RCCL", "p4de-a100": "NCCL", "p5-h100": "NCCL", "xe9680-h100-ndr": "NCCL",
           "vm-h100-ndr": "NCCL", "h100-ndr-8node": "NCCL", "oci-gpu4-a100": "NCCL", "abci-a100-hdr": "NCCL",
           "a3ultra-h200-roce": "NCCL"}
# networks whose libraries reach them through one transport, so that what a network step costs beyond a
# library's table transfers between the libraries: on Slingshot-11 both sweeps' scripts load the AWS OFI plugin
# over libfabric's cxi provider with the same rendezvous settings (Perlmutter NCCL_NET="AWS Libfabric", Frontier
# aws-ofi-rccl against /opt/cray/libfabric/1.15.2.0; both FI_CXI_RDZV_THRESHOLD=0, FI_CXI_RDZV_GET_MIN=0,
# FI_CXI_RDZV_EAGER_SIZE=0: axonn-ai/sc2025-pccl-reproducer scripts/{perlmutter,frontier}/
# run_raw_collectives_benchmark.sh @194759f, scripts/frontier/install_frontier.sh @540dd3e)
SHARED_TRANSPORT = {"Slingshot-11"}
# single-node sweeps (nodes = 1): machine -> (bundled profile whose network.protocols.inside_node they test, compute
# capability of NCCL's single-node rows, the board); the profile's inside_node.latency_scale is their fit
NODE_MACHINES = {
    "a100-sxm4-node": ("dgx-a100", 80, "one 8-GPU A100-SXM4 board (HGX/DGX, NVSwitch)"),
    "h200-node": ("dgx-h200", 90, "one 8-GPU HGX H200 board (NVLink4 NVSwitch, NVLink SHARP)"),
}
# rows of this many bytes and more are bandwidth-bound on every judged curve: the plateau is fitted on them
PLATEAU_BYTES = 2**28
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


# a call slower than STALL x a larger message's call on the same curve is a stall, not the steady state a per-call
# model describes (a larger message cannot take less time: the Frontier logs hold 1-4 MiB all-gathers of 6.5-7.2 ms
# beside 8 MiB at 0.57 ms, means of 20 calls after only 5 warm-up calls); the rule calibrate's fit applies
STALL = STALL_RATIO


def stalls(rows: list[dict]) -> set:
    """(curve, bytes) of every row slower than STALL x the fastest call of a larger message on its curve."""
    out = set()
    for c in {r["curve"] for r in rows}:
        pts = sorted((float(r["bytes"]), float(r["time_us"])) for r in rows if r["curve"] == c)
        out |= {(c, b) for (b, _), f in zip(pts, stalled(pts)) if f}
    return out


@functools.lru_cache(maxsize=None)
def _protocols(cap, cpu, nic_path, nvls=False) -> gpu_physics.Protocols:
    """The library's own rows: RCCL's tuning model where cap is 'rccl' (cpu: its tuning model), else NCCL's."""
    rows = gpu_physics.rccl_protocols(cpu) if cap == "rccl" else gpu_physics.nccl_protocols(cap, cpu, nic_path, nvls)
    return gpu_physics.parse({"network": {"protocols": rows}}, _Reader("the library's defaults")).protocols


@functools.lru_cache(maxsize=None)
def machine_profile(machine: str, gpus_per_node: int, model: str, latency_scale: float = 1.0,
                    efficiency: float = RING_EFFICIENCY):
    """model 'before' (the profile as it was) or 'protocols' (NCCL's defaults x latency_scale, the plateau
    `efficiency` x the NICs' line rate)."""
    name, nic_gbs, consts, own, _ = MACHINES[machine]
    prof = load_profile(name).replace(gpus_per_node=gpus_per_node)
    if model == "before":
        flat = prof.replace(physics=dataclasses.replace(prof.physics, protocols=None))
        return flat if own else flat.replace(inter_busbw=nic_gbs * RING_EFFICIENCY * GB)
    pr = dataclasses.replace(_protocols(*consts, machine in NVLS), latency_scale=latency_scale,
                             net_latency=NET_LATENCY_US.get(machine, 0.0) * 1e-6)
    return prof.replace(inter_busbw=nic_gbs * efficiency * GB,
                        physics=dataclasses.replace(prof.physics, protocols=pr))


def predict(r: dict, model: str, latency_scale=1.0, efficiency=RING_EFFICIENCY):
    """Seconds per call of row r; with arrays for latency_scale and efficiency (broadcast against each
    other, 'protocols' and 'own' only) an array of them. 'own': 'protocols' with the stalls the machine's own
    profile measured (network.stalls: the least such a call takes)."""
    nodes, gpn = int(r["nodes"]), int(r["gpus_per_node"])
    kind, nb = r["collective"], float(r["bytes"])
    p, stride = np.array([nodes * gpn]), np.array([1])
    if model == "before":
        prof = machine_profile(r["machine"], gpn, model)
        bw = prof.group_busbw(p, stride)
        return float(C.ring_time(prof, kind, nb, p, bw, prof.group_latency(p, stride), False, stride)[0])
    scalar = np.ndim(latency_scale) == 0 and np.ndim(efficiency) == 0
    prof = machine_profile(r["machine"], gpn, model, 1.0, 1.0)
    m, n = C.group_nodes(prof, p, stride)
    # the group's plateau (one group: it has the node's NICs to itself) x the share of the line rate
    bw = prof.group_busbw(p, stride)[0] * np.asarray(efficiency, dtype=np.float64)
    pr = dataclasses.replace(prof.physics.protocols, latency_scale=np.asarray(latency_scale, dtype=np.float64))
    t = C.protocol_seconds(prof.replace(physics=dataclasses.replace(prof.physics, protocols=pr)),
                           kind, nb, int(p[0]), float(m[0]), float(n[0]), bw)
    if model == "own":  # the machine's own measured behaviour too: its profile's network.stalls (in-sample)
        t = np.maximum(t, C.stall_seconds(machine_stalls(r["machine"]), kind, nb, int(p[0]), float(n[0])))
    return float(t) if scalar else t


@functools.lru_cache(maxsize=None)
def machine_stalls(machine: str) -> tuple:
    """The network.stalls of the machine's own bundled profile (none where the profile is another machine's)."""
    name, _, _, own, _ = MACHINES[machine]
    return load_profile(name).physics.stalls if own else ()


# the fit's grid: latency scale 0.25-50 (9% apart), plateau share of the line rate 0.30-1.20 (0.01 apart)
SCALES = np.exp(np.linspace(np.log(0.25), np.log(50.0), 61))
SHARES = np.round(np.arange(0.30, 1.2001, 0.01), 2)


def fit_network(rows: list[dict], model: str = "protocols") -> tuple[float, float]:
    """(latency_scale, plateau share of the NIC line rate) minimising the mean |log(pred/meas)| over rows."""
    if all(float(r["bytes"]) >= PLATEAU_BYTES for r in rows):  # no latency-bound row to fit it: NCCL's latency
        return 1.0, fit_share(rows)
    loss = np.zeros((len(SCALES), len(SHARES)))
    for r in rows:
        loss += np.abs(np.log(predict(r, model, SCALES[:, None], SHARES[None, :]) / (float(r["time_us"]) * 1e-6)))
    i, j = np.unravel_index(np.argmin(loss), loss.shape)
    return round(float(SCALES[i]), 2), float(SHARES[j])


def fit_share(rows: list[dict]) -> float:
    """The plateau's share of the NIC line rate: the mean |log(pred/meas)| fit over rows of PLATEAU_BYTES
    and more, latency at NCCL's own (a small part of those calls)."""
    big = [r for r in rows if float(r["bytes"]) >= PLATEAU_BYTES]
    loss = sum(np.abs(np.log(predict(r, "protocols", 1.0, SHARES) / (float(r["time_us"]) * 1e-6))) for r in big)
    return float(SHARES[int(np.argmin(loss))])


def leave_one_out(rows: list[dict], machine: str) -> tuple[float, float]:
    """(latency_scale, plateau share) for `machine` from the other machines' rows only: both fitted together
    on those sharing its network, whatever their library, where its libraries reach it through one transport
    (SHARED_TRANSPORT: what a network step costs beyond a library's table is the transport's, so each machine on
    it is evidence alike); else on those sharing its network and library (where those have no latency-bound row,
    their plateau share and the latency as below); else the plateau share from those and the latency NCCL's; a network no
    other sweep ran on gets the median of the latency scales each other machine of its library fits to its
    own rows (on the sweeps here every such fit is above NCCL's 1 but ABCI's, whose rows end at 32 MiB: NCCL's
    latency sits below what networks deliver) and NCCL's plateau share; with no other machine at all, NCCL's defaults."""
    others = [r for r in rows if r["machine"] != machine and NETWORK[r["machine"]] == NETWORK[machine]]
    same_lib = [r for r in others if LIBRARY[r["machine"]] == LIBRARY[machine]]
    if others and NETWORK[machine] in SHARED_TRANSPORT:
        return fit_network(others)
    if same_lib:
        scale, share = fit_network(same_lib)
        if any(float(r["bytes"]) < PLATEAU_BYTES for r in same_lib):
            return scale, share
        # peers whose rows are all bandwidth-bound say nothing of the latency (fit_network's 1 is NCCL's own, not
        # a measurement): the latency as on a network no other sweep ran on, their plateau share
        return _library_scale(rows, machine), share
    if others:
        return 1.0, fit_share(others)
    return _library_scale(rows, machine), RING_EFFICIENCY


def _library_scale(rows: list[dict], machine: str) -> float:
    """The median of the latency scales the library's other machines fit to their own rows (1: none)."""
    peers = sorted({r["machine"] for r in rows if r["machine"] != machine and LIBRARY[r["machine"]] == LIBRARY[machine]})
    if not peers:
        return 1.0
    return round(float(np.median([fit_network([r for r in rows if r["machine"] == m])[0] for m in peers])), 2)


def fit_latency(rows: list[dict], share: float = RING_EFFICIENCY) -> float:
    """network.protocols.latency_scale minimising the squared log error of the protocol model over rows,
    the plateau from the NICs x share (0.96: how the bundled DGX profiles' scale is fitted; a profile whose
    inter_node.busbw_gbs is another share of its NICs is fitted at that share)."""
    from scipy.optimize import minimize_scalar

    meas = np.array([float(r["time_us"]) * 1e-6 for r in rows])

    def loss(x):
        s = round(float(np.exp(x)), 4)  # a cache key: the fit never needs more digits
        return float(np.mean(np.log(np.array([predict(r, "protocols", s, share) for r in rows]) / meas) ** 2))

    res = minimize_scalar(loss, bounds=(np.log(0.2), np.log(30.0)), method="bounded", options={"xatol": 1e-3})
    return round(float(np.exp(res.x)), 4)


def node_rows(rows: list[dict]) -> list[dict]:
    """The single-node sweeps' rows from 1 MiB to 4 GiB."""
    return [r for r in rows if int(r["nodes"]) == 1 and r["machine"] in NODE_MACHINES and LO <= float(r["bytes"]) <= HI]


def predict_node(r: dict, model: str, latency_scale: float = 1.0) -> float:
    """Seconds per call of a single-node row: 'before' the alpha-beta line the profiles used inside a node (NCCL's
    latency sum plus the ring volume over the group's plateau), 'protocols' NCCL's single-node rows
    (gpu_physics.nccl_node_protocols) x latency_scale over the profile's plateau."""
    gpn = int(r["gpus_per_node"])
    prof = _node_profile(r["machine"], gpn, model, latency_scale)
    kind, nb, p = r["collective"], float(r["bytes"]), np.array([gpn])
    bw = prof.group_busbw(p, np.array([1]))
    if kind == "all_reduce":  # the node's switch may reduce it (NVLS: MachineProfile.intra_nvls)
        bw = prof.all_reduce_busbw(p, True, bw)
    if model == "before":
        return float(C.ring_time(prof, kind, nb, p, bw, prof.group_latency(p, np.array([1])), True, 1)[0])
    return float(C.node_protocol_seconds(prof, kind, nb, gpn, bw[0]))


@functools.lru_cache(maxsize=None)
def _node_profile(machine: str, gpus_per_node: int, model: str, latency_scale: float):
    """The sweep's bundled profile: as it is ('before'), or with NCCL's single-node rows x latency_scale."""
    name, cap, _ = NODE_MACHINES[machine]
    prof = load_profile(name).replace(gpus_per_node=gpus_per_node)
    if model == "before":
        return prof
    d = {"network": {"protocols": dict(gpu_physics.nccl_protocols(cap, "intel"),
                                       inside_node=gpu_physics.nccl_node_protocols(cap))}}
    node = gpu_physics.parse(d, _Reader("NCCL's single-node defaults")).protocols.inside_node
    pr = dataclasses.replace(prof.physics.protocols, inside_node=dataclasses.replace(node, latency_scale=latency_scale))
    return prof.replace(physics=dataclasses.replace(prof.physics, protocols=pr))


def fit_node_latency(rows: list[dict]) -> float:
    """network.protocols.inside_node.latency_scale minimising the squared log error of NCCL's single-node rows
    over single-node rows (as fit_latency across nodes)."""
    from scipy.optimize import minimize_scalar

    meas = np.array([float(r["time_us"]) * 1e-6 for r in rows])

    def loss(x):
        s = float(np.exp(x))
        return float(np.mean(np.log(np.array([predict_node(r, "protocols", s) for r in rows]) / meas) ** 2))

    res = minimize_scalar(loss, bounds=(np.log(0.2), np.log(30.0)), method="bounded", options={"xatol": 1e-3})
    return round(float(np.exp(res.x)), 4)


def node_errors(rows: list[dict], model: str, scale: float = 1.0) -> np.ndarray:
    return np.array([abs(predict_node(r, model, scale) / (float(r["time_us"]) * 1e-6) - 1) for r in rows])


def print_nodes(rows: list[dict]) -> None:
    """Inside one node: each single-node sweep against the alpha-beta line ('before'), NCCL's single-node rows at
    its own latency ('nccl'), at the other sweeps' fitted scale ('lomo') and at the sweep's own ('own', the
    profile's inside_node.latency_scale)."""
    nr = node_rows(rows)
    machines = sorted({r["machine"] for r in nr})
    if not machines:
        return
    own = {m: fit_node_latency([r for r in nr if r["machine"] == m]) for m in machines}
    print("\ninside one node (published single-node sweeps, 1 MiB-4 GiB; error = |pred/meas - 1|, mean over rows, median "
          "in brackets):")
    print(f"{'machine':17s} {'profile':9s} {'collective':14s} {'rows':>4s} {'before':>10s} {'nccl':>10s} {'lomo':>10s} "
          f"{'own':>10s}  latency_scale: lomo | own")
    for m in machines:
        others = [r for r in nr if r["machine"] != m]
        lomo = fit_node_latency(others) if others else 1.0
        for kind in sorted({r["collective"] for r in nr if r["machine"] == m}):
            kr = [r for r in nr if r["machine"] == m and r["collective"] == kind]
            es = [node_errors(kr, mod, sc) for mod, sc in (("before", 1.0), ("protocols", 1.0), ("protocols", lomo),
                                                           ("protocols", own[m]))]
            print(f"{m:17s} {NODE_MACHINES[m][0]:9s} {kind:14s} {len(kr):4d} "
                  + " ".join(f"{e.mean():4.0%} ({np.median(e):3.0%})" for e in es) + f"  {lomo:.2f} | {own[m]:.2f}")


def errors(rows: list[dict], model: str, scale: float = 1.0, share: float = RING_EFFICIENCY) -> np.ndarray:
    """|pred/meas - 1| per row."""
    return np.array([abs(predict(r, model, scale, share) / (float(r["time_us"]) * 1e-6) - 1) for r in rows])


def mean_err(rows: list[dict], model: str, scale: float = 1.0, share: float = RING_EFFICIENCY) -> float:
    return float(np.mean(errors(rows, model, scale, share)))


def _ratios(rows, model, scale, share, lo, hi):
    sel = [r for r in rows if lo <= float(r["bytes"]) <= hi]
    if not sel:
        return float("nan")
    return float(np.median([predict(r, model, scale, share) / (float(r["time_us"]) * 1e-6) for r in sel]))


def step_times(rows: list[dict]) -> dict:
    """(machine, collective) -> {share per rank (bytes): {nodes: measured time per ring step (s)}} for every
    sweep over at least 4 node counts, no stall (a call slower than a larger message's) counted. A ring moves one
    share per rank per step, so where a network congests with more nodes the step at one share slows."""
    out = {}
    skip = stalls(rows)
    for r in rows:
        if (r["curve"], float(r["bytes"])) in skip or int(r["nodes"]) < 2:
            continue
        p = int(r["nodes"]) * int(r["gpus_per_node"])
        steps = C.ring_steps(r["collective"], p)
        share = int(float(r["bytes"])) // p
        out.setdefault((r["machine"], r["collective"]), {}).setdefault(share, {})[int(r["nodes"])] = (
            float(r["time_us"]) * 1e-6 / steps)
    return {k: v for k, v in out.items() if len({n for s in v.values() for n in s}) >= 4}


def print_scale(rows: list[dict]) -> None:
    print("congestion at scale: measured time per ring step at one share per rank (each rank's part of the buffer), "
          "by node count; its spread is what more nodes cost beyond the model's steps (stalls left out)")
    for (machine, kind), by_share in sorted(step_times(rows).items()):
        print(f"{machine} {kind} ({NETWORK[machine]}, {LIBRARY[machine]})")
        for share, by_nodes in sorted(by_share.items()):
            if len(by_nodes) < 3 or share < 2**18:
                continue
            ts = [by_nodes[n] for n in sorted(by_nodes)]
            cells = "  ".join(f"{n}n {t * 1e6:6.1f}" for n, t in sorted(by_nodes.items()))
            print(f"    {share / 2**20:7.2f} MiB per rank: us per step  {cells}   max/min {max(ts) / min(ts):.2f}")


def stall_rows(rows: list[dict], machine: str) -> list[dict]:
    """The machine's rows across nodes as calibrate's stall fit reads them (members, seconds)."""
    return [dict(curve=r["curve"], collective=r["collective"], size=int(r["nodes"]) * int(r["gpus_per_node"]),
                 bytes=float(r["bytes"]), seconds=float(r["time_us"]) * 1e-6)
            for r in rows if r["machine"] == machine and int(r["nodes"]) > 1]


def print_stalls(rows: list[dict]) -> None:
    """Each network.stalls row of a machine's own profile checked leaving out one node count at a time: the band's
    time per ring step predicted as the median of the other node counts' band rows, against the left-out rows."""
    for m in sorted({r["machine"] for r in rows} & set(MACHINES)):
        for st in machine_stalls(m):
            band = [r for r in rows if r["machine"] == m and r["collective"] == st.kind and int(r["nodes"]) > 1
                    and st.lo <= float(r["bytes"]) / (int(r["nodes"]) * int(r["gpus_per_node"])) <= st.hi]
            step = {id(r): float(r["time_us"]) * 1e-6 / (int(r["nodes"]) * int(r["gpus_per_node"]) - 1) for r in band}
            found = [f for f in find_stalls(stall_rows(rows, m)) if f.collective == st.kind]
            print(f"{m} {st.kind}: each rank's part {st.lo / 1024:.0f}-{st.hi / 1024:.0f} KiB across nodes, the "
                  f"profile's {st.step * 1e6:.0f} us per ring step (median of all {len(band)} rows: "
                  f"{np.median(list(step.values())) * 1e6:.0f} us); calibrate's stall fit on these logs: "
                  + (", ".join(f"{f.lo / 1024:.0f}-{f.hi / 1024:.0f} KiB at {f.step * 1e6:.0f} us, {f.stalled} of "
                               f"{f.rows} rows stalled on {f.curves} curves" for f in found) or "none")
                  + "; leaving out one node count:")
            errs = []
            for n in sorted({int(r["nodes"]) for r in band}):
                out = [r for r in band if int(r["nodes"]) == n]
                pred = float(np.median([step[id(r)] for r in band if int(r["nodes"]) != n]))
                e = [abs(pred / step[id(r)] - 1) for r in out]
                errs += e
                print(f"    {n:4d} nodes: {len(out)} rows, measured " + ", ".join(f"{step[id(r)] * 1e6:.0f}" for r in out)
                      + f" us per step; predicted from the others {pred * 1e6:.0f} us; mean error {np.mean(e):.0%}")
            print(f"    mean error over the {len(errs)} rows, each predicted from the other node counts: "
                  f"{np.mean(errs):.0%} (median {np.median(errs):.0%})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every judged row")
    ap.add_argument("--diagnose", action="store_true", help="per curve: median pred/meas at small and large sizes")
    ap.add_argument("--fit-latency", metavar="MACHINE|NETWORK",
                    help="fit network.protocols.latency_scale to one machine, or jointly to every NCCL machine on one "
                         "network (e.g. 'InfiniBand NDR')")
    ap.add_argument("--fit-node-latency", metavar="MACHINE",
                    help="fit network.protocols.inside_node.latency_scale to one single-node sweep "
                         f"({', '.join(sorted(NODE_MACHINES))})")
    ap.add_argument("--share", type=float, default=RING_EFFICIENCY, metavar="S",
                    help=f"with --fit-latency: the plateau as this share of the NICs' line rate (default {RING_EFFICIENCY})")
    ap.add_argument("--steady", action="store_true",
                    help=f"judge only the steady state: leave out every call slower than {STALL} x a larger "
                         "message's on its curve (listed)")
    ap.add_argument("--scale", action="store_true",
                    help="congestion at scale: each sweep's time per ring step at one share per rank over its node "
                         "counts, the 128- and 256-node logs included")
    ap.add_argument("--stalls", action="store_true",
                    help="check each profile's network.stalls leaving out one node count at a time (the 128- and "
                         "256-node logs included)")
    args = ap.parse_args(argv)
    if args.stalls:
        print_stalls(load_rows())
        return 0
    if args.scale:
        print_scale(load_rows())
        return 0
    if args.fit_node_latency:
        mine = [r for r in node_rows(load_rows()) if r["machine"] == args.fit_node_latency]
        if not mine:
            print(f"error: no single-node rows for machine {args.fit_node_latency!r} (machines: "
                  f"{', '.join(sorted(NODE_MACHINES))})", file=sys.stderr)
            return 2
        s = fit_node_latency(mine)
        print(f"{args.fit_node_latency}: inside_node.latency_scale {s:.3f} (mean error "
              f"{node_errors(mine, 'protocols', s).mean():.0%} over its {len(mine)} rows; NCCL's own latency: "
              f"{node_errors(mine, 'protocols', 1.0).mean():.0%}; the alpha-beta line: "
              f"{node_errors(mine, 'before').mean():.0%})")
        return 0
    every = load_rows()
    rows = judged(every)
    if args.steady:
        out = stalls(rows)
        print(f"left out as stalls (slower than {STALL} x a larger message's call on the same curve): {len(out)} "
              f"of {len(rows)} rows")
        # where the stalls sit: the share of the buffer each rank holds, and the time over the ring's p - 1 steps
        print(f"    {'curve':34s} {'bytes':>11s} {'per rank':>10s} {'measured':>10s} {'per ring step':>13s}")
        for c, b in sorted(out):
            r = next(r for r in rows if r["curve"] == c and float(r["bytes"]) == b)
            p = int(r["nodes"]) * int(r["gpus_per_node"])
            t = float(r["time_us"])
            print(f"    {c:34s} {b:>11.0f} {b / p / 1024:>7.0f} KiB {t:>7.0f} us {t / (p - 1):>10.0f} us")
        rows = [r for r in rows if (r["curve"], float(r["bytes"])) not in out]
    machines = sorted({r["machine"] for r in rows})
    if args.fit_latency:
        mine = [r for r in rows if r["machine"] == args.fit_latency or
                (NETWORK[r["machine"]] == args.fit_latency and LIBRARY[r["machine"]] == "NCCL")]
        if not mine:
            print(f"error: no judged rows for machine or network {args.fit_latency!r} (machines: {', '.join(machines)}; "
                  f"networks: {', '.join(sorted(set(NETWORK.values())))})", file=sys.stderr)
            return 2
        s = fit_latency(mine, args.share)
        print(f"{args.fit_latency}: latency_scale {s:.3f} at a plateau of {args.share:g} x the NICs (mean error "
              f"{mean_err(mine, 'protocols', s, args.share):.0%} over its {len(mine)} judged rows)")
        for m in sorted({r["machine"] for r in mine}):
            mr = [r for r in mine if r["machine"] == m]
            print(f"    {m:18s} {len(mr):3d} rows, mean error {mean_err(mr, 'protocols', s, args.share):.0%}")
        return 0
    lomo = {m: leave_one_out(rows, m) for m in machines}
    own = {m: fit_network([r for r in rows if r["machine"] == m], "own") for m in machines}
    print("published cross-node collective sweeps vs axoplan: time per call, 1 MiB-4 GiB on 2-64 nodes, "
          "error = |pred/meas - 1|: mean per curve, then over curves (median over rows in brackets)")
    print(f"{'machine':17s} {'network':16s} {'collective':14s} {'curves':>6s} {'rows':>4s} {'before':>10s} "
          f"{'nccl':>10s} {'lomo':>10s} {'own':>10s}  latency_scale, plateau/NICs: lomo | own")
    models = lambda m: (("before", 1.0, RING_EFFICIENCY), ("protocols", 1.0, RING_EFFICIENCY),  # noqa: E731
                        ("protocols", *lomo[m]), ("own", *own[m]))
    per_machine, medians = [], []
    for m in machines:
        mr = [r for r in rows if r["machine"] == m]
        curve_means = []
        for kind in sorted({r["collective"] for r in mr}):
            kr = [r for r in mr if r["collective"] == kind]
            curves = sorted({r["curve"] for r in kr})
            e = np.array([[mean_err([r for r in kr if r["curve"] == c], *mod) for mod in models(m)] for c in curves])
            med = np.array([np.median(errors(kr, *mod)) for mod in models(m)])
            curve_means.append(e)
            print(f"{m:17s} {NETWORK[m]:16s} {kind:14s} {len(curves):6d} {len(kr):4d} "
                  + " ".join(f"{x:4.0%} ({y:3.0%})" for x, y in zip(e.mean(0), med))
                  + f"  {lomo[m][0]:.2f}, {lomo[m][1]:.2f} | {own[m][0]:.2f}, {own[m][1]:.2f}")
            if args.diagnose:
                for c in curves:
                    cr = [r for r in kr if r["curve"] == c]
                    nccl, mine = models(m)[1], models(m)[3]
                    print(f"    {c:38s} pred/meas nccl {_ratios(cr, *nccl, 2**20, 2**24):5.2f} at 1-16 MiB, "
                          f"{_ratios(cr, *nccl, 2**28, 2**32):5.2f} at >=256 MiB;  own "
                          f"{_ratios(cr, *mine, 2**20, 2**24):5.2f}, {_ratios(cr, *mine, 2**28, 2**32):5.2f}")
            if args.rows:
                for r in kr:
                    meas = float(r["time_us"]) * 1e-6
                    print(f"    {r['curve']:38s} {float(r['bytes']):>11.0f} B  measured {meas * 1e6:9.1f} us  "
                          "pred/meas " + " ".join(f"{predict(r, *mod) / meas:5.2f}" for mod in models(m)))
        per_machine.append(np.concatenate(curve_means).mean(0))
        medians.append([np.median(errors(mr, *mod)) for mod in models(m)])
    print(f"{'mean over machines':17s} {'':16s} {'':14s} {'':6s} {'':4s} "
          + " ".join(f"{x:4.0%} ({y:3.0%})" for x, y in zip(np.mean(per_machine, axis=0), np.mean(medians, axis=0))))
    print_nodes(every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
