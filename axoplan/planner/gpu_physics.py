"""GPU physics a profile may select explicitly (issue 15): attention throughput by sequence length and
head size, NCCL's per-call latency model, and compute slowed by collectives running beside it.

A profile without these fields (every CPU profile) gets `GpuPhysics()`, which changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

US = 1e-6
TFLOP = 1e12
LATENCY_MODELS = ("per_step", "nccl")
GB = 1e9
# the keys of network.protocols (issue 24), declared here once: the loader checks them and the schema names them
PROTOCOL_KEYS = {"source", "ring", "tree", "nvls_tree", "ring_plateau", "ll_max_busbw_gbs", "channels",
                 "two_node_tree_factor", "latency_scale", "net_latency_us", "inside_node"}
# network.protocols.inside_node: the same model for a group inside one node (NCCL's nNodes == 1)
NODE_PROTOCOL_KEYS = {"source", "ring", "tree", "ll_max_busbw_gbs", "latency_scale"}
PROTOCOL_ROW_KEYS = {"protocol", "base_us", "intra_us", "net_us", "bw_factor", "per_channel_gbs", "size_correction",
                     "source"}
PROTOCOL_NAMES = ("LL", "LL128", "Simple")
# a network.stalls row's keys, declared here once (the loader checks them, the schema names them)
STALL_KEYS = {"collective", "per_rank_kib", "step_us", "source"}
STALL_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# NCCL's tree correction by log2(bytes / 64), 64 B to 256 MB, per protocol (NVIDIA/nccl src/graph/tuning.cc
# @5067397 treeCorrectionFactor): its trees run slower than its own model at medium sizes; 1 beyond the table
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol of one algorithm: seconds per call, per step inside a node and per network step;
    its bus bandwidth is min(bw_factor x the group's plateau, channels x per_channel) (bytes/s), per_channel
    on 2 nodes and on more."""

    name: str
    base: float
    intra: float
    net: float
    bw_factor: float = 1.0
    per_channel: tuple = (float("inf"), float("inf"))
    # across nodes its bandwidth x this factor by log2(bytes / 64), the last beyond (RCCL's ringCorrectionFactor:
    # its own per-platform measurement of how far medium messages fall short); empty: none
    size_correction: tuple = ()


@dataclass(frozen=True)
class Protocols:
    """NCCL's protocol-aware model of a collective across nodes (NVIDIA/nccl src/graph/tuning.cc): every
    (algorithm, protocol) pair's time is latency + bytes / bandwidth, and NCCL takes the fastest."""

    ring: tuple  # Protocol per protocol NCCL runs for rings
    tree: tuple = ()  # the all-reduce tree's; empty: no tree (RCCL's rings only, or a profile without it)
    ring_plateau: float = 1.0  # a Simple ring all-reduce across nodes pays this x its latency ('plateau effect')
    ll_max: tuple = (float("inf"), float("inf"))  # LL bus bandwidth cap (bytes/s) on 2 nodes, on more
    channels: int = 1  # NCCL channels (rings) a group runs across nodes
    # on 2 nodes a tree's bus bandwidth is this x the ring's plateau: each node's NICs carry the buffer once
    # each way, where a ring's busbw convention assumes 2(p-1)/p of it over them
    two_node_tree_factor: float = 1.0
    # measured time over NCCL's modelled latency on this network (a published sweep, or calibration's fit)
    latency_scale: float = 1.0
    # the all-reduce's NVLink SHARP tree (NCCL's NVLSTree: the node reduces in its NVSwitch, its GPUs' NICs
    # exchange the result): one Simple row where the node's switch does multicast; empty: none
    nvls_tree: tuple = ()
    # the latency a network plugin reports to NCCL (s): NCCL adds it to every network step, twice for Simple
    # (its flush); NCCL's own InfiniBand and socket transports report 0
    net_latency: float = 0.0
    # groups inside one node by NCCL's single-node model too; None: the profile's alpha-beta line there
    inside_node: NodeProtocols | None = None


@dataclass(frozen=True)
class NodeProtocols:
    """NCCL's protocol model of a collective whose group sits inside one node (tuning.cc with nNodes == 1):
    every step over NVLink at NCCL's hwLat[NVLINK] (no network overhead raises it, no ring plateau), the
    tree a chain through the node's GPUs; the fastest (algorithm, protocol) pair, as across nodes. A
    protocol's bus bandwidth is min(bw_factor x the group's plateau, channels x per_channel)."""

    ring: tuple  # Protocol per protocol (net unused)
    tree: tuple = ()
    ll_max: float = float("inf")  # LL bus bandwidth cap (bytes/s) in one node (NCCL's llMaxBws, N1 column)
    # measured time over NCCL's modelled latency inside this node (a published single-node sweep)
    latency_scale: float = 1.0


