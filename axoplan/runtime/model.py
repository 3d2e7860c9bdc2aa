"""The GPT on the 4D grid, built from the 3D-parallel linear layer.

Layouts per rank (reference §2): hidden states between blocks [T, H/gx], replicated over Y;
qkv is a normal layer whose Y shard holds whole q, k and v heads (n_heads/gy and kv_heads/gy);
attention runs locally on those heads; attn_out and fc2 are transposed layers; the embedding is
vocab-parallel over Y and hidden-parallel over X; the LM head is a normal layer H -> Vp with a
vocab-parallel cross-entropy. Norm weights and learned positions are X slices, replicated over
Y, Z and D. Every sharded weight slices the same full tensors the reference GPT holds.

A pipeline rank holds a slice (`blocks`, with the embedding on the first stage and the final norm and LM
head on the last: runtime/pipeline_stage.py); names and initial values stay those of the whole model.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from axoplan.planner.specs import ModelSpec
from axoplan.runtime.loss import vocab_parallel_cross_entropy
from axoplan.runtime.norm import sharded_norm
from axoplan.runtime.parallel_linear import (
    LinearSpec,
    Runtime,
    ShardedWeight,
    parallel_embedding,
    parallel_linear,
)
from axoplan.runtime.reference import (
    apply_rope,
    attention,
    full_param_shapes,
    iter_full_init,
    rope_tables,
)

BLOCK_LINEARS = ("qkv", "attn_out", "fc1", "fc2")
FULL_INIT_MAX_PARAMS = 1 << 28  # above this, each rank draws only its own blocks (see init)


def _part(n: int, parts: int, i: int) -> torch.Tensor:
    size = n // parts
    return torch.arange(i * size, (i + 1) * size)


class ParallelGPT:
    def __init__(self, spec: ModelSpec, rt: Runtime, *, seed: int = 0, checkpointing: bool = False,
                 device: torch.device | str = "cpu", init_params: dict[str, torch.Tensor] | None = None,
                 blocks=None, embedding: bool = True, head: bool = True):
        self.spec, self.rt, self.checkpointing = spec, rt, checkpointing
        # the slice this rank holds (a pipeline stage's): global block indices, the embedding, the LM head
        self.block_ids = list(range(spec.n_layers)) if blocks is None else sorted(blocks)
        self.has_embedding, self.has_head = embedding, head
        self.device = torch.device(device)
        g = rt.grid
        c = g.coords
        h, vp = spec.hidden, spec.padded_vocab
        self.hx = h // g.gx
        self.heads_local, self.kv_local = spec.n_heads // g.gy, spec.kv_heads // g.gy
        self.vocab_lo = c.y * (vp // g.gy)
        shapes = full_param_shapes(spec)

        def sharded(name, rows, cols, block):
            w = ShardedWeight(name, shapes[name], rows, cols, g.gz, c.z, self.device)
            w.block_key = block  # which (row, column) block of the full weight: seeds its own init
            return w

        xs = {"x": c.x, "y": c.y}
        sizes = {"x": g.gx, "y": g.gy}
        self.weights: dict[str, ShardedWeight] = {}
        if embedding:
            self.weights["tok_emb"] = sharded("tok_emb", _part(vp, g.gy, c.y), _part(h, g.gx, c.x), f"{c.y}/{c.x}")
        self.blocks: dict[int, dict[str, LinearSpec]] = {}
        for i in self.block_ids:
            layers = {}
            for lin in spec.block_linears():
                name = f"blocks.{i}.{lin.name}"
                ia, oa = lin.axes
                rows = _part(lin.k, sizes[ia], xs[ia])
                cols = self._out_columns(lin.name, lin.n, sizes[oa], xs[oa])
                self.weights[name] = sharded(name, rows, cols, f"{xs[ia]}/{xs[oa]}")
                layers[lin.name] = LinearSpec(ia, oa, self.weights[name])
            self.blocks[i] = layers
        if head:
            self.weights["lm_head"] = sharded("lm_head", _part(h, g.gx, c.x), _part(vp, g.gy, c.y), f"{c.x}/{c.y}")
            self.head = LinearSpec("x", "y", self.weights["lm_head"])

        # replicated over Y, Z, D: the X slice of the hidden channels
        self.xcols = _part(h, g.gx, c.x)
        self.replicated: dict[str, torch.nn.Parameter] = {}
        for name, shape in shapes.items():
            if name in self.weights or not self.holds(name):
                continue
            t = torch.zeros(shape[:-1] + (self.hx,), device=self.device)
            self.replicated[name] = torch.nn.Parameter(t)
        self._init(seed, init_params)

        # gradients: all weight shards are views of one flat fp32 buffer -> one D all-reduce, or one per bucket
        total = sum(w.shard_len for w in self.weights.values())
        self.grad_buffer = torch.zeros(total, device=self.device)
        off = 0
        for w in self.weights.values():
            w.grad_offset = off
            w.param.grad = self.grad_buffer[off:off + w.shard_len]
            off += w.shard_len

    def holds(self, name: str) -> bool:
        """Whether this rank's slice holds the full parameter `name`."""
        if name in ("tok_emb", "pos_emb"):
            return self.has_embedding
        if name in ("lm_head", "norm_f"):
            return self.has_head
        return int(name.split(".")[1]) in self.blocks

    # ---- layouts ---------------------------------------------------------------------
    def _out_columns(self, name: str, n: int, parts: int, i: int) -> torch.Tensor:
        s = self.spec
        if name == "qkv":  # whole heads of q, k and v for this Y shard
            q, kv = s.n_heads * s.head_dim, s.kv_heads * s.head_dim
            return torch.cat([_part(q, parts, i), q + _part(kv, parts, i), q + kv + _part(kv, parts, i)])
        if name == "fc1" and s.mlp == "swiglu":  # matching gate and up columns
            return torch.cat([_part(s.ffn, parts, i), s.ffn + _part(s.ffn, parts, i)])
        return _part(n, parts, i)

    # ---- parameters --------------------------------------------------------------------
    def _init(self, seed: int, init_params) -> None:
        if init_params is not None:
            self.load_full_params(init_params)
        elif self.spec.n_params <= FULL_INIT_MAX_PARAMS:
            # same full tensors as ReferenceGPT(seed): every grid starts from the same model
            for name, t in iter_full_init(self.spec, seed):
                self._set_full(name, t)
        else:
            # too big to draw whole on every rank: each block from its own seeded generator
            for name, w in self.weights.items():
                key = f"{seed}/{name}/{w.block_key}"
                gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                std = 0.02 / ((2 * self.spec.n_layers) ** 0.5 if name.endswith(("attn_out", "fc2")) else 1.0)
                w.set_from_block((torch.randn(w.shape, generator=gen) * std).reshape(-1))
            for name, p in self.replicated.items():
                with torch.no_grad():
                    if p.dim() == 1:
                        p.fill_(1.0)
                    else:
                        gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}/{self.rt.grid.coords.x}".encode()))
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.01)

    def _set_full(self, name: str, t: torch.Tensor) -> None:
        if not self.holds(name):
            return
        if name in self.weights:
            self.weights[name].set_from_full(t)
        else:
            with torch.no_grad():
                self.replicated[name].copy_(t[..., self.xcols].to(self.device))

    def load_full_params(self, full: dict[str, torch.Tensor]) -> None:
        for name in full_param_shapes(self.spec):
            self._set_full(name, full[name])

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full tensors on every rank (a collective: all ranks call it). Holds the whole model."""
        g, c = self.rt.grid, self.rt.grid.coords
        out = {}
        for name, shape in full_param_shapes(self.spec).items():
            full = torch.zeros(shape, device=self.device)
            if name in self.weights:
                w = self.weights[name]
                block = self.rt.gather_exact(w)
                if c.z == 0 and c.d == 0:
                    full[w.rows.unsqueeze(1), w.cols.unsqueeze(0)] = block
            elif c.y == 0 and c.z == 0 and c.d == 0 and name in self.replicated:
                full[..., self.xcols] = self.replicated[name].detach()
            if g.size > 1:
                dist.all_reduce(full)  # one writer per element: the sum is exact
            out[name] = full.cpu()
        return out

    def grad_buckets(self, cap_bytes: int | None = None) -> list[tuple[list[ShardedWeight], torch.Tensor]]:
        """The buckets of the overlapped data-parallel all-reduce, as the cost model counts them
        (planner.comm.gradient_buckets): units in the order the backward makes them final (the LM
        head, each block's four weights from the last block, the embedding), filled greedily until a
        bucket holds cap_bytes (DP_BUCKET_BYTES) of fp32 gradient. Each bucket is its weights and the
        contiguous slice of grad_buffer their shards occupy (the buffer holds them in forward order)."""
        from axoplan.planner.comm import DP_BUCKET_BYTES, FP32

        cap = -(-(DP_BUCKET_BYTES if cap_bytes is None else cap_bytes) // FP32)
        w = self.weights
        units = ([[w["lm_head"]]] if self.has_head else []) + [
            [w[f"blocks.{i}.{name}"] for name in BLOCK_LINEARS] for i in reversed(self.block_ids)]
        units += [[w["tok_emb"]]] if self.has_embedding else []
        out, cur = [], []
        for k, unit in enumerate(units):
            cur += unit
            if sum(x.shard_len for x in cur) >= cap or k == len(units) - 1:
                lo = min(x.grad_offset for x in cur)
                hi = max(x.grad_offset + x.shard_len for x in cur)
                assert hi - lo == sum(x.shard_len for x in cur), "a bucket's shards must be adjacent in grad_buffer"
                out.append((cur, self.grad_buffer[lo:hi]))
                cur = []
        return out

    def replicated_params(self) -> list[torch.nn.Parameter]:
        return list(self.replicated.values())

    # ---- gather sequences (OAG) ----------------------------------------------------------
    def gather_sequence(self, backward: bool, chunk: tuple | None = None) -> list[ShardedWeight]:
        """The weight gathers of one micro-batch's forward (and backward) in order; chunk: (blocks, first,
        last) of one pipeline stage, whose forward and backward run apart (forward_sequence,
        backward_sequence)."""
        return self.forward_sequence(chunk) + (self.backward_sequence(chunk) if backward else [])

    def forward_sequence(self, chunk: tuple | None = None) -> list[ShardedWeight]:
        w = self.weights
        blocks, first, last = chunk or (self.block_ids, True, True)
        return (([w["tok_emb"]] if first else []) + [w[f"blocks.{i}.{name}"] for i in blocks for name in BLOCK_LINEARS]
                + ([w["lm_head"]] if last else []))

    def backward_sequence(self, chunk: tuple | None = None) -> list[ShardedWeight]:
        """The embedding's backward needs no weight: only the LM head and the blocks gather again."""
        w = self.weights
        blocks, _, last = chunk or (self.block_ids, True, True)
        seq = [w["lm_head"]] if last else []
        for i in reversed(list(blocks)):
            names = BLOCK_LINEARS if self.checkpointing else tuple(reversed(BLOCK_LINEARS))
            seq += [w[f"blocks.{i}.{name}"] for name in names]
        return seq

    # ---- forward -------------------------------------------------------------------------
    def _block(self, i: int, x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        s, rt, L = self.spec, self.rt, self.blocks[i]
        b, n = shape
        hd = s.head_dim
        h = sharded_norm(x, self.replicated[f"blocks.{i}.norm1"], s.hidden, s.norm, rt)
        qkv = parallel_linear(h, L["qkv"], rt)
        q, k, v = qkv.split([self.heads_local * hd, self.kv_local * hd, self.kv_local * hd], -1)
        q = q.reshape(b, n, self.heads_local, hd).transpose(1, 2)
        k = k.reshape(b, n, self.kv_local, hd).transpose(1, 2)
        v = v.reshape(b, n, self.kv_local, hd).transpose(1, 2)
        if s.position == "rope":
            cos, sin = rope_tables(n, hd, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = attention(q, k, v).transpose(1, 2).reshape(b * n, self.heads_local * hd)
        x = x + parallel_linear(a, L["attn_out"], rt)
        h = parallel_linear(sharded_norm(x, self.replicated[f"blocks.{i}.norm2"], s.hidden, s.norm, rt), L["fc1"], rt)
        if s.mlp == "swiglu":
            gate, up = h.chunk(2, -1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + parallel_linear(h, L["fc2"], rt)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] (the same on all X and Y ranks) -> local logits [b*s, Vp/gy]."""
        return self.stage_forward(ids, self.block_ids, True, True, tuple(ids.shape))

    def stage_forward(self, inp: torch.Tensor, blocks, first: bool, last: bool, shape: tuple[int, int]):
        """A slice of the forward: token ids [b, s] in on the first stage, else the residual stream
        [b*s, H/gx]; the blocks `blocks`; the residual stream out, or on the last stage the logits."""
        s, rt = self.spec, self.rt
        b, n = shape
        x = inp
        if first:
            x = parallel_embedding(inp.reshape(-1), self.weights["tok_emb"], self.vocab_lo, rt)
            if s.position == "learned":
                x = (x.view(b, n, -1) + self.replicated["pos_emb"][:n].to(x.dtype)).view(b * n, -1)
        for i in blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = _CheckpointBlock.apply(x, self, i, (b, n))
            else:
                x = self._block(i, x, (b, n))
        if not last:
            return x
        x = sharded_norm(x, self.replicated["norm_f"], s.hidden, s.norm, rt)
        with rt.memory_kind("logits"):
            return parallel_linear(x, self.head, rt)

    def loss_sum(self, tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """tokens [b, s+1]; keep [b, s] (1 = counts): the sum of the kept per-token losses."""
        logits = self.logits(tokens[:, :-1])
        with self.rt.memory_kind("logits"):
            per_tok = vocab_parallel_cross_entropy(logits, tokens[:, 1:].reshape(-1), self.vocab_lo,
                                                   self.spec.vocab, self.rt)
            return (per_tok * keep.reshape(-1).to(per_tok.dtype)).sum()


class _CheckpointBlock(torch.autograd.Function):
    """Full activation checkpointing of one block. The recompute gathers each weight (prefetched)
    and keeps it for the block's backward, so there is no second all-gather."""

    @staticmethod
    def forward(ctx, x, model: ParallelGPT, i: int, shape):
        ctx.model, ctx.i, ctx.shape = model, i, shape
        ctx.save_for_backward(x)
        return model._block(i, x, shape)  # autograd records nothing inside a Function's forward

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        model = ctx.model
        x = x.detach().requires_grad_(True)
        model.rt.keep_gathered = True
        try:
            with torch.enable_grad(), model.rt.memory_kind("activations"):
                y = model._block(ctx.i, x, ctx.shape)
        finally:
            model.rt.keep_gathered = False
        torch.autograd.backward(y, dy)
        return x.grad, None, None, None


@torch.no_grad()
def generate_greedy(model: ParallelGPT, prompt_ids, n_new: int) -> list[int]:
    """Greedy decoding with the parallel model; every rank calls it with the same prompt and gets
    the same tokens. No KV cache: each new token re-runs the (short) context."""
    rt, spec = model.rt, model.spec
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=model.device).view(1, -1)
    out = []
    for _ in range(n_new):
        ctx = ids[:, -spec.seq_len:]
        rt.start_sequence(model.gather_sequence(backward=False))
        last = model.logits(ctx)[-1].float()
        cols = torch.arange(model.vocab_lo, model.vocab_lo + last.numel(), device=last.device)
        last = last.masked_fill(cols >= spec.vocab, float("-inf"))
        val, idx = last.max(0)
        best = val.clone().view(1)
        rt.all_reduce(best, "y", op=dist.ReduceOp.MAX, layer="generate")
        # ties: the smallest global id wins, as argmax on one GPU
        cand = torch.where(val == best[0], idx + model.vocab_lo, torch.tensor(1 << 40, device=last.device)).view(1)
        rt.all_reduce(cand, "y", op=dist.ReduceOp.MIN, layer="generate")
        out.append(int(cand))
        ids = torch.cat([ids, cand.view(1, 1)], 1)
    rt.finish_backward()
    return out
