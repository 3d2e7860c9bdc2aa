"""The single-process reference GPT: plain PyTorch, every weight whole, the numbers the parallel
trainer must reproduce. Its parameters use the full-tensor names of `full_param_shapes`
(linear weights as W [k, n], O = I·W), so it loads what the parallel model gathers.

Layouts inside the full tensors (the parallel model slices them the same way):
  qkv columns  [q heads | k heads | v heads], each head `head_dim` wide
  fc1 columns  gelu: [F];  swiglu: [gate F | up F]  (activation: silu(gate) * up)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from axoplan.planner.specs import ModelSpec
from axoplan.runtime.goldfish import goldfish_keep

NORM_EPS = 1e-5


def full_param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, vp = spec.hidden, spec.padded_vocab
    shapes: dict[str, tuple[int, ...]] = {"tok_emb": (vp, h)}
    if spec.position == "learned":
        shapes["pos_emb"] = (spec.seq_len, h)
    for i in range(spec.n_layers):
        for lin in spec.block_linears():
            shapes[f"blocks.{i}.{lin.name}"] = (lin.k, lin.n)
        shapes[f"blocks.{i}.norm1"] = (h,)
        shapes[f"blocks.{i}.norm2"] = (h,)
    shapes["norm_f"] = (h,)
    shapes["lm_head"] = (h, vp)
    return shapes


def decays(name: str) -> bool:
    """Weight decay on the 2-D weights of linear layers and the token embedding only."""
    return name == "tok_emb" or name == "lm_head" or name.split(".")[-1] in ("qkv", "attn_out", "fc1", "fc2")


def iter_full_init(spec: ModelSpec, seed: int):
    """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers), norms at one.
    Yields one full tensor at a time so a caller never holds the whole model twice."""
    g = torch.Generator().manual_seed(seed)
    for name, shape in full_param_shapes(spec).items():
        if len(shape) == 1:
            yield name, torch.ones(shape)
            continue
        std = 0.01 if name == "pos_emb" else 0.02
        if name.endswith(("attn_out", "fc2")):
            std /= math.sqrt(2 * spec.n_layers)
        yield name, torch.randn(shape, generator=g) * std


def init_full_params(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    return dict(iter_full_init(spec, seed))


def rope_tables(seq: int, head_dim: int, device=None, base: float = 10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.cos(ang), torch.sin(ang)


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """t [b, heads, s, hd]; rotate-half convention."""
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half].float(), t[..., half:].float()
    out = torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)
    return out.to(t.dtype)


def attention(q, k, v):
    """q [b, hq, s, d], k/v [b, hkv, s, d]; causal, grouped-query when hkv < hq."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class ReferenceGPT(torch.nn.Module):
    def __init__(self, spec: ModelSpec, params: dict[str, torch.Tensor] | None = None, seed: int = 0):
        super().__init__()
        self.spec = spec
        params = params if params is not None else init_full_params(spec, seed)
        self.p = torch.nn.ParameterDict({n.replace(".", "__"): torch.nn.Parameter(t.clone().float())
                                         for n, t in params.items()})

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "__")]

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n.replace("__", "."): t.detach().clone() for n, t in self.p.items()}

    def named_full_parameters(self):
        return [(n.replace("__", "."), t) for n, t in self.p.items()]

    def _norm(self, x, w):
        if self.spec.norm == "rmsnorm":
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + NORM_EPS) * w
        return F.layer_norm(x, (x.shape[-1],), w, None, NORM_EPS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> logits [b, s, vocab] (the padded entries removed)."""
        s = self.spec
        b, n = ids.shape
        hd, nh, kv = s.head_dim, s.n_heads, s.kv_heads
        x = self.w("tok_emb")[ids]
        if s.position == "learned":
            x = x + self.w("pos_emb")[:n]
        else:
            cos, sin = rope_tables(n, hd, ids.device)
        for i in range(s.n_layers):
            pre = f"blocks.{i}."
            qkv = self._norm(x, self.w(pre + "norm1")) @ self.w(pre + "qkv")
            q, k, v = qkv.split([nh * hd, kv * hd, kv * hd], -1)
            q = q.view(b, n, nh, hd).transpose(1, 2)
            k = k.view(b, n, kv, hd).transpose(1, 2)
            v = v.view(b, n, kv, hd).transpose(1, 2)
            if s.position == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            a = attention(q, k, v).transpose(1, 2).reshape(b, n, nh * hd)
            x = x + a @ self.w(pre + "attn_out")
            h1 = self._norm(x, self.w(pre + "norm2")) @ self.w(pre + "fc1")
            if s.mlp == "swiglu":
                gate, up = h1.split([s.ffn, s.ffn], -1)
                h1 = F.silu(gate) * up
            else:
                h1 = F.gelu(h1)
            x = x + h1 @ self.w(pre + "fc2")
        logits = self._norm(x, self.w("norm_f")) @ self.w("lm_head")
        return logits[..., : s.vocab]

    def loss(self, tokens: torch.Tensor, goldfish: tuple[int, int] | None = None) -> torch.Tensor:
        """tokens [b, s+1]: mean cross-entropy over the kept target tokens of the whole batch."""
        logits = self(tokens[:, :-1])
        targets = tokens[:, 1:]
        per_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                  reduction="none")
        if goldfish is None:
            return per_tok.mean()
        keep = torch.from_numpy(goldfish_keep(targets.cpu().numpy(), *goldfish)).reshape(-1).to(per_tok.device)
        return (per_tok * keep).sum() / keep.sum()

    @torch.no_grad()
    def generate_greedy(self, prompt_ids, n_new: int) -> list[int]:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).view(1, -1)
        for _ in range(n_new):
            ctx = ids[:, -self.spec.seq_len:]
            nxt = self(ctx)[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        return ids[0, -n_new:].tolist() if n_new else []


def reference_optimizer(model: ReferenceGPT, lr: float, weight_decay: float, eps: float = 1e-8) -> torch.optim.AdamW:
    named = model.named_full_parameters()
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=eps)


def reference_step(model: ReferenceGPT, opt, tokens: torch.Tensor, grad_clip: float,
                   goldfish: tuple[int, int] | None = None) -> tuple[float, float]:
    """One optimizer step on the whole global batch; returns (loss, grad norm before clipping)."""
    opt.zero_grad(set_to_none=True)
    loss = model.loss(tokens, goldfish)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return float(loss.detach()), float(norm)


__all__ = ["ReferenceGPT", "full_param_shapes", "init_full_params", "reference_optimizer", "reference_step"]
