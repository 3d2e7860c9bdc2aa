"""MachineProfile: what one machine can do, and the bandwidth and GEMM time it gives a placed group or a shape.
profile_reader builds one from a sourced YAML (schema: machine_profiles/README.md); profile_tables holds its
measured tables.

Inside this module and the cost model everything is SI: seconds, bytes, bytes/s, FLOP/s.
The YAML speaks GB/s, TFLOP/s, GiB and microseconds for people.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from axoplan.planner import gpu_physics
from axoplan.planner.profile_tables import (COLLECTIVES, MEMO_SHAPES, AttentionTable, CollectiveTable,
                                         GemmTable, _memo_lookup, _table_lookup)
from axoplan.planner.rows import distinct_rows

GB = 1e9
GIB = 2**30
TFLOP = 1e12
US = 1e-6


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
