"""LayerNorm and RMSNorm over channels sharded across X, exact (the same numbers as one GPU
holding all channels): the per-token sums are all-reduced over X in forward and backward.
Statistics are kept in fp32 whatever the compute dtype."""
from __future__ import annotations

import torch

EPS = 1e-5


class _ShardedNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, hidden: int, rms: bool, rt):
        xf = x.float()
        if rms:
            stats = (xf * xf).sum(-1, keepdim=True)
            rt.all_reduce(stats, "x", layer="norm", exact=True)
            mean = torch.zeros_like(stats)
            var = stats / hidden
        else:
            stats = torch.cat([xf.sum(-1, keepdim=True), (xf * xf).sum(-1, keepdim=True)], -1)
            rt.all_reduce(stats, "x", layer="norm", exact=True)
            mean = stats[:, :1] / hidden
            var = (stats[:, 1:] / hidden - mean * mean).clamp_min(0.0)
        rstd = torch.rsqrt(var + EPS)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.hidden, ctx.rms, ctx.rt = hidden, rms, rt
        return ((xf - mean) * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        xhat = (x.float() - mean) * rstd
        dyf = dy.float()
        g = dyf * weight.float()
        dw = (dyf * xhat).sum(0)
        if ctx.rms:
            sums = (g * xhat).sum(-1, keepdim=True)
            ctx.rt.all_reduce(sums, "x", layer="norm", exact=True)
            dx = rstd * (g - xhat * sums / ctx.hidden)
        else:
            sums = torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1)
            ctx.rt.all_reduce(sums, "x", layer="norm", exact=True)
            dx = rstd * (g - sums[:, :1] / ctx.hidden - xhat * sums[:, 1:] / ctx.hidden)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None


def sharded_norm(x: torch.Tensor, weight: torch.Tensor, hidden: int, kind: str, rt) -> torch.Tensor:
    """x [T, H/gx] -> normalised over all H channels, times the X-sharded weight [H/gx]."""
    return _ShardedNormFn.apply(x, weight, hidden, kind == "rmsnorm", rt)
