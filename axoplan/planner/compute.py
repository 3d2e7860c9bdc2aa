"""Compute: GEMM time per shape from the profile, attention from its FLOP, element-wise work from the
bytes it moves, and a fixed cost per kernel launch. All per micro-batch unless named otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from axoplan.planner.execution import AXOPLAN, Execution
from axoplan.planner.machine import MachineProfile
from axoplan.planner.specs import LinearShape, ModelSpec
from axoplan.planner.rows import repeated_rows


@dataclass
class GemmTimes:
    fwd: np.ndarray
    dgrad: np.ndarray  # dI = dO W^T
    wgrad: np.ndarray  # dW = I^T dO
    extrapolated: np.ndarray
    shapes: dict  # "fwd" | "dgrad" | "wgrad" -> (m, n, k) of C[m, n] = A[m, k] B[k, n], per candidate
    layouts: dict  # "fwd" | "dgrad" | "wgrad" -> NN, NT, TN as written, or "best" where BLAS tuning picks

    def take(self, index) -> GemmTimes:
        """The same GEMMs for candidates index (rows of the arrays they were evaluated on)."""
        def pick(x):
            return x[index] if np.ndim(x) else x

        return GemmTimes(pick(self.fwd), pick(self.dgrad), pick(self.wgrad), pick(self.extrapolated),
                         {w: tuple(pick(x) for x in mnk) for w, mnk in self.shapes.items()}, self.layouts)


def block_gemms(profile: MachineProfile, lins: list, gx, gy, tokens, tuning: bool) -> list[GemmTimes]:
    """linear_gemms of each of lins, evaluated once per distinct (gx, gy, tokens): orders and checkpointing
    repeat each grid and micro-batch many times."""
    rows = repeated_rows(gx, gy, tokens)
    if rows is not None:
        first, inverse = rows
        cols = np.broadcast_arrays(*(np.asarray(a) for a in (gx, gy, tokens)))
        return [linear_gemms(profile, lin, *(c[first] for c in cols), tuning).take(inverse) for lin in lins]
    return [linear_gemms(profile, lin, gx, gy, tokens, tuning) for lin in lins]


def linear_gemms(profile: MachineProfile, lin: LinearShape, gx, gy, tokens, tuning: bool) -> GemmTimes:
    """Local GEMMs of one layer: [T, k/g_in] x [k/g_in, n/g_out] and its two backward products."""
    k, n = lin.local(gx, gy)
    lay = (None, None, None) if tuning else ("NN", "NT", "TN")
    f, e1 = profile.gemm_seconds(tokens, n, k, lay[0])
    d, e2 = profile.gemm_seconds(tokens, k, n, lay[1])
    w, e3 = profile.gemm_seconds(k, n, tokens, lay[2])
    return GemmTimes(f, d, w, e1 | e2 | e3, {"fwd": (tokens, n, k), "dgrad": (tokens, k, n), "wgrad": (k, n, tokens)},
                     dict(zip(("fwd", "dgrad", "wgrad"), (x or "best" for x in lay))))


def unaligned_dims(profile: MachineProfile, model: ModelSpec, gx: int, gy: int, tokens: int, unfused: bool) -> list:
    """(GEMM, dimension) of one configuration's GEMMs whose size is not a whole number of 16-byte vectors, which
    the profile's compute.gemm.unaligned_tflops caps (MachineProfile.gemm_seconds); [] where it has none."""
    if profile.gemm_unaligned is None or profile.gemm_table is not None:
        return []
    dims = [("tokens", tokens)]
    for lin in [*model.block_linears(), model.lm_head()]:
        k, n = lin.local(gx, gy)
        dims += [(f"{lin.name} in", k), (f"{lin.name} out", n)]
    if unfused:
        dims.append(("attention head size", model.head_dim))
    return [(name, float(d)) for name, d in dims if profile.unaligned(d)]