@dataclass(frozen=True)
class Stall:
    """A collective across nodes whose every ring step takes `step` seconds where each rank's part of the buffer is
    lo..hi bytes: a library's measured behaviour on one network (network.stalls), not a rule of the model."""

    kind: str  # all_gather, reduce_scatter or all_reduce
    lo: float  # bytes per rank, inclusive
    hi: float
    step: float  # seconds per ring step


@dataclass(frozen=True)
class GpuPhysics:
    # ((head_dim, (log2 seq, ...), (fwd FLOP/s, ...), (bwd FLOP/s, ...)), ...) sorted by head_dim and seq
    attn_rates: tuple = ()
    latency_model: str = "per_step"  # per_step: every ring step pays its group's latency; nccl: see comm.py
    base_latency: float = 0.0  # s per collective call (nccl model only)
    overlap_slowdown: float = 0.0  # compute runs 1 + this slower while a collective runs beside it
    protocols: Protocols | None = None  # network.protocols: collectives across nodes by NCCL's protocol model
    stalls: tuple = ()  # network.stalls: Stall rows, the least such a collective across nodes takes

    def attention_rates(self, seq_len: float, head_dim: float) -> tuple[float, float] | None:
        """(forward, backward) FLOP/s of the attention kernel at this sequence length and head size:
        linear in log2(seq) between measured lengths and in log2(head_dim) between measured sizes,
        clamped at both ends of each; None without a table."""
        if not self.attn_rates:
            return None
        x = np.log2(max(float(seq_len), 1.0))
        per_hd = [(hd, float(np.interp(x, s, f)), float(np.interp(x, s, b))) for hd, s, f, b in self.attn_rates]
        hds = np.log2([p[0] for p in per_hd])
        h = np.log2(max(float(head_dim), 1.0))
        return (float(np.interp(h, hds, [p[1] for p in per_hd])), float(np.interp(h, hds, [p[2] for p in per_hd])))


def parse(d: dict, rd) -> GpuPhysics:
    """The optional fields of a profile dict (rd: profile_reader._Reader, for sourced numbers and errors)."""
    comp = d.get("compute") or {}
    attn = (comp.get("attention") or {}) if isinstance(comp, dict) else {}
    net = d.get("network") or {}
    rows = attn.get("throughput") if isinstance(attn, dict) else None
    rates = ()
    if rows is not None:
        if not isinstance(rows, list) or not rows:
            rd.fail("compute.attention.throughput", "must be a non-empty list of {seq, head_dim, fwd_tflops, "
                                                     "bwd_tflops, source}")
        by_hd: dict = {}
        for i, r in enumerate(rows):
            p = f"compute.attention.throughput[{i}]"
            if not isinstance(r, dict):
                rd.fail(p, "must be a mapping {seq, head_dim, fwd_tflops, bwd_tflops, source}")
            seq, hd = rd.num(r, "seq", p), rd.num(r, "head_dim", p)
            if seq in by_hd.get(hd, {}):
                rd.fail(p, f"repeats seq {seq:g} at head_dim {hd:g}")
            fwd, bwd = rd.num(r, "fwd_tflops", p), rd.num(r, "bwd_tflops", p)
            peak = rd.num(comp, "peak_tflops", "compute")
            if max(fwd, bwd) > peak * (1 + 1e-9):  # as for the GEMM ceiling: a unit or copy mistake
                rd.fail(p, f"({max(fwd, bwd):g} TFLOP/s) is above compute.peak_tflops ({peak:g}); no kernel runs "
                           f"faster than the peak")
            by_hd.setdefault(hd, {})[seq] = (fwd * TFLOP, bwd * TFLOP)
        rates = tuple((hd, tuple(np.log2(sorted(v)).tolist()), tuple(v[s][0] for s in sorted(v)),
                       tuple(v[s][1] for s in sorted(v))) for hd, v in sorted(by_hd.items()))
    model = net.get("latency_model", "per_step") if isinstance(net, dict) else "per_step"
    if model not in LATENCY_MODELS:
        rd.fail("network.latency_model", f"must be one of {', '.join(LATENCY_MODELS)}, got {model!r}")
    base = rd.num(net, "base_latency_us", "network", default=0.0, allow_zero=True) * US if isinstance(net, dict) else 0.0
    if base and model != "nccl":
        rd.fail("network.base_latency_us", "is used by latency_model: nccl only")
    slow = rd.num(net, "overlap_compute_slowdown", "network", default=0.0, allow_zero=True) if isinstance(net, dict) else 0.0
    if slow >= 1:
        rd.fail("network.overlap_compute_slowdown", f"must be below 1 (a share of the compute time), got {slow:g}")
    return GpuPhysics(rates, model, base, slow, _protocols(net, rd) if isinstance(net, dict) else None,
                      _stalls(net, rd) if isinstance(net, dict) else ())


