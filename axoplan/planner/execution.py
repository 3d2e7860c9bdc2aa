"""Execution: how a training framework runs the step on a 4D grid, beyond the grid itself (Calculon's
"execution" beside its system and application). The bundled trainer is `axoplan`, the default; the other
presets describe published frameworks so that plans for them, and the published runs they measured, are
predicted with the mechanisms they really run. Each field is one mechanism; the schedule (schedule.py),
the element-wise work (compute.py) and memory (memory.py) read it, nothing else does.

`axoplan rank|explain|scale --execution NAME|FILE.yaml`; a YAML file holds any of the fields below
(`base: PRESET` starts from a preset). `axoplan emit --framework` writes a candidate for the frameworks that have a
writer (axoplan/loop/frameworks.py); `validate` runs the bundled trainer, which runs only `axoplan`.

Besides the mechanisms, an execution says what its framework can express (`grid_axes`, `placement`,
`pipeline`, `micro_batch_over_tensor`): `rank --execution X` marks every other candidate infeasible with the
reason (capability_masks; the pipeline schedules it lacks are not enumerated), so it ranks only what X can run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from axoplan.errors import UserError
from axoplan import inputs
from axoplan.runconfig import Overlap
from axoplan.yamlio import load_yaml

WEIGHTS = ("fp32-cast", "low-precision-copy")
RECOMPUTE = ("full", "op-selective", "attention-core")
ATTENTION = ("flash", "unfused")
ELEMENTWISE_KERNELS = ("eager", "fused")
GRADIENT_REDUCE = ("compute", "fp32")
DATA_PARALLEL_REDUCE = ("fp32", "compute-copy")
GRADIENT_ACCUMULATION = ("fp32", "fused", "compute")
OPTIMIZER_SHARDING = ("none", "data-parallel")
PIPELINE = ("none", "1f1b", "interleaved")
PIPELINE_BUFFERS = ("per-micro-batch", "per-transfer")


@dataclass(frozen=True)
class Execution:
    name: str = "axoplan"
    # norms, residual adds and the activations they save split over Y by tokens (Megatron's sequence
    # parallelism): each Y all-reduce becomes a reduce-scatter and an all-gather of the same ring volume, and a
    # normal layer's backward gathers its token-split input again (beside its dI GEMM)
    sequence_parallel: bool = False
    # fp32-cast: fp32 master weights, cast to the compute dtype where gathered or used (the trainer, FSDP2);
    # low-precision-copy: a compute-dtype copy kept beside the fp32 master, cast once per step after the update
    # (Megatron's Float16Module)
    weights: str = "fp32-cast"
    # none: every D rank keeps the whole shard's optimizer states and all-reduces its fp32 gradients;
    # data-parallel: the states split over D (Megatron's distributed optimizer, ZeRO-1): gradients
    # reduce-scattered, the updated compute-dtype weights all-gathered
    optimizer_sharding: str = "none"
    # with optimizer sharding, the fp32 gradients all-reduced whole over D before each rank steps its partition
    # (DeepSpeed's BF16_Optimizer in its pipeline engine: PipelineEngine._bf16_reduce_grads runs
    # buffered_allreduce_fallback over the optimizer's fp32 gradients), not reduce-scattered
    sharded_gradient_all_reduce: bool = False
    # the D gradient reduction per bucket beside the last micro-batch's backward, not after it
    overlap_grad_reduce: bool = Overlap().data_parallel
    # optimizer sharding: the D all-gather of the updated weights beside the next step's first forward
    overlap_param_gather: bool = False
    # with a pipeline, the D reductions beside its compute as Megatron-Core's schedules place them
    # (megatron/core/pipeline_parallel/schedules.py, with --overlap-grad-reduce): without interleaving the first
    # stage reduces during its last backward and the others after theirs, in the cooldown bubble; interleaved,
    # each rank reduces a model chunk's gradients once that chunk's last backward is done, beside the backward
    # passes of the chunks below it, the lowest chunk's after the rank's last; with overlap_param_gather the next
    # step's weight all-gather runs while a rank waits for its first input and beside its first forwards.
    # false: one blocking reduction after the rank's last backward (the bundled trainer, DeepSpeed's engine)
    pipeline_dp_overlap: bool = False
    # the forward's tensor-parallel collectives pipelined with their own GEMMs (Megatron --tp-comm-overlap)
    tp_comm_overlap: bool = False
    # the backward's tensor-parallel dI all-reduce beside the layer's dW GEMM (Megatron-LM's async all-reduce,
    # LinearWithGradAccumulationAndAsyncCommunication; the bundled trainer's OAR); false: after the layer's whole
    # backward, blocking (an autograd all-reduce of the input's gradient, as copy_to_tensor_model_parallel_region)
    tp_backward_overlap: bool = True
    # eager: the bundled trainer's own element-wise kernels, op for op as traced (runtime/optrace.py); fused: one
    # kernel per norm, activation, rotary embedding and the loss (Megatron's fusions, llm-foundry's), whose loss
    # keeps no fp32 copy of the logits and whose norm backward has no fp32 temporaries
    elementwise_kernels: str = "eager"
    # the loss: eager (op by op over an fp32 copy of the logits: the trainer; Megatron's vocab-parallel
    # cross-entropy without --cross-entropy-loss-fusion) or fused (one cross-entropy kernel keeping a
    # log-sum-exp per token, as flash_attn.losses.cross_entropy)
    loss_kernel: str = "eager"
    # what a checkpointing candidate recomputes in its backward. full: each block's whole forward from its
    # input (the trainer). op-selective: torchtitan's per-op policy, which keeps the output of every matmul
    # but every second one (counted in the block's order) and of attention, and recomputes the rest.
    # attention-core: Korthikanti et al.'s selective recomputation (Megatron --recompute-granularity selective):
    # everything kept but the attention core's [heads, S, S] tensors, recomputed before its backward
    recompute: str = "full"
    # the attention core. flash: one kernel that keeps no [S, S] tensor (FlashAttention, the trainer's SDPA);
    # unfused: Megatron's CoreAttention before FlashAttention: a batched QK^T GEMM, one fused scale-mask-softmax
    # kernel, the probabilities times V as a second batched GEMM, all over the whole S x S (no causal skip),
    # the probabilities kept for the backward
    attention: str = "flash"
    # GPT-3's dropout (Megatron's --attention-dropout and --hidden-dropout, default 0.1): on the attention
    # probabilities (unfused: a kernel of its own, its one-byte mask and output kept; inside a flash kernel: no
    # cost the model counts) and on the attention and MLP outputs before their residual adds, each keeping a
    # one-byte mask per element for the backward (fused kernels: in the bias-dropout-add; eager: a kernel each)
    dropout: bool = False
    # the Z-gathered weights freed after their forward and gathered again for the backward (and its recompute);
    # false: kept gathered from the forward to the end of their backward (FSDP SHARD_GRAD_OP / ZeRO-2, FSDP2
    # reshard_after_forward=False; AxoNN's weight caching of every layer)
    reshard_after_forward: bool = True
    # the dtype of the Z gradient reduce-scatter: compute (the trainer's bf16) or fp32 (gradients cast up before
    # it: FSDP2's reduce_dtype float32, torchtitan's mixed_precision_reduce default)
    gradient_reduce: str = "compute"
    # how a Linear's weight gradient joins the micro-batches' sum. fp32: cast to fp32 and added to the fp32
    # gradient after each backward (the trainer); fused: accumulated into the fp32 gradient by the dW GEMM itself
    # (Megatron's default --gradient-accumulation-fusion, wgrad_gemm_accum_fp32), no pass of its own; compute:
    # summed in the compute dtype by autograd's AccumulateGrad (DeepSpeed ZeRO-1's bf16 .grad), no cast
    gradient_accumulation: str = "fp32"
    # a checkpointing block's recompute gathers its first weight ahead, during the previous block's backward;
    # false: each recomputed block issues that gather itself and waits for it (Megatron-AxoNN's prefetch, one
    # Linear ahead, restarted per recomputed layer)
    prefetch_into_recompute: bool = True
    # the pipeline schedules the framework runs (pipeline.py): none; 1f1b; interleaved (1f1b and
    # interleaved-1f1b); the bundled trainer runs both (runtime/pipeline_stage.py, torch.distributed.pipelining)
    pipeline: str = "none"
    # the blocks must split evenly over the pp * vpp virtual stages (Megatron-LM's rule before its uneven-split
    # options); false: the first stages take one block more (pipeline.stage_blocks), which Megatron-Core places
    # with --pipeline-model-parallel-layout (emit_megatron)
    pipeline_even_split: bool = False
    # the stage-boundary transfer split over the Y ranks (each sends its 1/gy part; DeepSpeed's pipe_partitioned
    # PartitionedTensor, Megatron's scatter-gather without SP), the receiver gathering it over Y on its compute
    # stream before its forward or backward (schedule.RECEIVE)
    pipeline_p2p_split: bool = False
    # each transfer occupies its sender too (DeepSpeed's PipelineEngine: blocking p2p.send/recv instructions in
    # its schedule); false: sent beside the sender's next operation (torch.distributed.pipelining's isend)
    pipeline_blocking_p2p: bool = False
    # what the pipeline holds for its stage boundaries (memory.pipeline_buffers). per-micro-batch: torch.distributed.
    # pipelining's PipelineStage, a receive buffer per micro-batch for each boundary activation and gradient, kept,
    # and each forward's output kept until its backward; per-transfer: each receive allocated as it arrives (the
    # stage's input), each output freed once sent (Megatron's p2p_communication and deallocate_output_tensor)
    pipeline_buffers: str = "per-micro-batch"
    # how the D gradient reduction carries the fp32 gradients: fp32 (the trainer), or compute-copy: each bucket cast
    # into a compute-dtype copy, all-reduced in it and copied back (DeepSpeed engine.allreduce_bucket with
    # communication_data_type bf16, its default under bf16 without ZeRO: BLOOM's _bf16_reduce_grads), the copy
    # live beside the fp32 gradients. With gradient_accumulation 'compute' there is no fp32 gradient: the reduction
    # carries the compute-dtype one (DeepSpeed ZeRO-1's communication_data_type, fp16/bf16 by default; Megatron-LM's
    # fp16 main_grad buffers)
    data_parallel_reduce: str = "fp32"
    # the compute-dtype gradients a backward writes stay beside the fp32 accumulation until the next backward
    # starts, through the next forward (DeepSpeed's BF16_Optimizer: update_hp_grads(clear_lp_grads=False) after
    # each backward, clear_lp_grads() before the next; deepspeed/runtime/bf16_optimizer.py, pipe/engine.py), and
    # each is added into its fp32 gradient through an fp32 copy of it, one parameter at a time (update_hp_grads)
    low_precision_grads_kept: bool = False
    # the grid axes the framework can split (x, y, z, d = data); a candidate with another axis > 1 cannot run there
    grid_axes: str = "xyzd"
    # the placement it realises, innermost first (its device mesh's order; one of space.PLACEMENTS: without p the
    # pipeline axis is outermost), or "" for any: only the order of the axes > 1 counts, as an axis of size 1
    # takes no place
    placement: str = ""
    # it can also put its pipeline axis just inside data, the placement with p before d (Megatron-LM's
    # --use-tp-pp-dp-mapping: process groups in the order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp)
    pipeline_inside_data: bool = False
    # the micro-batch is split over the gx * gy tensor-parallel ranks (AxoNN's non-expert Linear layers gather
    # their X x Y group's sequences), so it must be a multiple of gx * gy
    micro_batch_over_tensor: bool = False
    source: str = "the bundled trainer (axoplan/runtime): what `emit` writes and `validate` runs"

    @property
    def pipeline_schedules(self) -> tuple:
        return {"none": (), "1f1b": ("1f1b",), "interleaved": ("1f1b", "interleaved-1f1b")}[self.pipeline]

    @property
    def bundled(self) -> bool:
        """The bundled trainer runs exactly this execution."""
        return dataclasses.replace(self, name="axoplan", source=AXOPLAN.source) == AXOPLAN

    def differences(self) -> str:
        """The fields where this execution is not the bundled trainer's, as `field=value` (for notes)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                         if f.name not in ("name", "source") and getattr(self, f.name) != getattr(AXOPLAN, f.name))

    def sequence_split(self, gy):
        """Over how many ranks a token-wise tensor between the Y-split GEMMs is split (1 without SP)."""
        return np.asarray(gy) if self.sequence_parallel else 1

    def capability_masks(self, c) -> list[tuple[np.ndarray, str]]:
        """(violated mask, reason) for every candidate of c this framework cannot express, as
        space.divisibility_masks (the reasons are formatted with the row's gx, gy, gz, gdata)."""
        from axoplan.planner.space import PLACEMENTS, layout

        rules = []
        for axis, name in (("x", "gx"), ("y", "gy"), ("z", "gz"), ("d", "gdata")):
            if axis not in self.grid_axes:
                rules.append((np.asarray(getattr(c, name)) > 1,
                              f"{self.name} cannot split {name} > 1 ({name}={{{name}}}): it has no {AXIS_NAMES[axis]}"))
        if self.placement:
            sizes = {"x": c.gx, "y": c.gy, "z": c.gz, "d": c.gdata, "p": c.pp}
            sizes = {a: np.asarray(v) for a, v in sizes.items()}
            order = np.asarray(c.order)
            owns = [layout(self.placement)]
            if self.pipeline_inside_data and "p" not in self.placement:
                owns.append(layout(self.placement + "p"))
            bad = np.zeros(np.shape(order), dtype=bool)
            present = np.bincount(np.ravel(order).astype(np.int64), minlength=len(PLACEMENTS)) > 0
            for i in np.nonzero(present)[0]:
                # the axes > 1 must come in one of the framework's orders: a pair it has the other way round clashes
                lo = layout(PLACEMENTS[i])
                hits = []
                for own in owns:
                    clash = [(a, b) for j, a in enumerate(lo) for b in lo[j + 1:] if own.index(a) > own.index(b)]
                    hits.append(np.logical_or.reduce([(sizes[a] > 1) & (sizes[b] > 1) for a, b in clash])
                                if clash else np.zeros(np.shape(order), dtype=bool))
                bad |= (order == i) & np.logical_and.reduce(hits)
            where = ("" if "p" in self.placement else
                     ", the pipeline axis outermost" + (" or just inside data" if len(owns) > 1 else ""))
            rules.append((bad, f"{self.name} places its axes {self.placement} (innermost first{where}), "
                               "not this order"))
        if self.micro_batch_over_tensor:
            tensor = np.asarray(c.gx) * np.asarray(c.gy)
            rules.append((np.asarray(c.micro_batch) % tensor != 0,
                          f"{self.name} splits each micro-batch over the gx*gy tensor-parallel ranks: micro-batch "
                          "{micro_batch} is not a multiple of gx*gy={gx}*{gy}"))
        return rules

    def recomputed_flops_per_token(self, model, seq_len: int) -> float:
        """Model FLOP per token a checkpointing candidate computes again: the blocks' whole forward (full), or
        the matmul share the op-selective policy recomputes."""
        if self.recompute == "op-selective":
            shares = op_selective(model).share
            return 2 * sum(s * lin.k * lin.n for s, lin in zip(shares, model.block_linears())) * model.n_layers
        if self.recompute == "attention-core":  # QK^T and the probabilities times V, as flops_per_token counts them
            return 4.0 * seq_len * model.hidden * model.n_layers
        return model.flops_per_token(seq_len, recompute=True) - model.flops_per_token(seq_len, recompute=False)

    def reduce_bytes(self, dtype_bytes: int) -> int:
        """Bytes per element of the Z gradient reduce-scatter."""
        return 4 if self.gradient_reduce == "fp32" else dtype_bytes

    def state_bytes(self, gdata, dtype_bytes: int = 2):
        """Bytes per weight-shard element of what persists through the step: the weight (fp32, or its
        compute-dtype copy), the gradient (fp32; in the compute dtype where the micro-batches' gradients are
        summed in it, gradient_accumulation 'compute'), and the optimizer's fp32 states (AdamW's two moments, and
        the fp32 master where the weight is a half-precision copy), split over D with optimizer sharding."""
        copy = self.weights == "low-precision-copy" and dtype_bytes != 4
        optimizer = 8 + (4 if copy else 0)
        split = np.asarray(gdata, dtype=np.float64) if self.optimizer_sharding == "data-parallel" else 1.0
        grad = dtype_bytes if self.gradient_accumulation == "compute" else 4
        return (dtype_bytes if copy else 4) + grad + optimizer / split


