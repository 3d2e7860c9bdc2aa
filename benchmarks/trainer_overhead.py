"""Trainer overhead at G = 1: time per batch of the bundled 4D trainer against a plain
single-process PyTorch GPT of the same shapes (written below, nanoGPT style), same batch, same
optimizer, same threads. Steps of the two alternate so machine noise hits both alike.

    python benchmarks/trainer_overhead.py [--model gpt-small] [--steps 20]

Prints the median times and their ratio (target: at most 1.10x on CPU).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainBlock(nn.Module):
    def __init__(self, h, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h, bias=False), nn.LayerNorm(h, bias=False)
        self.qkv, self.proj = nn.Linear(h, 3 * h, bias=False), nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, -1)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, spec):
        super().__init__()
        h = spec.hidden
        self.tok = nn.Embedding(spec.padded_vocab, h)
        self.pos = nn.Embedding(spec.seq_len, h)
        self.blocks = nn.ModuleList(PlainBlock(h, spec.n_heads, spec.ffn) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(h, bias=False)
        self.head = nn.Linear(h, spec.padded_vocab, bias=False)
        self.vocab = spec.vocab

    def forward(self, tokens):
        ids, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))[..., : self.vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--blas-tuning", default="auto", choices=("auto", "on", "off"),
                    help="the trainer's BLAS tuning (auto: off on CPU)")
    args = ap.parse_args()

    from axoplan.runconfig import LaunchConfig
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Trainer, init_distributed

    cfg = LaunchConfig(model=args.model, global_batch=args.global_batch, micro_batch=args.micro_batch, metrics=None,
                       blas_tuning=args.blas_tuning)
    _, res = init_distributed(cfg)  # a world of one; CPU threads as the trainer sets them
    trainer = Trainer(cfg, build_grid(1, 1, 1, 1), res)
    spec = trainer.spec
    plain = PlainGPT(spec)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    tokens = torch.from_numpy(trainer.source.sequences(0, range(args.global_batch), spec.seq_len + 1))
    acc = args.global_batch // args.micro_batch

    def plain_step():
        opt.zero_grad(set_to_none=True)
        for m in range(acc):
            (plain(tokens[m * args.micro_batch:(m + 1) * args.micro_batch]) / acc).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.grad_clip)
        opt.step()

    t_tr, t_pl = [], []
    for step in range(args.steps + 3):
        t0 = time.perf_counter()
        trainer.train_step(step)
        t1 = time.perf_counter()
        plain_step()
        t2 = time.perf_counter()
        if step >= 3:  # warm-up
            t_tr.append(t1 - t0)
            t_pl.append(t2 - t1)
    mt, mp = statistics.median(t_tr), statistics.median(t_pl)
    print(f"model {spec.name}: {spec.n_layers} layers, hidden {spec.hidden}, seq {spec.seq_len}, "
          f"batch {args.global_batch} (micro {args.micro_batch}), threads {torch.get_num_threads()}, "
          f"BLAS tuning {trainer.rt.tuner.enabled} {trainer.rt.tuner.summary() if trainer.rt.tuner.enabled else ''}")
    print(f"trainer (G=1)   median {mt * 1e3:8.2f} ms/batch")
    print(f"plain PyTorch   median {mp * 1e3:8.2f} ms/batch")
    print(f"overhead ratio  {mt / mp:.3f}x  (target <= 1.10x)")
    assert math.isfinite(mt / mp)


if __name__ == "__main__":
    main()
