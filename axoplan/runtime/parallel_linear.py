"""Agarwal's 3D-parallel linear layer as AxoNN runs it, with explicit collectives.

Normal layer O = I·W, W [k, n]: I is [T, k/gx] (replicated over Y), this rank owns the block
W[k/gx slice of x, n/gy slice of y], flattened and split into gz equal flat shards.
  forward : all-gather W over Z, local GEMM, all-reduce O over X      -> O [T, n/gy]
  backward: all-gather W over Z (or reuse the one kept by the recompute), dI = dO·Wᵀ and
            all-reduce over Y (OAR: async under the dW GEMM), dW = Iᵀ·dO reduce-scatter over Z
            (ORS: async, at most `max_inflight_rs` in flight: issuing one more first waits for the
            oldest, whose full-size gradient block is then released, as FSDP bounds them)
The transposed layer swaps X and Y. The gradient shards accumulate over micro-batches; their
data-parallel all-reduce happens once per step: with overlap.data_parallel, on the last micro-batch
each bucket (a contiguous slice of the gradient buffer of at least DP_BUCKET_BYTES, see
ParallelGPT.grad_buckets) is all-reduced over D asynchronously as soon as all its shards are final,
beside the rest of the backward
(Runtime.arm_data_parallel / finish_data_parallel); otherwise in one blocking call after it.
OAG: the weight all-gathers of one micro-batch follow a sequence known in advance (forward,
recompute, backward), so each `gather` launches the next one asynchronously.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from axoplan.runtime.blas_tuning import GemmTuner
from axoplan.runtime.grid import ParallelGrid

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedWeight:
    """A [rows, cols] block of a full weight, stored as this rank's flat Z shard (fp32 master copy).

    `row_axis`/`col_axis` name the grid axes that pick the block ("x" or "y"); `rows`/`cols`
    are the index tensors of the full weight that make up this rank's block.
    """

    def __init__(self, name: str, full_shape: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor,
                 gz: int, z: int, device):
        self.name = name
        self.full_shape = full_shape
        self.rows, self.cols = rows, cols
        self.shape = (len(rows), len(cols))
        self.numel = self.shape[0] * self.shape[1]
        self.shard_len = -(-self.numel // gz)  # pad the flat block so gz need not divide it
        self.gz, self.z = gz, z
        self.param = torch.nn.Parameter(torch.zeros(self.shard_len, device=device))

    def set_from_full(self, full: torch.Tensor) -> None:
        block = full.to(self.param.device, torch.float32)[self.rows][:, self.cols].reshape(-1)
        self.set_from_block(block)

    def set_from_block(self, flat_block: torch.Tensor) -> None:
        padded = torch.zeros(self.shard_len * self.gz, device=self.param.device)
        padded[: self.numel] = flat_block
        with torch.no_grad():
            self.param.copy_(padded[self.z * self.shard_len:(self.z + 1) * self.shard_len])


@dataclass
class _Pending:
    work: object
    buf: torch.Tensor  # this rank's reduced shard, accumulated when the work completes
    src: torch.Tensor  # the full-size gradient block: NCCL holds it until the work completes, so do we


@dataclass(frozen=True)
class CollectiveCall:
    """One collective as the trainer issued it: what for, which kind, over which axis, bytes moved
    (the all-reduced buffer, the gathered output, the reduce-scatter's full input)."""

    layer: str  # qkv, attn_out, fc1, fc2, lm_head, embedding, norm, loss, or a per-step name
    kind: str  # all_gather, reduce_scatter, all_reduce; send, recv (pipeline transfers)
    axis: str  # x, y, z, d, zd, all; p (between pipeline stages)
    nbytes: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def layer_kind(weight_name: str) -> str:
    """'blocks.3.fc1' -> 'fc1', 'tok_emb' -> 'embedding', 'lm_head' -> 'lm_head'."""
    if weight_name == "tok_emb":
        return "embedding"
    return weight_name.rsplit(".", 1)[-1]


class Runtime:
    """Per-model state of the parallel execution: grid, dtypes, overlap flags, prefetch and the
    pending reduce-scatters. One object is shared by all layers of a model."""

    def __init__(self, grid: ParallelGrid, *, compute_dtype=torch.float32, collective_dtype=torch.float32,
                 overlap_all_reduce=True, overlap_reduce_scatter=True, overlap_all_gather=True,
                 max_inflight_rs: int = 2, blas_tuning=False, overlap_data_parallel=True):
        self.grid = grid
        self.cdt = compute_dtype
        self.coll = collective_dtype
        self.oar, self.ors, self.oag = overlap_all_reduce, overlap_reduce_scatter, overlap_all_gather
        self.odp = overlap_data_parallel
        self.max_inflight_rs = max(1, int(max_inflight_rs))
        self.max_inflight_seen = 0  # the most reduce-scatters ever in flight at once (the bound's proof)
        self.calls: list[CollectiveCall] | None = None  # a list: every collective is recorded into it
        self.tracer = None  # a memory tracer (runtime/memtrace.py): allocations get a kind and a moment
        self.tuner = GemmTuner(blas_tuning)
        self.keep_gathered = False  # True while a checkpointed block recomputes its forward
        self._seq: list[ShardedWeight] = []
        self._cursor = 0
        self._prefetched: tuple[int, torch.Tensor, object] | None = None
        self._pending_rs: list[tuple[ShardedWeight, _Pending]] = []
        # overlapped D all-reduce: bucket of each weight, shards still to finish per bucket, launched works
        self._dp_bucket_of: dict[ShardedWeight, int] = {}
        self._dp_left: list[int] = []
        self._dp_buckets: list[torch.Tensor] = []
        self._dp_work: list = []
        self.dp_overlapped = 0  # bucket all-reduces launched inside a backward (the mechanism's proof)
        self.sequence_misses = 0  # gathers that did not follow the announced sequence (a bug if > 0)
        self.counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "send": 0, "recv": 0}
        # host time spent blocked on collectives: the exposed communication on CPU/gloo (with NCCL
        # a wait only orders streams, so this stays near zero on GPUs)
        self.blocked_s = 0.0

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.blocked_s += time.perf_counter() - t0

    # ---- what the step does, for the schedule's proof and the memory trace ----------------
    def _record(self, layer: str, kind: str, axis: str, nbytes: int) -> None:
        self.counts[kind] += 1
        if self.calls is not None:
            self.calls.append(CollectiveCall(layer, kind, axis, nbytes))

    def record_p2p(self, call: CollectiveCall) -> None:
        """A pipeline transfer (kind send or recv, axis p) as torch's schedule issues it."""
        self._record(call.layer, call.kind, call.axis, call.nbytes)

    def memory_kind(self, kind: str):
        """Allocations inside the context are of this kind (a no-op unless a tracer is attached)."""
        return self.tracer.kind(kind) if self.tracer is not None else contextlib.nullcontext()

    def moment(self, where: str) -> None:
        """Where the step is now (a layer and phase): the tracer reports the moment of its peak."""
        if self.tracer is not None:
            self.tracer.where = where

    # ---- collectives -----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, axis: str, async_op=False, op=dist.ReduceOp.SUM, *,
                   layer: str, exact: bool = False):
        """exact: reduce in the tensor's own dtype (statistics, fp32 gradients, counts) rather than
        the collective dtype."""
        g = self._group(axis)
        if g is None:
            return None
        if (not exact and t.dtype != self.coll and t.dtype != torch.float64 and t.is_floating_point()
                and op == dist.ReduceOp.SUM):
            # reduce in the collective dtype, hand back in the tensor's own dtype
            tmp = t.to(self.coll)
            self._record(layer, "all_reduce", axis, _nbytes(tmp))
            work = _CastBack(dist.all_reduce(tmp, op=op, group=g, async_op=True), tmp, t)
        else:
            self._record(layer, "all_reduce", axis, _nbytes(t))
            work = dist.all_reduce(t, op=op, group=g, async_op=True)
        if async_op:
            return work
        self.wait(work)
        return None

    def _group(self, axis: str):
        if axis == "all":  # the world: the gradient norm and the step barrier
            return dist.group.WORLD if self.grid.size > 1 else None
        return self.grid.group(axis)

    def barrier(self) -> None:
        """Every rank at the same point (gloo runs it as a tiny all-reduce; recorded as one)."""
        self._record("step barrier", "all_reduce", "all", 4)
        dist.barrier()

    # ---- weight all-gather with prefetch (OAG) --------------------------------------------
    def start_sequence(self, seq: list[ShardedWeight]) -> None:
        """Announce the order of weight gathers of the coming forward/backward."""
        if self._prefetched is not None and self._prefetched[2] is not None:
            self.wait(self._prefetched[2])  # never leave a collective dangling
        self._seq, self._cursor, self._prefetched = list(seq), 0, None

    def _launch_gather(self, w: ShardedWeight):
        if self.grid.gz == 1:
            return w.param.detach(), None
        with self.memory_kind("gathered weights"):
            out = torch.empty(w.shard_len * w.gz, dtype=self.coll, device=w.param.device)
            self._record(layer_kind(w.name), "all_gather", "z", _nbytes(out))
            work = _all_gather(out, w.param.detach().to(self.coll), group=self.grid.group("z"), async_op=True)
        return out, work

    def gather_exact(self, w: ShardedWeight) -> torch.Tensor:
        """The fp32 master block of `w` [rows, cols], outside any announced sequence (checkpoints)."""
        if self.grid.gz == 1:
            return w.param.detach()[: w.numel].view(w.shape).clone()
        out = torch.empty(w.shard_len * w.gz, device=w.param.device)
        _all_gather(out, w.param.detach().contiguous(), group=self.grid.group("z"))
        return out[: w.numel].view(w.shape)

    def gather(self, w: ShardedWeight) -> torch.Tensor:
        """The full block of `w` as [rows, cols] in the compute dtype."""
        flat = None
        if self._cursor < len(self._seq) and self._seq[self._cursor] is w:
            if self._prefetched is not None and self._prefetched[0] == self._cursor:
                _, flat, work = self._prefetched
                if work is not None:
                    self.wait(work)
            self._prefetched = None
            self._cursor += 1
            if self.oag and self._cursor < len(self._seq):
                nxt = self._seq[self._cursor]
                self._prefetched = (self._cursor, *self._launch_gather(nxt))
        else:
            self.sequence_misses += 1
        if flat is None:
            flat, work = self._launch_gather(w)
            if work is not None:
                self.wait(work)
        with self.memory_kind("gathered weights"):
            return flat[: w.numel].view(w.shape).to(self.cdt)

    # ---- gradient reduce-scatter (ORS) ---------------------------------------------------
    def reduce_scatter_grad(self, w: ShardedWeight, dw: torch.Tensor) -> None:
        if self.grid.gz == 1:
            self._accumulate(w, dw.reshape(-1))
            return
        with self.memory_kind("gradient blocks"):
            flat = dw.reshape(-1)
            if w.shard_len * w.gz != w.numel:
                flat = torch.nn.functional.pad(flat, (0, w.shard_len * w.gz - w.numel))
            flat = flat.to(self.coll).contiguous()
            if self.ors:
                while len(self._pending_rs) >= self.max_inflight_rs:
                    self._complete_oldest_rs()  # room first: its full-size block is released
            out = torch.empty(w.shard_len, dtype=self.coll, device=flat.device)
            self._record(layer_kind(w.name), "reduce_scatter", "z", _nbytes(flat))
            work = _reduce_scatter(out, flat, group=self.grid.group("z"), async_op=True)
        if self.ors:
            self._pending_rs.append((w, _Pending(work, out, flat)))
            self.max_inflight_seen = max(self.max_inflight_seen, len(self._pending_rs))
        else:
            self.wait(work)
            self._accumulate(w, out)

    def _complete_oldest_rs(self) -> None:
        w, p = self._pending_rs.pop(0)
        self.wait(p.work)
        self._accumulate(w, p.buf)

    def _accumulate(self, w: ShardedWeight, g: torch.Tensor) -> None:
        w.param.grad.add_(g.to(w.param.grad.dtype))
        i = self._dp_bucket_of.pop(w, None)
        if i is not None:
            self._dp_left[i] -= 1
            if self._dp_left[i] == 0:  # the bucket's last shard is final: reduce it over D beside the backward
                self._launch_dp(i)

    # ---- data-parallel gradient all-reduce overlapped with the last backward -------------------
    def arm_data_parallel(self, buckets: list[tuple[list[ShardedWeight], torch.Tensor]]) -> bool:
        """Before the step's last micro-batch: each (weights, contiguous fp32 gradient slice) bucket is
        all-reduced over D as soon as every weight in it has accumulated its last gradient. False
        (nothing armed) when the flag is off or D is not split."""
        if not self.odp or self._group("d") is None:
            return False
        self._dp_bucket_of = {w: i for i, (ws, _) in enumerate(buckets) for w in ws}
        self._dp_left = [len(ws) for ws, _ in buckets]
        self._dp_buckets = [t for _, t in buckets]
        self._dp_work = []
        return True

    def _launch_dp(self, i: int, inside_backward: bool = True) -> None:
        self._dp_left[i] = -1  # launched: never twice
        self.dp_overlapped += inside_backward
        self._dp_work.append(self.all_reduce(self._dp_buckets[i], "d", async_op=True, layer="gradients", exact=True))

    def finish_data_parallel(self) -> None:
        """Wait for every bucket's D all-reduce (a bucket whose shards never all arrived is reduced now)."""
        for i, left in enumerate(self._dp_left):
            if left >= 0:
                self._launch_dp(i, inside_backward=False)
        for work in self._dp_work:
            self.wait(work)
        self._dp_bucket_of, self._dp_left, self._dp_buckets, self._dp_work = {}, [], [], []

    def finish_backward(self) -> None:
        """End of one micro-batch's backward: collect the outstanding reduce-scatters."""
        while self._pending_rs:
            self._complete_oldest_rs()
        if self._prefetched is not None and self._prefetched[2] is not None:
            self.wait(self._prefetched[2])  # a prefetch nobody used: never leave a collective dangling
        self._prefetched = None

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.tuner.mm(a, b)


