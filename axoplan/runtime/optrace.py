"""Every operator of a training step, classified and counted per phase (forward, recompute, backward,
optimizer step): the element-wise work the cost model charges by bytes and the kernels it charges a
dispatch each, traced on the trainer itself (under `axoplan dryrun`'s fake tensors, for any grid).

Classification of each aten operator the step dispatches:
  - gemm: mm, addmm, bmm, matmul, baddbmm, addmv, mv, linear (their time is the GEMM model's);
  - attention: scaled_dot_product_* and the flash / efficient / cudnn kernels behind it;
  - free: no kernel or no traffic: views and metadata (view, reshape, transpose, slice, split, expand,
    detach, as_strided...), allocations without a fill (empty*), and every non-aten operator
    (c10d collectives, their waits: the communication model's);
  - kernel: everything else, element-wise and reductions, one launch each; its bytes are the storage
    actually touched: each distinct tensor argument read (broadcast dimensions, stride 0, count once)
    and each result written, an in-place result read and written, an overwritten one (copy_, fill_,
    zero_, out=) only written.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PHASES = ("forward", "recompute", "backward", "step")

GEMM = frozenset({"mm", "addmm", "bmm", "matmul", "baddbmm", "addbmm", "addmv", "mv", "linear", "_addmm_activation"})
FREE = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "view_as", "t", "transpose", "permute", "expand", "expand_as",
    "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "unsqueeze", "squeeze", "flatten", "unflatten",
    "narrow", "as_strided", "alias", "detach", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty",
    "new_empty_strided", "resize_", "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "real", "conj", "_conj", "_neg_view", "diagonal", "movedim", "numpy_T",
})
# the first argument is written without being read
OVERWRITE = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_"})
# gathers read, scatters read and write, only the rows their index names in the first argument
INDEXED = frozenset({"index", "gather", "index_select", "embedding", "index_add_", "scatter_add_", "scatter_",
                     "index_put_", "scatter_add", "index_add"})
# fused AdamW marks every list mutable (for grad scaling); it writes only params and the two moments
FUSED_WRITES = {"_fused_adamw_": (0, 2, 3), "_fused_adam_": (0, 2, 3)}


def classify(func) -> str:
    """'gemm', 'attention', 'free' or 'kernel' for an OpOverload."""
    if func.namespace != "aten":
        return "free"  # c10d collectives and waits: the communication model's, not a compute kernel
    name = func.overloadpacket.__name__
    if name in GEMM:
        return "gemm"
    if "scaled_dot_product" in name or name.startswith(("_flash_attention", "_efficient_attention", "_cudnn_attention")):
        return "attention"
    if name in FREE:
        return "free"
    return "kernel"


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes of storage a kernel reads or writes for this argument: broadcast (stride-0) dims once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x) -> dict:
    return {id(t): t for t in tree_leaves(x) if isinstance(t, torch.Tensor)}


def _operands(func, name: str, args, kwargs, out) -> tuple[dict, dict]:
    """(read, written) tensors of one kernel, each once by identity."""
    schema = func._schema.arguments
    mutated = [i for i, a in enumerate(schema[:len(args)]) if a.alias_info is not None and a.alias_info.is_write]
    if name in FUSED_WRITES:
        mutated = list(FUSED_WRITES[name])
    writes = _tensors([args[i] for i in mutated] + [kwargs.get("out")])
    skip = set(_tensors(kwargs.get("out")))
    if name in OVERWRITE or name.endswith("_like"):  # written (or only shaped) without being read
        skip |= set(_tensors(args[:1]))
    if name in INDEXED:
        skip |= set(_tensors(args[:1]))
        writes = {k: v for k, v in writes.items() if k not in _tensors(args[:1])}
    reads = {k: t for k, t in _tensors((args, {k: v for k, v in kwargs.items() if k != "out"})).items() if k not in skip}
    if not mutated or name in INDEXED:  # a fresh result; an in-place op returns what it already counts
        fresh = {k: t for k, t in _tensors(out).items() if k not in reads}
        if name in INDEXED and mutated:
            fresh = {}
        writes.update(fresh)
    return reads, writes


def _indexed_bytes(name: str, args, out) -> int:
    """The first argument's touched bytes: as many of its elements as the result (gathers) or the
    source (scatters, read and written)."""
    base = args[0]
    if name == "index_put_":
        return 2 * args[2].numel() * base.element_size()
    if name in ("index_add_", "index_add", "scatter_add_", "scatter_add", "scatter_"):
        src = args[3] if isinstance(args[3], torch.Tensor) else args[2]  # scatter_ of a value: the index's size
        return 2 * src.numel() * base.element_size()
    return out.numel() * base.element_size()


@dataclass
class PhaseCount:
    kernels: int = 0
    bytes: int = 0
    gemms: int = 0
    attention: int = 0
    ops: collections.Counter = field(default_factory=collections.Counter)  # kernel name -> launches


class OpCounter(TorchDispatchMode):
    """Counts kernels and their bytes per phase. Inside the autograd engine: backward, or recompute
    while a checkpointed block re-runs its forward (Runtime.keep_gathered). Outside it, the trainer's
    own marks: a micro-batch's forward starts at its Runtime.start_sequence, its backward at the first
    'backward ...' moment (and keeps its tail: the last reduce-scatters, the loss's sum), the optimizer
    step at the 'step' moment (and keeps the next step's prologue: the token count, zeroing)."""

    def __init__(self):
        super().__init__()
        self.rt = None
        self.stage = "step"
        self.counts = {p: PhaseCount() for p in PHASES}
        self.log: list | None = None  # a list: every kernel as (phase, the Runtime's moment, name, bytes)

    def attach(self, trainer) -> None:
        rt = self.rt = trainer.rt
        start, moment = rt.start_sequence, rt.moment

        def start_sequence(seq):
            self.stage = "forward"
            return start(seq)

        def mark(where):
            if where == "step" or where.startswith("backward"):
                self.stage = "step" if where == "step" else "backward"
            return moment(where)

        rt.start_sequence, rt.moment = start_sequence, mark

    def reset(self) -> None:
        self.counts = {p: PhaseCount() for p in PHASES}

    def phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if self.rt is not None and self.rt.keep_gathered else "backward"
        return self.stage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = classify(func)
        if kind == "free":
            return out
        phase = self.phase()
        c = self.counts[phase]
        if kind == "gemm":
            c.gemms += 1
            return out
        if kind == "attention":
            c.attention += 1
            return out
        name = func.overloadpacket.__name__
        reads, writes = _operands(func, name, args, kwargs, out)
        nbytes = sum(touched_bytes(t) for t in reads.values()) + sum(touched_bytes(t) for t in writes.values())
        if name in INDEXED:  # the indexed tensor is touched only where the index points: its other operand's size
            nbytes += _indexed_bytes(name, args, out)
        c.kernels += 1
        c.bytes += nbytes
        c.ops[name] += 1
        if self.log is not None:
            self.log.append((phase, getattr(getattr(self.rt, "tracer", None), "where", ""), name, nbytes))
        return out


def count_step(cfg, dtype: str = "bf16", fused_optimizer: bool = True) -> OpCounter:
    """The steady training step of cfg, as rank 0 of its grid under `axoplan dryrun`'s fake world."""
    from axoplan.runtime.dryrun import trace_step

    counter = OpCounter()
    trace_step(cfg, dtype, modes=(counter,), fused_optimizer=fused_optimizer)
    return counter


def modelled_step(cfg, dtype: str = "bf16", fused_optimizer: bool = True, fake: bool = True) -> dict:
    """The cost model's element-wise work of the same step, per phase: {phase: compute.Work}. fake: as
    count_step sees it, without the step's two host reads of its metrics (a fake tensor holds no value,
    so Trainer._item dispatches nothing)."""
    from axoplan.planner import compute
    from axoplan.planner.comm import parameter_shards
    from axoplan.planner.specs import load_model

    spec = load_model(cfg.model)
    g = cfg.grid
    S = cfg.seq_len or spec.seq_len
    grad_acc = cfg.global_batch // (g.gdata * g.gz * cfg.micro_batch)
    e = 2 if dtype == "bf16" else 4
    work = compute.elementwise_work(spec, g.gx, g.gy, g.gz, cfg.micro_batch, S, e, grad_acc,
                              prefetch=cfg.overlap.all_gather)
    out = work.phases(spec.n_layers, cfg.checkpointing, grad_acc)
    shard = parameter_shards(spec, g.gx, g.gy, g.gz).total
    out["step"] = compute.step_work(spec, g.gx, g.gz, g.gdata, cfg.micro_batch, S, grad_acc, shard, fused_optimizer)
    if fake:
        out["step"] = out["step"] + compute.Work(-16, -2)
    return out