def attention_seconds(profile: MachineProfile, model: ModelSpec, gy, micro_batch, seq_len) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of the local attention over n_heads/gy heads: from the profile's
    attention table where it measured the local sequence and head size (the shape itself, or
    interpolated over batch x heads: AttentionTable.seconds), else its FLOP at the profile's rate: the
    throughput table's at this sequence length and head size where the profile has one (GPU profiles),
    backward FLOP = backward_factor x forward at the table's backward rate."""
    heads = model.n_heads // np.asarray(gy)
    flop = 4.0 * micro_batch * seq_len * seq_len * model.head_dim * heads
    if profile.attn_causal_skip:
        flop = flop / 2
    scale = profile.corrections.gemm_scale
    rates = profile.physics.attention_rates(seq_len, model.head_dim)
    if rates is None:
        fwd = flop / (profile.attn_flops * scale)
        bwd = fwd * profile.attn_bwd_factor
    else:
        # the kernel's measured rate at this sequence and head size (short sequences waste causal tiles)
        fwd = flop / (rates[0] * scale)
        bwd = flop * profile.attn_bwd_factor / (rates[1] * scale)
    tab = profile.attn_table
    if tab is not None:
        mb_b, h_b = np.broadcast_arrays(np.asarray(micro_batch), heads)
        fwd, bwd = np.array(np.broadcast_to(fwd, mb_b.shape), float), np.array(np.broadcast_to(bwd, mb_b.shape), float)
        for b, h in set(zip(mb_b.ravel().tolist(), h_b.ravel().tolist())):
            hit = tab.seconds(int(b), int(h), int(seq_len), model.head_dim)
            if hit:
                m = (mb_b == b) & (h_b == h)
                fwd[m], bwd[m] = hit[0] / scale, hit[1] / scale
    return fwd, bwd


@dataclass
class UnfusedAttention:
    """The attention core as batched GEMMs and element-wise kernels over the [batch x heads, S, S] scores
    (Execution.attention 'unfused'), per micro-batch: forward and backward seconds, their element-wise
    bytes and launches."""

    fwd: np.ndarray
    bwd: np.ndarray
    fwd_work: Work
    bwd_work: Work


def _batched_gemm(profile: MachineProfile, batch, m, n, k) -> np.ndarray:
    """One strided-batched GEMM call of `batch` products C[m,n] = A[m,k] B[k,n]: each product's time
    (the best layout) once per product, one launch for the call; the products' tiles share the waves."""
    t, _ = profile.gemm_seconds(m, n, k, None, batch=batch)
    return batch * (t - profile.launch_cost) + profile.launch_cost