def _stalls(net: dict, rd) -> tuple:
    """network.stalls: [{collective, per_rank_kib: [lo, hi], step_us, source}, ...]."""
    rows = net.get("stalls")
    if rows is None:
        return ()
    what = "{collective, per_rank_kib: [lo, hi], step_us, source}"
    if not isinstance(rows, list) or not rows:
        rd.fail("network.stalls", f"must be a non-empty list of {what}")
    out = []
    for i, r in enumerate(rows):
        p = f"network.stalls[{i}]"
        if not isinstance(r, dict):
            rd.fail(p, f"must be a mapping {what}")
        kind = r.get("collective")
        if kind not in STALL_COLLECTIVES:
            rd.fail(f"{p}.collective", f"must be one of {', '.join(STALL_COLLECTIVES)}, got {kind!r}")
        band = r.get("per_rank_kib")
        if not isinstance(band, list) or len(band) != 2:
            rd.fail(f"{p}.per_rank_kib", "must be [lo, hi], each rank's part of the buffer in KiB")
        lo, hi = (rd.num({"v": v}, "v", f"{p}.per_rank_kib") * 1024 for v in band)
        if lo > hi:
            rd.fail(f"{p}.per_rank_kib", f"must be [lo, hi] with lo <= hi, got {band}")
        out.append(Stall(kind, lo, hi, rd.num(r, "step_us", p) * US))
    return tuple(out)


def _mapping(parent: dict, key: str, where: str, known: set, what: str, rd) -> dict | None:
    """parent[key] checked as a mapping of `known` keys (None where absent)."""
    d = parent.get(key)
    if d is None:
        return None
    if not isinstance(d, dict):
        rd.fail(where, f"must be a mapping of {what} fields {{source, ring: [...], tree: [...], ...}}")
    bad = sorted(str(k) for k in set(d) - known)
    if bad:
        rd.fail(f"{where}.{bad[0]}", f"is not a {what} field (known: {', '.join(sorted(known))})")
    return d


