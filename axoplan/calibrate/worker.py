"""The calibration worker, one per rank, started by torchrun (or srun + torchrun across nodes):

    python -m torch.distributed.run --nproc-per-node N -m axoplan.calibrate.worker --results DIR [--quick]

Every rank runs every microbenchmark at the same time as the others; rank 0 appends the results to
DIR as they come and prints progress lines (`AXOPLAN_PROGRESS done total phase`) for the parent
`axoplan calibrate`, which fits them and writes the profile."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Plan:
    gemm_shapes: list
    coll_shapes: list
    coll_bytes: list
    bw_elements: list
    act_shapes: list
    attn_shapes: list
    gemm_repeats: int
    repeats: int
    gemm_values: list = field(default_factory=list)
    # sizes for groups that cross nodes (a GPU run across nodes: on to 4 GiB); empty: coll_bytes
    coll_bytes_cross: list = field(default_factory=list)


PARTS = ("gemm", "collectives", "memory", "attention", "framework", "trainer", "overlap")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def make_plan(world: int, ranks_per_node: int, cuda: bool, quick: bool, models: list,
              gemm_max: int, coll_max: int = 0, bw_elements: int = 0) -> Plan:
    from axoplan.calibrate.collectives import group_shapes
    from axoplan.calibrate.gemm import cartesian_grid, model_shapes, pow2_values

    values = pow2_values(8, gemm_max, step=2 if quick else 1)
    grid = cartesian_grid(values)
    extra: set = set()
    if not quick:
        extra = model_shapes(models, ranks_per_node, (1, 2, 4, 8, 16) if not cuda else (1, 2, 4))
        extra = {s for s in extra if max(s) <= gemm_max} - set(grid)
    shapes = grid + sorted(extra)

    kib, mib = 1024, 1024 * 1024
    top = coll_max or ((512 * mib if not quick else 256 * mib) if cuda else (64 * mib if not quick else 4 * mib))
    step = 2 if not quick else 4
    # below 1 KiB: the scalars the trainer all-reduces every step (token count, loss, gradient norm)
    sizes, b = ([8, 64, 512] if not quick else [8, 256]), kib
    while b <= top:
        sizes.append(b)
        b *= step
    bw = [bw_elements or (256 * mib if cuda else 16 * mib)]  # elements per buffer: far beyond any cache

    acts = set()
    for mdl in models:
        for mb in ((1, 4, 16) if not cuda else (1, 4)):
            t = mb * mdl.seq_len
            acts.add((t, mdl.hidden))
            acts.add((t, mdl.ffn))
    attn = set()
    # the trainer part's own models too: its fit of the corrections should not rest on a fallback rate
    from axoplan.calibrate.trainer_grids import MODELS, calibration_model

    for mdl in list(models) + [calibration_model(*m) for m in MODELS]:
        for gy in _divisors(mdl.n_heads):
            if gy > world:
                continue
            for mb in ((1, 16) if quick else (1, 4, 16)) if not cuda else (1, 4):
                attn.add((mb, mdl.n_heads // gy, mdl.seq_len, mdl.head_dim))
    # and the framework part's (a grid of one, its own micro-batches): the same reason
    from axoplan.calibrate.framework import CONFIGS

    attn |= {(mb, heads, seq, hidden // heads) for _, _, mb, hidden, heads, _, seq in CONFIGS}
    # across nodes on GPUs the size x node-count curve, as nccl-tests sweeps it: on to 4 GiB (the protocol
    # model's plateau and latencies are fitted to it)
    cross = []
    if cuda and world > ranks_per_node and not coll_max:
        cross, b = list(sizes), sizes[-1] * step
        while b <= 4 * 1024 * mib:
            cross.append(b)
            b *= step
    return Plan(shapes, group_shapes(world), sizes, bw, sorted(acts), sorted(attn),
                gemm_repeats=3, repeats=3 if quick else 5, gemm_values=values, coll_bytes_cross=cross)


def _proc_kib(path: str, key: str) -> int | None:
    """A "key: N kB" line of a /proc file in bytes; None where the file or the line is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> int:
    rss = _proc_kib("/proc/self/status", "VmRSS:")
    if rss is not None:
        return rss
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_total_bytes() -> int:
    total = _proc_kib("/proc/meminfo", "MemTotal:")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_name() -> str:
    from axoplan.device import cpu_name

    return cpu_name()


