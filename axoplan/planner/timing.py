"""Timing: the batch time of a schedule (schedule.py), by a strategy the profile's kind selects.

- GPU streams (kind: gpu): compute and communication run side by side on their own streams; while a
  collective runs beside it, compute slows by the profile's stated contention (network.overlap_compute_slowdown).
- CPU ranks sharing cores (kind: cpu): a background collective hides only the calibrated share of itself
  (overlap efficiency), and a measured collective's time depends on the compute burst before it. A group
  with more members on a node than its cores hides none of its switching seconds (switching_seconds).

Either way a window is one layer's step on the compute stream plus what the Z stream does meanwhile:
- OAG: the next window's weight all-gather is prefetched during this one, so the window takes
  max(compute, next all-gather); only the first all-gather of a pass is exposed. Without OAG
  each all-gather sits in front of its own window.
- OAR: a layer's dI all-reduce runs under its dW GEMM; only the excess is exposed.
- ORS: a layer's gradient reduce-scatter runs on the Z stream behind the backward compute;
  without ORS it blocks.
Forward all-reduces (X for normal layers, Y for transposed), norm statistics and the loss
all-reduce block. The data-parallel gradient all-reduce (fp32) either blocks once after the last
backward, or (overlap.data_parallel, the trainer's default) runs per bucket (LM head, each block,
embedding) on the D group's own stream beside the last micro-batch's backward, each launched when
its shards are final: only the tail the backward does not cover is exposed (data_parallel_tail).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from axoplan.planner import comm
from axoplan.planner.machine import MachineProfile
from axoplan.planner.schedule import MAX_INFLIGHT_RS, Schedule, Window


@dataclass
class Timed:
    """A window's seconds per candidate: compute, what the compute stream waits for, and the Z stream."""

    name: str
    compute: np.ndarray
    blocking: np.ndarray
    ag: np.ndarray
    rs: np.ndarray
    # of ag and rs, the seconds no compute beside them hides: a wide group's members take turns on the cores
    # whatever runs beside them (Collective.switching; 0 on GPUs and for groups that fit the cores)
    ag_switching: np.ndarray | float = 0.0
    rs_switching: np.ndarray | float = 0.0


def overlapped(a, b, eta: float = 1.0, slow: float = 0.0, fixed=0.0):
    """Two activities run side by side: max(a, b) when they share nothing (eta 1), their sum when
    the one cannot progress while the other runs (eta 0, e.g. CPU ranks with no core to spare for a
    background collective). With slow > 0 (GPU profiles) compute a runs 1 + slow times slower while
    collective b runs beside it: max(b, a + b * slow / (1 + slow)) in place of max(a, b). fixed: of b, the
    seconds nothing beside it hides (CPU ranks sharing cores: Collective.switching; 0 on GPUs)."""
    if not slow:
        hideable = b if np.ndim(fixed) == 0 and fixed == 0 else np.maximum(b - fixed, 0.0)  # GPUs: no extra pass
        return a + b - eta * np.minimum(a, hideable)
    slowed = np.maximum(b, a + b * (slow / (1 + slow)))
    return slowed if eta == 1 else (1 - eta) * (a + b) + eta * slowed  # eta 1 (GPUs): no extra array pass


class GpuStreams:
    """Compute and collectives on separate streams; compute slowed by the contention the profile states."""

    def __init__(self, profile: MachineProfile):
        self.eta = profile.overlap
        self.slow = profile.physics.overlap_slowdown

    def side_by_side(self, a, b, fixed=0.0):
        return overlapped(a, b, self.eta, self.slow, fixed)

    def retime(self, profile: MachineProfile, sched: Schedule) -> None:
        """Collectives keep the times the placement gave them."""


