"""The batch-time combiner: lays each micro-batch out as the trainer runs it, a sequence of layer
windows, and overlaps communication with compute exactly where the trainer does.

A window is one layer's step on the compute stream plus what the Z stream does meanwhile:
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

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from axoplan.loop.launch import Overlap
from axoplan.planner.machine import MachineProfile
from axoplan.planner.space import CANDIDATE_FIELDS, Candidates, divisibility_masks
from axoplan.planner.specs import Job, ModelSpec
from axoplan.planner import comm as C
from axoplan.planner import compute as K
from axoplan.planner.memory import Memory, memory
from axoplan.planner.rows import distinct_rows

# the trainer's default bound on reduce-scatters in flight (one definition: the LaunchConfig's)
MAX_INFLIGHT_RS = Overlap().max_inflight_reduce_scatters
OVERLAP_DP = Overlap().data_parallel  # the trainer's default: D all-reduces inside the last backward


@dataclass
class Window:
    name: str
    compute: np.ndarray  # compute work on the stream (GEMMs, attention, element-wise, launches)
    blocking: np.ndarray  # communication the compute stream waits for
    ag: np.ndarray  # all-gather this window needs before it starts (Z stream)
    rs: np.ndarray  # reduce-scatter this window issues (Z stream)


@dataclass
class Evaluation:
    batch_time: np.ndarray
    compute: np.ndarray
    comm: np.ndarray
    exposed_comm: np.ndarray
    memory: Memory
    memory_limit: float
    feasible: np.ndarray
    reason_code: np.ndarray  # -1 feasible, 0.. index into reasons
    reasons: list  # templates
    flops_per_gpu: np.ndarray  # FLOP per step per GPU, the paper's accounting (recompute included)
    extrapolated: np.ndarray
    detail: dict = field(default_factory=dict)


def _zero(n):
    return 0.0  # a scalar broadcasts for free


def overlapped(a, b, eta: float = 1.0, slow: float = 0.0):
    """Two activities run side by side: max(a, b) when they share nothing (eta 1), their sum when
    the one cannot progress while the other runs (eta 0, e.g. CPU ranks with no core to spare for a
    background collective). With slow > 0 (GPU profiles) compute a runs 1 + slow times slower while
    collective b runs beside it: max(b, a + b * slow / (1 + slow)) in place of max(a, b)."""
    if not slow:
        return a + b - eta * np.minimum(a, b)
    slowed = np.maximum(b, a + b * (slow / (1 + slow)))
    return slowed if eta == 1 else (1 - eta) * (a + b) + eta * slowed  # eta 1 (GPUs): no extra array pass


def run_windows(prefix, block, suffix, n_blocks: int, oag: bool, ors: bool, record: list | None = None,
                eta: float = 1.0, slow: float = 0.0, parts: dict | None = None):
    """Total time of prefix + block * n_blocks + suffix, with identical blocks evaluated once.
    parts (a dict) receives the prefix's time (with the first all-gather), one interior block's, the
    last block's and the suffix's: total = prefix + block * (n_blocks - 1) + last + suffix."""

    def window_time(w: Window, nxt: Window | None):
        if oag:
            z = (nxt.ag if nxt is not None else 0.0) + (w.rs if ors else 0.0)
            return overlapped(w.compute + w.blocking + (0.0 if ors else w.rs), z, eta, slow)
        if ors:
            return w.ag + overlapped(w.compute + w.blocking, w.rs, eta, slow)
        return w.ag + w.compute + w.blocking + w.rs

    total = prefix[0].ag if oag else 0.0
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


def evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, overlap: bool = True,
             blas_tuning: bool | None = None, explain: bool = False) -> Evaluation:
    """Batch time, compute, communication, memory and feasibility of every candidate, as arrays."""
    h = len(c) // 2
    paired = (not explain and h > 0 and len(c) == 2 * h and not c.checkpointing[:h].any()
              and c.checkpointing[h:].all()
              and all(np.array_equal(getattr(c, f)[:h], getattr(c, f)[h:]) for f in CANDIDATE_FIELDS[:-1]))
    with np.errstate(divide="ignore", invalid="ignore"):  # rows with a zero-sized shard are infeasible anyway
        if not paired:
            return _evaluate(model, profile, job, c, c.checkpointing, overlap, blas_tuning, explain)
        # the second half is the first with checkpointing on: evaluate once, broadcast over [off, on]
        ev = _evaluate(model, profile, job, c.take(slice(0, h)), np.array([[False], [True]]), overlap, blas_tuning,
                       False)

    def flat(x):
        return np.broadcast_to(x, (2, h)).reshape(-1)

    mem = ev.memory.map(flat)
    return Evaluation(flat(ev.batch_time), flat(ev.compute), flat(ev.comm), flat(ev.exposed_comm), mem,
                      ev.memory_limit, flat(ev.feasible), flat(ev.reason_code), ev.reasons, flat(ev.flops_per_gpu),
                      flat(ev.extrapolated), {})


def _evaluate(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, ck, overlap: bool,
              blas_tuning: bool | None, explain: bool) -> Evaluation:
    """ck broadcasts against the candidate arrays: c.checkpointing itself, or [[False], [True]] for both."""
    tuning = profile.blas_tuning if blas_tuning is None else blas_tuning
    n = len(c)
    S = job.seq_len
    e = profile.dtype_bytes
    gx, gy, gz, gd, mb = c.gx, c.gy, c.gz, c.gdata, c.micro_batch
    grad_acc = np.maximum(job.global_batch // np.maximum(gd * gz * mb, 1), 1)
    T = (mb * S).astype(np.float64)

    # ---- per layer: GEMMs and collectives --------------------------------------------
    lins = model.block_linears()
    gem = [K.linear_gemms(profile, lin, gx, gy, T, tuning) for lin in lins]
    lm = model.lm_head()
    gem_lm = K.linear_gemms(profile, lm, gx, gy, T, tuning)
    attn_f, attn_b = K.attention_seconds(profile, model, gy, mb, S)
    # element-wise kernels as the trainer issues them (compute.elementwise_work, traced equal by runtime/optrace.py)
    ew = K.elementwise_work(model, gx, gy, gz, mb, S, e, grad_acc, prefetch=overlap,
                            fused=profile.elementwise_kernels == "fused")
    ew_f, ew_b = ew.block_fwd.seconds(profile), ew.block_bwd.seconds(profile)
    casts = [c.seconds(profile) for c in ew.gather_casts]  # each layer's gathered weight cast, where it is used
    ew_emb_f, ew_emb_b = ew.emb_fwd.seconds(profile), ew.emb_bwd.seconds(profile)
    ew_head_f, ew_head_b = ew.head_fwd.seconds(profile), ew.head_bwd.seconds(profile)
    eta = profile.overlap
    slow = profile.physics.overlap_slowdown
    g = C.place(profile, c)
    if profile.coll_table is not None:
        # measured collectives depend on the compute before each call (ranks sharing cores): the
        # micro-batch's compute over its calls
        comp0 = ((sum(gm.fwd + gm.dgrad + gm.wgrad for gm in gem) + attn_f + attn_b + ew_f + ew_b + 2 * sum(casts))
                 * model.n_layers + ew_emb_f + ew_emb_b + gem_lm.fwd + gem_lm.dgrad + gem_lm.wgrad + ew_head_f + ew_head_b)
        calls = C.calls_per_micro_batch(model, g)
        g = dataclasses.replace(g, burst=comp0 / np.maximum(calls, 1.0))
    col = [C.linear_collectives(profile, g, lin, T, e) for lin in lins]
    col_lm = C.linear_collectives(profile, g, lm, T, e)
    col_emb = C.embedding_collectives(profile, g, model, T, e)
    norm_f, norm_b = C.norm_collectives(profile, g, model, T, "norm")
    loss_c = C.loss_collectives(profile, g, T)
    t_loss = loss_c[0].seconds + loss_c[1].seconds
    extrapolated = np.zeros(n, dtype=bool)
    for gm in gem + [gem_lm]:
        extrapolated |= gm.extrapolated

    # forward windows of one block: norm1+qkv+attention, attn_out+residual, norm2+fc1+act, fc2+residual
    half_f = ew_f / 2
    extra_f = [attn_f + half_f, 0.0, half_f, 0.0]
    norm_block_f = [norm_f.seconds, 0.0, norm_f.seconds, 0.0]
    fwd_block = [Window(lin.name, gem[i].fwd + extra_f[i] + casts[i], col[i]["ar_fwd"].seconds + norm_block_f[i],
                        col[i]["ag"].seconds, _zero(n)) for i, lin in enumerate(lins)]
    emb_f = Window("embedding", ew_emb_f, col_emb["ar_fwd"].seconds, col_emb["ag"].seconds, _zero(n))
    lm_f = Window("lm_head", gem_lm.fwd + ew_head_f, col_lm["ar_fwd"].seconds + norm_f.seconds
                  + t_loss, col_lm["ag"].seconds, _zero(n))

    # backward windows
    half_b = ew_b / 2
    extra_b = [attn_b + half_b, 0.0, half_b, 0.0]

    def bwd_window(i, with_ag):
        gm, cl = gem[i], col[i]
        ar = cl["ar_bwd"].seconds
        exposed_ar = overlapped(gm.wgrad, ar, eta, slow) - gm.wgrad if overlap else ar
        return Window(lins[i].name, gm.dgrad + gm.wgrad + extra_b[i] + (casts[i] if with_ag else 0.0), exposed_ar + norm_block_f[i],
                      cl["ag"].seconds if with_ag else _zero(n), cl["rs"].seconds)

    ar_lm = col_lm["ar_bwd"].seconds
    lm_b = Window("lm_head", gem_lm.dgrad + gem_lm.wgrad + ew_head_b,
                  (overlapped(gem_lm.wgrad, ar_lm, eta, slow) - gem_lm.wgrad if overlap else ar_lm) + norm_b.seconds,
                  col_lm["ag"].seconds, col_lm["rs"].seconds)
    emb_b = Window("embedding", ew_emb_b, _zero(n), _zero(n), col_emb["rs"].seconds)

    rec_f = [] if explain else None
    rec_b = [] if explain else None
    rec_bc = [] if explain else None
    L = model.n_layers
    t_fwd = run_windows([emb_f], fwd_block, [lm_f], L, overlap, overlap, rec_f, eta, slow)
    bwd_plain = [bwd_window(i, True) for i in reversed(range(4))]
    parts_plain, parts_ck = {}, {}
    t_bwd_plain = run_windows([lm_b], bwd_plain, [emb_b], L, overlap, overlap, rec_b, eta, slow, parts_plain)
    recompute = [Window(w.name + " (recompute)", w.compute, w.blocking, w.ag, w.rs) for w in fwd_block]
    bwd_ck = recompute + [bwd_window(i, False) for i in reversed(range(4))]
    t_bwd_ck = run_windows([lm_b], bwd_ck, [emb_b], L, overlap, overlap, rec_bc, eta, slow, parts_ck)
    t_bwd = np.where(ck, t_bwd_ck, t_bwd_plain)

    # ---- compute and communication totals per micro-batch ------------------------------------
    comp_block_f = sum(w.compute for w in fwd_block)
    comp_block_b = sum(gm.dgrad + gm.wgrad for gm in gem) + attn_b + ew_b + np.where(ck, 0.0, sum(casts))
    comp_mb = (comp_block_f * (1 + ck) + comp_block_b) * L + emb_f.compute + lm_f.compute + lm_b.compute + emb_b.compute
    # two all-gathers per layer either way: forward and backward, or forward and recompute (kept for backward)
    comm_block = sum(cl["ar_fwd"].seconds * (1 + ck) + cl["ar_bwd"].seconds + 2 * cl["ag"].seconds + cl["rs"].seconds
                     for cl in col)
    comm_block = comm_block + norm_f.seconds * 2 * (1 + ck) + norm_b.seconds * 2
    comm_mb = (comm_block * L + sum(v.seconds for v in col_emb.values()) + col_lm["ar_fwd"].seconds
               + col_lm["ar_bwd"].seconds + 2 * col_lm["ag"].seconds + col_lm["rs"].seconds
               + norm_f.seconds + norm_b.seconds + t_loss)

    # ---- per step: data-parallel gradients and the optimizer ------------------------------------
    block_elems = [(lin.k // (gx if not lin.transposed else gy)) * (lin.n // (gy if not lin.transposed else gx)) for lin in lins]
    lm_elems = (lm.k // gx) * (lm.n // gy)
    emb_elems = (model.padded_vocab // gy) * (model.hidden // gx)
    shard = sum(C.shard_elems(b, gz) for b in block_elems) * L + C.shard_elems(lm_elems, gz) + C.shard_elems(emb_elems, gz)
    replicated = (2 * L + 1) * model.hidden / gx + (S * model.hidden / gx if model.position == "learned" else 0)
    t_opt = K.optimizer_seconds(profile, K.step_work(model, gx, gy, gz, gd, mb, S, grad_acc, shard,
                                                     K.fused_optimizer(profile)))
    g_step = g
    if profile.coll_table is not None:
        # the once-per-step calls: the first after the backward's tail (a whole micro-batch when no
        # collective ran in it), the loss after the optimizer, the rest back to back
        g_step = (dataclasses.replace(g, burst=np.where(calls > 0, g.burst, comp0)),
                  dataclasses.replace(g, burst=t_opt), dataclasses.replace(g, burst=0.0))
    overlap_dp = overlap and OVERLAP_DP
    plan = None
    if overlap_dp:  # the trainer's buckets, one definition: comm.gradient_buckets
        plan = C.gradient_buckets(sum(C.shard_elems(b, gz) for b in block_elems), C.shard_elems(lm_elems, gz),
                                  C.shard_elems(emb_elems, gz), L)
    step_colls = C.data_parallel_collectives(profile, g_step, shard.astype(np.float64), replicated,
                                             plan.rows if plan else None)
    comm_dp = sum(s.seconds * s.calls for s in step_colls)
    n_grad = len(plan.rows) if plan else 1
    t_others = sum(s.seconds for s in step_colls[n_grad:])
    t_grad = step_colls[0].seconds
    t_dp_hidden = 0.0
    if overlap_dp:
        # D stream beside the last backward; a shard is final when its reduce-scatter is collected: at
        # once without ORS or Z, else about max_inflight reduce-scatters (of 4 per block) later
        lag = np.where(gz > 1, min(MAX_INFLIGHT_RS / 4, 1.0), 0.0)
        part = {k: np.where(ck, parts_ck[k], parts_plain[k]) for k in parts_plain}
        (s1, sm, sl), (cm, cl) = (x.seconds for x in step_colls[:3]), (x.calls for x in step_colls[1:3])
        tail = data_parallel_tail(t_bwd, part["prefix"], part["block"], lag, plan.first_blocks, plan.per_bucket,
                                  plan.middle, plan.single, s1, sm, sl, cl)
        t_dp_hidden = s1 + cm * sm + cl * sl - tail
        # what runs beside the backward still costs (1 - eta) of itself (shared cores), or slows the GEMMs;
        # one bucket of everything is launched at the backward's end: the blocking call, exactly
        t_grad = np.where(plan.single, s1, tail + overlapped(t_bwd, t_dp_hidden, eta, slow) - t_bwd)
        t_dp_hidden = np.where(plan.single, 0.0, t_dp_hidden)
    t_dp = t_grad + t_others

    batch = grad_acc * (t_fwd + t_bwd) + t_dp + t_opt + profile.corrections.step_overhead_s
    compute_total = grad_acc * comp_mb + t_opt
    comm_total = grad_acc * comm_mb + comm_dp
    exposed = np.maximum(batch - compute_total - profile.corrections.step_overhead_s, 0.0)

    # ---- memory ------------------------------------------------------------------------------------
    # memory depends on (gx, gy, gz, micro-batch, checkpointing) only: evaluated once per distinct row
    ck_rows = np.broadcast_to(ck, np.shape(gx)) if np.ndim(ck) <= 1 else np.zeros(np.shape(gx), dtype=bool)
    first, inverse = distinct_rows(gx, gy, gz, mb, ck_rows)

    def pick(x):
        return x[first] if np.ndim(x) else x

    mem = memory(model, pick(gx), pick(gy), pick(gz), pick(T), ck if np.ndim(ck) > 1 else pick(ck),
                 pick(shard.astype(np.float64)), pick(replicated), [pick(b) for b in block_elems], pick(lm_elems),
                 pick(emb_elems), e, prefetch=overlap, max_inflight_rs=MAX_INFLIGHT_RS if overlap else 0,
                 breakdown=explain)
    mem = mem.map(lambda a: a[..., inverse])
    limit = profile.mem_capacity - profile.mem_headroom

    # ---- feasibility, first failing rule wins -----------------------------------------------
    rules = divisibility_masks(model, job.global_batch, S, c)
    reasons = [t for _, t in rules] + ["needs {mem:.1f} GiB per GPU, more than {limit:.1f} GiB available"]
    code = np.full(np.broadcast(ck, gx).shape, -1, dtype=np.int64)
    for i, (mask, _) in reversed(list(enumerate(rules + [(mem.total > limit, "")]))):
        code = np.where(mask, i, code)
    feasible = code < 0

    flops_token = np.where(ck, model.flops_per_token(S, recompute=True), model.flops_per_token(S, recompute=False))
    flops_gpu = flops_token * job.tokens_per_batch / job.gpus

    detail = {}
    if explain:
        detail = {"fwd": rec_f, "bwd": rec_b, "bwd_ckpt": rec_bc, "step": step_colls, "grad_acc": grad_acc,
                  "collectives": {"block": col, "lm_head": col_lm, "embedding": col_emb},
                  "norm": (norm_f, norm_b), "loss": loss_c, "groups": g, "t_fwd": t_fwd, "t_bwd": t_bwd,
                  "t_dp": t_dp, "t_dp_hidden": t_dp_hidden, "t_opt": t_opt, "gemm": gem, "gemm_lm": gem_lm, "attention": (attn_f, attn_b)}
    return Evaluation(batch, compute_total, comm_total, exposed, mem, limit, feasible, code, reasons, flops_gpu,
                      extrapolated, detail)
