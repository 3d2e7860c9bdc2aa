"""MachineProfile: what one machine can do, loaded from a sourced YAML (schema: machine_profiles/README.md).

Inside this module and the cost model everything is SI: seconds, bytes, bytes/s, FLOP/s.
The YAML speaks GB/s, TFLOP/s, GiB and microseconds for people.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from axoplan.planner import gpu_physics
from axoplan.planner.rows import distinct_rows

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.tables import TableError, read_rows
from axoplan.yamlio import load_yaml

GB = 1e9
GIB = 2**30
TFLOP = 1e12
US = 1e-6
LAYOUTS = ("NN", "NT", "TN")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
SCHEMA = "axoplan-profile/1"

# ---- the keys a profile may hold, at every level (checked by _check_keys before anything is parsed) ----
# A new field is declared in the section's table below (one place): a misspelled key anywhere, like
# memory.headroom_gb or groups[0].strde, is refused in one sentence instead of silently taking a default.
# NUM: a number, or {value: number, source: text}; TEXT, FLAG: a scalar; FREE: not checked here (provenance
# written by calibrate; launch.env, whose names _check_launch checks); a list holds one spec for each item.
NUM, TEXT, FLAG, FREE = "number", "text", "flag", "free"
TABLE_KEYS = {"path": TEXT, "source": TEXT}  # {path: FILE.csv, source: ...} beside a section
MEMORY_KEYS = {"source": TEXT, "capacity_gib": NUM, "headroom_gib": NUM, "bandwidth_gbs": NUM,
               "elementwise_efficiency": NUM}
GEMM_KEYS = {"source": TEXT, "ceiling_tflops": NUM, "sustained_fraction": NUM, "dim_half": NUM, "unaligned_tflops": NUM, "table": TABLE_KEYS,
             "waves": {"sms": FREE, "tiles": FREE, "source": TEXT}}
ATTENTION_KEYS = {"source": TEXT, "tflops": NUM, "causal_skip": FLAG, "backward_factor": NUM, "table": TABLE_KEYS,
                  "throughput": [{"seq": NUM, "head_dim": NUM, "fwd_tflops": NUM, "bwd_tflops": NUM, "source": TEXT}]}
COMPUTE_KEYS = {"source": TEXT, "peak_tflops": NUM, "kernel_overhead_us": NUM, "shared_cores": NUM, "gemm": GEMM_KEYS,
                "attention": ATTENTION_KEYS,
                "elementwise_kernels": FREE}  # refused by _no_framework_fields, with the reason
INTRA_NODE_KEYS = {"source": TEXT, "latency_us": NUM, "table": TABLE_KEYS,
                   "groups": [{"size": NUM, "stride": NUM, "busbw_gbs": NUM, "source": TEXT}],
                   "nvls_all_reduce": [{"size": NUM, "busbw_gbs": NUM, "source": TEXT}]}
INTER_NODE_KEYS = {"source": TEXT, "busbw_gbs": NUM, "latency_us": NUM, "ring_busbw_gbs": NUM}
COLLECTIVE_SCALE_KEYS = {"bandwidth_scale": NUM, "latency_scale": NUM, "source": TEXT}
COLLECTIVES_KEYS = {"source": TEXT, "all_gather": COLLECTIVE_SCALE_KEYS, "reduce_scatter": COLLECTIVE_SCALE_KEYS,
                    "all_reduce": COLLECTIVE_SCALE_KEYS}
# NCCL's protocol model across nodes: its keys are gpu_physics's (PROTOCOL_KEYS, a row's PROTOCOL_ROW_KEYS),
# the values checked where gpu_physics parses them
_ROW = [{k: FREE for k in gpu_physics.PROTOCOL_ROW_KEYS}]
PROTOCOLS_KEYS = {**{k: FREE for k in gpu_physics.PROTOCOL_KEYS}, "ring": _ROW, "tree": _ROW, "nvls_tree": _ROW}
NETWORK_KEYS = {"source": TEXT, "latency_model": TEXT, "base_latency_us": NUM, "overlap_compute_slowdown": NUM,
                "overlap_efficiency": NUM, "intra_node": INTRA_NODE_KEYS, "inter_node": INTER_NODE_KEYS,
                "collectives": COLLECTIVES_KEYS, "protocols": PROTOCOLS_KEYS,
                "stalls": [{k: FREE for k in gpu_physics.STALL_KEYS}]}
CORRECTIONS_KEYS = {"source": TEXT, **{name: NUM for name in (
    "gemm_scale", "elementwise_scale", "intra_bw_scale", "inter_bw_scale", "latency_scale", "step_overhead_s",
    "kernel_overhead_scale", "collective_overhead_s", "overlap_efficiency")}}  # = Corrections' fields (checked below)
LAUNCH_KEYS = {"env": FREE, "slurm": FREE, "source": TEXT}  # launch.slurm checked by _check_launch_slurm
# the device it was measured on: a name, or {name, count, source} as calibrate writes (checked in _device)
DEVICE_KEYS = {"name": FREE, "count": FREE, "source": FREE}
PROFILE_KEYS = {"schema": TEXT, "name": TEXT, "description": TEXT, "device": DEVICE_KEYS, "kind": TEXT, "dtype": TEXT,
                "source": TEXT, "gpus_per_node": NUM, "memory": MEMORY_KEYS, "compute": COMPUTE_KEYS,
                "network": NETWORK_KEYS, "corrections": CORRECTIONS_KEYS, "calibration": FREE, "launch": LAUNCH_KEYS}
TOP_LEVEL_KEYS = set(PROFILE_KEYS)


def _check_keys(node: Any, spec: Any, path: str, rd) -> None:
    """Refuse any key the schema (PROFILE_KEYS) does not declare at its level, naming the nearest known."""
    if spec == FREE or not isinstance(node, (dict, list)):
        return  # a scalar's type and range are checked where it is parsed
    if isinstance(spec, list):
        if isinstance(node, list):
            for i, item in enumerate(node):
                _check_keys(item, spec[0], f"{path}[{i}]", rd)
        return
    if spec in (NUM, TEXT, FLAG):
        spec = {"value": FREE, "source": TEXT}  # {value: ..., source: ...}
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        p = f"{path}.{k}" if path else str(k)
        if k not in spec:
            import difflib

            near = difflib.get_close_matches(str(k), [str(x) for x in spec], n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f" (known here: {', '.join(sorted(spec))})"
            rd.fail(p, f"is not a profile field{hint}")
        _check_keys(v, spec[k], p, rd)


@dataclass(frozen=True)
class Corrections:
    """Multiplicative corrections fitted by `axoplan refit`; identity by default."""

    gemm_scale: float = 1.0
    elementwise_scale: float = 1.0
    intra_bw_scale: float = 1.0
    inter_bw_scale: float = 1.0
    latency_scale: float = 1.0
    step_overhead_s: float = 0.0  # fixed time added to every step
    kernel_overhead_scale: float = 1.0  # multiplies the per-kernel launch cost
    # time added to every collective call a rank waits for as it issues it (dispatch, rank skew), a pair's: a
    # group of p waits for its last rank, comm.rank_skew(p) times it; the Z stream's calls issued ahead (OAG
    # prefetch, ORS) do not pay it (timing.timed)
    collective_overhead_s: float = 0.0
    # replaces network.overlap_efficiency when set: the trainer's own overlap can differ from the
    # calibration's synthetic burst beside a collective
    overlap_efficiency: float | None = None


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMM times: a full cartesian grid (interpolated in log space) plus exact extra shapes."""

    m: np.ndarray  # grid values, ascending
    n: np.ndarray
    k: np.ndarray
    log_tput: dict  # layout -> array [len(m), len(n), len(k)] of log(FLOP/s)
    exact: dict  # (m, n, k) -> {layout: seconds}
    path: str = ""
    # ((m, n, k), layout) -> (seconds, extrapolated) of the small lookups: a refit evaluates the same few
    # shapes hundreds of times, where one lookup's interpolation costs ~0.4 ms of numpy overhead
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def swappable(self) -> bool:
        return self.m.shape == self.n.shape and bool(np.all(self.m == self.n))


