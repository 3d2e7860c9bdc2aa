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

from .fit import COLLECTIVES


def group_shapes(world: int) -> list[tuple[int, int]]:
    return [(p, s) for s in range(1, world + 1) for p in range(2, world + 1) if world % (p * s) == 0]


def groups_of(world: int, size: int, stride: int) -> list[list[int]]:
    """All groups of one shape: each block of size·stride consecutive ranks holds `stride` groups."""
    block = size * stride
    return [[b * block + o + j * stride for j in range(size)] for b in range(world // block) for o in range(stride)]


def crosses_nodes(size: int, stride: int, ranks_per_node: int) -> bool:
    """The planner's rule: a group stays in a node when stride·size divides the node's ranks."""
    return not (size * stride <= ranks_per_node and ranks_per_node % (size * stride) == 0)


def _op(dist, name: str, group, p: int, elems: int, dtype, device) -> Callable[[], None]:
    import torch

    n = -(-elems // p) * p  # divisible by the group size
    if name == "all_reduce":
        buf = torch.ones(n, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    if name == "all_gather":
        inp = torch.ones(n // p, dtype=dtype, device=device)
        out = torch.empty(n, dtype=dtype, device=device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: fn(out, inp, group=group)
    if name == "reduce_scatter":
        inp = torch.ones(n, dtype=dtype, device=device)
        out = torch.empty(n // p, dtype=dtype, device=device)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: fn(out, inp, group=group)
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


def measure(dist, name: str, group, p: int, nbytes: int, dtype, device, world_max: Callable[[float], float],
            gather: Callable[[float], list[float]], repeats: int, min_batch_s: float,
            barrier: Callable[[], object] | None = None) -> tuple[int, float, float]:
    """Median seconds per call on this rank's group; every rank runs the same number of calls (agreed
    over the world, or rings would deadlock), and the slowest rank's median is the result."""
    import torch

    elem = torch.tensor([], dtype=dtype).element_size()
    fn = _op(dist, name, group, p, max(1, nbytes // elem), dtype, device)
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
    per_rank = gather(statistics.median(samples))
    n = -(-max(1, nbytes // elem) // p) * p
    return n * elem, max(per_rank), min(per_rank)


def run(dist, world: int, ranks_per_node: int, sizes_bytes: list[int], dtype, device,
        world_max: Callable[[float], float], gather: Callable[[float], list[float]],
        on_result: Callable[[CollectiveResult], None], repeats: int = 5, min_batch_s: float = 5e-3,
        shapes: list[tuple[int, int]] | None = None, barrier: Callable[[], object] | None = None) -> None:
    for (p, s) in shapes or group_shapes(world):
        # every rank must create every group, in the same order
        mine, _ = dist.new_subgroups_by_enumeration(groups_of(world, p, s))
        cross = crosses_nodes(p, s, ranks_per_node)
        for name in COLLECTIVES:
            for nbytes in sizes_bytes:
                dist.barrier()
                real, slow, fast = measure(dist, name, mine, p, nbytes, dtype, device, world_max, gather,
                                           repeats, min_batch_s, barrier)
                on_result(CollectiveResult(name, p, s, cross, real, slow, fast))