def _protocols(net: dict, rd) -> Protocols | None:
    """network.protocols: {source, channels, ring_plateau, ll_max_busbw_gbs: [2 nodes, more], ring: [rows],
    tree: [rows]}, each row {protocol, base_us, intra_us, net_us, bw_factor, per_channel_gbs}."""
    where = "network.protocols"
    d = _mapping(net, "protocols", where, PROTOCOL_KEYS, "protocol-model", rd)
    if d is None:
        return None

    def rows(key, d=d, where=where, network=True):
        rs = d.get(key) or []
        if not isinstance(rs, list) or (key == "ring" and not rs):
            rd.fail(f"{where}.{key}", "must be a non-empty list of {protocol, base_us, intra_us, net_us, bw_factor}")
        out = []
        for i, r in enumerate(rs):
            p = f"{where}.{key}[{i}]"
            if not isinstance(r, dict):
                rd.fail(p, "must be a mapping {protocol, base_us, intra_us, net_us, bw_factor, per_channel_gbs}")
            extra = sorted(str(k) for k in set(r) - PROTOCOL_ROW_KEYS)
            if extra:
                rd.fail(f"{p}.{extra[0]}", f"is not a protocol field (known: {', '.join(sorted(PROTOCOL_ROW_KEYS))})")
            name = r.get("protocol")
            if name not in PROTOCOL_NAMES or name in [x.name for x in out]:
                rd.fail(f"{p}.protocol", f"must be one of {', '.join(PROTOCOL_NAMES)}, each once, got {name!r}")
            f = rd.num(r, "bw_factor", p, default=1.0)
            if f > 1:
                rd.fail(f"{p}.bw_factor", f"must be at most 1 (a share of the plateau), got {f:g}")
            pc = r.get("per_channel_gbs")
            if isinstance(pc, list):
                if len(pc) != 2:
                    rd.fail(f"{p}.per_channel_gbs", "must be a number or [on 2 nodes, on more] in GB/s")
                pc = tuple(rd.num({"v": v}, "v", f"{p}.per_channel_gbs") * GB for v in pc)
            else:
                pc = (rd.num(r, "per_channel_gbs", p, default=float("inf")) * GB,) * 2
            sc = r.get("size_correction") or []
            if not isinstance(sc, list):
                rd.fail(f"{p}.size_correction", "must be a list of bandwidth factors by log2(bytes / 64)")
            sc = tuple(rd.num({"v": v}, "v", f"{p}.size_correction") for v in sc)
            if any(v > 1 for v in sc):
                rd.fail(f"{p}.size_correction", "must hold factors of at most 1")
            # inside one node no step crosses the network: a row needs no net_us there
            net_us = rd.num(r, "net_us", p, allow_zero=True, default=None if network else 0.0)
            out.append(Protocol(name, *(rd.num(r, k, p, allow_zero=True) * US for k in ("base_us", "intra_us")),
                                net_us * US, f, pc, sc))
        return tuple(out)

    ll = d.get("ll_max_busbw_gbs")
    if ll is None:
        ll_max = (float("inf"), float("inf"))
    else:
        if not isinstance(ll, list) or len(ll) != 2:
            rd.fail(f"{where}.ll_max_busbw_gbs", "must be [on 2 nodes, on more] in GB/s")
        ll_max = tuple(rd.num({"v": v}, "v", f"{where}.ll_max_busbw_gbs") * GB for v in ll)
    ch = rd.num(d, "channels", where, default=1.0)
    if ch != int(ch):
        rd.fail(f"{where}.channels", f"must be an integer, got {ch:g}")
    plateau = rd.num(d, "ring_plateau", where, default=1.0)
    two = rd.num(d, "two_node_tree_factor", where, default=1.0)
    nvls = rows("nvls_tree")
    if len(nvls) > 1 or any(r.name != "Simple" for r in nvls):
        rd.fail(f"{where}.nvls_tree", "must be one Simple row (NCCL runs NVLSTree with the Simple protocol only)")
    return Protocols(rows("ring"), rows("tree"), plateau, ll_max, int(ch), two,
                     rd.num(d, "latency_scale", where, default=1.0), nvls,
                     rd.num(d, "net_latency_us", where, default=0.0, allow_zero=True) * US, _node_protocols(d, rd, rows))


def _node_protocols(d: dict, rd, rows) -> NodeProtocols | None:
    """network.protocols.inside_node: {source, latency_scale, ll_max_busbw_gbs, ring: [rows], tree: [rows]}."""
    where = "network.protocols.inside_node"
    n = _mapping(d, "inside_node", where, NODE_PROTOCOL_KEYS, "single-node protocol", rd)
    if n is None:
        return None
    return NodeProtocols(rows("ring", n, where, False), rows("tree", n, where, False),
                         rd.num(n, "ll_max_busbw_gbs", where, default=float("inf")) * GB,
                         rd.num(n, "latency_scale", where, default=1.0))


NCCL_TUNING_SOURCE = "NVIDIA/nccl src/graph/tuning.cc @5067397 (ncclTunerConstantsDefaults, ncclTopoTuneModel, ncclTopoGetAlgoTime)"


# NCCL's GPU-to-NIC path types, nearest first (src/graph/topo.h topoPathTypeStr; P2C: through the Grace-Hopper C2C
# link to the CPU, then PCIe to the NIC); LL128 runs across nodes only where the ring's GPU-NIC path is PXB or
# nearer (tuning.cc ncclTopoTuneModel: pEnable &= typeInter <= PATH_PXB), on Hopper and later up to PXN, P2C
# included (NCCL_LL128_C2C, default 1: 'Enable LL128 by default only on Hopper/Blackwell for all connections up to
# P2C and PXN')
NIC_PATHS = ("PIX", "PXB", "P2C", "PXN", "PHB", "SYS")


def ll128_across_nodes(capability: int, nic_path: str) -> bool:
    """Whether NCCL enables LL128 for inter-node rings and trees with this GPU-to-NIC path."""
    if nic_path not in NIC_PATHS:
        raise ValueError(f"unknown GPU-to-NIC path {nic_path!r} (known: {', '.join(NIC_PATHS)})")
    i = NIC_PATHS.index(nic_path)
    return i <= NIC_PATHS.index("PXB") or (capability >= 90 and i <= NIC_PATHS.index("PXN"))