def _cpu_vendor() -> str:
    """'amd' or 'intel' from /proc/cpuinfo's vendor_id (NCCL's tuning differs by host CPU vendor), 'arm' on an Arm
    host (Grace: NCCL gives it an Intel host's constants), else ''."""
    if platform.machine() in ("aarch64", "arm64"):
        return "arm"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    v = line.split(":", 1)[1].strip()
                    return {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(v, "")
    except OSError:
        pass
    return ""


# nvidia-smi topo -m's legend -> NCCL's path type (gpu_physics.NIC_PATHS): NODE (PCIe host bridges of one NUMA
# node) is a path through the CPU, NCCL's PHB
_SMI_PATHS = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}


def nic_path_from_topo(text: str, gpu: int) -> str:
    """The nearest NIC of GPU `gpu` in `nvidia-smi topo -m`'s matrix, as NCCL's path type ('' where the matrix
    names no NIC or no row for that GPU). NCCL runs LL128 across nodes only up to PXB (network.protocols)."""
    from axoplan.planner.gpu_physics import NIC_PATHS

    lines = [ln.split() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if ln and ln[0] == "GPU0"), None)  # the header's first column is GPU0
    row = next((ln for ln in lines if ln and ln[0] == f"GPU{gpu}" and ln is not header and len(ln) > 1), None)
    if header is None or row is None:
        return ""
    nics = [i for i, name in enumerate(header) if re.fullmatch(r"NIC\d+|mlx\d+_\d+", name)]
    found = [_SMI_PATHS[row[i + 1]] for i in nics if i + 1 < len(row) and row[i + 1] in _SMI_PATHS]
    return min(found, key=NIC_PATHS.index) if found else ""


def _nic_path(gpu: int) -> str:
    """nic_path_from_topo of this host's `nvidia-smi topo -m`, '' where it cannot run."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return nic_path_from_topo(out.stdout, gpu)


# CUdevice_attribute CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (cuda.h, CUDA 12.1 on): the NVSwitch does multicast
MULTICAST_ATTRIBUTE = 132


def nvls_enabled(nvls_env: str | None, multicast: bool | None) -> bool:
    """Whether NCCL may run NVLS algorithms (NVLSTree across nodes) here, by its own rule (NVIDIA/nccl
    src/transport/nvls.cc): NCCL_NVLS_ENABLE 0 turns them off, 1 on, and its default 2 asks the driver whether
    the device does multicast (`multicast`: None where the driver could not be asked)."""
    v = (nvls_env or "2").strip()
    if v == "0":
        return False
    if v == "2":
        return bool(multicast)
    return True


def _multicast(gpu: int) -> bool | None:
    """cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) of GPU `gpu` from the driver library,
    None where it cannot be asked (no libcuda, a driver before CUDA 12.1, an error)."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, val = ctypes.c_int(), ctypes.c_int(0)
        if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), gpu)
                or cuda.cuDeviceGetAttribute(ctypes.byref(val), MULTICAST_ATTRIBUTE, dev)):
            return None
    except (OSError, AttributeError):
        return None
    return bool(val.value)