AXOPLAN = Execution(pipeline="interleaved")
AXIS_NAMES = {"x": "column (X, in-features) tensor parallelism: its tensor parallelism is one-dimensional",
              "y": "row (Y) tensor parallelism", "z": "sharded (Z, FSDP-like) data parallelism",
              "d": "replicated data parallelism"}


@dataclass(frozen=True)
class SelectiveRecompute:
    """The op-selective policy on one model's block: per block linear (qkv, attn_out, fc1, fc2) the share of
    its forward FLOP recomputed, and the matmul outputs kept per token, in elements: those split over Y
    (column-parallel outputs) and the [T, H] partial sums of the row-parallel ones (not split)."""

    share: tuple
    kept_split: float
    kept_full: float


def op_selective(model) -> SelectiveRecompute:
    """torchtitan's op policy (torchtitan/models/llama3/parallelize: the mm count per block, every even one
    recomputed) over the block's matmuls as a Llama block issues them: q, k, v, o, then w1, w3, w2 (a GELU MLP:
    fc1, fc2). Shares are of FLOP (in x out per token); attention's output is kept (by the caller)."""
    h, kv, f = model.hidden, model.kv_heads * model.head_dim, model.ffn
    mats = [("qkv", h, False), ("qkv", kv, False), ("qkv", kv, False), ("attn_out", h, True)]
    if model.mlp == "swiglu":
        mats += [("fc1", f, False), ("fc1", f, False), ("fc2", h, True)]
    else:
        mats += [("fc1", f, False), ("fc2", h, True)]
    ins = {"qkv": h, "attn_out": h, "fc1": h, "fc2": f}
    flop = {n: 0.0 for n in ins}
    redo = {n: 0.0 for n in ins}
    kept_split = kept_full = 0.0
    for i, (name, out, row) in enumerate(mats, start=1):
        flop[name] += ins[name] * out
        if i % 2 == 0:
            redo[name] += ins[name] * out
        elif row:
            kept_full += out
        else:
            kept_split += out
    return SelectiveRecompute(tuple(redo[n] / flop[n] for n in ins), kept_split, kept_full)

