"""Memory-bound work: streaming bandwidth, element-wise ops, per-op dispatch overhead, attention.

Every rank runs the same measurement at the same time, so the numbers are per rank with the
node busy, as in training (on a CPU the ranks share cores and memory channels)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from axoplan.calibrate.timing import time_window


@dataclass(frozen=True)
class MemResult:
    kind: str  # bandwidth | elementwise | overhead
    op: str
    elements: int
    nbytes: int  # bytes read + written by one call
    seconds: float  # mean over ranks of the per-rank median


def _cuda(device) -> bool:
    return device.type == "cuda"


def bandwidth_ops(elements: int, dtype, device) -> dict[str, tuple[Callable, int]]:
    """Large streaming ops (out of cache): copy moves 2 buffers, add 3."""
    import torch

    a = torch.ones(elements, dtype=dtype, device=device)
    b = torch.ones(elements, dtype=dtype, device=device)
    c = torch.empty(elements, dtype=dtype, device=device)
    e = a.element_size()
    return {
        "copy": (lambda: c.copy_(a), 2 * elements * e),
        "add": (lambda: torch.add(a, b, out=c), 3 * elements * e),
    }


def elementwise_ops(rows: int, cols: int, dtype, device) -> dict[str, tuple[Callable, int]]:
    """The non-GEMM work of a transformer block on an activation [rows, cols]: bytes are the
    compulsory traffic (inputs read once, output written once)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, cols, device=device).to(dtype)
    y = torch.randn(rows, cols, device=device).to(dtype)
    w = torch.ones(cols, device=device, dtype=dtype)
    b = torch.zeros(cols, device=device, dtype=dtype)
    out = torch.empty_like(x)
    nb = x.numel() * x.element_size()
    return {
        "add": (lambda: torch.add(x, y, out=out), 3 * nb),
        "gelu": (lambda: F.gelu(x), 2 * nb),
        "layer_norm": (lambda: F.layer_norm(x, (cols,), w, b), 2 * nb),
        "softmax": (lambda: torch.softmax(x, dim=-1), 2 * nb),
    }


def overhead_ops(dtype, device) -> dict[str, Callable]:
    """Ops on a handful of elements: their time is the fixed cost of one op dispatch / kernel launch."""
    import torch

    x = torch.ones(8, dtype=dtype, device=device)
    m = torch.ones(4, 4, dtype=dtype, device=device)
    return {"add": lambda: x.add_(1), "mul": lambda: torch.mul(x, x), "matmul4": lambda: torch.matmul(m, m),
            "gelu": lambda: torch.nn.functional.gelu(x)}


def run(dtype, device, bandwidth_elements: list[int], activation_shapes: list[tuple[int, int]],
        mean_over_ranks: Callable[[list[float]], list[float]], on_result: Callable[[MemResult], None],
        repeats: int = 5, min_batch_s: float = 2e-3, barrier=None) -> None:
    """`mean_over_ranks` is collective: each rank's times in, the mean over ranks out."""
    cuda = _cuda(device)

    def window(kind, ops: dict, elements: int, warmup: int, batch_s: float):
        names = list(ops)
        fns = [ops[k][0] if isinstance(ops[k], tuple) else ops[k] for k in names]
        ts = time_window(fns, cuda=cuda, warmup=warmup, repeats=repeats, min_batch_s=batch_s, barrier=barrier)
        for name, s in zip(names, mean_over_ranks([t.seconds for t in ts])):
            nb = ops[name][1] if isinstance(ops[name], tuple) else 0
            on_result(MemResult(kind, name, elements, nb, s))

    for n in bandwidth_elements:
        window("bandwidth", bandwidth_ops(n, dtype, device), n, 2, max(5e-3, min_batch_s))
    for rows, cols in activation_shapes:
        window("elementwise", elementwise_ops(rows, cols, dtype, device), rows * cols, 2, min_batch_s)
    window("overhead", overhead_ops(dtype, device), 8, 20, max(5e-3, min_batch_s))


# ---- attention ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnResult:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    pass_: str  # forward | forward_backward
    seconds: float


def run_attention(shapes: list[tuple[int, int, int, int]], dtype, device,
                  mean_over_ranks: Callable[[list[float]], list[float]], on_result: Callable[[AttnResult], None],
                  repeats: int = 5, min_batch_s: float = 2e-3, barrier=None) -> None:
    import torch
    import torch.nn.functional as F

    cuda = _cuda(device)
    for (b, h, s, d) in shapes:
        q, k, v = (torch.randn(b, h, s, d, device=device).to(dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(b, h, s, d, device=device).to(dtype)
        runs = []
        for causal in (False, True):
            def fwd(causal=causal, q=q, k=k, v=v):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def fwd_bwd(causal=causal, q=q, k=k, v=v, grad=grad):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                q.grad = k.grad = v.grad = None
                out.backward(grad)

            runs += [(causal, "forward", fwd), (causal, "forward_backward", fwd_bwd)]
        ts = time_window([r[2] for r in runs], cuda=cuda, warmup=1, repeats=repeats, min_batch_s=min_batch_s,
                         max_total_s=1.0, barrier=barrier)
        for (causal, name, _), sec in zip(runs, mean_over_ranks([t.seconds for t in ts])):
            on_result(AttnResult(b, h, s, d, causal, name, sec))