def unfused_attention(profile: MachineProfile, model: ModelSpec, gy, micro_batch, seq_len: int, dtype_bytes: int,
                      dropout: bool) -> UnfusedAttention:
    """Megatron's CoreAttention before FlashAttention over the local heads: forward Q K^T ([S, d] x [d, S] per
    batch and head), one scale-mask-softmax kernel (reads and writes the scores), dropout (reads them,
    writes its output and a one-byte mask), then P V ([S, S] x [S, d]); backward dP = dO V^T and dV = P^T dO,
    the dropout's and the softmax's backward, dQ = dS K and dK = dS^T Q. The whole S x S is computed (the
    causal mask is applied, not skipped)."""
    B = np.asarray(micro_batch, dtype=np.float64) * (model.n_heads // np.asarray(gy))
    S, d, e = float(seq_len), float(model.head_dim), dtype_bytes
    scores = B * S * S  # elements of one [batch x heads, S, S] tensor
    qk = _batched_gemm(profile, B, S, S, d)  # Q K^T, and dP = dO V^T (the same shape)
    pv = _batched_gemm(profile, B, S, d, S)  # P V, and dV, dQ, dK (each [S, d] from a k = S product)
    fwd_work = Work(2 * e * scores, 1) + Work((2 * e + 1) * scores, 1) * dropout
    bwd_work = Work(3 * e * scores, 1) + Work((2 * e + 1) * scores, 1) * dropout
    return UnfusedAttention(qk + pv + fwd_work.seconds(profile), qk + 3 * pv + bwd_work.seconds(profile),
                            fwd_work, bwd_work)


def elementwise_seconds(profile: MachineProfile, nbytes) -> np.ndarray:
    bw = profile.mem_bandwidth * profile.elementwise_efficiency * profile.corrections.elementwise_scale
    return np.asarray(nbytes, dtype=np.float64) / bw


class Work:
    """Element-wise bytes moved and kernels launched (arrays over candidates, or scalars)."""

    __slots__ = ("bytes", "kernels")

    def __init__(self, nbytes=0.0, kernels=0.0):
        self.bytes, self.kernels = nbytes, kernels

    def _zero(self) -> bool:
        return np.ndim(self.bytes) == 0 and np.ndim(self.kernels) == 0 and self.bytes == 0 and self.kernels == 0

    def __add__(self, other):
        # zeros (sum()'s 0, terms switched off) are skipped: the planner adds these over 10^5 candidates
        if isinstance(other, int) and other == 0 or other._zero():
            return self
        if self._zero():
            return other
        return Work(self.bytes + other.bytes, self.kernels + other.kernels)

    __radd__ = __add__

    def __mul__(self, k):
        if np.ndim(k) == 0 and k in (0, 1):  # a switch (dtype, position kind): no array arithmetic
            return self if k == 1 else Work()
        return Work(self.bytes * k, self.kernels * k)

    __rmul__ = __mul__

    def seconds(self, profile: MachineProfile):
        return elementwise_seconds(profile, self.bytes) + self.kernels * profile.launch_cost


def _norm_fwd(kind: str, T, hx, e: int) -> Work:
    """The exact sharded norm's forward (runtime/norm.py): fp32 statistics of x [T, H/gx], in and out casts."""
    # layernorm: sum, x*x, sum, cat, 2 div, mean^2, sub, clamp, +eps, rsqrt, -mean, *rstd, *w; rms: no mean, zeros
    w = Work(40 * T * hx + 92 * T + 4 * hx, 14) if kind == "layernorm" else Work(36 * T * hx + 40 * T + 4 * hx, 9)
    return w + Work(2 * (e + 4) * T * hx, 2) * (e != 4)


def _norm_bwd(kind: str, T, hx, e: int) -> Work:
    # xhat again (sub, mul), g = dy*w, dw = sum(dy*xhat), the per-token sums (cat for layernorm), dx in 4 to 5 ops
    w = Work(104 * T * hx + 52 * T + 8 * hx, 15) if kind == "layernorm" else Work(92 * T * hx + 20 * T + 8 * hx, 11)
    return w + Work(3 * (e + 4) * T * hx, 3) * (e != 4)


def _accumulate(s, nb, gz, e: int, grad_e: int, mode: str = "fp32") -> Work:
    """A weight's gradient block [nb] (dtype grad_e) into its fp32 shard [s]: padding for the
    reduce-scatter when gz does not divide it, the cast to the collective dtype, the cast back, add_.
    mode (Execution.gradient_accumulation): fused, no cast back nor add (the dW GEMM accumulates); compute,
    an add in the compute dtype and no cast."""
    split = np.asarray(gz) > 1
    pad = Work(grad_e * nb + grad_e * s * gz, 1) * (split & (s * gz != nb))
    to_coll = Work((grad_e + e) * s * gz, 1) * split * (grad_e != e)
    if mode == "fused":
        return pad + to_coll
    if mode == "compute":
        return pad + to_coll + Work(3 * e * s, 1)
    back = Work((e + 4) * s, 1) * np.where(split, e != 4, grad_e != 4)
    return pad + to_coll + back + Work(12 * s, 1)


def _rope_fwd(P, r, S, e: int) -> Work:
    """apply_rope on one of q, k: P = batch x heads x sequence rows of r = head_dim / 2 pairs."""
    # 4 products with the [S, r] tables, sub, add, cat; in half precision two casts in and one out
    return Work(72 * P * r + 16 * S * r, 7) + Work(4 * (e + 4) * P * r, 3) * (e != 4)


def _rope_bwd(P, r, S, e: int) -> Work:
    # 4 products, neg, 2 adds, the two halves' slice_backward (zero-filled full width) and their sum
    return Work(64 * P * r + 16 * S * r + 12 * e * P * r, 10) + Work(4 * (e + 4) * P * r, 3) * (e != 4)


@dataclass
class ElementwiseWork:
    """The non-GEMM, non-attention kernels of one micro-batch as the bundled trainer issues them
    (runtime/model.py, norm.py, loss.py, parallel_linear.py; traced equal by runtime/optrace.py):
    one block's forward (the recompute repeats it) and backward, the half-precision casts of the four
    weight gathers of a block (in the forward, and again in the backward unless checkpointing kept
    them), and outside the blocks the embedding's and the head's (final norm, LM head, loss) forward
    and backward."""

    block_fwd: Work
    block_bwd: Work
    gather_casts: list  # one Work per block linear: its gathered weight cast to the compute dtype
    emb_fwd: Work
    head_fwd: Work
    head_bwd: Work
    emb_bwd: Work
    shift: Work  # under checkpointing with prefetch: the cast of the last block's first weight, launched in the backward

    def take(self, index) -> ElementwiseWork:
        """The same work for candidates index (rows of the arrays it was evaluated on)."""
        def pick(w: Work) -> Work:
            return Work(*(x[index] if np.ndim(x) else x for x in (w.bytes, w.kernels)))

        return ElementwiseWork(pick(self.block_fwd), pick(self.block_bwd), [pick(c) for c in self.gather_casts],
                               pick(self.emb_fwd), pick(self.head_fwd), pick(self.head_bwd), pick(self.emb_bwd),
                               pick(self.shift))

    def phases(self, n_layers: int, checkpointing, grad_acc=1) -> dict:
        """Per step: forward, recompute and backward (the step phase is step_work's)."""
        casts = sum(self.gather_casts)
        fwd = (self.block_fwd + casts) * n_layers + self.emb_fwd + self.head_fwd
        rec = ((self.block_fwd + casts) * n_layers + self.shift * (-1)) * checkpointing
        bwd = ((self.block_bwd + casts * (1 - checkpointing)) * n_layers + self.head_bwd + self.emb_bwd
               + self.shift * checkpointing)
        return {"forward": fwd * grad_acc, "recompute": rec * grad_acc, "backward": bwd * grad_acc}


def elementwise_work(model: ModelSpec, gx, gy, gz, micro_batch, seq_len: int, dtype_bytes: int, grad_acc=1,
                     prefetch: bool = True, execution: Execution = AXOPLAN) -> ElementwiseWork:
    """Bytes and launches of the trainer's element-wise kernels for a compute dtype of dtype_bytes
    (collectives in the same dtype); fp32 statistics, losses and master weights whatever it is. The
    execution's sequence parallelism splits the norms and residual adds over Y; its low-precision weight
    copy removes the casts where weights are used (one cast per step instead: step_work)."""
    rows = repeated_rows(gx, gy, gz, micro_batch, grad_acc)
    if rows is not None:  # orders and checkpointing repeat each (grid, micro-batch): evaluate each once
        first, inverse = rows
        cols = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (gx, gy, gz, micro_batch, grad_acc)))
        w = _elementwise_work(model, *(c[first] for c in cols[:4]), seq_len, dtype_bytes, cols[4][first], prefetch,
                              execution)
        return w.take(inverse)
    return _elementwise_work(model, gx, gy, gz, micro_batch, seq_len, dtype_bytes, grad_acc, prefetch, execution)