_MEGATRON_FUSION = ("Megatron-LM keeps bf16 parameters beside fp32 masters (Float16Module; "
                    "megatron/core/optimizer: main params fp32) and accumulates gradients in fp32 "
                    "(arguments.py: bf16 forces accumulate_allreduce_grads_in_fp32) inside the dW GEMM "
                    "(--no-gradient-accumulation-fusion is an opt-out, store_false: NVIDIA/Megatron-LM "
                    "megatron/arguments.py @0012901; tensor_parallel layers call "
                    "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 on main_grad); its pipeline runs 1F1B or, with "
                    "--num-layers-per-virtual-pipeline-stage, the interleaved 1F1B of Narayanan et al. 2021, the "
                    "layers split evenly over the (virtual) stages; it fuses by default (its "
                    "arguments only offer opt-outs: --no-bias-gelu-fusion, --no-bias-dropout-fusion, "
                    "--no-persist-layer-norm; Transformer Engine's LayerNormLinear fuses the norm into the "
                    "GEMM), but its vocab-parallel cross-entropy upcasts the logits to fp32 op by op (--cross-entropy-loss-fusion "
                    "is off by default)")
PRESETS = {
    "axoplan": AXOPLAN,
    "megatron-core": Execution(
        "megatron-core", elementwise_kernels="fused", gradient_accumulation="fused", sequence_parallel=True, weights="low-precision-copy",
        optimizer_sharding="data-parallel", overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=True,
        pipeline="interleaved", pipeline_buffers="per-transfer", pipeline_dp_overlap=True,
        grid_axes="yd", placement="yzx", pipeline_inside_data=True,
        source="Megatron-Core as its README's scaling runs state (--overlap-grad-reduce, --overlap-param-gather, "
               "--tp-comm-overlap): --overlap-param-gather requires --use-distributed-optimizer and "
               "--tp-comm-overlap requires --sequence-parallel (megatron/training/arguments.py); "
               + _MEGATRON_FUSION + "; since megatron-core 0.13 any split of the layers over the (virtual) stages, "
               "--pipeline-model-parallel-layout (megatron/core/transformer/pipeline_parallel_layer_layout.py, e.g. "
               "Llama 3 405B's 126 layers on 16 stages), so the layers need not divide by pp x vpp"),
    "megatron-lm": Execution(
        "megatron-lm", elementwise_kernels="fused", gradient_accumulation="fused", sequence_parallel=True, weights="low-precision-copy",
        overlap_grad_reduce=False, recompute="attention-core", attention="unfused", dropout=True,
        pipeline="interleaved", pipeline_even_split=True, pipeline_buffers="per-transfer",
        grid_axes="yd", placement="yzx", pipeline_inside_data=True,
        source="Megatron-LM with sequence parallelism as in Korthikanti et al. 2022 (arXiv 2205.05198): its "
               "selective recomputation of the attention core (their Section 4.2), the core unfused as it was "
               "before FlashAttention (baddbmm, FusedScaleMaskSoftmax, attention dropout 0.1, bmm; their "
               "activation memory's 5as/h term is its softmax output, dropout mask and dropout output), no "
               "distributed optimizer, the data-parallel all-reduce after the backward; " + _MEGATRON_FUSION),
    "megatron-axonn": Execution(
        "megatron-axonn", elementwise_kernels="fused", weights="low-precision-copy", overlap_grad_reduce=False,
        prefetch_into_recompute=False, dropout=True,
        source="the AxoNN paper's runs (github.com/axonn-ai/Megatron-AxoNN, branch gordon-bell-perlmutter): "
               "bf16 weights of Float16Module sharded and gathered over Z, --overlap-grad-reduce rejected, the "
               "fp32 data-parallel all-reduce after the backward, the weight prefetch restarted per recomputed layer "
               "(docs/scale.md); Megatron's default dropout (0.1), which its Perlmutter script "
               "(examples/run_axonn_perlmutter.sh: --use-flash-attn, full recompute) does not change"),
    "llm-foundry": Execution(
        "llm-foundry", elementwise_kernels="fused", loss_kernel="fused",
        source="llm-foundry's MPT runs (mosaicml/llm-foundry scripts/train/benchmarking/submit_benchmarks.py): "
               "PyTorch FSDP FULL_SHARD over Z with fp32 shards cast before each gather, as the bundled trainer; "
               "model.low_precision_layernorm = True (one layer_norm kernel in bf16) and the default "
               "'fused_crossentropy' loss (flash_attn.losses.cross_entropy); GELU one kernel, no rotary (ALiBi)"),
    "torchtitan": Execution(
        "torchtitan", sequence_parallel=True, recompute="op-selective", gradient_reduce="fp32",
        pipeline="interleaved",
        grid_axes="yzd", placement="yzx",
        source="torchtitan (pytorch/torchtitan, parallelize_llama): tensor parallelism with SequenceParallel "
               "norms; FSDP2 with MixedPrecisionPolicy (fp32 shards cast to bf16 before each all-gather, "
               "gradients reduce-scattered in fp32: training.mixed_precision_reduce 'float32'); its "
               "default activation checkpointing, selective per op (activation_checkpoint.mode 'selective', "
               "selective_ac_option 'op'); pipeline stages on torch.distributed.pipelining (parallelism."
               "pipeline_parallel_schedule 1F1B or Interleaved1F1B)"),
    # what `emit --framework axonn` writes: AxoNN's own Linear layers and overlaps, the algorithm the bundled
    # trainer follows; its rank order is fixed (axonn/communication.py: column fastest, then row, then depth)
    "axonn": Execution(
        "axonn", placement="xyzp", micro_batch_over_tensor=True,
        source="AxoNN 0.2.0 (axonn.init, axonn.intra_layer.Linear, optimize_communication) as `emit --framework "
               "axonn` writes it: the bundled trainer's algorithm (fp32 weights cast under autocast, OAR/ORS/OAG); "
               "ranks placed column (X) fastest, then row (Y), depth (Z), inter-layer (G_inter), data "
               "(axonn/communication.py: inter_layer_parallel_rank = (world_rank // G_intra) % G_inter)"),
}


