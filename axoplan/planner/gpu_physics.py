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


@dataclass(frozen=True)
class GpuPhysics:
    # ((head_dim, (log2 seq, ...), (fwd FLOP/s, ...), (bwd FLOP/s, ...)), ...) sorted by head_dim and seq
    attn_rates: tuple = ()
    latency_model: str = "per_step"  # per_step: every ring step pays its group's latency; nccl: see comm.py
    base_latency: float = 0.0  # s per collective call (nccl model only)
    overlap_slowdown: float = 0.0  # compute runs 1 + this slower while a collective runs beside it

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
    return GpuPhysics(rates, model, base, slow)
