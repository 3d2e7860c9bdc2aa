"""Communication: which collective each layer issues, over which group, how many bytes, and how
long it takes on the placed group (ring α-β with the profile's placement-aware bandwidth).

Message sizes follow reference §2 per layer: normal layers (in over X, out over Y) and transposed
ones (X and Y truly swapped), the embedding, the LM head with vocabulary-parallel cross-entropy,
exact norms over X-sharded channels, and the data-parallel gradient all-reduce (fp32).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from axoplan.planner import gpu_physics
from axoplan.planner.execution import AXOPLAN, Execution
from axoplan.planner.machine import MachineProfile, groups_inside, per_distinct_pair
from axoplan.planner.space import Candidates, strides
from axoplan.planner.specs import LinearShape, ModelSpec

FP32 = 4
# a gradient bucket closes once it holds this much fp32 (PyTorch DDP's bucket_cap_mb): small layers share a call
DP_BUCKET_BYTES = 25 * 2**20


def rank_skew(p) -> np.ndarray:
    """How long a rank waits for the last of a group of p to arrive, in units of a pair's wait: with each rank's
    lateness independent and exponential, a rank waits E[max of p] - E[its own] = (H_p - 1) mean latenesses
    (H_p the p-th harmonic number; Renyi's representation of exponential order statistics), 1/2 for a pair:
    2 (H_p - 1), 1 for a pair, 0 for one rank. Measured in the trainer on 4 and 8 gloo ranks sharing 2 cores:
    a blocking all-reduce waits 0.4-0.6 ms more than its calibrated time in groups of 2 and 0.9-1.6 ms in groups
    of 4 (docs/calibration.md)."""
    if np.ndim(p) == 0:  # one group size (a measured shape's table lookup): computed once per size
        return _rank_skew_one(float(p))
    return _rank_skew(p)


def _rank_skew(p) -> np.ndarray:
    p = np.maximum(np.asarray(p, dtype=np.float64), 1.0)
    # H_p summed up to 64 ranks, beyond by its asymptotic series (within 1e-9 there)
    series = np.log(p) + np.euler_gamma + 1 / (2 * p) - 1 / (12 * p**2)
    harmonic = np.where(p <= len(_HARMONIC), _HARMONIC[np.minimum(p, len(_HARMONIC)).astype(np.int64) - 1], series)
    return 2.0 * (harmonic - 1.0)


@functools.lru_cache(maxsize=1024)
def _rank_skew_one(p: float) -> np.float64:
    return _rank_skew(p)[()]


_HARMONIC = np.cumsum(1.0 / np.arange(1, 65))


def call_overhead(corr, p) -> np.ndarray | float:
    """The corrections' per-call overhead (collective_overhead_s, a pair's) of a call over a group of p; 0 without
    the correction (every bundled GPU profile: no pass over the candidates for it)."""
    return corr.collective_overhead_s * rank_skew(p) if corr.collective_overhead_s else 0.0


@dataclass
class Groups:
    """Per axis and candidate: group size, stride, bus bandwidth (bytes/s), latency per ring step (s),
    and each collective's ring cost as time = nbytes * per_byte + fixed (see ring_time)."""

    size: dict
    stride: dict
    busbw: dict
    latency: dict
    per_byte: dict  # (axis, kind) -> s/byte
    fixed: dict  # (axis, kind) -> s
    shapes: dict = None  # axis -> (unique (size, stride) pairs, inverse index per candidate) where a table exists
    nodes: dict = None  # axis -> (members per node, nodes spanned): the protocol model's placement
    busbw_ar: dict = None  # axis -> an all-reduce's bus bandwidth where it differs from busbw (NVLS inside a node)

    def bw(self, axis: str, kind: str):
        """The bus bandwidth (bytes/s) a collective of `kind` gets on `axis` (kind_busbw)."""
        return kind_busbw(self.busbw, self.busbw_ar, axis, kind)


def kind_busbw(busbw: dict, busbw_ar: dict | None, axis: str, kind: str):
    """busbw[axis], or an all-reduce's own busbw_ar[axis] where there is one (the node reduces in its switch:
    MachineProfile.intra_nvls)."""
    return busbw_ar[axis] if kind == "all_reduce" and busbw_ar is not None else busbw[axis]


KINDS = ("all_gather", "reduce_scatter", "all_reduce")
# a tensor-parallel all-reduce that sequence parallelism splits into a reduce-scatter and an all-gather of the same
# buffer (Megatron's and torchtitan's SP): two calls timed as their sum, at the ring's bandwidth, not the all-reduce's
# NVLS or tree (an HGX H200's all-gathers and reduce-scatters measure at the ring's: dgx-h100.yaml)
SP_PAIR = "reduce_scatter+all_gather"


def ring_steps(kind: str, p):
    """Steps of a ring collective over p: all-reduce 2(p-1), all-gather and reduce-scatter p-1."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}")
    return (2 if kind == "all_reduce" else 1) * (p - 1)


def ring_volume(kind: str, p, nbytes):
    """Bytes each rank sends in a ring collective of `nbytes` (nccl-tests conventions: an all-reduce's
    per-GPU buffer, an all-gather's gathered buffer, a reduce-scatter's input): 2(p-1)/p of it for an
    all-reduce, (p-1)/p for the others. The one ring cost: the planner, its measured tables and calibration."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}")
    if isinstance(p, (int, np.integer)):  # one group size (a table lookup's slope): no array pass
        return (2.0 if kind == "all_reduce" else 1.0) * (p - 1) / max(p, 1) * nbytes
    return (2.0 if kind == "all_reduce" else 1.0) * (p - 1) / np.maximum(p, 1) * nbytes