CHOICES = {"weights": WEIGHTS, "optimizer_sharding": OPTIMIZER_SHARDING, "elementwise_kernels": ELEMENTWISE_KERNELS,
           "loss_kernel": ELEMENTWISE_KERNELS, "gradient_reduce": GRADIENT_REDUCE,
           "data_parallel_reduce": DATA_PARALLEL_REDUCE,
           "gradient_accumulation": GRADIENT_ACCUMULATION, "recompute": RECOMPUTE,
           "attention": ATTENTION, "pipeline": PIPELINE, "pipeline_buffers": PIPELINE_BUFFERS}
CAPABILITY_DOC = ("grid_axes: the axes it can split (of x, y, z, d); placement: its fixed order of x, y, z innermost "
                  "first (p among them: where its pipeline axis sits inside data; without p it is outermost), or "
                  "empty for any; pipeline_inside_data: it can also put the pipeline just inside data; pipeline: which "
                  "schedules it runs")


def _check(e: Execution, where: str) -> Execution:
    from axoplan.planner.space import PLACEMENTS

    for name, allowed in CHOICES.items():
        if getattr(e, name) not in allowed:
            raise UserError(f"{where}: {name} must be one of {', '.join(allowed)}, not {inputs.show(getattr(e, name))}")
    if not e.grid_axes or set(e.grid_axes) - set("xyzd") or len(set(e.grid_axes)) != len(e.grid_axes):
        raise UserError(f"{where}: grid_axes must be distinct letters of x, y, z, d, not '{e.grid_axes}'")
    if e.placement and e.placement not in PLACEMENTS:
        raise UserError(f"{where}: placement must be an order of x, y, z (innermost first, p among them to place the "
                        f"pipeline axis inside data) or empty, not '{e.placement}'")
    if e.overlap_param_gather and e.optimizer_sharding != "data-parallel":
        raise UserError(f"{where}: overlap_param_gather needs optimizer_sharding: data-parallel")
    return e