def nccl_protocols(capability: int, cpu_vendor: str, nic_path: str = "PXB", nvls: bool = False) -> dict | None:
    """network.protocols as NCCL's defaults give it for GPUs of compute capability `capability` (80 for
    A100, 90 for H100) on hosts of `cpu_vendor` ('amd', 'intel' or 'arm') whose GPUs reach their NICs by
    `nic_path` (NIC_PATHS: PXB, a PCIe switch shared by GPU and NIC as on DGX and HGX boards; PHB, through
    the CPU's host bridge; P2C, Grace Hopper's C2C link and then PCIe), every number with its source; None for a
    generation whose constants are not written here (before Ampere, or not NVIDIA). NCCL gives an Arm host
    (Grace) an Intel x86 host's constants: getNetOverhead is 2 us for AMD x86 alone and 1 us otherwise, and
    llMaxBws takes its AMD row for AMD hosts alone (tuning.cc). Beyond PXB NCCL runs no LL128 across nodes: no LL128 rows.
    nvls: the node's NVSwitch does multicast (HGX H100/H200 boards; NCCL_NVLS_ENABLE not 0), so NCCL may
    run the all-reduce as NVLSTree (nvls_tree_row); Hopper only."""
    if capability < 80 or cpu_vendor not in ("amd", "intel", "arm"):
        return None
    if nvls and not 90 <= capability < 100:
        raise ValueError(f"NVLSTree's constants are written here for Hopper only (compute capability 90), "
                         f"not {capability}")
    ll128 = ll128_across_nodes(capability, nic_path)
    hopper = capability >= 90
    amd = cpu_vendor == "amd"
    src = NCCL_TUNING_SOURCE
    gen = "Hopper" if hopper else "Ampere"
    # inter-node rings: each intra-node step costs at least the network post overhead (getNetOverhead:
    # 2 us on AMD x86 hosts, 1 us on Intel; x3 for Simple)
    over = 2.0 if amd else 1.0
    ll_in, ll128_in, simple_in = max(0.6, over), max(1.9, over), max(3.4, 3 * over)
    ll_max = [22.5, 19.0] if amd else [39.0, 20.4]  # llMaxBws for multi-node jobs by CPU vendor: 2 nodes, more
    ring_ll128 = 36.7 if hopper else 20.0  # perChMaxRingLL128Bws
    tree_ll128 = [36.7, 29.0] if hopper else [20.0, 20.0]  # perChMaxTreeLL128Bws: 2 nodes, more
    tree_simple = [41.4, 36.0] if hopper else [23.6, 17.8]  # perChMaxTreeBws: 2 nodes, more
    d = {
        "source": (f"{src}; {gen} GPUs (compute capability {capability}), "
                   + {"amd": "AMD x86 host CPUs", "intel": "Intel x86 host CPUs",
                      "arm": "Arm host CPUs (Grace), which NCCL treats as Intel x86 ones"}[cpu_vendor]
                   + f": getNetOverhead {over:g} us, x3 for Simple, raises each intra-node step of an inter-node "
                   f"ring; llMaxBws for multi-node jobs {ll_max[0]:g} GB/s on 2 nodes, {ll_max[1]:g} on more"
                   + ("" if ll128 else f"; GPU-to-NIC path {nic_path}: no LL128 across nodes (ncclTopoTuneModel "
                                       f"enables it only where the path is PXB or nearer)")),
        "channels": {"value": 8, "source": "documented assumption: NCCL builds one ring per NIC on a rail-optimised "
                                           "node of 8 GPUs and 8 compute NICs; bounds only the per-channel caps"},
        "ring_plateau": {"value": 1.4, "source": f"{src} ncclTopoGetAlgoTime: a Simple ring all-reduce across nodes "
                                                 "pays 1.4x its latency on compute capability >= 8.0"},
        "two_node_tree_factor": {"value": 2.0, "source": (
            "NCCL team (AddyLaddy, NVIDIA/nccl-tests issue #22): 'the reported BusBW figure can exceed the actual "
            "available peak BW, when running on just 2 nodes' (the tree); NCCL doubles NVLSTree's inter-node "
            f"bandwidth on 2 nodes ({src}): each node's NICs carry the buffer once each way")},
        "ll_max_busbw_gbs": ll_max,
        "ring": [
            {"protocol": "LL", "base_us": 6.6, "intra_us": ll_in, "net_us": 2.7, "bw_factor": 0.5,
             "source": f"{src}: baseLat[Ring][LL] 6.6, hwLat[NVLINK][Ring][LL] 0.6 (or the net overhead), "
                       "hwLat[NET][Ring][LL] 2.7; busBw = min(llMaxBw, 0.5 x busBw)"},
            {"protocol": "LL128", "base_us": 14.0, "intra_us": ll128_in, "net_us": 4.0, "bw_factor": 0.92,
             "per_channel_gbs": ring_ll128,
             "source": f"{src}: baseLat[Ring][LL128] 14.0, hwLat[NVLINK][Ring][LL128] 1.9 (or the net overhead), "
                       f"hwLat[NET][Ring][LL128] 4.0; busBw = min(0.92 x busBw, nChannels x "
                       f"perChMaxRingLL128Bws[{gen}] {ring_ll128:g})"},
            {"protocol": "Simple", "base_us": 8.4, "intra_us": simple_in, "net_us": 14.0, "bw_factor": 1.0,
             "source": f"{src}: baseLat[Ring][Simple] 8.4, hwLat[NVLINK][Ring][Simple] 3.4 (or 3x the net "
                       "overhead), hwLat[NET][Ring][Simple] 14.0; bandwidth: the plateau inter_node.busbw_gbs"},
        ],
        "tree": [
            {"protocol": "LL", "base_us": 6.8, "intra_us": 0.6, "net_us": 5.0, "bw_factor": 0.2421,
             "source": f"{src}: baseLat[Tree][LL] 6.8, hwLat[NVLINK][Tree][LL] 0.6, hwLat[NET][Tree][LL] 5.0; "
                       "busBw = 0.92 / 3.8 = 0.2421 x, under llMaxBw"},
            {"protocol": "LL128", "base_us": 14.0, "intra_us": 1.25, "net_us": 8.5, "bw_factor": 0.8625,
             "per_channel_gbs": tree_ll128,
             "source": f"{src}: baseLat[Tree][LL128] 14.0, hwLat[NVLINK][Tree][LL128] 1.25, hwLat[NET][Tree][LL128] "
                       f"8.5; busBw = 0.92 x 120/128 = 0.8625 x, under nChannels x perChMaxTreeLL128Bws[{gen}] "
                       f"{tree_ll128[0]:g} on 2 nodes, {tree_ll128[1]:g} on more"},
            {"protocol": "Simple", "base_us": 8.4, "intra_us": 4.0, "net_us": 14.0, "bw_factor": 0.92,
             "per_channel_gbs": tree_simple,
             "source": f"{src}: baseLat[Tree][Simple] 8.4, hwLat[NVLINK][Tree][Simple] 4.0, hwLat[NET][Tree][Simple] "
                       f"14; busBw = min(0.92 x busBw, nChannels x perChMaxTreeBws[{gen}] {tree_simple[0]:g} on 2 "
                       f"nodes, {tree_simple[1]:g} on more)"},
        ],
    }
    if not ll128:
        d["ring"] = [r for r in d["ring"] if r["protocol"] != "LL128"]
        d["tree"] = [r for r in d["tree"] if r["protocol"] != "LL128"]
    if nvls:
        d["nvls_tree"] = [nvls_tree_row()]
    return d


