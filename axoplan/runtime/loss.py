"""Vocabulary-parallel cross-entropy over Y, and the loss of a micro-batch.

Each Y rank holds logits for its slice of the padded vocabulary [T, Vp/gy] (replicated over X).
Per token, the max, the sum of exponentials and the target's logit are all-reduced over Y; the
padded vocabulary entries are masked to -inf so they never win and get no gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, lo: int, vocab: int, rt):
        rt.moment("forward loss")
        # one fp32 copy of the local logits, then in place (as fused vocabulary-parallel losses do)
        lf = logits.to(torch.float32, copy=True)
        cols = torch.arange(lo, lo + lf.shape[1], device=lf.device)
        lf.masked_fill_(cols >= vocab, float("-inf"))
        gmax = lf.max(-1, keepdim=True).values
        rt.all_reduce(gmax, "y", op=dist.ReduceOp.MAX, layer="loss")
        local_t = targets - lo
        inside = (local_t >= 0) & (local_t < lf.shape[1])
        idx = torch.where(inside, local_t, torch.zeros_like(local_t)).unsqueeze(-1)
        tgt = torch.where(inside.unsqueeze(-1), lf.gather(-1, idx), torch.zeros_like(gmax))
        e = lf.sub_(gmax).exp_()
        sums = torch.cat([e.sum(-1, keepdim=True), tgt], -1)
        del lf, e
        rt.all_reduce(sums, "y", layer="loss", exact=True)  # fp32 whatever the collective dtype: this is the loss
        loss = torch.log(sums[:, 0]) + gmax[:, 0] - sums[:, 1]
        ctx.save_for_backward(logits, gmax, sums[:, :1], idx, inside)
        ctx.lo, ctx.vocab, ctx.rt = lo, vocab, rt
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, gmax, sumexp, idx, inside = ctx.saved_tensors
        ctx.rt.moment("backward loss")
        with ctx.rt.memory_kind("logits"):
            p = logits.to(torch.float32, copy=True)  # the one fp32 copy: softmax and its gradient in place
            cols = torch.arange(ctx.lo, ctx.lo + p.shape[1], device=p.device)
            p.masked_fill_(cols >= ctx.vocab, float("-inf")).sub_(gmax).exp_().div_(sumexp)
            p.scatter_add_(-1, idx, -inside.unsqueeze(-1).to(p.dtype))
            return p.mul_(dloss.unsqueeze(-1)).to(logits.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, lo: int, vocab: int, rt) -> torch.Tensor:
    """Per-token loss [T] (fp32) from local logits [T, Vp/gy] and global target ids [T]."""
    return _VocabParallelCE.apply(logits, targets, lo, vocab, rt)
