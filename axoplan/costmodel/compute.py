"""Compute: GEMM time per shape from the profile, attention from its FLOP, element-wise work from the
bytes it moves, and a fixed cost per kernel launch. All per micro-batch unless named otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..machine import MachineProfile
from ..specs import LinearShape, ModelSpec
from .comm import linear_axes

# Compute kernels (not GEMMs, whose launch is part of their time; not views, which launch nothing)
# the bundled trainer dispatches, counted with benchmarks/trainer_op_counts.py (GPT block, layernorm,
# GELU): per block forward and backward (the recompute repeats the forward), outside the blocks
# (embedding, final norm, LM head, loss), and AdamW per parameter tensor plus a fixed part per step.
KERNELS_FWD_PER_BLOCK = 32
KERNELS_BWD_PER_BLOCK = 41
KERNELS_FWD_OUTSIDE = 46
KERNELS_BWD_OUTSIDE = 40
KERNELS_PER_PARAM_STEP = 11
KERNELS_STEP_FIXED = 14
# AdamW traffic per fp32 shard element: read param, grad, m, v; write param, m, v.
OPTIMIZER_BYTES_PER_ELEMENT = 28


@dataclass
class GemmTimes:
    fwd: np.ndarray
    dgrad: np.ndarray  # dI = dO W^T
    wgrad: np.ndarray  # dW = I^T dO
    extrapolated: np.ndarray


def linear_gemms(profile: MachineProfile, lin: LinearShape, gx, gy, tokens, tuning: bool) -> GemmTimes:
    """Local GEMMs of one layer: [T, k/g_in] x [k/g_in, n/g_out] and its two backward products."""
    ax_in, _ = linear_axes(lin)
    g_in, g_out = (gx, gy) if ax_in == "x" else (gy, gx)
    k = lin.k // g_in
    n = lin.n // g_out
    lay = (None, None, None) if tuning else ("NN", "NT", "TN")
    f, e1 = profile.gemm_seconds(tokens, n, k, lay[0])
    d, e2 = profile.gemm_seconds(tokens, k, n, lay[1])
    w, e3 = profile.gemm_seconds(k, n, tokens, lay[2])
    return GemmTimes(f, d, w, e1 | e2 | e3)


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


def elementwise_bytes_fwd(model: ModelSpec, gx, gy, tokens, dtype_bytes: int) -> np.ndarray:
    """Bytes moved by the non-GEMM work of one block's forward: two norms (read twice, write once),
    two residual adds, the activation, rotary embedding where used."""
    h_x = model.hidden / gx
    per_token = 2 * 3 * h_x + 2 * 3 * h_x
    per_token = per_token + (3 if model.mlp == "swiglu" else 2) * model.ffn / gy
    if model.position == "rope":
        per_token = per_token + 2 * (model.qkv_out - model.kv_heads * model.head_dim) / gy
    return tokens * per_token * dtype_bytes


def elementwise_seconds(profile: MachineProfile, nbytes) -> np.ndarray:
    bw = profile.mem_bandwidth * profile.elementwise_efficiency * profile.corrections.elementwise_scale
    return np.asarray(nbytes, dtype=np.float64) / bw


def loss_elementwise_bytes(model: ModelSpec, gy, tokens) -> np.ndarray:
    """Vocabulary-parallel softmax cross-entropy on fp32 logits: max, exp-sum, gradient."""
    return tokens * (model.padded_vocab / gy) * 4 * 5


def optimizer_seconds(profile: MachineProfile, shard_elements, n_param_tensors: int) -> np.ndarray:
    return (elementwise_seconds(profile, shard_elements * OPTIMIZER_BYTES_PER_ELEMENT)
            + (n_param_tensors * KERNELS_PER_PARAM_STEP + KERNELS_STEP_FIXED) * profile.launch_cost)
