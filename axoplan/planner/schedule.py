"""The schedule: one training step as the trainer issues it, op for op, on every candidate at once.

A pass (forward; backward; backward with recompute) is a prefix of windows, a block of windows repeated
once per transformer block, and a suffix. A window is one layer's work on the compute stream (GEMMs,
attention, element-wise kernels and their launches) with the collectives around it: those the compute
stream waits for, the dI all-reduce that runs beside the dW GEMM (OAR), and on the Z stream the weight
all-gather the window needs and the gradient reduce-scatter it issues. The step adds the data-parallel
collectives and the optimizer.

Everything the planner reports derives from this one description: the batch time (timing.py), the
compute and communication totals and call counts (here), explain's tables (rank.py); memory.py walks the
same order for the peak. The trainer records what it ran (runtime Runtime.calls, runtime/optrace.py) and
the tests compare it with this schedule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from axoplan.runconfig import Overlap
from axoplan.planner import comm
from axoplan.planner import compute as work
from axoplan.planner.comm import Collective
from axoplan.planner.execution import AXOPLAN, Execution, op_selective
from axoplan.planner.machine import MachineProfile
from axoplan.planner.space import Candidates
from axoplan.planner.specs import Job, ModelSpec

# the trainer's default (one definition: the LaunchConfig's): at most this many reduce-scatters in flight
MAX_INFLIGHT_RS = Overlap().max_inflight_reduce_scatters


@dataclass
class Op:
    """Work on the compute stream, per candidate: its seconds and what they come from: a GEMM's (m, n, k),
    attention, or element-wise kernels (bytes moved, kernels launched)."""

    kind: str  # gemm | attention | element-wise
    seconds: object
    shape: tuple = ()  # GEMM: (m, n, k)
    layout: str = ""  # GEMM: NN, NT, TN as written, or "best" (BLAS tuning)
    bytes: object = 0.0  # element-wise: bytes moved
    kernels: object = 1.0  # launches (a GEMM or attention: one)


@dataclass(frozen=True)
class Moment:
    """A point inside a backward window where the live set can peak (memory.py walks them in order): the
    activations the block saved that are freed once it is past, the transient buffer live at it, how many
    of the block's recomputed weights checkpointing still keeps, and whether it is the window's own GEMM
    (its gathered weight and its gradient block live; before it, the window's weight is being prefetched)."""

    name: str
    frees: tuple = ()
    transient: str = ""
    kept: int = 0
    gemm: bool = False
    logits: str = ""  # the LM head's logits live at it: "loss forward", "loss backward", "logits gradient"


# the step's moments as the trainer runs it (runtime/model.py, loss.py): the loss at the end of the forward,
# the LM head's and the final norm's backward, per block window, and the embedding's backward
HEAD_FORWARD_MOMENTS = (Moment("forward loss", logits="loss forward"),)
HEAD_BACKWARD_MOMENTS = (Moment("backward loss", logits="loss backward"),
                         Moment("backward lm_head", ("head input",), "head dI", gemm=True, logits="logits gradient"),
                         Moment("backward final norm", transient="norm"))
EMBEDDING_MOMENTS = (Moment("backward embedding", transient="residual", gemm=True),)
BLOCK_MOMENTS = {
    "fc2": (Moment("fc2", ("act", "mask2"), "fc2", 4, True),),
    "fc1": (Moment("fc1", ("fc1", "h2"), "fc1", 3, True), Moment("norm2", ("x1",), "norm", 2)),
    "attn_out": (Moment("attn_out", ("mask1",), "attn_out", 2, True),),
    "qkv": (Moment("attention", ("sdpa",), "attention", 1), Moment("qkv", ("h1",), "qkv", 1, True),
            Moment("norm1", (), "norm", 0)),
}


@dataclass
class Window:
    """One layer's step: its ops on the compute stream, the collectives by how they meet the compute, and
    the moments inside it where memory can peak."""

    name: str
    compute: dict  # op name (gemm fwd, attention, element-wise, weight cast, ...) -> Op
    blocking: list = field(default_factory=list)  # collectives the compute stream waits for
    # collectives run beside one of the window's ops, by op name: the dI all-reduce beside "gemm wgrad" (OAR);
    # with the execution's TP overlap the forward's all-reduce beside "gemm fwd"; SP's input gather beside dI
    beside: dict = field(default_factory=dict)
    gather: list = field(default_factory=list)  # Z stream: the weight all-gather needed before the window
    scatter: list = field(default_factory=list)  # Z stream: the gradient reduce-scatter it issues
    moments: tuple = ()  # where memory can peak inside it (Moment), in order (the memory walk's windows)
    _compute: object = field(default=None, repr=False)

    def compute_s(self):
        if self._compute is None:  # the timing, the totals and the CPU burst all read it
            self._compute = sum(op.seconds for op in self.compute.values())
        return self._compute

    def collectives(self) -> list[Collective]:
        return self.blocking + [c for cs in self.beside.values() for c in cs] + self.gather + self.scatter


# the window in which a pipeline stage gathers a transfer its senders split over Y (Execution.pipeline_p2p_split)
RECEIVE = "pipeline receive"


@dataclass
class Pass:
    name: str
    prefix: list
    block: list  # repeated once per transformer block
    suffix: list

    def windows(self, n_blocks: int):
        """(window, times per micro-batch) in the trainer's order, the block's windows once with their count."""
        return [(w, 1) for w in self.prefix] + [(w, n_blocks) for w in self.block] + [(w, 1) for w in self.suffix]

    def stage(self, first: bool, last: bool) -> Pass:
        """This pass on one pipeline stage: the embedding's window on the first only, the LM head's on the last,
        the gather of a split transfer (RECEIVE) where the stage receives: after the first in the forward, before
        the last in the backward."""
        receives = not first if self.name == "forward" else not last

        def keep(ws):
            return [w for w in ws if (w.name != "embedding" or first) and (w.name != "lm_head" or last)
                    and (w.name != RECEIVE or receives)]
        return Pass(self.name, keep(self.prefix), self.block, keep(self.suffix))

    def total(self, n_blocks, value):
        """value(window) summed over one micro-batch of this pass with n_blocks blocks."""
        return sum(value(w) * n for w, n in self.windows(1)) + sum(value(w) for w in self.block) * (n_blocks - 1)


@dataclass
class Schedule:
    n_blocks: int
    grad_acc: np.ndarray
    checkpointing: np.ndarray  # which backward each candidate runs (broadcasts against the candidates)
    forward: Pass
    backward: Pass  # checkpointing off
    backward_recompute: Pass  # checkpointing on: each block's forward again, then its backward
    step: list  # per step, in the trainer's order: the data-parallel and other collectives (Collective.calls)
    optimizer: np.ndarray  # seconds of the optimizer step (element-wise over the fp32 states)
    buckets: comm.BucketPlan | None  # the D gradient all-reduce's buckets when it overlaps the last backward
    groups: comm.Groups
    extrapolated: np.ndarray  # some GEMM shape fell outside a measured table
    replicated_elems: np.ndarray  # elements of the replicated parameters (norm weights, positions)
    params: comm.ParameterShards  # this rank's weight blocks and fp32 shard elements
    # between pipeline stages, per micro-batch: the activation (forward) and its gradient (backward), [Ts, H/gx]
    # as the grid shards the residual stream, and the seconds of one transfer (0 without a pipeline) at a
    # boundary inside a node and at one crossing nodes (comm.boundary_crosses says which boundary is which)
    p2p_bytes: np.ndarray | float = 0.0
    p2p_near: np.ndarray | float = 0.0
    p2p_far: np.ndarray | float = 0.0

    def p2p_fastest(self, profile) -> np.ndarray:
        """A lower bound of every boundary's transfer: inside a node wherever stages sit closer than a node."""
        near = np.minimum(self.p2p_near, self.p2p_far)
        return np.where(np.asarray(self.groups.stride["p"]) < profile.gpus_per_node, near, self.p2p_far)

    def passes(self, checkpointing: bool) -> tuple[Pass, Pass]:
        return self.forward, (self.backward_recompute if checkpointing else self.backward)

    def _per_micro_batch(self, value, checkpointing: bool):
        total = 0.0
        for p in self.passes(checkpointing):
            for w, n in p.windows(self.n_blocks):
                total = total + value(w) * n
        return total

    def compute_per_micro_batch(self):
        """Compute-stream seconds of one micro-batch (forward, recompute where on, backward)."""
        return np.where(self.checkpointing, self._per_micro_batch(Window.compute_s, True),
                        self._per_micro_batch(Window.compute_s, False))

    def comm_per_micro_batch(self):
        """Seconds of every collective of one micro-batch, hidden or not."""
        def seconds(w):
            return sum(c.seconds for c in w.collectives())
        return np.where(self.checkpointing, self._per_micro_batch(seconds, True),
                        self._per_micro_batch(seconds, False))

    def calls_per_micro_batch(self, checkpointing: bool = False):
        """Collective calls of one micro-batch over groups of more than one GPU."""
        def calls(w):
            return sum((np.asarray(self.groups.size[c.axis]) > 1).astype(np.float64) for c in w.collectives())
        return self._per_micro_batch(calls, checkpointing)

    def collective_rows(self, i: int, checkpointing: bool, stage: tuple | None = None) -> list[tuple[Collective, int]]:
        """(collective, calls per step) of candidate i, every call of the step once, grouped by layer,
        phase, kind, axis and size in the trainer's order (explain's collectives table). stage: (blocks, first,
        last) of one pipeline stage: its windows' collectives only (its once-per-step ones are its shard's)."""
        ga = int(np.ravel(self.grad_acc)[i] if np.ndim(self.grad_acc) else self.grad_acc)
        rows: dict = {}
        blocks, first, last = stage or (self.n_blocks, True, True)
        for p in self.passes(checkpointing):
            for w, n in p.stage(first, last).windows(blocks):
                for c in w.collectives():
                    key = (c.layer, c.phase, c.kind, c.axis, float(np.ravel(c.nbytes)[i]))
                    rows[key] = (rows[key][0], rows[key][1] + n * ga) if key in rows else (c, n * ga)
        for j, c in enumerate(self.step if stage is None else ()):  # each gradient bucket its own row, as issued
            calls = int(np.ravel(c.calls)[i]) if np.ndim(c.calls) else int(c.calls)
            if calls:
                rows["step", j] = (c, calls)
        return [v for v in rows.values() if int(np.ravel(self.groups.size[v[0].axis])[i]) > 1]


def _backward(name, comp, blocking, ar_bwd, gather, rs, overlap: bool, ag_input=None) -> Window:
    """A layer's backward window: its dI all-reduce beside the dW GEMM (OAR), or blocking without overlap;
    a sequence-parallel input gather beside the dI GEMM."""
    moments = HEAD_BACKWARD_MOMENTS if name == "lm_head" else BLOCK_MOMENTS[name]
    if overlap:
        beside = {"gemm wgrad": [ar_bwd], **({"gemm dgrad": [ag_input]} if ag_input is not None else {})}
        return Window(name, comp, blocking, beside, gather, [rs], moments=moments)
    return Window(name, comp, [ar_bwd] + ([ag_input] if ag_input is not None else []) + blocking, {}, gather, [rs],
                  moments=moments)


def build(model: ModelSpec, profile: MachineProfile, job: Job, c: Candidates, ck, overlap: bool,
          tuning: bool, groups: comm.Groups, execution: Execution = AXOPLAN) -> Schedule:
    """The step of every candidate as the trainer runs it (ck: checkpointing, broadcasting against them), or
    as the execution's framework runs it."""
    ex = execution
    S = job.seq_len
    e = profile.dtype_bytes
    gx, gy, gz, gd, mb = c.gx, c.gy, c.gz, c.gdata, c.micro_batch
    grad_acc = np.maximum(job.global_batch // np.maximum(gd * gz * mb, 1), 1)
    T = (mb * S).astype(np.float64)
    L = model.n_layers

    # ---- compute: GEMMs, attention, element-wise kernels as the trainer issues them ------------------
    lins = model.block_linears()
    lm = model.lm_head()
    *gemms, head_gemms = work.block_gemms(profile, [*lins, lm], gx, gy, T, tuning)
    if ex.attention == "unfused":  # batched GEMMs and softmax kernels over the [S, S] scores
        ua = work.unfused_attention(profile, model, gy, mb, S, e, ex.dropout)
        attn_f = Op("attention", ua.fwd, bytes=ua.fwd_work.bytes, kernels=ua.fwd_work.kernels + 2)
        attn_b = Op("attention", ua.bwd, bytes=ua.bwd_work.bytes, kernels=ua.bwd_work.kernels + 4)
    else:
        attn_f, attn_b = (Op("attention", t) for t in work.attention_seconds(profile, model, gy, mb, S))
    elementwise = work.elementwise_work(model, gx, gy, gz, mb, S, e, grad_acc, prefetch=overlap, execution=ex)
    extrapolated = np.zeros(len(c), dtype=bool)
    for layer_gemms in gemms + [head_gemms]:
        extrapolated |= layer_gemms.extrapolated

    def gemm(times: work.GemmTimes, which: str) -> Op:
        return Op("gemm", getattr(times, which), times.shapes[which], times.layouts[which])

    def elem(w: work.Work, share: float = 1.0) -> Op:
        w = w * share
        return Op("element-wise", w.seconds(profile), bytes=w.bytes, kernels=w.kernels)

    # each layer's gathered weight cast, where it is used
    casts = [elem(w) for w in elementwise.gather_casts]

    # ---- collectives ---------------------------------------------------------------------------------
    g = groups
    r = ex.reduce_bytes(e)
    colls = [comm.linear_collectives(profile, g, lin, T, e, ex.sequence_parallel, r) for lin in lins]
    head_colls = comm.linear_collectives(profile, g, lm, T, e, reduce_bytes=r, split_all_reduce=ex.sequence_parallel)
    emb_colls = comm.embedding_collectives(profile, g, model, T, e, r, ex.sequence_parallel)
    norm_f, norm_b = comm.norm_collectives(profile, g, model, T, "norm")
    loss = list(comm.loss_collectives(profile, g, T))

    # forward windows of one block: norm1+qkv+attention, attn_out+residual, norm2+fc1+act, fc2+residual;
    # the block's element-wise work is split between the two norm windows, as the trainer's order has it
    attention_f = [{"attention": attn_f, "element-wise": elem(elementwise.block_fwd, 0.5)}, {},
                   {"element-wise": elem(elementwise.block_fwd, 0.5)}, {}]
    norms = [True, False, True, False]

    def fwd_window(i, suffix=""):
        comp = {"gemm fwd": gemm(gemms[i], "fwd"), **attention_f[i], "weight cast": casts[i]}
        norm = [norm_f] if norms[i] else []
        if ex.tp_comm_overlap and overlap:  # the all-reduce pipelined with the GEMM that makes its input
            return Window(lins[i].name + suffix, comp, norm, {"gemm fwd": [colls[i]["ar_fwd"]]},
                          gather=[colls[i]["ag"]])
        return Window(lins[i].name + suffix, comp, [colls[i]["ar_fwd"]] + norm, gather=[colls[i]["ag"]])

    fwd_block = [fwd_window(i) for i in range(4)]
    emb_f = Window("embedding", {"element-wise": elem(elementwise.emb_fwd)}, [emb_colls["ar_fwd"]],
                   gather=[emb_colls["ag"]])
    lm_f = Window("lm_head", {"gemm fwd": gemm(head_gemms, "fwd"), "element-wise": elem(elementwise.head_fwd)},
                  [head_colls["ar_fwd"], norm_f] + loss, gather=[head_colls["ag"]], moments=HEAD_FORWARD_MOMENTS)

    attention_b = [{"attention": attn_b, "element-wise": elem(elementwise.block_bwd, 0.5)}, {},
                   {"element-wise": elem(elementwise.block_bwd, 0.5)}, {}]

    def bwd_window(i, with_gather):
        comp = {"gemm dgrad": gemm(gemms[i], "dgrad"), "gemm wgrad": gemm(gemms[i], "wgrad"), **attention_b[i]}
        if with_gather:
            comp["weight cast"] = casts[i]
        return _backward(lins[i].name, comp, [norm_b] if norms[i] else [], colls[i]["ar_bwd"],
                         [colls[i]["ag"]] if with_gather else [], colls[i]["rs"], overlap and ex.tp_backward_overlap,
                         colls[i].get("ag_input"))

    lm_b = _backward("lm_head", {"gemm dgrad": gemm(head_gemms, "dgrad"), "gemm wgrad": gemm(head_gemms, "wgrad"),
                                 "element-wise": elem(elementwise.head_bwd)},
                     [norm_b], head_colls["ar_bwd"], [head_colls["ag"]] if ex.reshard_after_forward else [],
                     head_colls["rs"], overlap and ex.tp_backward_overlap)
    emb_b = Window("embedding", {"element-wise": elem(elementwise.emb_bwd)}, scatter=[emb_colls["rs"]],
                   moments=EMBEDDING_MOMENTS)

    def selective_window(i, share):
        """op-selective recompute: the window's element-wise forward and the matmul share the policy drops;
        attention's output and the reduce-scatters' are kept, but a recomputed matmul's sequence-parallel input
        is gathered again; the weight is gathered as for full recompute (the backward needs it)."""
        g_op = gemm(gemms[i], "fwd")
        comp = {"gemm fwd": Op("gemm", g_op.seconds * share, g_op.shape, g_op.layout),
                "element-wise": attention_f[i].get("element-wise", Op("element-wise", 0.0, kernels=0.0)),
                "weight cast": casts[i]}
        regather = [colls[i]["ag_input"]] if share > 0 and "ag_input" in colls[i] else []
        return Window(lins[i].name + " (recompute)", comp, ([norm_f] if norms[i] else []) + regather,
                      gather=[colls[i]["ag"]])

    plain = [bwd_window(i, ex.reshard_after_forward) for i in reversed(range(4))]
    if ex.recompute == "attention-core":
        # nothing before the block's backward: the core's forward again where its backward starts, every
        # weight gathered as without recompute
        recompute, ckpt = [], plain[:3] + [Window("attention (recompute)", {"attention": attn_f})] + plain[3:]
    else:
        if ex.recompute == "op-selective":
            recompute = [selective_window(i, share) for i, share in enumerate(op_selective(model).share)]
        else:
            recompute = [fwd_window(i, " (recompute)") for i in range(4)]
        if not ex.reshard_after_forward:  # the weights stay gathered from the forward: the recompute gathers nothing
            recompute = [dataclasses.replace(w, compute={k: v for k, v in w.compute.items() if k != "weight cast"},
                                             gather=[], _compute=None) for w in recompute]
        elif not ex.prefetch_into_recompute:  # the block's first gather issued by its own recompute, waited for
            first = recompute[0]
            recompute[0] = dataclasses.replace(first, blocking=first.gather + first.blocking, gather=[])
        ckpt = [bwd_window(i, False) for i in reversed(range(4))]

    # ---- per step: data-parallel gradients, replicated parameters, the optimizer --------------------
    params = comm.parameter_shards(model, gx, gy, gz)
    shard = params.total
    replicated = (2 * L + 1) * model.hidden / gx + (S * model.hidden / gx if model.position == "learned" else 0)
    optimizer_s = work.optimizer_seconds(profile, work.step_work(model, gx, gz, gd, mb, S, grad_acc, shard,
                                                           work.fused_optimizer(profile), ex, e))
    plan = None
    if overlap and ex.overlap_grad_reduce:  # the trainer's buckets, one definition: comm.gradient_buckets
        plan = comm.gradient_buckets(params.block_shard, params.lm_shard, params.emb_shard, L)
    step = comm.data_parallel_collectives(profile, g, shard.astype(np.float64), replicated,
                                          plan.rows if plan else None, ex, e)
    p2p_bytes = T / ex.sequence_split(gy) * model.hidden / gx * e
    receive = {"fwd": [], "bwd": []}
    split = ex.pipeline_p2p_split and not ex.sequence_parallel
    staged = np.asarray(c.pp if c.pp is not None else 1) > 1
    if split and np.any(staged):
        # each Y rank sent its 1/gy part; the receiver gathers the whole boundary tensor on its compute stream
        # before it runs (Megatron's gather_split_1d_tensor, DeepSpeed's PartitionedTensor.full()): a stage that
        # receives, in its pass (Pass.stage); none without a pipeline
        for phase, into in receive.items():
            g_all = comm._coll(profile, g, "pipeline", phase, "all_gather", "y", p2p_bytes)
            into.append(Window(RECEIVE, {}, [dataclasses.replace(g_all, seconds=np.where(staged, g_all.seconds, 0.0))]))
    if split:
        p2p_bytes = p2p_bytes / gy
    return Schedule(L, grad_acc, ck, Pass("forward", [emb_f, *receive["fwd"]], fwd_block, [lm_f]),
                    Pass("backward", [lm_b, *receive["bwd"]], plain, [emb_b]),
                    Pass("backward", [lm_b, *receive["bwd"]], recompute + ckpt, [emb_b]),
                    step, optimizer_s, plan, g, extrapolated, replicated, params, p2p_bytes,
                    *comm.stage_transfer_seconds(profile, g, p2p_bytes))
