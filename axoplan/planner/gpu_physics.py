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
PROTOCOL_KEYS = {"source", "ring", "tree", "ring_plateau", "ll_max_busbw_gbs", "channels", "two_node_tree_factor"}
PROTOCOL_ROW_KEYS = {"protocol", "base_us", "intra_us", "net_us", "bw_factor", "per_channel_gbs", "source"}
PROTOCOL_NAMES = ("LL", "LL128", "Simple")
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


@dataclass(frozen=True)
class GpuPhysics:
    # ((head_dim, (log2 seq, ...), (fwd FLOP/s, ...), (bwd FLOP/s, ...)), ...) sorted by head_dim and seq
    attn_rates: tuple = ()
    latency_model: str = "per_step"  # per_step: every ring step pays its group's latency; nccl: see comm.py
    base_latency: float = 0.0  # s per collective call (nccl model only)
    overlap_slowdown: float = 0.0  # compute runs 1 + this slower while a collective runs beside it
    protocols: Protocols | None = None  # network.protocols: collectives across nodes by NCCL's protocol model

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
    """The optional fields of a profile dict (rd: machine._Reader, for sourced numbers and errors)."""
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
            by_hd.setdefault(hd, {})[seq] = (rd.num(r, "fwd_tflops", p) * TFLOP, rd.num(r, "bwd_tflops", p) * TFLOP)
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
    return GpuPhysics(rates, model, base, slow, _protocols(net, rd) if isinstance(net, dict) else None)


def _protocols(net: dict, rd) -> Protocols | None:
    """network.protocols: {source, channels, ring_plateau, ll_max_busbw_gbs: [2 nodes, more], ring: [rows],
    tree: [rows]}, each row {protocol, base_us, intra_us, net_us, bw_factor, per_channel_gbs}."""
    d = net.get("protocols")
    if d is None:
        return None
    where = "network.protocols"
    if not isinstance(d, dict):
        rd.fail(where, "must be a mapping {source, channels, ring: [...], tree: [...], ...}")
    bad = sorted(str(k) for k in set(d) - PROTOCOL_KEYS)
    if bad:
        rd.fail(f"{where}.{bad[0]}", f"is not a protocol-model field (known: {', '.join(sorted(PROTOCOL_KEYS))})")

    def rows(key):
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
            out.append(Protocol(name, *(rd.num(r, k, p, allow_zero=True) * US for k in ("base_us", "intra_us", "net_us")),
                                f, pc))
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
    return Protocols(rows("ring"), rows("tree"), plateau, ll_max, int(ch), two)
