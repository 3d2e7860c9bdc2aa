"""Collective microbenchmark: all-gather, reduce-scatter and all-reduce over every group shape the
planner uses, with every group of that shape busy at once (groups share links and, on a CPU,
cores: the ring-sharing effect the planner models).

A group shape is (size p, stride s): the ranks {r, r+s, ..., r+(p−1)s}. On W ranks the planner's
axes, placed innermost first, give exactly the shapes with p·s dividing W (s = the product of the
axes inside). The message size is the total buffer: the all-reduce buffer, the all-gather output,
the reduce-scatter input (nccl-tests' convention)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

from axoplan.calibrate.fit import COLLECTIVES

# The interleaving bursts: small dependent ops per rank, 0 (back to back) and roughly 1, 4 and 15 ms
# with 4 ranks on 2 cores here, spanning the trainer's compute between two collectives on small
# models; the planner interpolates between them with its own estimate of that compute.
BURST_DIM = 64
BURST_CALLS = (0, 24, 96, 384)


def group_shapes(world: int) -> list[tuple[int, int]]:
    return [(p, s) for s in range(1, world + 1) for p in range(2, world + 1) if world % (p * s) == 0]


def groups_of(world: int, size: int, stride: int) -> list[list[int]]:
    """All groups of one shape: each block of size·stride consecutive ranks holds `stride` groups."""
    block = size * stride
    return [[b * block + o + j * stride for j in range(size)] for b in range(world // block) for o in range(stride)]


def crosses_nodes(size: int, stride: int, ranks_per_node: int) -> bool:
    """The planner's rule: a group stays in a node when stride·size divides the node's ranks."""
    return not (size * stride <= ranks_per_node and ranks_per_node % (size * stride) == 0)


def _op(dist, name: str, group, p: int, elems: int, dtype, device, async_op: bool = False) -> Callable[[], object]:
    import torch

    kw = {"async_op": True} if async_op else {}
    if name == "all_reduce":
        # exactly as many elements as asked: the trainer all-reduces single scalars, fewer than p elements,
        # which some backends handle differently from a buffer split into p chunks
        buf = torch.ones(elems, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group, **kw)
    n = -(-elems // p) * p  # divisible by the group size
    if name == "all_gather":
        inp = torch.ones(n // p, dtype=dtype, device=device)
        out = torch.empty(n, dtype=dtype, device=device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(out, inp, group=group, **kw)
    if name == "reduce_scatter":
        inp = torch.ones(n, dtype=dtype, device=device)
        out = torch.empty(n // p, dtype=dtype, device=device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(out, inp, group=group, **kw)
    raise ValueError(f"unknown collective {name!r}")


@dataclass(frozen=True)
class CollectiveResult:
    collective: str
    size: int  # group size p
    stride: int
    crosses_nodes: bool
    nbytes: int  # total message bytes (after rounding to a multiple of p elements)
    seconds: float  # slowest rank's median seconds per call
    seconds_min_rank: float
    burst_s: float = 0.0  # compute burst before each call (all ranks at once), 0 = back to back


def compute_burst(device, calls: int) -> Callable[[], None]:
    """A short stretch of small dependent ops, like the trainer's work between two collectives."""
    import torch

    a = torch.randn(BURST_DIM, BURST_DIM, device=device)
    state = [a]

    def burst():
        x = state[0]
        for _ in range(calls):
            x = torch.tanh(x @ a)
        state[0] = x

    return burst