def group_nodes(profile: MachineProfile, p, stride) -> tuple[np.ndarray, np.ndarray]:
    """(members per node, nodes spanned) of groups of p members `stride` GPUs apart; where the axis's blocks
    (p x stride consecutive ranks) do not line up with the nodes, or the stride does not divide a node, the
    most nodes a group of it spans, and members per node as NCCL counts them, p // nodes (_misaligned_nodes)."""
    n = profile.gpus_per_node
    p = np.maximum(np.asarray(p, dtype=np.float64), 1.0)
    s = np.maximum(np.asarray(stride, dtype=np.float64), 1.0)
    per_node = np.clip(np.floor(n / s), 1.0, p)
    nodes = np.ceil(p / per_node)
    span = p * s
    off = (s < n) & ((np.mod(span, n) != 0) | (np.mod(n, s) != 0)) & ~groups_inside(p, s, n)
    if np.any(off):
        p_b, s_b = (x.astype(np.int64) for x in np.broadcast_arrays(p, s))
        nodes, per_node = (np.broadcast_to(x, p_b.shape).copy() for x in (nodes, per_node))
        most = per_distinct_pair(_misaligned_nodes, p_b[off], s_b[off], n)
        nodes[off] = most
        per_node[off] = np.maximum(np.floor(p_b[off] / most), 1.0)
    return per_node, nodes