class CpuSharedCores(GpuStreams):
    """Ranks sharing the cores: a background collective hides the calibrated share of itself, and where
    the profile measured collectives after compute bursts, each call takes the time measured after the
    compute that precedes it in the schedule."""

    def __init__(self, profile: MachineProfile):
        self.eta = profile.overlap
        self.slow = 0.0

    def retime(self, profile: MachineProfile, sched: Schedule) -> None:
        if profile.coll_table is None:
            return
        # one micro-batch's compute (no recompute) over its calls: the burst before a call inside the passes
        comp0 = sum(w.compute_s() * n for p in sched.passes(False) for w, n in p.windows(sched.n_blocks))
        calls = sched.calls_per_micro_batch(False)
        burst = comp0 / np.maximum(calls, 1.0)
        seen = set()
        for p in (sched.forward, sched.backward, sched.backward_recompute):
            for w in p.prefix + p.block + p.suffix:
                for c in w.collectives():
                    if id(c) not in seen:
                        seen.add(id(c))
                        alone = c.seconds  # as build timed it: the calibration's calls back to back (burst 0)
                        c.seconds = comm.collective_seconds(profile, sched.groups, c, burst)
                        c.switching = switching_seconds(profile, sched.groups, c, alone)
        # the once-per-step calls: after the backward's tail (a whole micro-batch when no collective ran in
        # it) the first with a group of more than one, the loss after the optimizer, the rest back to back
        after_bwd = np.where(calls > 0, burst, comp0)
        earlier = False
        for c in sched.step:
            on = np.asarray(sched.groups.size[c.axis]) > 1
            if c.after == "backward":
                b, earlier = after_bwd, earlier | on
            elif c.after == "backward_first":
                b, earlier = np.where(on & ~earlier, after_bwd, 0.0), earlier | on
            elif c.after == "optimizer":
                b = sched.optimizer
            else:
                b = 0.0
            c.seconds = comm.collective_seconds(profile, sched.groups, c, b)


def switching_seconds(profile: MachineProfile, groups, c, alone) -> np.ndarray | float:
    """Of a collective's seconds, those it takes even while the node's other ranks wait: over more ranks than the
    cores (MachineProfile.shared_cores) not every member can run at once, so each ring step waits for the OS to
    switch one in, whatever the others do. That is its time called back to back (the calibration's burst 0, every
    group busy at once: benchmarks/cpu_stage_collectives.py measured groups of 4 on 2 cores at 64-85% of it with
    the other ranks asleep, pairs at 0.3-0.8 ms). Smaller groups: 0 (all of it shrinks as their compute does).
    What counts is a group's members on one node, whose cores they share. It is also what compute beside the call
    cannot hide (a Z all-gather or reduce-scatter in flight): the calibration's overlap part measures groups wider
    than the cores hiding less (benchmarks/data/cpu_overlap_rows_2026-12-07.csv: median 0.17 against pairs' 0.26).
    alone: that back-to-back time (retime passes the time schedule.build gave the call, at burst 0)."""
    if profile.shared_cores is None:
        return 0.0
    wide = comm.group_nodes(profile, groups.size[c.axis], groups.stride[c.axis])[0] > profile.shared_cores
    if not np.any(wide):
        return 0.0
    return np.where(wide, np.minimum(alone, c.seconds), 0.0)


def strategy(profile: MachineProfile) -> GpuStreams:
    """The timing strategy of the profile's kind of device."""
    return CpuSharedCores(profile) if profile.kind == "cpu" else GpuStreams(profile)


def timed(w: Window, side_by_side, overlap: bool) -> Timed:
    """A window's seconds: a collective beside one of its GEMMs (the dI all-reduce beside the dW GEMM) exposes
    only what the GEMM does not cover. Each call's per-call overhead (Collective.overhead: dispatch and rank skew,
    what a rank waits out when it issues a call and waits for it at once) stays in a blocking call; with overlap
    on, the Z stream's calls are issued a window ahead (OAG) or left in flight (ORS), so their partners have long
    arrived when they are waited for: they shed theirs."""
    blocking = sum(c.seconds for c in w.blocking)
    for op, colls in w.beside.items():
        t = sum(c.seconds for c in colls)
        gemm = w.compute[op].seconds
        blocking = blocking + (side_by_side(gemm, t) - gemm if overlap else t)

    def z_stream(calls):
        return sum(np.maximum(c.seconds - c.overhead, 0.0) if overlap and c.overhead is not None else c.seconds
                   for c in calls)

    def switching(calls):  # 0.0 (no array pass) wherever no call has switching seconds (GPUs, narrow groups)
        return sum(c.switching for c in calls if np.any(c.switching))  # already at most c.seconds

    return Timed(w.name, w.compute_s(), blocking, z_stream(w.gather), z_stream(w.scatter),
                 switching(w.gather), switching(w.scatter))