class _CastBack:
    """Async all-reduce done in another dtype: copy the result back into the original tensor."""

    def __init__(self, work, tmp, dst):
        self.work, self.tmp, self.dst = work, tmp, dst

    def wait(self):
        self.work.wait()
        self.dst.copy_(self.tmp)


@dataclass
class LinearSpec:
    """Which grid axis splits the in- and out-features (normal: x, y; transposed: y, x)."""

    in_axis: str
    out_axis: str
    weight: ShardedWeight = field(repr=False)


class _ParallelLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, layer: LinearSpec, rt: Runtime):
        rt.moment(("recompute " if rt.keep_gathered else "forward ") + layer.weight.name)
        w = rt.gather(layer.weight)
        out = rt.mm(x, w).contiguous()
        rt.all_reduce(out, layer.in_axis, layer=layer_kind(layer.weight.name))  # partial sums over the in-features split
        ctx.layer, ctx.rt = layer, rt
        # under recompute the gathered weight is kept for this block's backward: no second gather
        ctx.save_for_backward(x, w if rt.keep_gathered else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w = ctx.saved_tensors
        rt, layer = ctx.rt, ctx.layer
        rt.moment("backward " + layer.weight.name)
        if w is None:
            w = rt.gather(layer.weight)
        dout = dout.contiguous()
        dx = rt.mm(dout, w.t()).contiguous()
        kind = layer_kind(layer.weight.name)
        handle = rt.all_reduce(dx, layer.out_axis, async_op=rt.oar, layer=kind)  # partial over the out-features split
        with rt.memory_kind("gradient blocks"):
            dw = rt.mm(x.t(), dout)  # OAR: runs while the dI all-reduce is in flight
        if handle is not None:
            rt.wait(handle)
        rt.reduce_scatter_grad(layer.weight, dw)
        return dx, None, None, None


def parallel_linear(x: torch.Tensor, layer: LinearSpec, rt: Runtime) -> torch.Tensor:
    return _ParallelLinearFn.apply(x, layer.weight.param, layer, rt)


class _ParallelEmbeddingFn(torch.autograd.Function):
    """Vocab-parallel (over Y), hidden over X, weight flat-sharded over Z like a linear layer.
    Backward needs no weight, so only the forward gathers it."""

    @staticmethod
    def forward(ctx, ids, shard, weight: ShardedWeight, lo: int, rt: Runtime):
        rt.moment("forward " + weight.name)
        w = rt.gather(weight)  # [Vp/gy, H/gx]
        local = ids - lo
        inside = (local >= 0) & (local < w.shape[0])
        idx = torch.where(inside, local, torch.zeros_like(local))
        out = w[idx] * inside.unsqueeze(-1).to(w.dtype)
        rt.all_reduce(out, "y", layer="embedding")
        ctx.save_for_backward(idx, inside)
        ctx.weight, ctx.rt = weight, rt
        return out

    @staticmethod
    def backward(ctx, dout):
        idx, inside = ctx.saved_tensors
        w, rt = ctx.weight, ctx.rt
        rt.moment("backward " + w.name)
        with rt.memory_kind("gradient blocks"):
            dw = torch.zeros(w.shape, dtype=torch.float32, device=dout.device)
            # tokens of other vocabulary shards add zeros to row 0: no data-dependent shapes (fake tensors)
            dw.index_add_(0, idx, dout.float() * inside.unsqueeze(-1))
        rt.reduce_scatter_grad(w, dw)
        return None, None, None, None, None


def parallel_embedding(ids: torch.Tensor, weight: ShardedWeight, lo: int, rt: Runtime) -> torch.Tensor:
    return _ParallelEmbeddingFn.apply(ids, weight.param, weight, lo, rt)