def nccl_node_protocols(capability: int) -> dict:
    """network.protocols.inside_node as NCCL's defaults give it for a group inside one node of GPUs of compute
    capability `capability` (80 Ampere, 90 Hopper), every number with its source; without its latency_scale,
    which a measurement gives. NCCL's nNodes == 1 rows: each step over NVLink at hwLat[NVLINK] (no network
    overhead raises it), no ring plateau, llMaxBws' N1 column; its tree a chain through the node: 2 (ranks - 1)
    steps, every tree protocol's bus bandwidth 0.92 x under channels x perChMaxTreeBws (N1), LL128's 7/9 x
    for one node. Not written here: NCCL's 0.85 for a tree whose search found a true tree pattern."""
    if not 80 <= capability < 100:
        raise ValueError(f"NCCL's single-node constants are written here for Ampere and Hopper (compute capability "
                         f"80 or 90), not {capability}")
    src = NCCL_TUNING_SOURCE
    hopper = capability >= 90
    gen = "Hopper" if hopper else "Ampere"
    ll_max = 141.0 if hopper else 87.7  # llMaxBws, N1 column
    ring_ll128 = 36.7 if hopper else 20.0  # perChMaxRingLL128Bws N1
    tree_simple = 38.7 if hopper else 24.0  # perChMaxTreeBws N1
    tree_ll128 = min(36.7 if hopper else 20.0, tree_simple)  # perChMaxTreeLL128Bws N1, under perChMaxTreeBws
    return {
        "source": (f"{src} with nNodes == 1: hw = NCCL_HW_NVLINK for every step; the ring all-reduce's 1.4x "
                   f"'plateau effect' only where nNodes > 1 (ncclTopoGetAlgoTime); {gen} GPUs (compute capability "
                   f"{capability}): llMaxBws N1 {ll_max:g} GB/s"),
        "ll_max_busbw_gbs": ll_max,
        "ring": [
            {"protocol": "LL", "base_us": 6.6, "intra_us": 0.6, "bw_factor": 0.5,
             "source": f"{src}: baseLat[Ring][LL] 6.6, hwLat[NVLINK][Ring][LL] 0.6; busBw = min(llMaxBw, 0.5 x busBw)"},
            {"protocol": "LL128", "base_us": 14.0, "intra_us": 1.9, "bw_factor": 0.92, "per_channel_gbs": ring_ll128,
             "source": f"{src}: baseLat[Ring][LL128] 14.0, hwLat[NVLINK][Ring][LL128] 1.9; busBw = min(0.92 x busBw, "
                       f"nChannels x perChMaxRingLL128Bws[{gen}] N1 {ring_ll128:g})"},
            {"protocol": "Simple", "base_us": 8.4, "intra_us": 3.4, "bw_factor": 1.0,
             "source": f"{src}: baseLat[Ring][Simple] 8.4, hwLat[NVLINK][Ring][Simple] 3.4; bandwidth: the group's "
                       "plateau (network.intra_node.groups)"},
        ],
        "tree": [
            {"protocol": "LL", "base_us": 6.8, "intra_us": 0.6, "bw_factor": 0.2421,
             "source": f"{src}: baseLat[Tree][LL] 6.8, hwLat[NVLINK][Tree][LL] 0.6; busBw = 0.92 / 3.8 = 0.2421 x, "
                       "under llMaxBw"},
            {"protocol": "LL128", "base_us": 14.0, "intra_us": 1.25, "bw_factor": 0.7156, "per_channel_gbs": tree_ll128,
             "source": f"{src}: baseLat[Tree][LL128] 14.0, hwLat[NVLINK][Tree][LL128] 1.25; busBw = 0.92 x 7/9 (nNodes "
                       f"== 1) = 0.7156 x, under nChannels x perChMaxTreeLL128Bws[{gen}] N1 {tree_ll128:g}"},
            {"protocol": "Simple", "base_us": 8.4, "intra_us": 4.0, "bw_factor": 0.92, "per_channel_gbs": tree_simple,
             "source": f"{src}: baseLat[Tree][Simple] 8.4, hwLat[NVLINK][Tree][Simple] 4.0; busBw = min(0.92 x busBw, "
                       f"nChannels x perChMaxTreeBws[{gen}] N1 {tree_simple:g})"},
        ],
    }