def merge_meta(old: dict, new: dict, parts: set) -> dict:
    """The meta of an earlier complete run with `parts` measured again now: its own fields kept (they
    describe the parts that stay), the date of every part recorded, the new load averages kept apart."""
    if old.get("status") != "complete":
        raise SystemExit("axoplan.calibrate.worker --add: the results folder holds no complete earlier run")
    for k in ("world", "ranks_per_node", "device", "dtype", "threads_per_rank"):
        if old.get(k) != new.get(k):
            raise SystemExit(f"axoplan.calibrate.worker --add: the earlier run had {k} {old.get(k)}, this one {new.get(k)}")
    m = dict(old)
    dates = dict(old.get("part_dates") or {p: old["date"] for p in old.get("measured", [])})
    dates.update({p: new["date"] for p in parts})
    earlier = old.get("added") or []
    m.update(status="running", part_dates=dates, measured=sorted(set(old.get("measured", [])) | set(parts)),
             added=([earlier] if isinstance(earlier, dict) else list(earlier))
             + [{"date": new["date"], "parts": sorted(parts), "command": new["command"],
                 "loadavg_start": new["loadavg_start"]}])
    return m


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="axoplan.calibrate.worker")
    ap.add_argument("--results", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="")
    ap.add_argument("--gemm-max", type=int, default=0)
    ap.add_argument("--coll-max", type=int, default=0, help="largest collective message, bytes")
    ap.add_argument("--bw-elements", type=int, default=0, help="elements per buffer of the bandwidth test")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--command", default="")
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--add", action="store_true",
                    help="re-measure the --only parts on top of the complete run in --results, keeping the others")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from axoplan.planner.specs import load_model

    from axoplan.calibrate import collectives, framework, gemm, memory, trainer_grids
    from axoplan.calibrate.results_io import ResultsDir
    from axoplan.runtime.dist_env import cpu_threads

    t_start = time.time()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dtype, backend = torch.bfloat16, "nccl"
    else:
        device = torch.device("cpu")
        dtype, backend = torch.float32, "gloo"
        # exactly the trainer's threading (dist_env.cpu_threads), so the profile measures what training gets
        threads = cpu_threads(local_world)
        if threads is not None:
            torch.set_num_threads(threads)
    dist.init_process_group(backend, **({"device_id": device} if cuda else {}))
    rank, world = dist.get_rank(), dist.get_world_size()

    def world_tensor(values):
        return torch.tensor(values, dtype=torch.float64, device=device)

    def gather(x: float) -> list[float]:
        t = world_tensor([0.0] * world)
        t[rank] = x
        dist.all_reduce(t)
        return t.tolist()

    def gather_list(xs: list[float]) -> list[list[float]]:
        t = world_tensor([0.0] * (world * len(xs)))
        t[rank * len(xs):(rank + 1) * len(xs)] = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t)
        v = t.tolist()
        return [v[r * len(xs):(r + 1) * len(xs)] for r in range(world)]

    def world_max(x: float) -> float:
        t = world_tensor([x])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def mean_over_ranks(xs: list[float]) -> list[float]:
        per_rank = gather_list(xs)
        return [sum(r[i] for r in per_rank) / world for i in range(len(xs))]

    # nodes: torchrun sets GROUP_WORLD_SIZE (number of agents = nodes, one agent per node)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", str(max(1, world // local_world))))
    default_models = "gpt-tiny,gpt-small" if not cuda else "gpt-5b,gpt-20b"
    models = [load_model(m.strip()) for m in (args.models or default_models).split(",") if m.strip()]
    gemm_max = args.gemm_max or (2048 if not cuda else 16384)
    plan = make_plan(world, local_world, cuda, args.quick, models, gemm_max, args.coll_max, args.bw_elements)
    only = set(args.only.split(","))
    # With more busy threads than cores the OS time-slices the ranks in slices of milliseconds: a
    # timing must span many slices, or a rank that happened to run alone looks twice as fast.
    oversubscribed = not cuda and local_world * torch.get_num_threads() > (os.cpu_count() or 1)
    batch_s = (0.01 if args.quick else 0.02) if oversubscribed else 2e-3
    coll_batch_s = 0.05 if not cuda else 5e-3

    def barrier():
        # a non-blocking barrier over all ranks: see timing.keep_busy
        return dist.all_reduce(torch.zeros(1), async_op=True)

    busy = barrier if not cuda else None  # GPUs do not share their compute; CPU ranks share cores
    total = ((3 * len(plan.gemm_shapes) if "gemm" in only else 0)
             + (3 * len(plan.coll_shapes) * len(plan.coll_bytes) * (len(collectives.BURST_CALLS) if oversubscribed else 1)
                if "collectives" in only else 0)
             + ((2 * len(plan.bw_elements) + 4 * len(plan.act_shapes) + 4) if "memory" in only else 0)
             + (4 * len(plan.attn_shapes) if "attention" in only else 0)
             + (len(framework.CONFIGS) if "framework" in only else 0)
             + (len(trainer_grids.plan(world)) if "trainer" in only and world > 1 else 0)
             + (len(plan.coll_shapes) * 2 * len(collectives.OVERLAP_BYTES) if "overlap" in only and oversubscribed else 0))

    # per-rank memory the runtime itself takes (interpreter, torch, process group; CUDA context and
    # communicator buffers on GPUs): the profile's headroom
    dist.all_reduce(torch.ones(1024, device=device))
    if cuda:
        free, total_mem = torch.cuda.mem_get_info(device)
        overhead, capacity = total_mem - free, total_mem
    else:
        overhead, capacity = _rss_bytes(), _mem_total_bytes() // local_world
    overhead = world_max(float(overhead))

    results = ResultsDir(args.results)
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (datetime.UTC needs Python 3.11; 3.10 is supported)
    meta = {
        "status": "running",
        "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": backend,
        "backend_version": ("nccl " + ".".join(map(str, torch.cuda.nccl.version()))) if cuda else "gloo",
        "device": torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        "cuda": torch.version.cuda if cuda else None,
        # NCCL's protocol constants differ by GPU generation and host CPU vendor (network.protocols)
        "cuda_capability": (lambda c: c[0] * 10 + c[1])(torch.cuda.get_device_capability(device)) if cuda else None,
        "cpu_vendor": _cpu_vendor(),
        # and LL128 runs across nodes only where the GPU reaches its NIC by PXB or nearer
        "nic_path": _nic_path(device.index or 0) if cuda else "",
        # and an all-reduce may take NVLSTree where the NVSwitch does multicast (network.protocols.nvls_tree)
        "nvls": nvls_enabled(os.environ.get("NCCL_NVLS_ENABLE"), _multicast(device.index or 0)) if cuda else False,
        "dtype": "bf16" if cuda else "fp32",
        "world": world,
        "ranks_per_node": local_world,
        "nodes": nodes,
        "cpu_count": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "quick": args.quick,
        "command": args.command or " ".join(sys.argv),
        "models": [m.name for m in models],
        "gemm_values": plan.gemm_values,
        "capacity_bytes": int(capacity),
        "runtime_overhead_bytes": int(overhead),
        "measured": sorted(only),
        # other work on the machine slows every number: recorded so a reader can tell
        "loadavg_start": _loadavg(),
        "oversubscribed": oversubscribed,
        "min_batch_s": {"gemm_memory_attention": batch_s, "collectives": coll_batch_s},
        # ranks sharing cores: each collective is timed after a compute burst, less the burst
        "collectives_interleaved": oversubscribed,
    }
    if rank == 0:
        # rank 0 alone reads the earlier run's meta: the others would read it after start() marked it running
        if args.add:
            meta = merge_meta(results.meta(), meta, only)
        results.start(meta, tables=only if args.add else None)
    done = 0

    def tick(phase: str) -> None:
        nonlocal done
        done += 1
        if rank == 0:
            print(f"AXOPLAN_PROGRESS {done} {total} {phase}", flush=True)

    def on_gemm(r):
        if rank == 0:
            results.append("gemm", {"m": r.m, "n": r.n, "k": r.k, "layout": r.layout, "seconds": r.seconds,
                                    "tflops": r.tflops, "seconds_min_rank": r.seconds_min_rank,
                                    "seconds_max_rank": r.seconds_max_rank})
        tick("gemm")

    def on_coll(r):
        if rank == 0:
            from axoplan.calibrate.fit import busbw

            results.append("collectives", {"collective": r.collective, "size": r.size, "stride": r.stride,
                                           "crosses_nodes": r.crosses_nodes, "bytes": r.nbytes,
                                           "seconds": r.seconds, "seconds_min_rank": r.seconds_min_rank,
                                           "busbw_gbs": busbw(r.collective, r.size, r.nbytes, r.seconds) / 1e9,
                                           "burst_s": r.burst_s})
        tick(f"{r.collective} p={r.size} s={r.stride}")

    def on_mem(r):
        if rank == 0:
            results.append("memory", {"kind": r.kind, "op": r.op, "elements": r.elements, "bytes": r.nbytes,
                                      "seconds": r.seconds})
        tick(r.kind)

    def on_attn(r):
        if rank == 0:
            results.append("attention", {"batch": r.batch, "heads": r.heads, "seq": r.seq, "head_dim": r.head_dim,
                                         "causal": r.causal, "pass": r.pass_, "seconds": r.seconds})
        tick("attention")

    def on_framework(r):
        if rank == 0:
            results.append("framework", {"layers": r.layers, "hidden": r.hidden, "heads": r.heads, "vocab": r.vocab,
                                         "seq": r.seq, "micro_batch": r.micro_batch, "grad_acc": r.grad_acc,
                                         "seconds": r.seconds})
        tick("framework")

    def on_trainer(r):
        if rank == 0:
            results.append("trainer", {k: getattr(r, k) for k in results.columns("trainer")})
        tick(f"trainer {r.gx}x{r.gy}x{r.gz}x{r.gdata} {r.order}")

    def on_overlap(r):
        if rank == 0:
            results.append("overlap", {"collective": r.collective, "size": r.size, "stride": r.stride,
                                       "bytes": r.nbytes, "burst_s": r.burst_s, "collective_s": r.collective_s,
                                       "together_s": r.together_s, "efficiency": r.efficiency})
        tick("overlap")

    phase_s = {}
    t_phase = time.time()

    def phase_done(name):
        nonlocal t_phase
        phase_s[name] = round(time.time() - t_phase, 1)
        t_phase = time.time()

    if "memory" in only:
        memory.run(dtype, device, plan.bw_elements, plan.act_shapes, mean_over_ranks, on_mem, plan.repeats,
                   min_batch_s=batch_s, barrier=busy)
        phase_done("memory")
    if "attention" in only:
        memory.run_attention(plan.attn_shapes, dtype, device, mean_over_ranks, on_attn, plan.repeats,
                             min_batch_s=batch_s, barrier=busy)
        phase_done("attention")
    if "framework" in only:
        framework.run(device, dtype, mean_over_ranks, on_framework, plan.repeats, min_batch_s=batch_s, barrier=busy)
        phase_done("framework")
    if "trainer" in only and world > 1:  # a grid of one is the framework part
        trainer_grids.run(world, device, dtype, mean_over_ranks, on_trainer,
                          **({"warmup": 2, "steps": 5} if args.quick else {}))
        phase_done("trainer")
    if "collectives" in only:
        collectives.run(dist, world, local_world, plan.coll_bytes, dtype, device, world_max, gather, on_coll,
                        cross_bytes=plan.coll_bytes_cross,
                        repeats=plan.repeats, min_batch_s=coll_batch_s, barrier=busy, interleave=oversubscribed)
        phase_done("collectives")
    if "overlap" in only and oversubscribed:  # GPUs overlap on other engines: not measured there
        collectives.run_overlap(dist, world, dtype, device, world_max, gather, on_overlap, plan.repeats,
                                min_batch_s=coll_batch_s, barrier=busy)
        phase_done("overlap")
    if "gemm" in only:
        gemm.run(plan.gemm_shapes, dtype, device, gather_list, on_gemm, repeats=plan.gemm_repeats, min_batch_s=batch_s,
                 barrier=busy)
        phase_done("gemm")

    dist.barrier()
    if rank == 0:
        if args.add:
            meta["added"][-1].update(loadavg_end=_loadavg(), elapsed_s=round(time.time() - t_start, 1), phase_s=phase_s)
            meta["status"] = "complete"
        else:
            meta.update(loadavg_end=_loadavg(), status="complete", elapsed_s=round(time.time() - t_start, 1),
                        phase_s=phase_s)
        results.write_meta(meta)
    dist.barrier()  # the meta says complete before any rank tears down (calibrate accepts a teardown failure)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