def measure(dist, name: str, group, p: int, nbytes: int, dtype, device, world_max: Callable[[float], float],
            gather: Callable[[float], list[float]], repeats: int, min_batch_s: float,
            barrier: Callable[[], object] | None = None, burst: Callable[[], None] | None = None,
            burst_s: float = 0.0, beside: Callable[[], None] | None = None) -> tuple[int, float, float]:
    """Median seconds per call on this rank's group; every rank runs the same number of calls (agreed
    over the world, or rings would deadlock), and the slowest rank's median is the result.

    With `burst` (ranks sharing cores): every call follows a compute burst, as in training, and the
    result is the time per (burst + call) less `burst_s`, the burst's own time with all ranks at
    once. Back-to-back calls on an oversubscribed node find their peers already waiting; between
    bursts a call also waits for the peer the OS had descheduled, and pays the wake-ups.

    With `beside`: the call is started asynchronously, `beside` runs, then the call is waited for;
    the result is the whole (the overlap microbenchmark)."""
    import torch

    elem = torch.tensor([], dtype=dtype).element_size()
    op = _op(dist, name, group, p, max(1, nbytes // elem), dtype, device, async_op=beside is not None)
    fn = op
    if beside is not None:
        def fn():
            work = op()
            beside()
            work.wait()
    elif burst is not None:
        def fn():
            burst()
            op()
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def batch(calls: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return time.perf_counter() - t0

    def keep_busy():
        # like timing.keep_busy, but the members of a ring must agree on every extra call
        if barrier is None:
            return
        handle, flag = barrier(), torch.zeros(1, device=device)
        while True:
            fn()
            flag.fill_(1.0 if handle.is_completed() else 0.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() > 0:
                break
        handle.wait()

    fn()  # warm-up: connection setup, allocator
    first = batch(1)
    calls = int(world_max(float(max(1, int(min_batch_s / max(first, 1e-9))))))
    keep_busy()
    samples = [batch(calls) / calls for _ in range(repeats)]
    keep_busy()
    # a call costs at least a microsecond: with a long burst, timing noise can exceed the call itself
    per_rank = gather(max(statistics.median(samples) - burst_s, 1e-6) if burst is not None
                      else statistics.median(samples))
    n = max(1, nbytes // elem)
    if name != "all_reduce":
        n = -(-n // p) * p
    return n * elem, max(per_rank), min(per_rank)


@dataclass(frozen=True)
class OverlapResult:
    collective: str
    size: int
    stride: int
    nbytes: int
    burst_s: float  # the compute alone, all ranks at once
    collective_s: float  # the collective after such a burst, less the burst
    together_s: float  # the collective started, the burst run beside it, the collective waited for
    efficiency: float  # (burst + collective - together) / min(burst, collective), within [0, 1]


OVERLAP_BYTES = (64 * 1024, 1024 * 1024)
OVERLAP_BURST_CALLS = 96


def run_overlap(dist, world: int, dtype, device, world_max: Callable[[float], float],
                gather: Callable[[float], list[float]], on_result: Callable[[OverlapResult], None],
                repeats: int = 5, min_batch_s: float = 5e-2, barrier: Callable[[], object] | None = None,
                shapes: list[tuple[int, int]] | None = None) -> None:
    """How much of a background collective hides behind compute: the trainer's Z all-gathers and
    reduce-scatters run on their own process group while the layer computes. On GPUs they use other
    engines; on CPU ranks that share cores, the collective's own work (copies, reductions, the
    loopback stack) needs the cores the compute uses, so only its waiting can hide."""
    burst = compute_burst(device, OVERLAP_BURST_CALLS)
    for (p, s) in shapes or group_shapes(world):
        mine, _ = dist.new_subgroups_by_enumeration(groups_of(world, p, s))
        for name in ("all_gather", "reduce_scatter"):
            for nbytes in OVERLAP_BYTES:
                # the burst alone right before its pair of measurements: all three see the same machine
                b_s = burst_seconds(burst, world_max, repeats, min_batch_s, barrier)
                dist.barrier()
                real, c_s, _ = measure(dist, name, mine, p, nbytes, dtype, device, world_max, gather, repeats,
                                       min_batch_s, barrier, burst, b_s)
                dist.barrier()
                _, t_s, _ = measure(dist, name, mine, p, nbytes, dtype, device, world_max, gather, repeats,
                                    min_batch_s, barrier, beside=burst)
                eff = min(max((b_s + c_s - t_s) / max(min(b_s, c_s), 1e-9), 0.0), 1.0)
                on_result(OverlapResult(name, p, s, real, b_s, c_s, t_s, eff))


def burst_seconds(burst: Callable[[], None], world_max: Callable[[float], float], repeats: int, min_batch_s: float,
                  barrier: Callable[[], object] | None) -> float:
    """The compute burst's time per call with every rank bursting at once (the slowest rank's)."""
    from axoplan.calibrate.timing import time_call

    return world_max(time_call(burst, warmup=3, repeats=repeats, min_batch_s=min_batch_s, barrier=barrier).seconds)


def run(dist, world: int, ranks_per_node: int, sizes_bytes: list[int], dtype, device,
        world_max: Callable[[float], float], gather: Callable[[float], list[float]],
        on_result: Callable[[CollectiveResult], None], repeats: int = 5, min_batch_s: float = 5e-3,
        shapes: list[tuple[int, int]] | None = None, barrier: Callable[[], object] | None = None,
        interleave: bool = False, cross_bytes: list[int] | None = None) -> None:
    """cross_bytes: the sizes for groups that cross nodes, where they differ (a GPU run across nodes
    sweeps them to 4 GiB, as nccl-tests does: the size x node-count curves the protocol model is fitted to)."""
    bursts = [compute_burst(device, n) if n else None for n in (BURST_CALLS if interleave else (0,))]
    for (p, s) in shapes or group_shapes(world):
        # every rank must create every group, in the same order
        mine, _ = dist.new_subgroups_by_enumeration(groups_of(world, p, s))
        cross = crosses_nodes(p, s, ranks_per_node)
        for burst in bursts:
            # the burst alone, re-measured per shape: the machine's state drifts over a long sweep
            b_s = burst_seconds(burst, world_max, repeats, min_batch_s, barrier) if burst is not None else 0.0
            for name in COLLECTIVES:
                for nbytes in (cross_bytes or sizes_bytes) if cross else sizes_bytes:
                    dist.barrier()
                    real, slow, fast = measure(dist, name, mine, p, nbytes, dtype, device, world_max, gather,
                                               repeats, min_batch_s, barrier, burst, b_s)
                    on_result(CollectiveResult(name, p, s, cross, real, slow, fast, b_s))