@functools.lru_cache(maxsize=4096)
def _misaligned_nodes(p: int, stride: int, n: int) -> int:
    """The most nodes of n GPUs a group spans, its members base + k stride (k < p) for every base the axis's
    blocks of p x stride ranks give (their offsets in a node: multiples of gcd(span, n) plus 0 .. stride - 1)."""
    g = math.gcd(p * stride, n)
    first = {(k * g + i) % n for k in range(n // g) for i in range(stride)}
    return max((x + (p - 1) * stride) // n + 1 for x in first)


def nccl_latency(profile: MachineProfile, kind: str, p, stride) -> np.ndarray:
    """Fixed seconds of one collective in NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc): a base
    cost per call, then per ring pass each step inside a node at the intra-node latency and each node
    crossing at the network latency (an all-reduce is two passes); across nodes an all-reduce may
    take the tree, (members per node - 1) intra-node steps and log2(nodes) network hops, up and down."""
    c = profile.corrections.latency_scale
    a_in, a_net = profile.intra_latency * c, profile.inter_latency * c
    p = np.asarray(p, dtype=np.float64)
    m, n = group_nodes(profile, p, stride)
    passes = 2.0 if kind == "all_reduce" else 1.0
    ring = passes * ((p - n) * a_in + (n - 1) * a_net)  # p-1 steps of which n-1 cross a node boundary
    if kind == "all_reduce":
        tree = 2.0 * ((m - 1) * a_in + np.floor(np.log2(n)) * a_net)  # NCCL's log2i: floor
        ring = np.where(n > 1, np.minimum(ring, tree), ring)
    t = (profile.physics.base_latency * c + ring) * profile.coll_lat_scale[kind]
    return np.where(p > 1, t, 0.0)


def protocol_seconds(profile: MachineProfile, kind: str, nbytes, p, per_node, nodes, busbw) -> np.ndarray:
    """Seconds of one collective across nodes on a profile with network.protocols (protocol_time with the
    profile's per-collective scales and corrections)."""
    corr = profile.corrections
    t = protocol_time(profile.physics.protocols, kind, nbytes, p, per_node, nodes,
                      np.asarray(busbw, dtype=np.float64) * profile.coll_bw_scale[kind],
                      corr.latency_scale * profile.coll_lat_scale[kind])
    return np.where(np.asarray(p) > 1, t + call_overhead(corr, p), 0.0)


def node_protocol_seconds(profile: MachineProfile, kind: str, nbytes, p, busbw) -> np.ndarray:
    """Seconds of one collective inside one node on a profile with network.protocols.inside_node
    (node_protocol_time with the profile's per-collective scales and corrections)."""
    corr = profile.corrections
    t = node_protocol_time(profile.physics.protocols, kind, nbytes, p,
                           np.asarray(busbw, dtype=np.float64) * profile.coll_bw_scale[kind],
                           corr.latency_scale * profile.coll_lat_scale[kind])
    return np.where(np.asarray(p) > 1, t + call_overhead(corr, p), 0.0)


def stall_seconds(stalls: tuple, kind: str, nbytes, p, nodes) -> np.ndarray | float:
    """The least one collective across nodes takes under a profile's network.stalls: p - 1 ring steps of a
    matching row's step where each rank's part of the buffer (nbytes / p) lies in the row's band; 0 elsewhere."""
    out = 0.0
    for s in stalls:
        if s.kind == kind:
            p_ = np.maximum(np.asarray(p, dtype=np.float64), 1.0)
            part = np.asarray(nbytes, dtype=np.float64) / p_
            hit = (np.asarray(nodes) > 1) & (part >= s.lo) & (part <= s.hi)
            out = np.maximum(out, np.where(hit, (p_ - 1) * s.step, 0.0))
    return out


def _log_size(nbytes) -> np.ndarray:
    """NCCL's logSize of a buffer, log2(bytes / 64) floored: the index of its per-size factor tables."""
    return np.floor(np.log2(np.maximum(nbytes, 64.0) / 64.0)).astype(np.int64)


def _by_size(table, log_size) -> np.ndarray:
    """A per-size factor table at log_size (its first entry below, its last beyond)."""
    t = np.asarray(table, dtype=np.float64)
    return t[np.clip(log_size, 0, len(t) - 1)]


def _tree_factor(pro: gpu_physics.Protocol, name: str, log_size) -> np.ndarray:
    """A tree row's bandwidth factor by size: the row's own correction (RCCL's) where it has one, else NCCL's
    tree correction table for protocol `name`, 1 beyond it."""
    return _by_size(pro.size_correction or gpu_physics.TREE_CORRECTION[name] + (1.0,), log_size)


def protocol_time(pr: gpu_physics.Protocols, kind: str, nbytes, p, per_node, nodes, busbw,
                  lat_scale: float = 1.0) -> np.ndarray:
    """NCCL's protocol model (NVIDIA/nccl src/graph/tuning.cc) of one collective across nodes: each ring
    protocol costs base + (steps - network steps) x intra + network steps x net (a Simple ring all-reduce
    x ring_plateau) plus the buffer's ring volume over its bus bandwidth (x the row's size_correction at
    log2(bytes / 64) where it has one: RCCL's ringCorrectionFactor), min(bw_factor x the group's
    plateau busbw, channels x per_channel; LL also under ll_max); an all-reduce may take the tree instead:
    base + 2((members per node - 1) x intra + floor(log2(nodes)) x net) plus the buffer over half the bus
    bandwidth (on 2 nodes two_node_tree_factor x the plateau), slowed by NCCL's tree correction at medium
    sizes. NCCL runs the fastest. busbw: the group's plateau, already shared among the groups that leave
    its nodes at once. With one member per node a ring's network steps cost the tree's (NCCL: 'with
    ppn=1 latencies are fully exposed'). Where the profile has an nvls_tree row (the node's NVSwitch does
    multicast) an all-reduce over 2 or more members per node may take NVLSTree: intra + 2 floor(log2(nodes))
    x net, and the ring's volume over min(2 x (on 2 nodes) the plateau, heads x per_channel), one head per
    member up to `channels`, slowed at medium sizes by NCCL's Simple tree correction. Every network step
    also pays the plugin's net_latency (twice for Simple, NCCL's flush). Every latency x the network's
    latency_scale x lat_scale."""
    nb = np.asarray(nbytes, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    n = np.maximum(np.asarray(nodes, dtype=np.float64), 1.0)
    bw = np.asarray(busbw, dtype=np.float64)
    members = np.asarray(per_node, dtype=np.float64)
    ar = kind == "all_reduce"
    net_steps = (2.0 if ar else 1.0) * (n - 1)
    intra_steps = ring_steps(kind, p) - net_steps
    two = n <= 2
    ll_cap = np.where(two, pr.ll_max[0], pr.ll_max[1])

    def bus(pro, plateau):
        b = np.minimum(pro.bw_factor * plateau, pr.channels * np.where(two, *pro.per_channel))
        return np.minimum(b, ll_cap) if pro.name == "LL" else b

    lat_scale = lat_scale * pr.latency_scale

    def net_of(pro, hw):  # a network step: the table's plus the plugin's latency, twice for Simple (flush)
        return hw + pr.net_latency * (2.0 if pro.name == "Simple" else 1.0)

    tree_net = {pro.name: pro.net for pro in pr.tree}
    one = members <= 1
    # the size tables' index, only where a row reads one (the tree's corrections, RCCL's ring corrections)
    log_size = _log_size(nb) if ar or any(pro.size_correction for pro in pr.ring) else None
    volume = ring_volume(kind, p, nb)  # the same bytes whatever the protocol
    best = np.inf
    for pro in pr.ring:
        net = pro.net if pro.name not in tree_net else np.where(one, tree_net[pro.name], pro.net)
        lat = pro.base + intra_steps * pro.intra + net_steps * net_of(pro, net)
        if ar and pro.name == "Simple":
            lat = lat * pr.ring_plateau
        b = bus(pro, bw)
        if pro.size_correction:
            b = b * _by_size(pro.size_correction, log_size)
        best = np.minimum(best, lat * lat_scale + volume / b)
    if ar:
        lg = np.floor(np.log2(n))  # NCCL's log2i(nNodes), as its logSize: floor
        tree_bw = np.where(two, pr.two_node_tree_factor, 1.0) * bw
        for pro in pr.tree:
            corr = _tree_factor(pro, pro.name, log_size)
            lat = pro.base + 2.0 * ((members - 1) * pro.intra + lg * net_of(pro, pro.net))
            best = np.minimum(best, lat * lat_scale + nb / (0.5 * bus(pro, tree_bw) * corr))
        for pro in pr.nvls_tree:  # NVLSTree: one head per member and NIC, its NIC doubled on 2 nodes
            heads = np.minimum(pr.channels, members)
            bus_nv = np.minimum(np.where(two, 2.0, 1.0) * bw, heads * np.where(two, *pro.per_channel))
            # a pipelined tree too: NCCL's tree correction (which NCCL applies to NVLSTree from Blackwell on)
            corr = _tree_factor(pro, "Simple", log_size)
            lat = pro.base + pro.intra + 2.0 * lg * net_of(pro, pro.net)
            t = lat * lat_scale + nb * 2.0 * (p - 1) / (p * bus_nv * corr)
            best = np.where((members >= 2) & (n > 1), np.minimum(best, t), best)
    return best


def node_protocol_time(pr: gpu_physics.Protocols, kind: str, nbytes, p, busbw, lat_scale: float = 1.0) -> np.ndarray:
    """NCCL's protocol model (NVIDIA/nccl src/graph/tuning.cc, nNodes == 1) of one collective whose group sits
    inside one node (pr.inside_node's rows): each ring protocol base + steps x its NVLink step latency plus the
    ring volume over min(bw_factor x the group's plateau busbw, channels x per_channel), LL also under the
    single-node ll_max; an all-reduce may take the tree, a chain through the node: base + 2 (p - 1) x step
    latency plus the buffer over half its bus bandwidth, slowed by NCCL's tree correction at medium sizes.
    A row's size_correction applies as across nodes. NCCL runs the fastest. Every latency x
    inside_node.latency_scale x lat_scale."""
    node = pr.inside_node
    nb = np.asarray(nbytes, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    bw = np.asarray(busbw, dtype=np.float64)
    steps = ring_steps(kind, p)
    scale = lat_scale * node.latency_scale

    def bus(pro):
        b = np.minimum(pro.bw_factor * bw, pr.channels * pro.per_channel[0])
        return np.minimum(b, node.ll_max) if pro.name == "LL" else b

    ar = kind == "all_reduce"
    log_size = _log_size(nb) if ar or any(pro.size_correction for pro in node.ring) else None
    volume = ring_volume(kind, p, nb)  # the same bytes whatever the protocol
    best = np.inf
    for pro in node.ring:
        b = bus(pro) * _by_size(pro.size_correction, log_size) if pro.size_correction else bus(pro)
        best = np.minimum(best, (pro.base + steps * pro.intra) * scale + volume / b)
    if ar:
        for pro in node.tree:
            corr = _tree_factor(pro, pro.name, log_size)
            best = np.minimum(best, (pro.base + 2.0 * (p - 1) * pro.intra) * scale + nb / (0.5 * bus(pro) * corr))
    return best


def p2p_seconds(profile: MachineProfile, nbytes, crosses_node, concurrent_per_node=1) -> np.ndarray:
    """Seconds of one send/receive of `nbytes` between two GPUs (a pipeline's activations between stages),
    vectorised. Inside a node: the 2-GPU group's bus bandwidth and one intra-node step (plus NCCL's base
    latency where the profile takes NCCL's latency model). Across nodes: the node's inter-node bandwidth
    shared by the `concurrent_per_node` pairs that leave it at once (as group_busbw shares it among groups;
    a lone pair is credited the node's NICs, an upper bound: NCCL spreads a send over channels), and at most
    what one ring carries across a node boundary (inter_node.ring_busbw_gbs, where the profile sets it); with
    network.protocols the fastest protocol's base + one network step + bytes over its bandwidth."""
    nb = np.asarray(nbytes, dtype=np.float64)
    cross = np.asarray(crosses_node, dtype=bool)
    conc = np.clip(np.asarray(concurrent_per_node, dtype=np.float64), 1.0, profile.gpus_per_node)
    corr = profile.corrections
    lat_c = corr.latency_scale
    base = profile.physics.base_latency if profile.physics.latency_model == "nccl" else 0.0
    intra = (base + profile.intra_latency) * lat_c + nb / (profile.intra_busbw(2, 1) * corr.intra_bw_scale)
    bw = np.minimum(profile.inter_busbw / conc, profile.inter_ring_busbw) * corr.inter_bw_scale
    pr = profile.physics.protocols
    if pr is None:
        inter = (base + profile.inter_latency) * lat_c + nb / bw
    else:
        inter = np.inf
        for pro in pr.ring:
            b = np.minimum(np.minimum(pro.bw_factor * bw, pr.channels * pro.per_channel[0]),
                           pr.ll_max[0] if pro.name == "LL" else np.inf)
            inter = np.minimum(inter, (pro.base + pro.net) * lat_c * pr.latency_scale + nb / b)
    return np.where(cross, inter, intra) + call_overhead(corr, 2)


def _ring_coefficients(profile: MachineProfile, kind: str, p, busbw, latency, inside=True, stride=1):
    """Ring collectives: all-reduce moves 2(p-1)/p of the buffer in 2(p-1) steps, all-gather and
    reduce-scatter (p-1)/p in p-1 steps (nbytes: the per-GPU buffer of an all-reduce, the full
    gathered buffer of an all-gather, the full input of a reduce-scatter: nccl-tests conventions).
    Across nodes an all-reduce may take NCCL's tree instead, whose latency grows as log2(p): the
    cheaper step count is used there (it only matters for small messages over large groups).
    A profile with network.latency_model 'nccl' takes nccl_latency instead of steps x latency."""
    p = np.asarray(p, dtype=np.float64)
    per_byte = ring_volume(kind, p, 1.0) / (busbw * profile.coll_bw_scale[kind])
    if profile.physics.latency_model == "nccl":
        fixed = nccl_latency(profile, kind, p, stride)
    else:
        steps = ring_steps(kind, p)
        if kind == "all_reduce":  # the tree's two passes of log2(p) steps where cheaper across nodes
            tree = 2 * np.ceil(np.log2(np.maximum(p, 1)))
            steps = np.where(inside, steps, np.minimum(steps, tree))
        fixed = steps * latency * profile.coll_lat_scale[kind]
    fixed = fixed + call_overhead(profile.corrections, p)
    return per_byte, fixed


class _Coefficients(dict):
    """per_byte[(axis, kind)], computed on first use: a step uses 7 of the 18 (axis, kind) pairs. (A cached
    method on Groups reads simpler but measured 54 ms against 41 ms per evaluation of 57,806 candidates: this
    pair's reference cycle frees its arrays at the next garbage collection, which lets glibc reuse heap pages
    instead of trimming and page-faulting them back; with malloc's thresholds pinned the two are equal.)"""

    def __init__(self, profile, size, busbw, lat, inside, stride, busbw_ar):
        super().__init__()
        self.fixed = _Fixed(self)
        self._args = (profile, size, busbw, lat, inside, stride, busbw_ar)

    def __missing__(self, key):
        profile, size, busbw, lat, inside, stride, busbw_ar = self._args
        a, kind = key
        self[key], self.fixed[key] = _ring_coefficients(profile, kind, size[a], kind_busbw(busbw, busbw_ar, a, kind),
                                                        lat[a], inside[a], stride[a])
        return self[key]


class _Fixed(dict):
    """fixed[(axis, kind)], computed with per_byte."""

    def __init__(self, per_byte):
        super().__init__()
        self._per_byte = per_byte

    def __missing__(self, key):
        self._per_byte[key]  # computes both
        return self[key]


def place(profile: MachineProfile, c: Candidates) -> Groups:
    """The groups of each axis, plus the two the trainer also uses once per step: 'zd' (Z and D
    together, where samples differ) and 'all' (every GPU). A combined group is as slow as its
    slowest member axis."""
    pp = np.asarray(c.pp)
    sx, sy, sz, sd, sp = strides(c.gx, c.gy, c.gz, c.gdata, c.order, pp)
    size = {"x": c.gx, "y": c.gy, "z": c.gz, "d": c.gdata}
    stride = {"x": sx, "y": sy, "z": sz, "d": sd}
    busbw = {a: profile.group_busbw(size[a], stride[a]) for a in size}
    lat = {a: profile.group_latency(size[a], stride[a]) for a in size}
    inside = {a: profile.group_inside(size[a], stride[a]) for a in size}
    # the pipeline axis (outermost unless the order places it): a stage's rank sends to the rank of the next
    # stage with the same coordinates
    size["p"], stride["p"] = pp, sp
    pair = np.minimum(pp, 2)  # a transfer between stages is a pair of GPUs
    busbw["p"], lat["p"] = profile.group_busbw(pair, stride["p"]), profile.group_latency(pair, stride["p"])
    inside["p"] = profile.group_inside(pair, stride["p"])
    # 'all' spans every pipeline stage too: its pipeline member is the whole pipeline group, not a pair
    busbw["P"], lat["P"] = profile.group_busbw(pp, stride["p"]), profile.group_latency(pp, stride["p"])
    inside["P"], size["P"], stride["P"] = profile.group_inside(pp, stride["p"]), pp, stride["p"]
    for name, axes in (("zd", "zd"), ("all", "xyzdP")):
        size[name] = np.prod([size[a] for a in axes], axis=0)
        stride[name] = np.min([np.where(size[a] > 1, stride[a], np.iinfo(np.int64).max) for a in axes], axis=0)
        stride[name] = np.where(size[name] > 1, stride[name], 1)
        busbw[name] = np.min([busbw[a] for a in axes], axis=0)
        lat[name] = np.max([np.where(size[a] > 1, lat[a], 0.0) for a in axes], axis=0)
        inside[name] = np.all([inside[a] | (size[a] <= 1) for a in axes], axis=0)
    for d in (size, stride, busbw, lat, inside):
        del d["P"]
    # an all-reduce inside a node may reduce in the switch (NVLS): its own bandwidth, the combined groups' by
    # their own size (an 8-member Z x D group inside a node reduces as one)
    busbw_ar = {a: profile.all_reduce_busbw(size[a], inside[a], busbw[a]) for a in size}
    per_byte = _Coefficients(profile, size, busbw, lat, inside, stride, busbw_ar)
    shapes = None
    if profile.coll_table is not None:
        shapes = {}
        for a, sz in size.items():
            pairs = np.stack(np.broadcast_arrays(sz, stride[a]), axis=-1).reshape(-1, 2)
            shapes[a] = np.unique(pairs, axis=0, return_inverse=True)
    spans = profile.physics.protocols or profile.physics.stalls  # the models that need the nodes a group spans
    nodes = {a: group_nodes(profile, size[a], stride[a]) for a in size} if spans else None
    return Groups(size, stride, busbw, lat, per_byte, per_byte.fixed, shapes, nodes,
                  busbw_ar if profile.intra_nvls else None)


def table_seconds(profile: MachineProfile, kind: str, size: int, stride: int, nbytes, burst=0.0) -> np.ndarray:
    """One collective on a measured group shape: log-log interpolation of the calibration's times,
    the smallest size's time below the table (latency-bound), and beyond it the largest time plus
    the alpha-beta model's per-byte cost; linear in the compute burst before the call between the
    bursts measured (clamped at both ends). The corrections split each curve at its smallest size:
    latency_scale multiplies that part, intra_bw_scale divides the rest."""
    nb = np.asarray(nbytes, dtype=np.float64)
    slope = ring_volume(kind, size, 1.0) / (
        profile.intra_busbw(int(size), int(stride)) * profile.coll_bw_scale[kind])
    c = profile.corrections
    per_burst = [t0 * c.latency_scale + (t - t0) / c.intra_bw_scale
                 for t0, t in _table_curves(profile.coll_table, kind, int(size), int(stride), nb, float(slope))]
    bursts = [b for b, _, _ in profile.coll_table.curves[kind, int(size), int(stride)]]
    if len(bursts) == 1:
        return per_burst[0] + call_overhead(c, size)
    stack = np.stack(np.broadcast_arrays(*per_burst))
    w = np.clip(np.asarray(burst, dtype=np.float64), bursts[0], bursts[-1])
    out = np.empty(np.broadcast(stack[0], w).shape)
    for i in range(len(bursts) - 1):  # piecewise linear in the burst length
        lo, hi = bursts[i], bursts[i + 1]
        f = (w - lo) / (hi - lo)
        seg = (w >= lo) & ((w <= hi) if i == len(bursts) - 2 else (w < hi))
        out = np.where(seg, stack[i] * (1 - f) + stack[i + 1] * f, out)
    return out + call_overhead(c, size)


# lookups of at most this many sizes are kept in CollectiveTable.memo (at most MEMO_MAX entries)
MEMO_SIZES = 64
MEMO_MAX = 100_000


def _table_curves(tab, kind: str, size: int, stride: int, nb: np.ndarray, slope: float) -> list:
    """Per measured burst, (t0, t): the curve's smallest-size time and its log-log interpolation at nb (beyond
    the table, its largest time plus slope per byte), before the corrections."""
    key = (kind, size, stride, nb.shape, nb.tobytes(), slope) if nb.size <= MEMO_SIZES else None
    hit = tab.memo.get(key) if key is not None else None
    if hit is not None:
        return hit
    x = np.log(np.maximum(nb, 1.0))
    out = []
    for _, lb, ls in tab.curves[kind, size, stride]:
        t = np.exp(np.interp(x, lb, ls))
        over = nb > np.exp(lb[-1])
        if np.any(over):
            t = np.where(over, np.exp(ls[-1]) + (nb - np.exp(lb[-1])) * slope, t)
        out.append((np.exp(ls[0]), t))
    if key is not None and len(tab.memo) < MEMO_MAX:
        for _, t in out:
            if isinstance(t, np.ndarray):
                t.flags.writeable = False  # shared by every later lookup
        tab.memo[key] = out
    return out


def ring_time(profile: MachineProfile, kind: str, nbytes, p, busbw, latency, inside=True, stride=1) -> np.ndarray:
    """Seconds of one collective over a group of p (0 when p == 1)."""
    per_byte, fixed = _ring_coefficients(profile, kind, p, busbw, latency, inside, stride)
    return np.asarray(nbytes, dtype=np.float64) * per_byte + fixed


@dataclass
class Collective:
    """One collective a layer issues per micro-batch (or per step), with its size and time per call."""

    layer: str
    phase: str  # fwd, bwd, step
    kind: str  # all_gather, reduce_scatter, all_reduce
    axis: str  # x, y, z, d
    nbytes: np.ndarray
    seconds: np.ndarray
    calls: np.ndarray | int = 1  # calls per micro-batch (or per step) of this size: gradient buckets share a row
    # the once-per-step calls: what compute precedes this one (measured collectives depend on it): the
    # backward, the backward where it is the first call after it with a group of more than one, the optimizer
    after: str = ""
    # of `seconds`, the per-call overhead (call_overhead), which a call waited for long after it was issued saves;
    # None where the profile has none
    overhead: np.ndarray | None = None
    # of `seconds`, what the call takes even while other ranks leave their cores free (ranks sharing cores, a
    # group larger than the cores: its members switched in turn at every step); 0 elsewhere
    switching: np.ndarray | float = 0.0


def collective_seconds(profile, g: Groups, c: Collective, burst) -> np.ndarray:
    """The collective's time per call after `burst` seconds of compute (measured tables only)."""
    return _coll(profile, g, c.layer, c.phase, c.kind, c.axis, c.nbytes, burst).seconds


def _replace_where(mask, t, fn, *args) -> np.ndarray:
    """t with fn(*args) where mask holds, fn evaluated on those candidates alone (args broadcast against t)."""
    if not np.any(mask):
        return t
    shape = np.broadcast_shapes(np.shape(t), np.shape(mask), *(np.shape(a) for a in args))
    out = np.array(np.broadcast_to(t, shape), dtype=np.float64)
    sel = np.broadcast_to(mask, shape)
    out[sel] = fn(*(np.broadcast_to(a, shape)[sel] for a in args))
    return out


def _coll(profile, g: Groups, layer, phase, kind, axis, nbytes, burst=0.0) -> Collective:
    if kind == SP_PAIR:
        rs, ag = (_coll(profile, g, layer, phase, k, axis, nbytes, burst) for k in ("reduce_scatter", "all_gather"))
        over = None if rs.overhead is None else rs.overhead + ag.overhead
        return Collective(layer, phase, kind, axis, rs.nbytes, rs.seconds + ag.seconds, overhead=over)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    t = nbytes * g.per_byte[axis, kind] + g.fixed[axis, kind]
    if profile.physics.protocols is not None:
        # across nodes NCCL's protocol model replaces the one alpha-beta line; inside one node too where the
        # profile gives NCCL's single-node rows
        m, n = g.nodes[axis]
        p = g.size[axis]
        t = _replace_where(n > 1, t, lambda nb, p, m, n, bw: protocol_seconds(profile, kind, nb, p, m, n, bw),
                           nbytes, p, m, n, g.busbw[axis])
        if profile.physics.protocols.inside_node is not None:
            t = _replace_where((n <= 1) & (p > 1), t, lambda nb, p, bw: node_protocol_seconds(profile, kind, nb, p, bw),
                               nbytes, p, g.bw(axis, kind))
    if any(st.kind == kind for st in profile.physics.stalls):
        t = np.maximum(t, stall_seconds(profile.physics.stalls, kind, nbytes, g.size[axis], g.nodes[axis][1]))
    if g.shapes is not None:
        # measured group shapes take the calibration's own curve instead of the alpha-beta fit
        pairs, inv = g.shapes[axis]
        t = np.array(np.broadcast_to(t, np.broadcast(t, inv).shape), dtype=np.float64)
        nb = np.broadcast_to(nbytes, t.shape)
        bu = np.broadcast_to(burst, t.shape)
        for i, (p, s) in enumerate(pairs):
            if p > 1 and profile.coll_table.covers(kind, p, s):
                m = inv == i
                t[m] = table_seconds(profile, kind, p, s, nb[m], bu[m])
    over = call_overhead(profile.corrections, g.size[axis]) if profile.corrections.collective_overhead_s else None
    return Collective(layer, phase, kind, axis, np.broadcast_to(nbytes, t.shape), t, overhead=over)


def boundary_crosses(gpus_per_node: int, stride, pp: int, gpus) -> np.ndarray:
    """[pp, n]: whether boundary b of each candidate's pipeline has a pair of ranks on two nodes (b < pp - 1:
    stages b and b + 1; b = pp - 1: the last stage back to the first, which the interleaved order crosses).

    A stage-b rank is a + b s + c S (the axes inside the pipeline give a in [0, s), s its stride; those
    outside give c, S = s pp), its partner d ranks on (s, or (pp - 1) s for the wrap). Some pair leaves its
    node iff d >= n or (t + s - 1) + d >= n for the largest start t = (b s + c S) mod n over the c."""
    n = int(gpus_per_node)
    s = np.asarray(stride, dtype=np.int64).reshape(1, -1)
    big_s = s * pp
    outer = np.asarray(gpus, dtype=np.int64).reshape(1, -1) // big_s
    b = np.arange(pp).reshape(-1, 1)
    wrap = b == pp - 1
    base, d = np.where(wrap, 0, b * s), np.where(wrap, (pp - 1) * s, s)
    c = np.arange(n).reshape(-1, 1, 1)  # c S mod n repeats within n values of c
    t = np.where(c < outer, (base + c * big_s) % n, -n).max(axis=0)
    return (d >= n) | (t + s - 1 + d >= n)


def stage_transfer_seconds(profile: MachineProfile, g: Groups, nbytes) -> tuple[np.ndarray, np.ndarray]:
    """One point-to-point transfer between neighbouring pipeline stages (p2p_seconds), (at a boundary inside a
    node, at one crossing nodes): every rank of a stage sends at once to its partner in the next, the
    pipeline's stride apart, so across nodes the pairs leaving a node, min(stride, GPUs per node) of them,
    share its NICs; which boundaries cross is boundary_crosses'. Zero without a pipeline."""
    stride = np.asarray(g.stride["p"])
    conc = np.minimum(stride, profile.gpus_per_node)
    on = np.asarray(g.size["p"]) > 1
    return tuple(np.where(on, p2p_seconds(profile, nbytes, cross, conc), 0.0) for cross in (False, True))


def linear_collectives(profile, g: Groups, lin: LinearShape, tokens, dtype_bytes: int,
                       sequence_parallel: bool = False, reduce_bytes: int | None = None,
                       split_all_reduce: bool | None = None) -> dict[str, Collective]:
    """Per micro-batch: fwd all-reduce of O over the in-axis, bwd all-reduce of dI over the out-axis,
    all-gather of the weight block and reduce-scatter of its gradient over Z. With sequence parallelism a
    normal layer's backward gathers its token-split input over Y again (ag_input), and the all-reduces become a
    reduce-scatter and an all-gather of the same buffer (SP_PAIR; split_all_reduce says so apart from ag_input,
    for the LM head). reduce_bytes: the gradient reduce-scatter's dtype where it is not the compute dtype."""
    ax_in, ax_out = lin.axes
    k, n = lin.local(g.size["x"], g.size["y"])
    block = padded_block(k * n, g.size["z"])
    tp = SP_PAIR if (sequence_parallel if split_all_reduce is None else split_all_reduce) else "all_reduce"
    extra = {}
    if sequence_parallel and not lin.transposed:
        extra["ag_input"] = _coll(profile, g, lin.name, "bwd", "all_gather", ax_out, tokens * k * dtype_bytes)
    return {**extra,
        "ar_fwd": _coll(profile, g, lin.name, "fwd", tp, ax_in, tokens * n * dtype_bytes),
        "ar_bwd": _coll(profile, g, lin.name, "bwd", tp, ax_out, tokens * k * dtype_bytes),
        "ag": _coll(profile, g, lin.name, "fwd", "all_gather", "z", block * dtype_bytes),
        "rs": _coll(profile, g, lin.name, "bwd", "reduce_scatter", "z", block * (reduce_bytes or dtype_bytes)),
    }


@dataclass
class ParameterShards:
    """One rank's weights: elements of each block linear's [k/g_in, n/g_out] block (qkv, attn_out, fc1, fc2),
    of the LM head's and of the embedding's, before Z sharding; the elements of their Z shards (one block's
    four together), and `total` the fp32 elements of all its Z shards."""

    blocks: list
    lm_head: np.ndarray
    embedding: np.ndarray
    block_shard: np.ndarray
    lm_shard: np.ndarray
    emb_shard: np.ndarray
    total: np.ndarray


def parameter_shards(model: ModelSpec, gx, gy, gz) -> ParameterShards:
    blocks = [k * n for k, n in (lin.local(gx, gy) for lin in model.block_linears())]
    k, n = model.lm_head().local(gx, gy)
    rows, cols = model.embedding_local(gx, gy)
    lm, emb = k * n, rows * cols
    block_shard, lm_shard, emb_shard = sum(shard_elems(b, gz) for b in blocks), shard_elems(lm, gz), shard_elems(emb, gz)
    return ParameterShards(blocks, lm, emb, block_shard, lm_shard, emb_shard,
                           block_shard * model.n_layers + lm_shard + emb_shard)


def padded_block(elems, gz) -> np.ndarray:
    """Elements a weight block's all-gather and reduce-scatter move: the block zero-padded to gz shards."""
    return shard_elems(elems, gz) * gz


def shard_elems(lin_elems_block, gz) -> np.ndarray:
    """Elements of one Z shard of a weight block (flat blocks are padded to a multiple of gz)."""
    return -(-lin_elems_block // gz)


def norm_collectives(profile, g: Groups, model: ModelSpec, tokens, name: str) -> tuple[Collective, Collective]:
    """Exact norm over X-sharded channels: per-token statistics all-reduced over X, fp32
    (layernorm: sum and sum of squares; rmsnorm: sum of squares), forward and backward alike."""
    stats = 2 if model.norm == "layernorm" else 1
    nbytes = tokens * stats * FP32
    return (_coll(profile, g, name, "fwd", "all_reduce", "x", nbytes),
            _coll(profile, g, name, "bwd", "all_reduce", "x", nbytes))


def embedding_collectives(profile, g: Groups, model: ModelSpec, tokens, dtype_bytes,
                          reduce_bytes: int | None = None, sequence_parallel: bool = False) -> dict[str, Collective]:
    """Vocabulary-parallel embedding [V/gy, H/gx], flat-sharded over Z: all-gather before the lookup,
    all-reduce of the partial lookups over Y (with sequence parallelism a reduce-scatter to the token split and
    the first layer's all-gather: SP_PAIR), reduce-scatter of the gradient (the backward needs no weight)."""
    rows, cols = model.embedding_local(g.size["x"], g.size["y"])
    block = padded_block(rows * cols, g.size["z"])
    tp = SP_PAIR if sequence_parallel else "all_reduce"
    return {
        "ag": _coll(profile, g, "embedding", "fwd", "all_gather", "z", block * dtype_bytes),
        "ar_fwd": _coll(profile, g, "embedding", "fwd", tp, "y", tokens * cols * dtype_bytes),
        "rs": _coll(profile, g, "embedding", "bwd", "reduce_scatter", "z", block * (reduce_bytes or dtype_bytes)),
    }


def loss_collectives(profile, g: Groups, tokens) -> tuple[Collective, Collective]:
    """Vocabulary-parallel cross-entropy, two fp32 all-reduces over Y as the trainer issues them: the
    per-token max, then the sum of exponentials with the target logit."""
    return (_coll(profile, g, "loss", "fwd", "all_reduce", "y", tokens * FP32),
            _coll(profile, g, "loss", "fwd", "all_reduce", "y", tokens * 2 * FP32))


@dataclass
class BucketPlan:
    """Per candidate, the overlapped D all-reduce's buckets: the first (the LM head and `first_blocks`
    blocks), `middle` buckets of `per_bucket` blocks each, the last (the remaining blocks and the
    embedding; none where the first took everything: `single`)."""

    first_blocks: np.ndarray
    per_bucket: np.ndarray
    middle: np.ndarray
    single: np.ndarray
    rows: list  # (which, fp32 elements per call, calls per step) of the first, middle and last buckets


def gradient_buckets(block_shards, lm_shard, emb_shard, n_layers: int, cap_bytes: int | None = None) -> BucketPlan:
    """The trainer's buckets (ParallelGPT.grad_buckets): units in the order the last backward makes them
    final (the LM head, blocks last to first with their four shards, the embedding), filled greedily; a
    bucket closes at the unit that brings it to cap_bytes (DP_BUCKET_BYTES) of fp32 or more, the last one
    at the embedding. Integer arithmetic, as the trainer counts shard lengths."""
    cap = -(-(DP_BUCKET_BYTES if cap_bytes is None else cap_bytes) // FP32)
    a, b, c = (np.asarray(x).astype(np.int64) for x in np.broadcast_arrays(lm_shard, block_shards, emb_shard))
    bb = np.maximum(b, 1)  # a zero-sized block (an infeasible split) must not divide by zero
    k0 = np.where(a >= cap, 0, -(-(cap - a) // bb))  # blocks that close the LM head's bucket
    single = k0 > n_layers  # never reaches the cap before the embedding: one bucket of everything
    k0 = np.minimum(k0, n_layers)
    k = -(-cap // bb)
    middle = np.where(single, 0, (n_layers - k0) // k)
    rest = np.where(single, 0, n_layers - k0 - middle * k)
    first = np.where(single, a + n_layers * b + c, a + k0 * b)
    rows = [("first", first.astype(np.float64), np.ones_like(middle)),
            ("middle", np.where(middle > 0, k * b, 0).astype(np.float64), middle),  # no call, no size
            ("last", np.where(single, 0, rest * b + c).astype(np.float64), np.where(single, 0, 1))]
    return BucketPlan(k0, k, middle, single, rows)


def data_parallel_collectives(profile, g: Groups, shard_elements, replicated_elements, buckets=None,
                               execution: Execution = AXOPLAN, dtype_bytes: int = 2) -> list[Collective]:
    """Once per step, as the trainer does it: the fp32 gradient shards all-reduced over D (one buffer; or
    with `buckets` (gradient_buckets(...).rows) one call per bucket, launched inside the last backward:
    the first len(buckets) rows, phase 'bwd', calls per candidate); replicated parameters (norm weights,
    positions) over Z and D together; the kept-token count and the loss over Z and D; the squared gradient
    norm over every GPU; the barrier that closes each timed step. An execution that shards the optimizer
    over D reduce-scatters the gradients instead and all-gathers the updated weights after the optimizer
    (phase 'next forward' where it overlaps the next step's first forward)."""
    sharded = execution.optimizer_sharding == "data-parallel"
    kind = "reduce_scatter" if sharded and not execution.sharded_gradient_all_reduce else "all_reduce"
    # the execution's D reduction dtype: fp32, or a compute-dtype copy of the fp32 gradients (DeepSpeed's bf16); where
    # the micro-batches' gradients are summed in the compute dtype there is no fp32 gradient: reduced as they are
    gb = dtype_bytes if execution.data_parallel_reduce == "compute-copy" or execution.gradient_accumulation == "compute" \
        else FP32
    if buckets is None:
        grads = [dataclasses.replace(_coll(profile, g, "gradients", "step", kind, "d", shard_elements * gb),
                                     after="backward_first")]
    else:
        grads = [dataclasses.replace(_coll(profile, g, "gradients", "bwd", kind, "d", elems * gb),
                                     calls=calls, after="backward") for _, elems, calls in buckets]
    if sharded:
        phase = "next forward" if execution.overlap_param_gather else "step"
        grads.append(dataclasses.replace(_coll(profile, g, "weights", phase, "all_gather", "d",
                                               shard_elements * dtype_bytes), after="optimizer"))
    return grads + [
        dataclasses.replace(_coll(profile, g, "replicated", "step", "all_reduce", "zd", replicated_elements * FP32),
                            after="backward_first"),
        _coll(profile, g, "token count", "step", "all_reduce", "zd", 8.0),
        dataclasses.replace(_coll(profile, g, "loss", "step", "all_reduce", "zd", 8.0), after="optimizer"),
        dataclasses.replace(_coll(profile, g, "gradient norm", "step", "all_reduce", "all", 8.0),
                            after="backward_first"),
        # the trainer ends every timed step with a barrier over all ranks (gloo: a tiny all-reduce)
        _coll(profile, g, "step barrier", "step", "all_reduce", "all", 4.0),
    ]