def run_windows(prefix, block, suffix, n_blocks: int, oag: bool, ors: bool, record: list | None = None,
                side_by_side=overlapped, parts: dict | None = None, memo: dict | None = None):
    """Total time of prefix + block * n_blocks + suffix (Timed windows), identical blocks evaluated once.
    parts (a dict) receives the prefix's time (with the first all-gather), one interior block's, the
    last block's and the suffix's: total = prefix + block * (n_blocks - 1) + last + suffix.
    memo: a dict shared by calls over the same Timed windows (the stages of one pass), each window's time
    before a given next window computed once."""
    memo = {} if memo is None else memo

    def window_time(w: Timed, nxt: Timed | None):
        key = (id(w), id(nxt))
        if key not in memo:
            memo[key] = _window_time(w, nxt)
        return memo[key]

    def _window_time(w: Timed, nxt: Timed | None):
        if oag:
            z = (nxt.ag if nxt is not None else 0.0) + (w.rs if ors else 0.0)
            zs = (nxt.ag_switching if nxt is not None else 0.0) + (w.rs_switching if ors else 0.0)
            return side_by_side(w.compute + w.blocking + (0.0 if ors else w.rs), z, fixed=zs)
        if ors:
            return w.ag + side_by_side(w.compute + w.blocking, w.rs, fixed=w.rs_switching)
        return w.ag + w.compute + w.blocking + w.rs

    total = (prefix + block)[0].ag if oag else 0.0
    for i, w in enumerate(prefix):
        nxt = (prefix + block)[i + 1]
        t = window_time(w, nxt)
        total = total + t
        if record is not None:
            record.append((w, t, 1))
    # interior blocks: the last window prefetches the next block's first all-gather
    interior = 0.0
    last = 0.0
    for i, w in enumerate(block):
        nxt_int = block[(i + 1) % len(block)]
        nxt_last = block[i + 1] if i + 1 < len(block) else (suffix[0] if suffix else None)
        t_int = window_time(w, nxt_int)
        t_last = window_time(w, nxt_last)
        interior = interior + t_int
        last = last + t_last
        if record is not None:
            record.append((w, t_int * (n_blocks - 1) + t_last, n_blocks))
    t_prefix = total
    total = total + interior * (n_blocks - 1) + last
    t_suffix = 0.0
    for i, w in enumerate(suffix):
        nxt = suffix[i + 1] if i + 1 < len(suffix) else None
        t = window_time(w, nxt)
        t_suffix = t_suffix + t
        if record is not None:
            record.append((w, t, 1))
    if parts is not None:
        parts.update(prefix=t_prefix, block=interior, last=last, suffix=t_suffix)
    return total + t_suffix


def data_parallel_tail(t_end, t_first, t_block, lag, first_blocks, per_bucket, middle, single, s_first, s_mid,
                       s_last, last_calls):
    """Seconds the D stream runs past the end of the last backward (t_end) when each bucket's all-reduce
    (comm.gradient_buckets) is queued on it once its last shard is final, one call at a time, in order.
    Block j (0 first in the backward) is final j + 1 + lag block windows (t_block) after the LM head's
    window (t_first), at the latest at t_end where the last reduce-scatters are collected; a bucket
    holding the embedding at t_end. A queue finishes at the max over buckets of (arrival + every
    service from it on); over the identical middle buckets that is concave, so its maximum is at an
    end or beside the kink where the arrivals reach t_end."""
    per = np.maximum(np.asarray(per_bucket, dtype=np.float64), 1.0)
    k0, mid = np.asarray(first_blocks, dtype=np.float64), np.asarray(middle, dtype=np.float64)
    rest = mid * s_mid + last_calls * s_last
    arrive1 = np.where(single, t_end, np.minimum(t_first + (k0 + lag) * t_block, t_end))
    finish = np.maximum(arrive1 + s_first + rest, t_end + last_calls * s_last)
    kink = np.floor(((t_end - t_first) / np.maximum(t_block, 1e-30) - k0 - lag) / per - 1)
    top = np.maximum(mid - 1, 0)
    for m in (np.zeros_like(kink), kink, kink + 1, top):
        m = np.clip(m, 0, top)
        arrive = np.minimum(t_first + (k0 + (m + 1) * per + lag) * t_block, t_end)
        finish = np.where(mid > 0, np.maximum(finish, arrive + (mid - m) * s_mid + last_calls * s_last), finish)
    return np.maximum(finish - t_end, 0.0)