def nvls_tree_row() -> dict:
    """NCCL's NVLSTree all-reduce on Hopper as network.protocols.nvls_tree's one row: the node reduces
    through its NVSwitch and each head GPU's NIC carries its share between nodes."""
    src = NCCL_TUNING_SOURCE
    return {"protocol": "Simple", "base_us": 0.0, "intra_us": 25.0, "net_us": 20.9, "bw_factor": 1.0,
            "per_channel_gbs": [57.7, 45.5],
            "source": (f"{src}: baseLat[NVLSTree] 0, hwLat[NVLINK][NVLSTree][Simple] 25, hwLat[NET][NVLSTree]"
                       "[Simple] 20.9, latency intra + 2 x log2(nodes) x net; per head (one GPU and its NIC, up to "
                       "channels: src/graph/search.cc maxChannels = min(NVLS arity, GPUs)) min(2 x its NIC's "
                       "bandwidth on 2 nodes, 1 x on more; perChMaxNVLSTreeBws[Hopper] 57.7 on 2 nodes, 45.5 "
                       "on more); algorithm bandwidth busBw x ranks / (2 (ranks - 1)); NVLink's bound "
                       "(bwIntra x nvlsEfficiency 0.85 x 2) is above both caps on 8-GPU Hopper nodes, not "
                       "modelled; needs 2 or more GPUs per node (src/transport/nvls.cc); bandwidth x NCCL's "
                       "Simple treeCorrectionFactor at medium sizes, which NCCL applies to its trees and, from "
                       "Blackwell on, to NVLSTree (ncclTopoGetAlgoTime): a documented choice for Hopper, whose "
                       "2-node H100 sweeps run 8-64 MiB 25% slower than the uncorrected model "
                       "(benchmarks/collective_fidelity.py)")}


RCCL_TUNING_SOURCE = "ROCm/rccl src/graph/tuning.cc @0cbce2a (2024-10-24; baseLat, rcclTuningModel, ncclTopoGetAlgoTime)"


