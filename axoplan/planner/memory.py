"""Memory per GPU: the peak of live bytes along one training step, following each buffer the
trainer allocates and frees, in its order (not a sum of worst cases).

The step is walked through the moments where the live set can peak: the loss (fp32 logits and
their gradient), the LM head's backward, each layer of the first block the backward reaches (all
saved activations still live; under checkpointing the recomputed block and its kept weights), and
the optimizer step. At each moment the live bytes are split into kinds:

- states: fp32 weight shards, their fp32 gradients and AdamW's two moments (FSDP-style: the compute
  copy of a weight exists only while gathered), plus the replicated norm and position parameters;
- gathered weights: the block in use, the one prefetched (OAG), and under checkpointing the
  recomputed block's weights kept for its backward;
- gradient blocks: the full-size dW of the layer in backward and those whose reduce-scatter is in
  flight (at most `max_inflight_rs`, each with its padded copy and its reduced shard);
- activations: what autograd saved (per block, or only block inputs plus the recomputed block);
- logits: the LM head's output, its one fp32 copy in the loss and the gradient handed back;
- transients: activation gradients and the fp32 temporaries of the norms' backward;
- pipeline buffers: on a pipeline stage, the receive buffers its framework keeps for the activations and the
  gradients that cross the stage boundaries (pipeline_buffers); what each forward in flight keeps beyond its
  saved activations, its stage output (or on the last stage its logits), counts with those kinds.

Everything is per candidate (numpy arrays). What PyTorch and the driver add beyond tensors stays
the profile's headroom.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from axoplan.planner.execution import AXOPLAN, Execution, op_selective
from axoplan.planner.specs import ModelSpec
from axoplan.planner.comm import FP32, padded_block, shard_elems
from axoplan.planner.schedule import RECEIVE

KINDS = ("states", "gathered", "gradients", "activations", "logits", "transients", "buffers")
KIND_NAMES = {"states": "states", "gathered": "gathered weights", "gradients": "gradient blocks",
              "activations": "activations", "logits": "logits", "transients": "transients",
              "buffers": "pipeline buffers"}
# fp32 copies of a [T, H/gx] tensor live at once at the worst point of an exact norm's backward (runtime/norm.py:
# x-hat, dy, g and two temporaries of dx's expression; LayerNorm's mean term one more)
NORM_BWD_FP32_COPIES = {"layernorm": 6, "rmsnorm": 5}


@dataclass
class Memory:
    """Peak bytes per candidate and which moment that is (an index into `moments`); with the breakdown,
    the bytes live per kind at that moment (None without: ranking needs only the total)."""

    total: np.ndarray
    moment: np.ndarray
    moments: tuple = ()
    states: np.ndarray | None = None
    gathered: np.ndarray | None = None
    gradients: np.ndarray | None = None
    activations: np.ndarray | None = None
    logits: np.ndarray | None = None
    transients: np.ndarray | None = None
    buffers: np.ndarray | None = None

    def where(self, i: int) -> str:
        return self.moments[int(np.asarray(self.moment).reshape(-1)[i])]

    def map(self, f) -> Memory:
        """The same memory with f applied to every per-candidate array."""
        kinds = {k: None if getattr(self, k) is None else f(getattr(self, k)) for k in KINDS}
        return Memory(f(self.total), f(self.moment), self.moments, **kinds)


@dataclass
class _Layer:
    """One linear (or the embedding) per candidate: bytes of its gathered block, of the gradient
    block its backward makes, of what stays in flight until its reduce-scatter completes; of the reduced
    shard (part of dw, allocated once the oldest reduce-scatter in flight has made room) and of the fp32 copy
    of it made when it is added to the fp32 gradient (parallel_linear._accumulate: none where it is fp32)."""

    gathered: np.ndarray
    dw: np.ndarray
    inflight: np.ndarray
    shard_out: np.ndarray | float = 0.0
    accumulate: np.ndarray | float = 0.0


@dataclass(frozen=True)
class PipelineBuffers:
    """What one pipeline rank's framework holds for its stage boundaries, in counts per candidate: receive
    buffers of one boundary activation (or its gradient) each, how many of them are the inputs its forwards
    in flight saved (counted with the buffers, not the activations), the stage outputs and the logits its
    forwards in flight keep until their backward ends."""

    recv: np.ndarray | float = 0.0
    received_inputs: np.ndarray | float = 0.0
    outputs: np.ndarray | float = 0.0
    logits: np.ndarray | float = 0.0


NO_PIPELINE_BUFFERS = PipelineBuffers()


def pipeline_buffers(execution: Execution, pp: int, vpp: int, rank: int, m, flight) -> PipelineBuffers:
    """The buffers of pipeline rank `rank` (its virtual stages rank + k pp) with m micro-batches per step and
    `flight` the forwards of each virtual stage in flight at its peak (pipeline.peak_in_flight).

    per-micro-batch (torch.distributed.pipelining, torch 2.13 stage.py): when the schedule first runs,
    _setup_forward_recv_info gives every non-first virtual stage one activation receive buffer per micro-batch
    (the received activation is that buffer: the stage's input, saved by its first block) and
    _setup_backward_recv_info every non-last one a gradient receive buffer per micro-batch, all kept for the
    run; fwd_cache keeps each forward's output (the last stage's: its logits) until that micro-batch's backward
    has returned. per-transfer: nothing beyond the saved inputs (a receive allocated per transfer is the stage
    input; Megatron's deallocate_output_tensor frees the output once sent)."""
    if execution.pipeline_buffers != "per-micro-batch":
        return NO_PIPELINE_BUFFERS
    V = pp * vpp
    own = range(rank, V, pp)
    flight = np.asarray(flight, dtype=np.float64)
    m = np.asarray(m, dtype=np.float64)
    n_act = sum(v != 0 for v in own)
    n_grad = sum(v != V - 1 for v in own)
    return PipelineBuffers(recv=(n_act + n_grad) * m, received_inputs=sum(flight[v] for v in own if v != 0),
                           outputs=sum(flight[v] for v in own if v != V - 1),
                           logits=flight[V - 1] if V - 1 in own else 0.0)


def _layer(numel, gz, e: int, grad_bytes: int | None = None, copy: bool = False, reduce_bytes: int | None = None
           ) -> _Layer:
    numel = np.asarray(numel, dtype=np.float64)
    shard = shard_elems(numel, gz)
    padded = padded_block(numel, gz)
    sharded = gz > 1
    # gz == 1: the "gathered" block is the fp32 shard itself, cast only when computing in half precision and
    # no compute-dtype copy is kept (copy: the execution's low-precision weights, counted in the states)
    gathered = np.where(sharded, padded * e, numel * e if e != FP32 and not copy else 0.0)
    gb = e if grad_bytes is None else grad_bytes
    r = e if reduce_bytes is None else reduce_bytes  # the reduce-scatter's dtype
    # sharded: the block, its padded (or cast) copy for the reduce-scatter, and the reduced shard, allocated
    # before the call is issued; gz == 1: accumulated into the fp32 gradient at once (a cast copy in half precision)
    dw = np.where(sharded, numel * gb + np.where((padded != numel) | (gb != r), padded * r, 0.0) + shard * r,
                  numel * gb + (numel * FP32 if gb != FP32 else 0.0))
    # in flight: the full-size block (or its padded, cast copy) and the reduced shard
    inflight = np.where(sharded, padded * r + shard * r, 0.0)
    return _Layer(gathered, dw, inflight, np.where(sharded, shard * r, 0.0),
                  np.where(sharded & (r != FP32), shard * FP32, 0.0))


def memory(*args, breakdown: bool = False, **kw) -> Memory:
    """The peak over the step's moments (arguments: step_moments'), per candidate; with `breakdown`,
    the bytes of each kind at that peak too."""
    moments = step_moments(*args, **kw)
    names = tuple(moments)
    totals = np.stack(np.broadcast_arrays(*(sum(m.values()) for m in moments.values())))
    best = np.argmax(totals, axis=0)
    total = np.take_along_axis(totals, best[None], axis=0)[0]
    if not breakdown:
        return Memory(total, best, names)

    def pick(kind):
        stacked = np.stack([np.broadcast_to(np.asarray(m[kind], dtype=np.float64), total.shape)
                            for m in moments.values()])
        return np.take_along_axis(stacked, best[None], axis=0)[0]

    return Memory(total, best, names, **{k: pick(k) for k in KINDS})


def step_moments(model: ModelSpec, gx, gy, gz, tokens, checkpointing, shard_elements, replicated_elements,
                 block_elems, lm_elems, emb_elems, dtype_bytes: int, prefetch: bool, max_inflight_rs: int,
                 passes: tuple, gdata=1, execution: Execution = AXOPLAN, seq_len: int | None = None,
                 n_blocks=None, live_blocks=None, embedding: bool = True, head: bool = True,
                 buffers: PipelineBuffers = NO_PIPELINE_BUFFERS, others_blocks=0.0, received_gradient: bool = False,
                 chunk_blocks=None) -> dict:
    """moment -> kind -> live bytes per candidate, in step order. block_elems: the gathered elements of
    each block linear (qkv, attn_out, fc1, fc2) per GPU; lm_elems/emb_elems: the LM head's and the
    embedding's; shard_elements: this GPU's weight shards; replicated_elements: its norm and
    position parameters (the same states, unsharded). passes: the schedule's (schedule.py) forward and
    backward (without recompute) Pass, whose windows name the moments walked, in order. execution: the
    framework's state bytes per element (execution.state_bytes, over gdata D ranks); its sequence parallelism,
    which splits the block input, the norms' inputs and the residual stream's tensors over Y by tokens; its
    fused kernels, whose loss keeps no fp32 copy of the logits and whose norm backward writes the input
    gradient with no fp32 temporaries; its attention core (unfused: probabilities over seq_len keys, the model's
    context unless given) and its attention-core recompute. A pipeline stage (pipeline.py) holds n_blocks blocks
    (default all), the embedding and the LM head only where it says so, and when its backward starts the
    activations of live_blocks blocks are saved (its micro-batches in flight; default n_blocks); its passes
    are the stage's (Pass.stage). buffers: what its framework holds for the stage boundaries (pipeline_buffers);
    others_blocks: the blocks of its other micro-batches in flight, still saved when its blocks' backward is
    done (the embedding's); received_gradient: the gradient entering its last block is a receive buffer (no
    residual-stream gradient of its own until the MLP branch's is added); chunk_blocks: the blocks of the
    (virtual) stage whose backward is walked, after which nothing is prefetched (default n_blocks)."""
    e = dtype_bytes
    fused = execution.elementwise_kernels == "fused"
    fused_loss = execution.loss_kernel == "fused"
    T = np.asarray(tokens, dtype=np.float64)
    L = model.n_layers if n_blocks is None else np.asarray(n_blocks, dtype=np.float64)
    live = L if live_blocks is None else np.asarray(live_blocks, dtype=np.float64)
    hx = model.hidden / gx
    hd = model.head_dim
    qh = model.n_heads / gy * hd
    kvh = model.kv_heads / gy * hd
    heads = model.n_heads / gy
    f1 = model.fc1_out / gy
    ffn = model.ffn / gy
    vl = model.padded_vocab / gy
    ck = np.asarray(checkpointing)
    Ts = T / execution.sequence_split(gy)  # tokens of the residual stream's tensors on this rank

    elements = np.asarray(shard_elements, dtype=np.float64) + np.asarray(replicated_elements, dtype=np.float64)
    states = elements * execution.state_bytes(gdata, e)
    copy = execution.weights == "low-precision-copy"
    r = execution.reduce_bytes(e)
    qkv, out, fc1, fc2 = (_layer(b, gz, e, copy=copy, reduce_bytes=r) for b in block_elems)
    lm = _layer(lm_elems, gz, e, copy=copy, reduce_bytes=r)
    # the embedding's gradient is built in fp32
    emb = _layer(emb_elems, gz, e, grad_bytes=FP32, copy=copy, reduce_bytes=r)
    pre = 1.0 if prefetch else 0.0

    # ---- saved activations of one block (autograd's), per token, beyond the block input --------
    stats = 2 * 2 * FP32  # mean and rstd of both norms
    rope = (qh + kvh) * e if model.position == "rope" else 0.0  # rotated copies of q and k
    act_out = (2 * ffn if model.mlp == "swiglu" else ffn) * e  # the activation's output(s) fc2 reads
    sp = Ts / T  # the token share of what sequence parallelism splits
    # what the attention core keeps beyond q, k, v and its output, per token: FlashAttention a log-sum-exp per
    # head; unfused the softmax's probabilities over S keys per head (and the dropout's mask and output)
    unfused = execution.attention == "unfused"
    S = model.seq_len if seq_len is None else seq_len
    core = heads * S * (e + (1 + e) * execution.dropout) if unfused else heads * FP32
    saved = {  # freed in this order by the backward: fc2's input, fc1's output, fc1's input, ...
        "act": act_out, "fc1": f1 * e, "h2": (hx * e + stats / 2) * sp, "x1": hx * e * sp,
        "sdpa": (qh + 2 * kvh) * e + rope + qh * e + core, "h1": (hx * e + stats / 2) * sp,
        # the dropout masks of the attention and MLP outputs (a byte per element), freed by their layer's backward
        "mask2": hx * sp if execution.dropout else 0.0, "mask1": hx * sp if execution.dropout else 0.0,
    }
    attention_core = execution.recompute == "attention-core"
    if attention_core:  # a checkpointing block keeps all but the core's own tensors, remade before its backward
        saved["sdpa"] = np.where(ck, saved["sdpa"] - core, saved["sdpa"])
    block_saved = T * sum(saved.values())
    x_in = Ts * hx * e  # one block's input (kept per block under checkpointing)
    # under op-selective recompute each checkpointed block keeps its policy's matmul outputs and attention's
    selected = 0.0
    if attention_core:
        selected = block_saved
    elif execution.recompute == "op-selective":
        sel = op_selective(model)
        selected = T * ((sel.kept_split / gy + qh) * e + heads * FP32) + Ts * sel.kept_full * e
    # all blocks but the last, as the backward finds them when it reaches the last block
    earlier = np.where(ck, (live - 1) * (x_in + selected), (live - 1) * (x_in + block_saved))
    one_block = np.where(ck, x_in + selected, x_in + block_saved)  # what one block keeps for its backward
    final = Ts * (2 * hx * e + FP32 * 2) * head  # the final norm's input and output (the LM head's input)

    def inflight(layers):
        """Bytes still in flight when the next layer's dW appears: the last max_inflight_rs issued."""
        return sum(layer.inflight for layer in layers[-max_inflight_rs:]) if max_inflight_rs > 0 else 0.0

    # the stage boundaries' receive buffers (the inputs of the forwards in flight among them), the outputs and
    # logits the forwards in flight keep (the logits of the one in backward: the loss's own saved logits)
    bufs = buffers.recv * x_in
    held = buffers.outputs * x_in - buffers.received_inputs * x_in
    held_logits = buffers.logits * T * vl * e
    moments = {}
    only = [1.0]  # 0 where a stage has no such moment (the block before the last on a one-block stage)

    def moment(name, gathered, gradients, activations, logits=0.0, transients=0.0, in_step=True):
        kinds = {"states": states, "gathered": gathered, "gradients": gradients,
                 "activations": activations + held * in_step, "logits": logits + held_logits * in_step,
                 "transients": transients, "buffers": bufs}
        moments[name] = kinds if isinstance(only[0], float) else {k: v * only[0] for k, v in kinds.items()}

    # every block's input (or all it saved) and the final norm's
    stack = earlier + x_in + np.where(ck, 0.0, block_saved) + final
    forward, backward = passes
    layers = dict(zip(("qkv", "attn_out", "fc1", "fc2"), (qkv, out, fc1, fc2)))
    layers["lm_head"] = lm
    layers["embedding"] = _Layer(0.0, emb.dw, emb.inflight)  # its backward needs no weight
    kept = [layers[w.name].gathered for w in forward.block]  # in the order the recompute gathers them
    dres = Ts * hx * e  # the residual stream's gradient, live through the blocks
    norm_bwd = Ts * hx * (e + (0 if fused else NORM_BWD_FP32_COPIES[model.norm] * FP32))
    qkv_l = qh + 2 * kvh
    attention = qkv_l * e * 2  # attention's backward: q, k, v's gradients
    if unfused:
        attention = attention + 2 * e * heads * S  # two [S, S] gradients at a time
    if attention_core:
        attention = attention + np.where(ck, core, 0.0)  # the recomputed core
    transients = {"": 0.0, "head dI": T * hx * e, "norm": norm_bwd, "residual": dres, "fc2": T * ffn * e,
                  "fc1": T * (f1 + hx) * e, "attn_out": T * (hx + qh) * e, "attention": T * attention,
                  "qkv": T * qkv_l * e + T * hx * e}
    if fused_loss:
        # a fused cross-entropy reads the logits in their dtype, saves a log-sum-exp per token and writes
        # their gradient beside them (flash_attn.losses.cross_entropy, inplace_backward off by default)
        loss_f, loss_b = T * vl * e + T * FP32, T * vl * 2 * e + T * FP32
    else:
        # the saved logits and their one fp32 copy; backward also the gradient handed back (the copy itself
        # when the logits are fp32)
        loss_f, loss_b = T * vl * (e + FP32), T * vl * (e + FP32 + (e if e != FP32 else 0))
    # on a pipeline's last stage the logits the loss saves are the ones its forward keeps (counted held)
    own_logits = (np.asarray(buffers.logits) > 0) * T * vl * e
    logits = {"": 0.0, "loss forward": loss_f - own_logits, "loss backward": loss_b - own_logits,
              "logits gradient": T * vl * e}
    order = []  # reduce-scatters issued so far, oldest first

    def walk(windows, label, activations, then, live, block: bool, cached=None, next_block=1.0):
        """The moments of these windows in order. Without checkpointing a window holds its own weight at its
        GEMM and prefetches the next gather to come: its own before its GEMM, else the next window's (after
        the last window, `then`); in a block under checkpointing, the recomputed weights still kept and the
        next block's first. `live`: the activations still saved, freed as the moments say. `cached`: the
        weights an execution that does not reshard after the forward still holds gathered (all of them).
        next_block: 0 where no block of the same backward follows (nothing to prefetch into its recompute)."""
        windows = [w for w in windows if w.name != RECEIVE]  # a stage's gather of a split transfer: no weights
        for i, w in enumerate(windows):
            layer = layers[w.name]
            following = layers[windows[i + 1].name].gathered if i + 1 < len(windows) else then
            before_gemm = True
            for mo in w.moments:
                own = layer if mo.gemm else None
                nxt = layer.gathered if before_gemm and not mo.gemm else following
                gathered = (own.gathered if own is not None else 0.0) + nxt * pre
                if block:
                    gathered = np.where(ck, sum(kept[:mo.kept]) + kept[0] * pre * next_block, gathered)
                if cached is not None:
                    gathered = cached
                gradients = inflight(order)
                if own is not None:
                    gradients = gradients + own.dw
                    if max_inflight_rs == 0:  # reduced at once, then added to the fp32 gradient
                        gradients = gradients + own.accumulate
                    elif len(order) >= max_inflight_rs:
                        # room first: the oldest in flight is added to its fp32 gradient (a cast copy of its
                        # shard) while still held, before this one's reduced shard exists
                        oldest = order[-max_inflight_rs]
                        gradients = np.maximum(gradients, gradients - own.shard_out + oldest.accumulate)
                own_dres = dres if block else 0.0
                if block and received_gradient and label == "backward last block " and mo.name in ("fc2", "fc1", "norm2"):
                    own_dres = 0.0  # until the MLP branch's gradient joins it, the residual's is the received one
                moment(label + mo.name, gathered, gradients, activations(live), logits[mo.logits],
                       transients[mo.transient] + own_dres)
                for k in mo.frees:
                    live.pop(k)
                if mo.gemm:
                    order.append(layer)
                    before_gemm = False
                if block and mo.name == "fc2" and model.mlp == "swiglu":
                    # the product silu(gate) * up backward: fc2's input freed, silu(gate) still saved beside fc1's
                    # output; fc2's dI and the two gradients it makes, [T, ffn] each
                    moment(label + "swiglu", cached if cached is not None else
                           np.where(ck, sum(kept[:mo.kept - 1]) + kept[0] * pre * next_block, following * pre),
                           inflight(order), activations(live) + T * ffn * e, 0.0, 3 * T * ffn * e + own_dres)

    # the loss, the LM head's and the final norm's backward: the stack of activations until the LM head's
    # input is freed; the next gather is the last block's first: the recompute's (qkv) or the backward's (fc2)
    first = np.where(ck, kept[0], layers[backward.block[0].name].gathered)
    # without resharding after the forward every gathered weight stays until its own backward is done
    per_block = sum(layers[n].gathered for n in ("qkv", "attn_out", "fc1", "fc2"))

    has_head = head

    def cache(blocks, head=False):
        return (None if execution.reshard_after_forward else
                blocks * per_block + embedding * emb.gathered + head * has_head * lm.gathered)

    if execution.low_precision_grads_kept:
        # a forward after a backward (the next micro-batch's; a pipeline's steady state, every forward in flight
        # saved) while that backward's compute-dtype gradients are still kept: the end of its last block's forward
        lp_grads = elements * e
        # between that backward and the next forward each compute-dtype gradient is added into the fp32 one through
        # an fp32 copy of it, one parameter at a time (DeepSpeed bf16_optimizer.py update_hp_grads:
        # hp_grad.add_(lp.grad.to(hp_grad.dtype)), @15293139f 2022-02-28): the largest parameter's copy, the
        # other micro-batches' saved activations live (the next forward's not yet)
        largest = np.maximum.reduce([np.asarray(b, dtype=np.float64) for b in block_elems]
                                    + [np.asarray(emb_elems, dtype=np.float64) * embedding,
                                       np.asarray(lm_elems, dtype=np.float64) * head])
        moment("fp32 accumulation after a backward", kept[0] * pre, lp_grads, np.maximum(live - L, 0.0) * one_block,
               transients=FP32 * largest)
        moment("forward after a backward", kept[-1] + kept[0] * pre, lp_grads, live * one_block,
               transients=np.where(ck, T * (f1 * e + act_out), 0.0))
    walk(forward.suffix + backward.prefix, "", lambda live: stack - Ts * hx * e + sum(live.values()), first,
         {"head input": Ts * hx * e}, False, cache(L, True))

    # the last two blocks' backward, window by window; the second finds the first's reduce-scatters in flight
    # the recompute's block output, held until its backward ends (none when only the core is recomputed)
    recomputed_out = np.where(ck, x_in, 0.0) * (not attention_core)
    # a block of the chunk in backward follows these two (its weights prefetched), else the embedding or nothing
    chunk = np.asarray(L if chunk_blocks is None else chunk_blocks, dtype=np.float64)
    following = [(chunk > 1).astype(np.float64), (chunk > 2).astype(np.float64)]
    for blk, label in ((0, "last block"), (1, "block before it"))[:min(int(np.max(L)), 2)]:
        only[0] = 1.0 if blk == 0 or np.min(L) >= 2 else (np.asarray(L) >= 2).astype(np.float64)
        walk(backward.block, f"backward {label} ",
             lambda live, blk=blk: earlier - blk * one_block + x_in + T * sum(live.values()) + recomputed_out,
             layers[backward.block[0].name].gathered * following[blk], dict(saved), True, cache(L - blk),
             following[blk])

    only[0] = 1.0
    # the embedding's backward (every block done, its fp32 gradient block), then the optimizer step
    # the other micro-batches in flight keep their blocks' saved activations through it
    others = np.asarray(others_blocks, dtype=np.float64) * one_block
    walk(backward.suffix, "", lambda live: others, 0.0, {}, False, cache(0))
    if execution.data_parallel_reduce == "compute-copy":
        # the D reduction after the last backward: the fp32 gradients' compute-dtype copy (DeepSpeed
        # engine.allreduce_bucket: tensor.to(communication_data_type), @15293139f 2022-02-28; one bucket per flat
        # group of 500M+ elements, a large rank's weights one) beside them, and the last backward's compute-dtype
        # gradients where the execution keeps them
        kept_lp = elements * e * execution.low_precision_grads_kept
        moment("gradient reduction", 0.0, kept_lp, 0.0, transients=np.asarray(shard_elements, dtype=np.float64) * e,
               in_step=False)
    moment("optimizer step", 0.0, 0.0, 0.0, in_step=False)

    return moments