@dataclass(frozen=True)
class CollectiveTable:
    """Measured seconds per call of each collective on each intra-node group shape, every group of
    the shape busy at once (the calibration's collectives.csv), for log-log interpolation in bytes.
    Where ranks share cores the calibration times calls after compute bursts of several lengths
    (`burst_s`, 0 = back to back): a call waits longer for peers the OS descheduled the longer
    they computed, so the planner interpolates in burst length too."""

    curves: dict  # (kind, size, stride) -> ((burst s, log bytes ascending, log seconds), ...) by burst
    path: str = ""
    # (kind, size, stride, bytes, slope) -> each burst's (t0, t) before the corrections, for small lookups
    # (comm.table_seconds): a refit times the same few calls hundreds of times
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def covers(self, kind: str, size: int, stride: int) -> bool:
        return (kind, int(size), int(stride)) in self.curves


@dataclass(frozen=True)
class AttentionTable:
    """Measured causal attention per local shape (batch, heads, seq, head_dim): forward seconds and
    backward seconds, all ranks at once. Where a shape was measured the planner takes it as it is:
    throughput varies by an order of magnitude with head_dim and sequence on CPUs and small GPUs."""

    shapes: dict  # (batch, heads, seq, head_dim) -> (forward s, backward s)
    path: str = ""

    def seconds(self, batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float] | None:
        """The measured shape itself; else, where the same (seq, head_dim) was measured with other batch
        and head counts, interpolated in n = batch x heads: the kernel runs the n (sequence, head) pairs
        as one batch of identical independent problems, so time follows n (log-log between measured n,
        proportional to n beyond them). None where that sequence and head size were never measured."""
        hit = self.shapes.get((batch, heads, seq, head_dim))
        if hit:
            return hit
        pts = sorted((b * h, f, bw) for (b, h, s, d), (f, bw) in self.shapes.items() if s == seq and d == head_dim)
        if not pts:
            return None
        by_n: dict = {}
        for n0, f, bw in pts:  # shapes of equal n (4 x 2, 1 x 8) measured the same problem: geometric mean
            by_n.setdefault(n0, []).append((f, bw))
        ns = np.array(sorted(by_n), dtype=np.float64)
        logs = np.array([[np.mean(np.log(np.maximum([v[i] for v in by_n[n0]], 1e-12))) for i in (0, 1)]
                         for n0 in sorted(by_n)])
        n = float(batch * heads)
        if n <= ns[0] or n >= ns[-1]:
            j = 0 if n <= ns[0] else -1
            return tuple(float(np.exp(logs[j, i]) * n / ns[j]) for i in (0, 1))
        x = np.log(n)
        return tuple(float(np.exp(np.interp(x, np.log(ns), logs[:, i]))) for i in (0, 1))


DIM_HALF_RULE = "memory-traffic"


def _dim_half(gemm: dict, rd) -> float | None:
    """compute.gemm.dim_half: a number (measured or fitted), or 'memory-traffic' for the rule of
    MachineProfile.gemm_half."""
    v = gemm.get("dim_half")
    if isinstance(v, dict):
        v = v.get("value")
    if isinstance(v, str):
        if v != DIM_HALF_RULE:
            rd.fail("compute.gemm.dim_half", f"must be a number or {DIM_HALF_RULE!r}, got {inputs.show(v)}")
        return None
    return rd.num(gemm, "dim_half", "compute.gemm", default=0.0, allow_zero=True)


def _waves(gemm: dict, rd) -> tuple | None:
    """compute.gemm.waves: {sms: N, tiles: [[rows, cols], ...], source: ...} -> (N, ((rows, cols), ...)), or None."""
    w = gemm.get("waves")
    if w is None:
        return None
    where = "compute.gemm.waves"
    if not isinstance(w, dict) or "source" not in w:
        rd.fail(where, "must be a mapping {sms: N, tiles: [[rows, cols], ...], source: ...}")
    sms = w.get("sms")
    if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= 100_000:
        rd.fail(f"{where}.sms", f"must be the device's count of streaming multiprocessors, got {inputs.show(sms)}")
    tiles = w.get("tiles")
    ok = isinstance(tiles, list) and tiles and all(
        isinstance(t, list) and len(t) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 4096
                                                    for x in t) for t in tiles)
    if not ok:
        rd.fail(f"{where}.tiles", f"must be a list of [rows, cols] output tiles (integers 1-4096), got {inputs.show(tiles)}")
    return sms, tuple((int(a), int(b)) for a, b in tiles)


def wave_efficiency(m, n, batch, sms: int, tiles: tuple) -> np.ndarray:
    """The share of its waves' tile slots that a GEMM's output C[m, n] (batch products of it) keeps busy, at its
    best output tile: the tiles (a partial one whole) run in waves of `sms` at once, a part-full last wave taking
    a full wave's time (NVIDIA's Matrix Multiplication Background User's Guide, DU-09799-001, sections 3.1-3.2).
    A GEMM within one wave of a tile is not quantized by it: below a wave cuBLAS picks smaller tiles or splits
    k to fill the device, the loss the thin-dimension curve d/(d + dim_half) already describes."""
    best = np.zeros(np.broadcast(m, n, batch).shape)
    for tm, tn in tiles:
        count = np.ceil(m / tm) * np.ceil(n / tn) * batch
        busy = m * n * batch / (np.maximum(np.ceil(count / sms), 1.0) * sms * tm * tn)
        best = np.maximum(best, np.where(count <= sms, 1.0, busy))
    return best


def _kind(d, rd) -> str:
    if "kind" not in d:
        rd.fail("kind", "is missing: say which device the profile describes, `kind: gpu` or `kind: cpu`")
    if d["kind"] not in KINDS:
        rd.fail("kind", f"must be one of {', '.join(KINDS)}, got {d['kind']!r}")
    return d["kind"]


KINDS = ("gpu", "cpu")


def _no_framework_fields(comp, rd) -> None:
    """Which kernels a framework runs is its execution's (planner/execution.py), not the machine's."""
    if isinstance(comp, dict) and "elementwise_kernels" in comp:
        rd.fail("compute.elementwise_kernels", "is the framework's, not the machine's: give it in an execution "
                                               "(--execution, a preset or a YAML file with elementwise_kernels)")