def rccl_protocols(tuning: int = 3) -> dict:
    """network.protocols as RCCL's own tuning model gives it across nodes, for its tuning model `tuning` (3: the
    one rome_model_63 selects, 8 MI250X GCDs and 4 NICs per node as on Frontier: ROCm/rccl src/graph/rome_models.cc
    @0cbce2a, GPUs at bus c1000..de000, NICs at c5000, cd000, d5000, dd000, options 'tuning=3'). Not written here:
    its ring all-reduce's 2 x nodes network steps (the model counts NCCL's 2 (nodes - 1)), and its tree's LL on 2
    nodes, which two_node_tree_factor (Simple's 1.75 / 0.96) raises too."""
    if tuning != 3:
        raise ValueError(f"RCCL tuning model {tuning} is not written here (only 3, Frontier's)")
    src = RCCL_TUNING_SOURCE
    # intra-node steps of an inter-node ring cost at least getNetOverhead (2 us on AMD hosts, x3 for Simple)
    return {
        "source": (f"{src}: RCCL's tuning model 3 (rome_model_63: Frontier's 8 MI250X GCDs and 4 NICs per node); "
                   "AMD host CPUs: getNetOverhead 2 us, x3 for Simple; no LL128 (bwRatio 0), no llMaxBw cap and no "
                   "ring plateau factor on AMD builds"),
        "channels": {"value": 4, "source": "documented assumption: one ring per NIC, 4 per node; bounds nothing here "
                                           "(no per-channel caps)"},
        "ring": [
            {"protocol": "LL", "base_us": 12.0, "intra_us": 2.0, "net_us": 9.5, "bw_factor": 0.2,
             "size_correction": [0.1, 0.1, 0.1, 0.1, 0.1, 0.3, 0.1, 0.2, 0.1, 0.4, 0.4, 0.2, 0.2, 0.3, 0.7, 0.5,
                                 0.4, 0.3, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
             "source": f"{src}: baseLat[Ring][LL] 12.0, tuning_model_3 hwLat[NVLINK][Ring][LL] 0.8 (or the net "
                       "overhead 2), hwLat[NET][Ring][LL] 9.5, bwRatio[Ring][LL] 0.20, ringCorrectionFactor[LL]"},
            {"protocol": "Simple", "base_us": 17.0, "intra_us": 6.0, "net_us": 19.8, "bw_factor": 1.0,
             "size_correction": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.5, 1.0, 0.1, 0.3, 0.1, 0.1, 0.1, 0.2, 0.2,
                                 0.2, 0.3, 0.4, 0.7, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
             "source": f"{src}: baseLat[Ring][Simple] 17.0, tuning_model_3 hwLat[NVLINK][Ring][Simple] 3.6 (or 3x "
                       "the net overhead, 6), hwLat[NET][Ring][Simple] 19.8, bwRatio[Ring][Simple] 1.00, "
                       "ringCorrectionFactor[Simple] (1-4 MiB: 0.2; 8 MiB 0.3; 16 MiB 0.4; 32 MiB 0.7; 64 MiB on 1.0)"},
        ],
        "two_node_tree_factor": {"value": round(1.75 / 0.96, 4), "source": (
            f"{src}: tuning_model_3 bwRatio[Tree][Simple] 1.75 on 2 nodes against 0.96 on more")},
        "tree": [
            {"protocol": "LL", "base_us": 12.0, "intra_us": 0.8, "net_us": 12.5, "bw_factor": 0.2,
             "size_correction": [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 0.2, 1.0, 0.9, 1.0, 0.6, 0.4, 0.6, 0.4,
                                 0.3, 0.3, 0.3, 0.3, 0.3, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
             "source": f"{src}: baseLat[Tree][LL] 12.0, tuning_model_3 hwLat[NVLINK][Tree][LL] 0.8, "
                       "hwLat[NET][Tree][LL] 12.5, bwRatio[Tree][LL] 0.20, treeCorrectionFactor[LL]"},
            {"protocol": "Simple", "base_us": 17.0, "intra_us": 2.5, "net_us": 22.4, "bw_factor": 0.96,
             "size_correction": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.2, 1.0, 0.8, 1.0, 1.0, 1.0, 1.0,
                                 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.7, 0.8, 0.9, 0.7, 0.7],
             "source": f"{src}: baseLat[Tree][Simple] 17.0, tuning_model_3 hwLat[NVLINK][Tree][Simple] 2.5, "
                       "hwLat[NET][Tree][Simple] 22.4, bwRatio[Tree][Simple] 0.96 on more than 2 nodes, "
                       "treeCorrectionFactor[Simple] (64 MiB on: 0.7-0.9)"},
        ],
    }