def load_execution(name_or_path: str | Execution | None) -> Execution:
    """A preset by name, or a YAML file of Execution fields (`base: PRESET` to start from one)."""
    if name_or_path is None:
        return AXOPLAN
    if isinstance(name_or_path, Execution):
        return _check(name_or_path, name_or_path.name)
    s = str(name_or_path)
    if s in PRESETS:
        return PRESETS[s]
    p = Path(s)
    if not (s.endswith((".yaml", ".yml")) or p.exists()):
        raise UserError(f"unknown execution '{s}'; known: {', '.join(PRESETS)} (or a YAML file of its fields)")
    if not p.is_file():
        raise UserError(f"execution file '{s}' {'is not a file' if p.exists() else 'does not exist'}")
    data = load_yaml(p, s)
    if not isinstance(data, dict):
        raise UserError(f"{s}: expected a mapping of execution fields at the top level")
    base = data.pop("base", "axoplan")
    if not isinstance(base, str) or base not in PRESETS:
        raise UserError(f"{s}: base {inputs.show(base)} is not a preset ({', '.join(PRESETS)})")
    known = {f.name: f.type for f in dataclasses.fields(Execution)}
    for k, v in data.items():
        if k not in known:
            raise UserError(f"{s}: unknown field {inputs.show(k)} (known: base, {', '.join(known)})")
        if (known[k] == "bool") != isinstance(v, bool) or (known[k] == "str" and not isinstance(v, str)):
            raise UserError(f"{s}: field '{k}' must be {'true or false' if known[k] == 'bool' else 'a string'}")
    return _check(dataclasses.replace(PRESETS[base], **{"name": p.stem, "source": f"{s} (base {base})", **data}), s)