@dataclass(frozen=True)
class MachineProfile:
    name: str
    description: str
    device: str
    dtype: str
    gpus_per_node: int
    # gpu: NCCL, BLAS tuning, fused AdamW, --gpus-per-node in Slurm; cpu: gloo ranks sharing cores. Chosen by
    # the profile's `kind`, never guessed from the dtype
    kind: str
    mem_capacity: float  # bytes per GPU
    mem_headroom: float  # bytes
    mem_bandwidth: float  # bytes/s
    elementwise_efficiency: float
    peak_flops: float
    kernel_overhead: float  # s per kernel
    gemm_ceiling: float  # FLOP/s held under sustained full load (ceiling_tflops x sustained_fraction)
    # each GEMM dimension d runs at d/(d + dim_half) of the ceiling; None: the memory-traffic rule (gemm_half)
    gemm_dim_half: float | None
    attn_flops: float
    attn_causal_skip: bool
    attn_bwd_factor: float
    intra_latency: float  # s per ring step
    intra_groups: tuple  # ((size, stride, busbw bytes/s), ...)
    inter_busbw: float  # bytes/s of one ring leaving a node
    inter_latency: float  # s per ring step
    coll_bw_scale: dict = field(default_factory=lambda: {c: 1.0 for c in COLLECTIVES})
    coll_lat_scale: dict = field(default_factory=lambda: {c: 1.0 for c in COLLECTIVES})
    corrections: Corrections = field(default_factory=Corrections)
    gemm_table: GemmTable | None = None
    coll_table: CollectiveTable | None = None
    attn_table: AttentionTable | None = None
    overlap_efficiency: float = 1.0  # share of the shorter of compute and a background collective hidden
    physics: gpu_physics.GpuPhysics = field(default_factory=gpu_physics.GpuPhysics)  # GPU-only, chosen by fields
    path: str | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)
    device_count: int | None = None  # the device section's count: logical CPUs of the host, or GPUs per node
    # cpu only: the cores a node's ranks share, its rates measured with every rank busy; a pipeline rank that
    # waits frees its share (pipeline.shared_rank_end_times), save for collectives with more members on a node than its cores
    # (timing.switching_seconds). None: each rank has its own device
    shared_cores: int | None = None
    # bytes/s one ring (one communicator's channels) can carry across a node boundary, however few rings share
    # the node's NICs (network.inter_node.ring_busbw_gbs; inf: only the node's share, busbw / rings, bounds it)
    inter_ring_busbw: float = float("inf")
    # ((members, busbw bytes/s), ...): an all-reduce of a group of that many members inside one node runs NCCL's
    # NVLS (NVLink SHARP, the reduction in the NVSwitch) at this bus bandwidth; other collectives and other
    # sizes run the ring (intra_groups). Empty: no NVLS (the node's switch does no multicast, or too few members)
    intra_nvls: tuple = ()
    # compute.gemm.waves: (SMs, output tiles) quantizing the analytic GEMM curve (wave_efficiency); None: not modelled
    gemm_waves: tuple | None = None
    # compute.gemm.unaligned_tflops (FLOP/s): the most a GEMM any of whose dimensions is not a whole number of
    # 16-byte vectors runs at (the BLAS's kernels for such operands); None: not modelled
    gemm_unaligned: float | None = None
    # compute.gemm.sustained_fraction: the share of ceiling_tflops (a burst measurement) a GPU holds at its power
    # limit under full load; gemm_ceiling already carries it
    gemm_sustained: float = 1.0

    # ---- for people ---------------------------------------------------------------
    @property
    def peak_tflops(self) -> float:
        return self.peak_flops / TFLOP

    @property
    def launch_cost(self) -> float:
        """Seconds per kernel launch, corrected."""
        return self.kernel_overhead * self.corrections.kernel_overhead_scale

    @property
    def overlap(self) -> float:
        """Share of the shorter of compute and a background collective that hides, corrected."""
        e = self.corrections.overlap_efficiency
        return self.overlap_efficiency if e is None else e

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def blas_tuning(self) -> bool:
        """The trainer tunes GEMM layouts on GPUs and not on CPU, by default."""
        return self.kind == "gpu"

    def replace(self, **kw) -> MachineProfile:
        return dataclasses.replace(self, **kw)

    @property
    def gemm_half(self) -> float:
        """The GEMM curve's dim_half: the profile's number, or by the memory-traffic rule the size of a
        dimension at which moving the operand it does not index, at the element-wise kernels' share of HBM
        bandwidth, takes as long as the GEMM's FLOP at the ceiling (A[m,k] against 2·m·n·k: n = C·e/(2·η·BW))."""
        if self.gemm_dim_half is not None:
            return self.gemm_dim_half
        return self.gemm_ceiling * self.dtype_bytes / (2.0 * self.elementwise_efficiency * self.mem_bandwidth)

    def with_corrections(self, **kw) -> MachineProfile:
        return dataclasses.replace(self, corrections=dataclasses.replace(self.corrections, **kw))

    # ---- bandwidth of a placed group -----------------------------------------------
    def intra_busbw(self, size: int, stride: int) -> float:
        """Bus bandwidth (bytes/s) of a group inside one node, all such groups busy at once."""
        rows = self.intra_groups
        exact = [bw for (s, st, bw) in rows if s == size and st == stride]
        if exact:
            return exact[0]
        same = [(abs(np.log2(st) - np.log2(stride)), bw) for (s, st, bw) in rows if s == size]
        if same:
            return min(same)[1]
        base = sorted((s, bw) for (s, st, bw) in rows if st == 1) or sorted((s, bw) for (s, st, bw) in rows)
        sizes = np.log2([s for s, _ in base])
        bws = np.log([bw for _, bw in base])
        return float(np.exp(np.interp(np.log2(size), sizes, bws)))

    def group_busbw(self, size, stride) -> np.ndarray:
        """Bus bandwidth (bytes/s) for groups of `size` members `stride` ranks apart, vectorised.

        Inside a node (stride*size divides gpus_per_node): the intra-node table. Across nodes:
        the rings of all the groups that leave the busiest node at once share its inter-node bandwidth
        (AxoNN's model, reference §3: `min(stride, gpus_per_node)` of them; more where the groups' spans
        do not line up with the nodes: rings_per_node).
        """
        size = np.asarray(size, dtype=np.int64)
        stride = np.asarray(stride, dtype=np.int64)
        n = self.gpus_per_node
        inside = self.group_inside(size, stride)
        out = np.empty(np.broadcast(size, stride).shape, dtype=np.float64)
        size_b, stride_b = np.broadcast_arrays(size, stride)
        scale = self.corrections.inter_bw_scale
        inter = np.minimum(self.inter_busbw * scale / rings_per_node(size_b, stride_b, n), self.inter_ring_busbw * scale)
        out[...] = inter
        if np.any(inside):
            # one table lookup per distinct (size, stride) inside a node, not per candidate or per node size
            # inside a node size and stride are at most gpus_per_node: one int64 key per pair (a fast 1-D unique)
            keys, inv = np.unique(size_b[inside] * (n + 1) + stride_b[inside], return_inverse=True)
            pairs = np.stack([keys // (n + 1), keys % (n + 1)], axis=-1)
            bw = np.array([self.intra_busbw(int(a), int(b)) if a >= 2 else np.nan for a, b in pairs])
            out[inside] = bw[inv.reshape(-1)] * self.corrections.intra_bw_scale
        out[size_b <= 1] = np.inf
        return out

    def all_reduce_busbw(self, size, inside, ring) -> np.ndarray:
        """The bus bandwidth (bytes/s) of an all-reduce over groups of `size` members, `inside` one node or not,
        whose ring path has `ring` (group_busbw): a group inside a node whose size intra_nvls lists takes NVLS
        where that is faster (NCCL chooses it); every other group its ring."""
        ring = np.asarray(ring, dtype=np.float64)
        if not self.intra_nvls:
            return ring
        size_b, inside_b, out = np.broadcast_arrays(np.asarray(size), np.asarray(inside, dtype=bool), ring)
        out = np.array(out, dtype=np.float64)
        for members, bw in self.intra_nvls:
            hit = inside_b & (size_b == members)
            out[hit] = np.maximum(out[hit], bw * self.corrections.intra_bw_scale)
        return out

    def group_inside(self, size, stride) -> np.ndarray:
        """Whether every group of `size` members `stride` ranks apart sits inside one node."""
        return groups_inside(size, stride, self.gpus_per_node)

    def group_latency(self, size, stride) -> np.ndarray:
        """Latency per ring step (s) of a placed group."""
        inside = self.group_inside(size, stride)
        return np.where(inside, self.intra_latency, self.inter_latency) * self.corrections.latency_scale

    # ---- GEMM time -------------------------------------------------------------------
    def unaligned(self, d) -> np.ndarray:
        """Whether a GEMM dimension of d elements is not a whole number of 16-byte vectors (compute.gemm.unaligned_tflops
        caps such GEMMs)."""
        return np.mod(np.asarray(d, dtype=np.float64), 16.0 / self.dtype_bytes) != 0

    def gemm_seconds(self, m, n, k, layout: str | None = None, batch=1):
        """Seconds of one C[m,n] = A[m,k] @ B[k,n] call, launch included, and whether each shape was
        extrapolated. A measured table already holds whole calls; the curve adds kernel_overhead, and where the
        profile has gemm.waves its tile and wave quantization (batch: products of one strided-batched call, whose
        tiles share the waves; the time stays one product's).

        layout None: the best of every layout and of both forms (C = AB and C^T = B^T A^T), as the
        trainer's BLAS tuning picks; otherwise the given layout of the direct form.
        """
        if self.gemm_waves is not None and self.gemm_table is None:
            m, n, k, batch = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (m, n, k, batch)))
        else:
            m, n, k = np.broadcast_arrays(np.asarray(m, np.float64), np.asarray(n, np.float64), np.asarray(k, np.float64))
        shape = m.shape
        flop = 2.0 * m * n * k
        scale = self.corrections.gemm_scale
        if self.gemm_table is None:
            d = self.gemm_half
            eff = (m / (m + d)) * (n / (n + d)) * (k / (k + d))
            if self.gemm_waves is not None:
                eff = eff * wave_efficiency(m, n, batch, *self.gemm_waves)
            t_compute = flop / (self.gemm_ceiling * eff * scale)
            if self.gemm_unaligned is not None:
                off = self.unaligned(m) | self.unaligned(n) | self.unaligned(k)
                t_compute = np.where(off, np.maximum(t_compute, flop / (self.gemm_unaligned * scale)), t_compute)
            t_memory = (m * k + k * n + m * n) * self.dtype_bytes / (self.mem_bandwidth * scale)
            return np.maximum(t_compute, t_memory) + self.launch_cost, np.zeros(shape, dtype=bool)
        tab = self.gemm_table
        pts = np.stack([m.ravel(), n.ravel(), k.ravel()], axis=-1)
        if len(pts) <= MEMO_SHAPES:
            t, ext = _memo_lookup(tab, pts, layout)
            return (t / scale).reshape(shape), ext.reshape(shape)
        uniq, inv = np.unique(pts, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        t_u, ext_u = _table_lookup(tab, uniq, layout)
        return (t_u[inv] / scale).reshape(shape), ext_u[inv].reshape(shape)


# lookups of at most this many shapes go through GemmTable.memo (which holds at most MEMO_MAX entries)
MEMO_SHAPES = 64
MEMO_MAX = 100_000


def _memo_lookup(tab: GemmTable, pts: np.ndarray, layout: str | None):
    """_table_lookup of the rows of pts, each distinct shape interpolated once per table and layout."""
    keys = [(tuple(r), layout) for r in pts.tolist()]
    todo = list(dict.fromkeys(k for k in keys if k not in tab.memo))
    if todo:
        t, ext = _table_lookup(tab, np.array([k[0] for k in todo], dtype=np.float64), layout)
        found = dict(zip(todo, zip(t.tolist(), ext.tolist())))
        if len(tab.memo) + len(found) <= MEMO_MAX:
            tab.memo.update(found)
    else:
        found = {}
    got = [tab.memo.get(k) or found[k] for k in keys]
    return np.array([g[0] for g in got], dtype=np.float64), np.array([g[1] for g in got], dtype=bool)


def _interp_log_tput(tab: GemmTable, lm, ln, lk, grid):
    """Trilinear interpolation of log throughput on the log2 grid; coordinates already clamped."""
    idx, wts = [], []
    for vals, x in ((tab.m, lm), (tab.n, ln), (tab.k, lk)):
        g = np.log2(vals)
        if len(g) == 1:
            i = np.zeros_like(x, dtype=np.int64)
            w = np.zeros_like(x)
        else:
            i = np.clip(np.searchsorted(g, x, side="right") - 1, 0, len(g) - 2)
            w = (x - g[i]) / (g[i + 1] - g[i])
        idx.append(i)
        wts.append(w)
    res = np.zeros_like(lm)
    for dm in (0, 1):
        for dn in (0, 1):
            for dk in (0, 1):
                im = np.minimum(idx[0] + dm, grid.shape[0] - 1)
                in_ = np.minimum(idx[1] + dn, grid.shape[1] - 1)
                ik = np.minimum(idx[2] + dk, grid.shape[2] - 1)
                w = (wts[0] if dm else 1 - wts[0]) * (wts[1] if dn else 1 - wts[1]) * (wts[2] if dk else 1 - wts[2])
                res += w * grid[im, in_, ik]
    return res


def _table_lookup(tab: GemmTable, shapes: np.ndarray, layout: str | None):
    m, n, k = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    flop = 2.0 * m * n * k
    forms = [(m, n, k)]
    if layout is None and tab.swappable:
        forms.append((n, m, k))
    layouts = LAYOUTS if layout is None else (layout,)
    best = np.full(len(m), np.inf)
    ext = np.zeros(len(m), dtype=bool)
    for (a, b, c) in forms:
        la, lb, lc = np.log2(a), np.log2(b), np.log2(c)
        outside = np.zeros(len(m), dtype=bool)
        clamped = []
        for vals, x in ((tab.m, la), (tab.n, lb), (tab.k, lc)):
            lo, hi = np.log2(vals[0]), np.log2(vals[-1])
            outside |= (x < lo - 1e-9) | (x > hi + 1e-9)
            clamped.append(np.clip(x, lo, hi))
        for lay in layouts:
            if lay not in tab.log_tput:
                continue
            t = flop / np.exp(_interp_log_tput(tab, *clamped, tab.log_tput[lay]))
            better = t < best
            best = np.where(better, t, best)
            ext = np.where(better, outside, ext)
    if tab.exact:
        for i, (a, b, c) in enumerate(shapes):
            hit = tab.exact.get((int(a), int(b), int(c)))
            if hit:
                cands = [hit[layout] for layout in layouts if layout in hit]
                if layout is None and tab.swappable:
                    other = tab.exact.get((int(b), int(a), int(c)), {})
                    cands += list(other.values())
                if cands:
                    best[i] = min(cands)
                    ext[i] = False
    return best, ext


# ---- loading ---------------------------------------------------------------------------
def _device(dev, rd) -> tuple[str, int | None]:
    """`device: NAME` or `device: {name, count, source}` (what calibrate writes): the device it was measured on."""
    if isinstance(dev, str):
        return dev, None
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or not dev["name"]:
        rd.fail("device", f"must be text or a mapping with a name (and count, source), got {inputs.show(dev)}")
    unknown = set(dev) - {"name", "count", "source"}
    if unknown:
        rd.fail("device", f"has unknown key(s) {', '.join(sorted(map(str, unknown)))}: name, count, source")
    count = dev.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        rd.fail("device.count", f"must be a positive whole number, got {inputs.show(count)}")
    if count is not None and not isinstance(dev.get("source"), str):
        rd.fail("device.count", "has no source: give the device section a source")
    return dev["name"], count


def _bundled_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("AXOPLAN_PROFILES")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(Path.cwd() / "machine_profiles")
    dirs.append(Path(__file__).resolve().parents[2] / "machine_profiles")
    dirs.append(Path(sys.prefix) / "share" / "axoplan" / "machine_profiles")
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def profile_paths() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in _bundled_dirs():
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def profile_names() -> list[str]:
    return sorted(profile_paths())


_BUNDLED = Path(__file__).resolve().parents[2] / "machine_profiles"
_noted: set = set()


def _note_local(name: str, path: Path) -> None:
    """A name that resolves to a file outside the bundled profiles (./machine_profiles or
    AXOPLAN_PROFILES) shadows the bundled one silently otherwise: say which file is used, once."""
    real = path.resolve()
    if real.parent == _BUNDLED or real in _noted:
        return
    _noted.add(real)
    shadow = " instead of the bundled one" if (_BUNDLED / path.name).is_file() else ""
    print(f"note: machine '{name}' is the local file {path}{shadow}", file=sys.stderr)


# What a profile's launch.env may set: the communication libraries' and threading settings a network
# needs, nothing that chooses which code runs (PATH, LD_PRELOAD, PYTHONPATH, BASH_ENV, ...). Within these
# families a name that loads code or searches for it (NCCL_NET_PLUGIN, FI_PROVIDER_PATH) is refused too.
LAUNCH_ENV_PREFIXES = ("NCCL_", "RCCL_", "TORCH_NCCL_", "GLOO_", "FI_", "UCX_", "MPICH_", "CXI_", "HSA_",
                       "MIOPEN_", "TORCH_DISTRIBUTED_")
LAUNCH_ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS",
                    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_LAUNCH_ENV_CODE = ("PLUGIN", "PATH", "LIB", "PRELOAD")


def groups_inside(size, stride, gpus_per_node: int) -> np.ndarray:
    """Whether every group of `size` members `stride` ranks apart sits inside one node of gpus_per_node."""
    span = np.asarray(size, dtype=np.int64) * np.asarray(stride, dtype=np.int64)
    return (span <= gpus_per_node) & (gpus_per_node % np.maximum(span, 1) == 0)


def rings_per_node(size, stride, gpus_per_node: int) -> np.ndarray:
    """How many groups of `size` members `stride` ranks apart (a grid axis: blocks of size x stride consecutive
    ranks, each holding `stride` interleaved groups) have rings leaving the busiest node at once, for groups
    that cross nodes: min(stride, gpus_per_node) where the blocks line up with the nodes (AxoNN's model); where
    they do not (a block of 6 ranks on 4-GPU nodes) a node's two edges may each cut a block, and every group
    with members on both sides of an edge leaves the node (_cut_groups)."""
    size, stride = np.broadcast_arrays(np.asarray(size, dtype=np.int64), np.asarray(stride, dtype=np.int64))
    n = int(gpus_per_node)
    out = np.array(np.minimum(stride, n), dtype=np.float64)
    span = size * stride
    # a group of one has no ring; one inside a node none that leaves it (the value there is AxoNN's, unused)
    off = (stride < n) & (span % n != 0) & (size > 1) & ~groups_inside(size, stride, n)
    if np.any(off):
        out[off] = per_distinct_pair(_cut_groups, size[off], stride[off], n)
    return out


def per_distinct_pair(fn, size, stride, n: int) -> np.ndarray:
    """fn(size, stride, n) for each candidate's pair, called once per distinct pair (rows.distinct_rows)."""
    first, inverse = distinct_rows(size, stride)
    return np.array([fn(int(size[i]), int(stride[i]), n) for i in first], dtype=np.float64)[inverse]


@functools.lru_cache(maxsize=4096)
def _cut_groups(size: int, stride: int, n: int) -> float:
    """The most groups any node cuts (rings_per_node): over every position of a node against the blocks of
    span size x stride, the groups with members on both sides of its left or its right edge."""
    span, last = size * stride, (size - 1) * stride
    left = np.arange(span // math.gcd(span, n), dtype=np.int64) * n % span  # each node's left edge in its block

    def cut(d):  # the groups i (i < stride) with a member i + k stride before offset d and one at or after it
        lo, hi = np.clip(d - last, 0, None), np.minimum(d, stride)
        return lo, hi, np.clip(hi - lo, 0, None)

    lo_l, hi_l, n_l = cut(left)
    right = left + n
    lo_r, hi_r, n_r = cut(right % span)
    # both edges in one block: a group cut at both counts once
    both = np.where(right < span, np.clip(np.minimum(hi_l, hi_r) - np.maximum(lo_l, lo_r), 0, None), 0)
    return float(min(int(np.max(n_l + n_r - both)), n))


def launch_env_refusal(name: str) -> str | None:
    """Why a profile may not set the environment variable `name`, or None if it may."""
    if name in LAUNCH_ENV_NAMES:
        return None
    if not name.startswith(LAUNCH_ENV_PREFIXES):
        return (f"is not a communication or threading setting a profile may set (allowed: names starting "
                f"{', '.join(LAUNCH_ENV_PREFIXES)} or one of {', '.join(LAUNCH_ENV_NAMES)})")
    if any(w in name for w in _LAUNCH_ENV_CODE):
        return "names a plugin, library or search path, which would choose the code a run loads"
    return None


def _check_launch(section, rd: _Reader, where: str) -> None:
    """`launch: {env: {NAME: value}, source: ...}` reaches the emitted scripts: names must be shell
    names a profile may set (launch_env_refusal) and every text printable (a newline in `source`
    would end a script comment)."""
    if section is None:
        return
    if not isinstance(section, dict):
        rd.fail("launch", "must be a mapping {env: {NAME: value, ...}, source: ...}")
    if "source" in section:
        inputs.text(section["source"] if isinstance(section["source"], str) else str(section["source"]),
                    f"{where}: field 'launch.source'", allow_empty=True)
    _check_launch_slurm(section.get("slurm"), rd)
    env = section.get("env")
    if env is None:
        return
    if not isinstance(env, dict):
        rd.fail("launch.env", "must be a mapping of NAME: value")
    from axoplan.shell import env_name

    for k, v in env.items():
        env_name(k)
        why = launch_env_refusal(k)
        if why:
            rd.fail(f"launch.env.{k}", why)
        if isinstance(v, (dict, list)):
            rd.fail(f"launch.env.{k}", "must be a single value")
        inputs.text("" if v is None else str(v), f"{where}: field 'launch.env.{k}'", allow_empty=True)


# the range of every nonzero number in a profile, in its own units (GB/s, TFLOP/s, GiB, us, ratios): far beyond
# any machine (a test's "free" resource is 1e12: communication-only models), and low enough that every product
# the model forms stays finite
MIN_NUMBER, MAX_NUMBER = 1e-9, 1e15


def _check_launch_slurm(sl, rd: _Reader) -> None:
    """`launch.slurm: {account, partition, qos, constraint, cpus_per_task, gpu_bind}` become #SBATCH directives
    and srun options, which no shell quotes: plain words only."""
    if sl is None:
        return
    from axoplan.slurm import SITE_KEYS, directive_safe

    known = SITE_KEYS + ("cpus_per_task", "gpu_bind")
    if not isinstance(sl, dict):
        rd.fail("launch.slurm", f"must be a mapping of {', '.join(known)}")
    for k, v in sl.items():
        if k not in known:
            rd.fail(f"launch.slurm.{k}", f"is not a Slurm option axoplan writes (known: {', '.join(known)})")
        if k == "cpus_per_task":
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 4096:
                rd.fail("launch.slurm.cpus_per_task", f"must be a whole number of CPUs from 1 to 4096, got {v!r}")
        elif not isinstance(v, str) or not directive_safe(v.replace(",", "").replace(":", "").replace("&", "")
                                                          .replace("|", "")):
            rd.fail(f"launch.slurm.{k}", f"must be a plain word (letters, digits, . _ - / , : & |), got {v!r}")


class _Reader:
    """Reads numbers with their sources, naming the file and field in every error."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, msg: str):
        raise UserError(f"{self.where}: field '{path}' {msg}")

    def section(self, d: dict, key: str, path: str = "", required: bool = True) -> dict:
        full = f"{path}.{key}" if path else key
        v = d.get(key)
        if v is None:
            if required:
                self.fail(full, "is missing")
            return {}
        if not isinstance(v, dict):
            self.fail(full, "must be a mapping")
        return v

    def num(self, d: dict, key: str, path: str = "", default: float | None = None, positive: bool = True,
            allow_zero: bool = False) -> float:
        full = f"{path}.{key}" if path else key
        if key not in d or d[key] is None:
            if default is not None:
                return default
            self.fail(full, "is missing")
        v = d[key]
        if isinstance(v, dict):
            if "value" not in v:
                self.fail(full, "must be a number or {value: ..., source: ...}")
            v = v["value"]  # sources were checked for the whole file by _check_all_numbers_sourced
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(full, f"must be a number, got {inputs.show(v)}")
        try:
            v = float(v)
        except OverflowError:  # an integer beyond float range
            self.fail(full, f"must be a finite number, got {inputs.show(v)}")
        if not np.isfinite(v) or v < 0 or (positive and not allow_zero and v == 0):
            self.fail(full, f"must be {'non-negative' if allow_zero else 'positive'}, got {v!r}")
        if v > MAX_NUMBER or (positive and not allow_zero and v < MIN_NUMBER):
            # 1e-300 GB/s (a divisor) or a dim_half of 1e308 makes every time inf or nan downstream, and
            # 1e300 TFLOP/s overflows on conversion: no machine quantity in the profile's units lies out here
            # (a quantity that may be zero, an overhead or latency, is only added: tiny is harmless)
            self.fail(full, f"must be {'between ' + format(MIN_NUMBER, 'g') + ' and' if not allow_zero else 'at most'} "
                            f"{MAX_NUMBER:g} in its units, got {v:g}")
        return v


def _has_source(d: dict) -> bool:
    s = d.get("source")
    return isinstance(s, str) and s.strip() != ""


def _check_all_numbers_sourced(node: Any, path: str, rd: _Reader, inherited: bool = False):
    """No number anywhere (outside `calibration`) may lack a source: a bare number is covered by the
    `source` of the mapping it sits in or of an enclosing section ({value: X, source: ...} is the
    one-number case). The file's top-level `source`, if any, covers nothing: too coarse to be useful."""
    if isinstance(node, dict):
        sourced = inherited or (bool(path) and _has_source(node))
        for k, v in node.items():
            if k in ("calibration", "schema"):
                continue
            p = f"{path}.{k}" if path else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not sourced:
                    rd.fail(p, "has no source (every number in a profile needs one)")
            else:
                _check_all_numbers_sourced(v, p, rd, sourced)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            p = f"{path}[{i}]"
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not inherited:
                rd.fail(p, "has no source (every number in a profile needs one)")
            _check_all_numbers_sourced(v, p, rd, inherited)


def _load_gemm_table(path: Path, rd: _Reader) -> GemmTable:
    rows = _read_csv(path, rd, "compute.gemm.table.path", {"m", "n", "k", "layout", "seconds"},
                     ints=("m", "n", "k"), floats=("seconds",))
    data: dict = {}
    for r in rows:
        key, sec = (r["m"], r["n"], r["k"]), r["seconds"]
        lay = r["layout"].strip().upper()
        if lay not in LAYOUTS or sec <= 0:
            continue
        slot = data.setdefault(key, {})
        slot[lay] = min(sec, slot.get(lay, np.inf))
    # The cartesian grid: drop the axis value with the poorest coverage until the product is complete.
    vals = [sorted({s[i] for s in data}) for i in range(3)]
    while True:
        total = len(vals[0]) * len(vals[1]) * len(vals[2])
        present = {s for s in data if s[0] in vals[0] and s[1] in vals[1] and s[2] in vals[2]}
        if len(present) == total or total == 0:
            break
        worst, worst_cov = None, 2.0
        for ax in range(3):
            for v in vals[ax]:
                others = total // len(vals[ax])
                cov = sum(1 for s in present if s[ax] == v) / others
                if cov < worst_cov:
                    worst, worst_cov = (ax, v), cov
        vals[worst[0]].remove(worst[1])
    if any(len(v) == 0 for v in vals):
        rd.fail("compute.gemm.table.path", f"'{path}' holds no complete cartesian grid of m, n, k")
    grid_m, grid_n, grid_k = (np.array(v, dtype=np.float64) for v in vals)
    log_tput = {}
    for lay in LAYOUTS:
        arr = np.empty((len(grid_m), len(grid_n), len(grid_k)))
        ok = True
        for i, a in enumerate(vals[0]):
            for j, b in enumerate(vals[1]):
                for kk, c in enumerate(vals[2]):
                    sec = data[(a, b, c)].get(lay)
                    if sec is None:
                        ok = False
                        break
                    arr[i, j, kk] = np.log(2.0 * a * b * c / sec)
        if ok:
            log_tput[lay] = arr
    if not log_tput:
        rd.fail("compute.gemm.table.path", f"'{path}' has no layout measured on the whole grid")
    grid_set = {(a, b, c) for a in vals[0] for b in vals[1] for c in vals[2]}
    exact = {s: v for s, v in data.items() if s not in grid_set}
    return GemmTable(grid_m, grid_n, grid_k, log_tput, exact, str(path))


def _non_decreasing(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks = []  # [sum, count]
    for v in y:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, n2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += n2
    return np.concatenate([np.full(n, s_ / n) for s_, n in blocks])


def _pool_strides(points: dict) -> dict:
    """Where ranks share cores (the table was timed after compute bursts) no rank is pinned to a core,
    so which ranks form a group cannot matter: the groups of one size but different strides measured
    the same thing, and their differences are noise. Pooled per burst level (the calibration runs the
    same bursts on every shape; level i of each stride is one measurement of it): geometric mean time
    per size, mean burst length."""
    by_size: dict = {}
    for key, by_burst in points.items():
        by_size.setdefault((key[0], key[1]), []).append((key, by_burst))
    out = {}
    for members in by_size.values():
        levels: dict = {}
        for _, by_burst in members:
            for i, burst in enumerate(sorted(by_burst)):
                levels.setdefault(i, []).append((burst, by_burst[burst]))
        pooled = {}
        for runs in levels.values():
            sizes = sorted({b for _, pts in runs for b in pts})
            pooled[float(np.mean([burst for burst, _ in runs]))] = {
                b: float(np.exp(np.mean([np.log(pts[b]) for _, pts in runs if b in pts]))) for b in sizes}
        for key, _ in members:
            out[key] = pooled
    return out


def _load_collective_table(path: Path, rd: _Reader, gpus_per_node: int) -> CollectiveTable:
    where = "network.intra_node.table.path"
    rows = _read_csv(path, rd, where, {"collective", "size", "stride", "bytes", "seconds"},
                     ints=("size", "stride"), floats=("bytes", "seconds", "burst_s"))
    points: dict = {}
    for r in rows:
        key = (r["collective"].strip(), r["size"], r["stride"])
        nbytes, sec = r["bytes"], r["seconds"]
        burst = r.get("burst_s") or 0.0
        if key[0] not in COLLECTIVES:
            rd.fail(where, f"'{path}' names an unknown collective {key[0]!r}")
        # only groups inside one node: across nodes the rings share NICs, which the alpha-beta model handles
        if nbytes <= 0 or sec <= 0 or key[1] < 2 or key[1] * key[2] > gpus_per_node or gpus_per_node % (key[1] * key[2]):
            continue
        points.setdefault(key, {}).setdefault(burst, {})[nbytes] = sec
    if any(burst > 0 for by_burst in points.values() for burst in by_burst):
        points = _pool_strides(points)
    curves = {}
    for key, by_burst in points.items():
        cs = []
        for burst, pts in sorted(by_burst.items()):
            if len(pts) < 2:
                continue
            b = np.array(sorted(pts), dtype=np.float64)
            # a collective never gets cheaper with more bytes: a dip is timing noise, pooled away
            cs.append((burst, np.log(b), np.log(_non_decreasing(np.array([pts[x] for x in sorted(pts)])))))
        if cs:
            curves[key] = tuple(cs)
    if not curves:
        rd.fail(where, f"'{path}' holds no intra-node group with two or more sizes")
    return CollectiveTable(curves, str(path))


def _read_csv(path: Path, rd: _Reader, where: str, need: set, ints=(), floats=()) -> list[dict]:
    try:
        return read_rows(path, need, ints=ints, floats=floats)
    except TableError as e:
        rd.fail(where, f"names '{path}', which cannot be read ({e.detail})")


def _load_attention_table(path: Path, rd: _Reader) -> AttentionTable:
    where = "compute.attention.table.path"
    rows = _read_csv(path, rd, where, {"batch", "heads", "seq", "head_dim", "causal", "pass", "seconds"},
                     ints=("batch", "heads", "seq", "head_dim"), floats=("seconds",))
    t = {}
    for r in rows:
        key = tuple(r[k] for k in ("batch", "heads", "seq", "head_dim"))
        sec = r["seconds"]
        if str(r["causal"]).strip().lower() in ("true", "1") and sec > 0:
            t[key + (str(r["pass"]).strip(),)] = sec
    shapes = {}
    for key in {k[:4] for k in t}:
        f, fb = t.get(key + ("forward",)), t.get(key + ("forward_backward",))
        if f and fb:
            shapes[key] = (f, max(fb - f, 0.0))
    if not shapes:
        rd.fail(where, f"'{path}' holds no shape with causal forward and forward_backward times")
    return AttentionTable(shapes, str(path))


def _overlap_efficiency(net: dict, rd: _Reader) -> float:
    v = rd.num(net, "overlap_efficiency", "network", default=1.0, allow_zero=True)
    if v > 1:
        rd.fail("network.overlap_efficiency", f"must be between 0 and 1, got {v:g}")
    return v


def _table_path(d: dict, key: str, base_dir: Path | None, rd: _Reader) -> Path | None:
    tab = d.get("table")
    if not tab:
        return None
    if not isinstance(tab, dict) or not isinstance(tab.get("path"), str):
        rd.fail(key, "must be {path: FILE.csv, source: ...}")
    if not _has_source(tab):
        rd.fail(key, "has no source (name the calibration run)")
    p = Path(tab["path"])
    return p if p.is_absolute() else (base_dir or Path.cwd()) / p


def _mapping_rows(rd, rows, where: str, fields: str, required: bool = True):
    """(path, mapping) of each row of a profile's list of mappings `rows` at `where`; one sentence where it is not
    a list of mappings (required: nor empty)."""
    if rows is None and not required:
        return
    if not isinstance(rows, list) or (required and not rows):
        rd.fail(where, f"must be a {'non-empty ' if required else ''}list of {fields}")
    for i, g in enumerate(rows):
        if not isinstance(g, dict):
            rd.fail(f"{where}[{i}]", f"must be a mapping {fields}")
        yield f"{where}[{i}]", g


def profile_from_dict(d: Any, where: str, base_dir: Path | None = None) -> MachineProfile:
    rd = _Reader(where)
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a mapping at the top level")
    schema = d.get("schema", SCHEMA)
    if schema != SCHEMA:
        rd.fail("schema", f"must be '{SCHEMA}', got {inputs.show(schema)}")
    for key in ("name",):
        if not isinstance(d.get(key), str) or not d.get(key):
            rd.fail(key, "must be a non-empty string")
    for key in ("name", "description"):
        if key in d and not isinstance(d[key], str):
            rd.fail(key, f"must be text, got {inputs.show(d[key])}")
    device_name, device_count = _device(d.get("device", ""), rd)
    # the name reaches launch scripts and one-line records; a description may span lines
    inputs.text(d["name"], f"{where}: field 'name'")
    _check_launch(d.get("launch"), rd, where)
    dtype = d.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        rd.fail("dtype", f"must be bf16, fp16 or fp32, got {inputs.show(dtype)}")
    unknown = sorted(str(k) for k in set(d) - TOP_LEVEL_KEYS)
    if unknown:
        rd.fail(unknown[0], f"is not a profile field (known: {', '.join(sorted(TOP_LEVEL_KEYS))})")
    _no_framework_fields(d.get("compute"), rd)
    _check_keys(d, PROFILE_KEYS, "", rd)
    _check_all_numbers_sourced(d, "", rd)

    gpn = rd.num(d, "gpus_per_node")
    if gpn != int(gpn):
        rd.fail("gpus_per_node", "must be an integer")
    if gpn > inputs.MAX_GPUS_PER_NODE:
        rd.fail("gpus_per_node", f"must be at most {inputs.MAX_GPUS_PER_NODE}, got {gpn:g}")
    mem = rd.section(d, "memory")
    comp = rd.section(d, "compute")
    _no_framework_fields(comp, rd)
    gemm = rd.section(comp, "gemm", "compute")
    attn = rd.section(comp, "attention", "compute")
    net = rd.section(d, "network")
    intra = rd.section(net, "intra_node", "network")
    inter = rd.section(net, "inter_node", "network")
    colls = rd.section(net, "collectives", "network", required=False)
    corr = rd.section(d, "corrections", required=False)
    known_corr = {f.name for f in dataclasses.fields(Corrections)} | {"source"}
    bad_corr = sorted(str(k) for k in set(corr) - known_corr)
    if bad_corr:
        rd.fail(f"corrections.{bad_corr[0]}", f"is not a correction (known: {', '.join(sorted(known_corr - {'source'}))})")

    parsed_groups = []
    for p, g in _mapping_rows(rd, intra.get("groups"), "network.intra_node.groups", "{size, stride, busbw_gbs, source}"):
        size, stride = rd.num(g, "size", p), rd.num(g, "stride", p, default=1.0)
        if size != int(size) or stride != int(stride) or size < 2:
            rd.fail(p, "size and stride must be integers, size >= 2")
        if size * stride > gpn:
            rd.fail(p, f"spans {size:g} x {stride:g} GPUs, more than gpus_per_node ({gpn:g})")
        parsed_groups.append((int(size), int(stride), rd.num(g, "busbw_gbs", p) * GB))
    parsed_nvls = []
    for p, g in _mapping_rows(rd, intra.get("nvls_all_reduce"), "network.intra_node.nvls_all_reduce",
                              "{size, busbw_gbs, source}", required=False):
        size = rd.num(g, "size", p)
        if size != int(size) or size < 2 or size > gpn:
            rd.fail(p, f"size must be an integer from 2 to gpus_per_node ({gpn:g})")
        if int(size) in dict(parsed_nvls):
            rd.fail(p, f"repeats size {size:g}")
        parsed_nvls.append((int(size), rd.num(g, "busbw_gbs", p) * GB))

    bw_scale, lat_scale = {}, {}
    for c in COLLECTIVES:
        cd = colls.get(c) or {}
        if cd and not isinstance(cd, dict):
            rd.fail(f"network.collectives.{c}", "must be a mapping {bandwidth_scale, latency_scale}")
        bw_scale[c] = rd.num(cd, "bandwidth_scale", f"network.collectives.{c}", default=1.0)
        lat_scale[c] = rd.num(cd, "latency_scale", f"network.collectives.{c}", default=1.0, allow_zero=True)

    # scales must stay positive (a zero bandwidth or throughput scale means infinite time); only the
    # latency scale and the fixed per-step overhead may be zero
    corrections = Corrections(**{
        f.name: rd.num(corr, f.name, "corrections", default=f.default,
                       allow_zero=f.name in ("latency_scale", "step_overhead_s", "kernel_overhead_scale",
                                              "collective_overhead_s"))
        for f in dataclasses.fields(Corrections) if f.name != "overlap_efficiency"
    }) if corr else Corrections()
    if corr.get("overlap_efficiency") is not None:
        eta = rd.num(corr, "overlap_efficiency", "corrections", allow_zero=True)
        if eta > 1:
            rd.fail("corrections.overlap_efficiency", f"must be between 0 and 1, got {eta:g}")
        corrections = dataclasses.replace(corrections, overlap_efficiency=eta)

    table = None
    tab = gemm.get("table")
    if tab:
        if not isinstance(tab, dict) or not isinstance(tab.get("path"), str):
            rd.fail("compute.gemm.table", "must be {path: FILE.csv, source: ...}")
        if not _has_source(tab):
            rd.fail("compute.gemm.table", "has no source (name the calibration run)")
        tp = Path(tab["path"])
        if not tp.is_absolute():
            tp = (base_dir or Path.cwd()) / tp
        table = _load_gemm_table(tp, rd)

    cp = _table_path(intra, "network.intra_node.table", base_dir, rd)
    coll_table = _load_collective_table(cp, rd, int(gpn)) if cp else None
    ap = _table_path(attn, "compute.attention.table", base_dir, rd)
    attn_table = _load_attention_table(ap, rd) if ap else None

    causal = attn.get("causal_skip", True)
    if not isinstance(causal, bool):
        rd.fail("compute.attention.causal_skip", "must be true or false")

    peak = rd.num(comp, "peak_tflops", "compute")
    sustained = rd.num(gemm, "sustained_fraction", "compute.gemm", default=1.0)
    if sustained > 1.0:
        rd.fail("compute.gemm.sustained_fraction", f"must be at most 1 (a share of ceiling_tflops), got {sustained:g}")
    unaligned = rd.num(gemm, "unaligned_tflops", "compute.gemm") if gemm.get("unaligned_tflops") is not None else None
    ceiling = rd.num(gemm, "ceiling_tflops", "compute.gemm")
    for sec, key, val in (("compute.gemm", "ceiling_tflops", ceiling),
                          ("compute.gemm", "unaligned_tflops", unaligned or 0.0),
                          ("compute.attention", "tflops", rd.num(attn, "tflops", "compute.attention"))):
        if val > peak * (1 + 1e-9):
            # a measured ceiling above the peak is a unit or copy mistake; it would show > 100 % of peak
            rd.fail(f"{sec}.{key}", f"({val:g} TFLOP/s) is above compute.peak_tflops ({peak:g}); "
                                    f"no kernel runs faster than the peak")

    capacity = rd.num(mem, "capacity_gib", "memory")
    headroom = rd.num(mem, "headroom_gib", "memory", default=0.0, allow_zero=True)
    if headroom >= capacity:
        rd.fail("memory.headroom_gib", f"({headroom:g}) must be smaller than memory.capacity_gib ({capacity:g})")

    return MachineProfile(
        name=d["name"],
        description=str(d.get("description", "")),
        device=device_name,
        device_count=device_count,
        kind=_kind(d, rd),
        dtype=dtype,
        gpus_per_node=int(gpn),
        mem_capacity=capacity * GIB,
        mem_headroom=headroom * GIB,
        mem_bandwidth=rd.num(mem, "bandwidth_gbs", "memory") * GB,
        elementwise_efficiency=rd.num(mem, "elementwise_efficiency", "memory", default=1.0),
        peak_flops=peak * TFLOP,
        kernel_overhead=rd.num(comp, "kernel_overhead_us", "compute", default=0.0, allow_zero=True) * US,
        shared_cores=_shared_cores(comp, rd, _kind(d, rd)),
        gemm_ceiling=ceiling * sustained * TFLOP,
        gemm_sustained=sustained,
        gemm_dim_half=_dim_half(gemm, rd),
        gemm_waves=_waves(gemm, rd),
        gemm_unaligned=unaligned * TFLOP if unaligned is not None else None,
        attn_flops=rd.num(attn, "tflops", "compute.attention") * TFLOP,
        attn_causal_skip=causal,
        attn_bwd_factor=rd.num(attn, "backward_factor", "compute.attention", default=2.5),
        intra_latency=rd.num(intra, "latency_us", "network.intra_node", allow_zero=True) * US,
        intra_groups=tuple(parsed_groups),
        inter_busbw=rd.num(inter, "busbw_gbs", "network.inter_node") * GB,
        inter_latency=rd.num(inter, "latency_us", "network.inter_node", allow_zero=True) * US,
        inter_ring_busbw=rd.num(inter, "ring_busbw_gbs", "network.inter_node", default=float("inf")) * GB,
        intra_nvls=tuple(sorted(parsed_nvls)),
        coll_bw_scale=bw_scale,
        coll_lat_scale=lat_scale,
        corrections=corrections,
        gemm_table=table,
        coll_table=coll_table,
        attn_table=attn_table,
        overlap_efficiency=_overlap_efficiency(net, rd),
        physics=gpu_physics.parse(d, rd),
        path=None,
        raw=d,
    )


def _shared_cores(comp: dict, rd, kind: str) -> int | None:
    """compute.shared_cores: only a cpu profile's ranks share cores (a GPU is its own rank's)."""
    if "shared_cores" not in comp:
        return None
    if kind != "cpu":
        rd.fail("compute.shared_cores", "is a cpu profile's field (ranks sharing cores); this profile's kind is "
                f"{kind}")
    v = rd.num(comp, "shared_cores", "compute")
    if v != int(v):
        rd.fail("compute.shared_cores", f"must be a whole number of cores, got {v:g}")
    return int(v)


def load_profile(name_or_path: str | MachineProfile) -> MachineProfile:
    """A bundled profile name (see `axoplan profiles`) or a path to a profile YAML."""
    if isinstance(name_or_path, MachineProfile):
        return name_or_path
    s = inputs.text(str(name_or_path), "--machine")
    p = Path(s)
    if not (s.endswith((".yaml", ".yml")) or p.exists()):
        paths = profile_paths()
        if s not in paths:
            raise UserError(f"unknown machine '{s}'; known profiles: {', '.join(sorted(paths)) or 'none'} "
                            f"(or give a YAML path)")
        p = paths[s]
        _note_local(s, p)
    where = f"machine profile '{p}'"
    if not p.is_file():
        raise UserError(f"machine profile '{s}' {'is not a file' if p.exists() else 'does not exist'}")
    d = load_yaml(p, where)
    prof = profile_from_dict(d, where, base_dir=p.parent)
    return dataclasses.replace(prof, path=str(p))