def _elementwise_work(model: ModelSpec, gx, gy, gz, micro_batch, seq_len: int, dtype_bytes: int, grad_acc,
                      prefetch: bool, execution: Execution = AXOPLAN) -> ElementwiseWork:
    e, S = dtype_bytes, seq_len
    half = e != 4
    cast = half and execution.weights == "fp32-cast"  # weights cast to the compute dtype where they are used
    T = np.asarray(micro_batch) * S * 1.0
    Ts = T / execution.sequence_split(gy)  # tokens of a norm or residual add on this rank
    hx = model.hidden / np.asarray(gx)
    hd, r = model.head_dim, model.head_dim / 2
    hq, hkv = model.n_heads / np.asarray(gy), model.kv_heads / np.asarray(gy)
    f = model.ffn / np.asarray(gy)
    later = (np.asarray(grad_acc) - 1) / np.asarray(grad_acc)  # AccumulateGrad adds from the 2nd micro-batch on

    def shard(lin):
        k, n = lin.local(gx, gy)
        return -(-(k * n) // gz), k * n

    lins = model.block_linears()
    casts = [Work((4 + e) * shard(lin)[0], 1) * cast for lin in lins]
    red = execution.reduce_bytes(e)  # the gradient reduce-scatter's dtype
    mode = execution.gradient_accumulation
    acc = sum(_accumulate(*shard(lin), gz, red, e, mode) for lin in lins)

    rope = model.position == "rope"
    attn_f = Work()
    attn_b = Work(2 * e * T * model.qkv_out / np.asarray(gy), 1)  # the q, k, v gradients concatenated
    if rope:
        tables = Work(40 * r + 8 * S + 20 * S * r, 9)  # recomputed per block
        attn_f = (tables + _rope_fwd(micro_batch * hq * S, r, S, e) + _rope_fwd(micro_batch * hkv * S, r, S, e)
                  + Work(2 * e * T * hq * hd, 1))  # the attention output made contiguous
        attn_b = (attn_b + _rope_bwd(micro_batch * hq * S, r, S, e) + _rope_bwd(micro_batch * hkv * S, r, S, e)
                  + Work(2 * e * T * (hq + hkv) * hd, 2))
    act_f = Work(5 * e * T * f, 2) if model.mlp == "swiglu" else Work(2 * e * T * f, 1)
    act_b = Work(13 * e * T * f, 4) if model.mlp == "swiglu" else Work(3 * e * T * f, 1)
    # the residual add, and with the execution's dropout before it a kernel writing the output and a byte mask
    residual = Work(3 * e * Ts * hx, 1) + Work((2 * e + 1) * Ts * hx, 1) * execution.dropout
    block_fwd = _norm_fwd(model.norm, Ts, hx, e) * 2 + attn_f + act_f + residual * 2
    block_bwd = (_norm_bwd(model.norm, Ts, hx, e) * 2 + attn_b + act_b + residual * 2 + acc
                 + Work(12 * hx, 1) * (2 * later))

    # outside the blocks
    V = model.padded_vocab / np.asarray(gy)
    emb_rows, emb_cols = model.embedding_local(np.asarray(gx), np.asarray(gy))
    nb_emb = emb_rows * emb_cols
    s_emb = -(-nb_emb // gz)
    s_lm, nb_lm = shard(model.lm_head())
    learned = model.position == "learned"
    rows = model.seq_len  # positions held: the model's whole context
    # ids - lo, two bounds, and, where (int64 per token), the row lookup, its mask cast and product
    emb_fwd = (Work((4 + e) * s_emb, 1) * cast + Work((79 + 2 * e) * T + 4 * e * T * hx, 9)
               + (Work((4 + e) * S * hx, 1) * cast + Work(2 * e * T * hx + e * S * hx, 1)) * learned)
    # the fp32 copy, mask, max, sub_, exp_, sum over [T, V/gy]; the target's logit; log-sum-exp; then the kept
    # sum and the step's scaling of it (part / n_kept, the seed gradient)
    loss_f = Work((36 + e) * T * V + 18 * V + 171 * T, 21) + Work(16 * T + 4, 2) + Work(28, 3)
    # tokens[:, :-1] and tokens[:, 1:] of several sequences are not flat views: reshape(-1) copies them
    rows_copy = Work(32 * T, 2) * (np.asarray(micro_batch) > 1)
    # the softmax recomputed from a second fp32 copy (copy, mask, sub_, exp_, div_), the target's -1, mul_
    loss_b = (Work(8 * T + 16, 2) + Work((44 + e) * T * V + 18 * V + 45 * T, 11)
              + Work((4 + e) * T * V, 1) * half)
    # the loss as the framework runs it: op by op over an fp32 copy as above, or one fused kernel reading the
    # logits once forward and once backward
    loss = ((Work(e * T * V, 1), Work(2 * e * T * V, 1)) if execution.loss_kernel == "fused"
            else (loss_f + rows_copy, loss_b))
    lm_cast = Work((4 + e) * s_lm, 1) * cast
    # a prefetched gather over Z casts its shard when launched, one weight early; without Z the block casts at use
    early = prefetch * (np.asarray(gz) > 1)
    head_fwd = _norm_fwd(model.norm, Ts, hx, e) + lm_cast * (1 + early) + loss[0]
    head_bwd = (loss[1] + lm_cast * (1 - early) + _accumulate(s_lm, nb_lm, gz, red, e, mode)
                + _norm_bwd(model.norm, Ts, hx, e) + Work(12 * hx, 1) * later)
    # a zero fp32 [V/gy, H/gx] gradient, the masked dout, index_add_; the step's loss sum (2 kernels) lands here too
    emb_bwd = (Work(4 * V * hx + 8 * T + 20 * T * hx + T, 3) + Work((e + 4) * T * hx, 1) * half
               + _accumulate(s_emb, nb_emb, gz, red, 4) + Work(36, 2)
               + (Work(e * T * hx + e * S * hx + 4 * S * hx + 4 * rows * hx, 2)
                  + Work((e + 4) * S * hx, 1) * half + Work(12 * rows * hx, 1) * later) * learned)
    shift = casts[0] * early
    if execution.elementwise_kernels == "fused":
        return _fused(model, T, Ts, S, hx, hq, hkv, hd, f, V, e, acc, casts, lm_cast, early, learned, later,
                      _accumulate(s_lm, nb_lm, gz, red, e, mode), _accumulate(s_emb, nb_emb, gz, red, 4), s_emb,
                      shift, cast,
                      loss, execution.dropout)
    return ElementwiseWork(block_fwd, block_bwd, casts, emb_fwd, head_fwd, head_bwd, emb_bwd, shift)


def _fused(model: ModelSpec, T, Ts, S, hx, hq, hkv, hd, f, V, e: int, acc, casts, lm_cast, early, learned, later,
           acc_lm, acc_emb, s_emb, shift, cast, loss, dropout: bool = False) -> ElementwiseWork:
    """A framework that fuses each norm, activation, rotary embedding and the loss into one kernel (its
    forward reads the inputs and writes the output once; its backward reads the inputs and the output's
    gradient and writes the input's): the same gathers, casts and gradient accumulation as the trainer."""
    norm_f, norm_b = Work(2 * e * Ts * hx, 1), Work(3 * e * Ts * hx, 1)
    rope = model.position == "rope"
    qk = (hq + hkv) * hd
    rope_f, rope_b = Work(2 * e * T * qk, 2) * rope, Work(2 * e * T * qk, 2) * rope
    swiglu = model.mlp == "swiglu"
    act_f = Work((3 if swiglu else 2) * e * T * f, 1)
    act_b = Work((5 if swiglu else 3) * e * T * f, 1)
    # the bias-dropout-add: with dropout its mask written in the forward and read in the backward, a byte each
    residual = Work(3 * e * Ts * hx, 1) + Work(Ts * hx, 0) * dropout
    block_fwd = norm_f * 2 + rope_f + act_f + residual * 2
    block_bwd = norm_b * 2 + rope_b + act_b + residual * 2 + acc + Work(12 * hx, 1) * (2 * later)
    # the embedding: the row lookup (and the learned positions' add); its gradient scattered in fp32
    emb_fwd = Work((4 + e) * s_emb, 1) * cast + Work(2 * e * T * hx, 1) + residual * learned
    emb_bwd = Work((e + 4) * T * hx, 1) + acc_emb + Work(4 * S * hx + e * T * hx, 1) * learned
    head_fwd = norm_f + lm_cast * (1 + early) + loss[0]
    head_bwd = loss[1] + lm_cast * (1 - early) + acc_lm + norm_b + Work(12 * hx, 1) * later
    return ElementwiseWork(block_fwd, block_bwd, casts, emb_fwd, head_fwd, head_bwd, emb_bwd, shift)


def fused_optimizer(profile: MachineProfile) -> bool:
    """The trainer runs AdamW as one fused kernel per group on GPUs, per tensor on CPU (the profile's kind)."""
    return profile.kind == "gpu"


def step_work(model: ModelSpec, gx, gz, gdata, micro_batch, seq_len: int, grad_acc, shard, fused: bool,
              execution: Execution = AXOPLAN, dtype_bytes: int = 2) -> Work:
    """Once per step on rank 0 (train.py train_step): the keep mask and token count, zeroing the
    gradient buffer (shard: its fp32 elements), the replicated gradients over Z and D, the global
    norm and clipping, AdamW (fused per parameter group, or per tensor: 9 kernels, and 1 more with
    weight decay), the loss. One norm weight per [H/gx] X slice; learned positions [seq_len, H/gx]."""
    hx = model.hidden / np.asarray(gx)
    L = model.n_layers
    learned = model.position == "learned"
    n_rep = 2 * L + 1 + learned
    R = (2 * L + 1) * hx + learned * model.seq_len * hx
    n_dec = 4 * L + 2  # every sharded weight decays
    seqs = np.asarray(grad_acc) * np.asarray(micro_batch) * seq_len  # this rank's tokens
    w = Work(9 * seqs + 4 + 12 + 4 * shard + 8, 5)  # keep mask cast and sum, the count in fp64, zero_, loss_sum
    # replicated gradients over Z and D: one cat, one copy_ back per tensor
    w = w + Work(16 * R, 1 + n_rep) * (np.asarray(gz) * np.asarray(gdata) > 1)
    # the norm: per tensor vector_norm, double, pow, add_ (rank 0 holds every part); the clip coefficient; mul_
    w = w + Work(8 + 4 * shard + 4 + 52 + 4 * R + 56 * n_rep, 1 + 4 * (1 + n_rep)) + Work(92, 6)
    w = w + Work(8 * shard + 4 + 8 * R + 4 * n_rep, 1 + n_rep)
    # the execution's optimizer sharding updates only this D rank's part of the shard
    own = shard / np.asarray(gdata) if execution.optimizer_sharding == "data-parallel" else shard
    if fused:  # per group: the steps' foreach add_, one kernel reading p, g, m, v and writing p, m, v
        w = w + Work(28 * (own + R) + 12 * (n_dec + n_rep), 4)
    else:  # per tensor: step, lerp_, mul_, addcmul_, .item(), sqrt, div, add_, addcdiv_ (+ mul_ with decay)
        w = w + Work(72 * (own + R) + 12 * (n_dec + n_rep) + 8 * own, 9 * (n_dec + n_rep) + n_dec)
    if execution.weights == "low-precision-copy":  # the updated fp32 masters cast once into the weights
        w = w + Work((4 + dtype_bytes) * own, 1)
    # the loss over the kept tokens, then the loss and the gradient norm read on the host for the metrics
    return w + Work(24, 1) + Work(16, 2)


def optimizer_seconds(profile: MachineProfile, work: Work) -> np.ndarray:
    return work.seconds(profile)