@dataclass
class StepTime:
    batch: np.ndarray
    forward: np.ndarray  # one micro-batch's forward pass
    backward: np.ndarray  # one micro-batch's backward pass (with recompute where on)
    data_parallel: np.ndarray  # exposed seconds of the once-per-step collectives
    data_parallel_hidden: np.ndarray  # seconds of the D all-reduce hidden in the last backward
    records: dict  # explain: pass name -> [(Timed, seconds per micro-batch, count)]


def step_time(profile: MachineProfile, sched: Schedule, overlap: bool, explain: bool = False) -> StepTime:
    """The batch time of every candidate: grad_acc micro-batches of forward and backward windows, then the
    exposed part of the step's collectives, the optimizer and the profile's fixed overhead per step."""
    timing = strategy(profile)
    timing.retime(profile, sched)
    side = timing.side_by_side
    L = sched.n_blocks

    def times(p):
        return ([timed(w, side, overlap) for w in p.prefix], [timed(w, side, overlap) for w in p.block],
                [timed(w, side, overlap) for w in p.suffix])

    records = {"forward": [], "backward": [], "backward_recompute": []} if explain else {}
    t_fwd = run_windows(*times(sched.forward), L, overlap, overlap, records.get("forward"), side)
    parts_plain, parts_ck = {}, {}
    t_bwd_plain = run_windows(*times(sched.backward), L, overlap, overlap, records.get("backward"), side, parts_plain)
    t_bwd_ck = run_windows(*times(sched.backward_recompute), L, overlap, overlap, records.get("backward_recompute"),
                           side, parts_ck)
    ck = sched.checkpointing
    t_bwd = np.where(ck, t_bwd_ck, t_bwd_plain)

    plan = sched.buckets
    n_grad = len(plan.rows) if plan else 1
    step = sched.step
    # the updated weights' D all-gather (optimizer sharding) may run beside the next step's first forward
    t_others = sum(s.seconds if s.phase != "next forward" else side(t_fwd, s.seconds) - t_fwd for s in step[n_grad:])
    t_grad = step[0].seconds
    hidden = 0.0
    if plan is not None:
        # D stream beside the last backward; a shard is final when its reduce-scatter is collected: at
        # once without ORS or Z, else about max_inflight reduce-scatters (of 4 per block) later
        lag = np.where(sched.groups.size["z"] > 1, min(MAX_INFLIGHT_RS / 4, 1.0), 0.0)
        part = {k: np.where(ck, parts_ck[k], parts_plain[k]) for k in parts_plain}
        (s1, sm, sl), (cm, cl) = (x.seconds for x in step[:3]), (x.calls for x in step[1:3])
        tail = data_parallel_tail(t_bwd, part["prefix"], part["block"], lag, plan.first_blocks, plan.per_bucket,
                                  plan.middle, plan.single, s1, sm, sl, cl)
        hidden = s1 + cm * sm + cl * sl - tail
        # what runs beside the backward still costs (1 - eta) of itself (shared cores), or slows the GEMMs;
        # one bucket of everything is launched at the backward's end: the blocking call, exactly
        t_grad = np.where(plan.single, s1, tail + side(t_bwd, hidden) - t_bwd)
        hidden = np.where(plan.single, 0.0, hidden)
    t_dp = t_grad + t_others
    batch = sched.grad_acc * (t_fwd + t_bwd) + t_dp + sched.optimizer + profile.corrections.step_overhead_s
    return StepTime(batch, t_fwd, t_bwd, t_dp, hidden, records)
