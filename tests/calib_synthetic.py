"""Synthetic calibration results with known constants, shared by the calibration tests."""
from __future__ import annotations

import random

from axoplan.calibrate.collectives import crosses_nodes, group_shapes
from axoplan.calibrate.fit import COLLECTIVES
from axoplan.planner.comm import ring_steps, ring_volume
from axoplan.calibrate.results_io import ResultsDir

ALPHA = 30e-6  # s per ring step
BUSBW = {(2, 1): 20e9, (4, 1): 12e9, (2, 2): 8e9}  # the intra shapes of 4 ranks per node  # bytes/s, intra-node
INTER_BW = 6e9  # one ring leaving a node
SCALE = {"all_gather": 1.25, "reduce_scatter": 0.8, "all_reduce": 1.0}
BW = 50e9
OVERHEAD = 5e-6


def meta(world=4, ranks_per_node=4, **kw):
    m = {"status": "complete", "date": "2026-01-01T00:00:00Z", "host": "testhost", "torch": "0.0", "python": "3",
         "backend": "gloo", "backend_version": "gloo", "device": "Test CPU", "cuda": None, "dtype": "fp32",
         "world": world, "ranks_per_node": ranks_per_node, "nodes": world // ranks_per_node, "cpu_count": 2,
         "threads_per_rank": 1, "quick": True, "command": "axoplan calibrate --test", "models": ["gpt-tiny"],
         "gemm_values": [8, 64, 512], "capacity_bytes": 8 * 2**30, "runtime_overhead_bytes": 300 * 2**20,
         "measured": ["attention", "collectives", "gemm", "memory"], "elapsed_s": 1.0}
    m.update(kw)
    return m


def nccl_truth(lat_scale: float, nic_path: str = "PXB", nvls: bool = False):
    """NCCL's default protocol rows for an H100 on Intel hosts (the synthetic GPU run's truth); nvls: with
    NVLSTree, as on HGX boards whose NVSwitch does multicast."""
    from axoplan.planner import gpu_physics
    from axoplan.planner.profile_reader import _Reader

    d = gpu_physics.nccl_protocols(90, "intel", nic_path, nvls)
    return gpu_physics.parse({"network": {"protocols": d}}, _Reader("test")).protocols, lat_scale


def write(path, world=4, ranks_per_node=4, noise=0.02, seed=0, gpu_truth=None, nic_path=None,
          nvls=None, stall=None) -> ResultsDir:
    """gpu_truth: (busbw of one ring leaving a node, latency scale) -- a GPU run whose groups crossing nodes
    follow NCCL's protocol model with those two numbers (comm.protocol_time), the rest as on CPUs; nic_path:
    the GPU-to-NIC path the worker recorded (None: none recorded, an older run), which the truth's rows follow;
    nvls: whether the worker found NVLS (None: not recorded, an older run), which the truth follows too; stall:
    (collective, lo, hi bytes per rank, seconds per ring step) -- its calls across nodes whose every rank's part
    lies in lo..hi take at least size - 1 steps of it (as RCCL's all-gathers on Frontier)."""
    from axoplan.planner.comm import protocol_time

    rng = random.Random(seed)
    rd = ResultsDir(path)
    md = meta(world, ranks_per_node)
    if gpu_truth is not None:
        md.update(cuda="12.4", cuda_capability=90, cpu_vendor="intel", device="Test GPU")
        if nic_path is not None:
            md["nic_path"] = nic_path
        if nvls is not None:
            md["nvls"] = nvls
    md["status"] = "running"
    rd.start(md)

    def jitter(x):
        return x * (1 + rng.uniform(-noise, noise))

    for (p, s) in group_shapes(world):
        cross = crosses_nodes(p, s, ranks_per_node)
        bw = INTER_BW / min(s, ranks_per_node) if cross else BUSBW[(p, s)]
        for c in COLLECTIVES:
            for nbytes in [2**e for e in range(10, 27 if gpu_truth is None or not cross else 33, 2)]:
                if cross and gpu_truth is not None:
                    pr, lat = nccl_truth(gpu_truth[1], nic_path or "PXB", bool(nvls))
                    m = max(min(ranks_per_node // s, p), 1)
                    t = jitter(float(protocol_time(pr, c, nbytes, p, m, -(-p // m), gpu_truth[0] / min(s, ranks_per_node),
                                                   lat)))
                    if stall is not None and c == stall[0] and stall[1] <= nbytes / p <= stall[2]:
                        t = max(t, jitter((p - 1) * stall[3]))
                else:
                    t = jitter(ring_steps(c, p) * ALPHA + ring_volume(c, p, nbytes) / (bw * SCALE[c]))
                rd.append("collectives", {"collective": c, "size": p, "stride": s, "crosses_nodes": cross,
                                          "bytes": nbytes, "seconds": t, "seconds_min_rank": t,
                                          "busbw_gbs": ring_volume(c, p, nbytes) / t / 1e9, "burst_s": 0.0})
    for m in (8, 64, 512):
        for n in (8, 64, 512):
            for k in (8, 64, 512):
                for layout, f in (("NN", 1.0), ("NT", 0.9), ("TN", 0.95)):
                    eff = m / (m + 32) * n / (n + 32) * k / (k + 32)
                    tf = 0.05 * eff * f
                    rd.append("gemm", {"m": m, "n": n, "k": k, "layout": layout, "seconds": 2 * m * n * k / tf / 1e12,
                                       "tflops": tf, "seconds_min_rank": 0, "seconds_max_rank": 0})
    rd.append("memory", {"kind": "bandwidth", "op": "copy", "elements": 2**24, "bytes": 2**27, "seconds": 2**27 / BW})
    for elems in (4096, 65536, 2**20):
        for op, mult in (("add", 3), ("gelu", 2)):
            nb = 4 * elems * mult
            rd.append("memory", {"kind": "elementwise", "op": op, "elements": elems, "bytes": nb,
                                 "seconds": OVERHEAD + nb / (0.5 * BW)})
    rd.append("memory", {"kind": "overhead", "op": "add", "elements": 8, "bytes": 0, "seconds": OVERHEAD})
    for b in (1, 4):
        flop = 4 * b * 8 * 64 * 64 * 8
        for causal in (False, True):
            fwd = flop / 10e9
            rd.append("attention", {"batch": b, "heads": 8, "seq": 64, "head_dim": 8, "causal": causal,
                                    "pass": "forward", "seconds": fwd})
            rd.append("attention", {"batch": b, "heads": 8, "seq": 64, "head_dim": 8, "causal": causal,
                                    "pass": "forward_backward", "seconds": 3.5 * fwd})
    md["status"] = "complete"
    rd.write_meta(md)
    return rd
