"""Framework microbenchmark: what one dispatched kernel, and the element-wise work, cost inside the
bundled trainer.

A bare op on a few elements (memory.overhead_ops) measures the dispatcher alone. The trainer pays
more per kernel: autograd records and replays every op, its parallel layers are Python autograd
Functions, the optimizer walks parameter lists. On small models (and on any model at small
micro-batches) that cost decides the step time, so it is measured here on the trainer itself:
whole optimizer steps of tiny GPT models on a grid of one, every rank at once, as the node runs
them when it trains. The profile writer subtracts what the planner models for GEMMs and attention and
splits the rest, by least squares over the models, into a cost per kernel the planner counts and a
bandwidth for the bytes it counts (profile_writer.framework_part)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from axoplan.calibrate.timing import time_window

# (layers, micro-batches per step, micro-batch, hidden, heads, vocab, seq). The first four are tiny
# (every tensor a few hundred elements: dispatch sets the time); the last two move activations of
# about a thousand tokens, so the element-wise work between the GEMMs shows as well.
CONFIGS = ((1, 1, 1, 16, 2, 64, 16), (2, 1, 1, 16, 2, 64, 16), (4, 1, 1, 16, 2, 64, 16), (2, 2, 1, 16, 2, 64, 16),
           (1, 1, 16, 32, 4, 128, 64), (2, 1, 16, 32, 4, 128, 64))


@dataclass(frozen=True)
class FrameworkResult:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    grad_acc: int
    seconds: float  # median seconds per optimizer step, mean over ranks


def tiny_model(layers: int, hidden: int, heads: int, vocab: int, seq: int):
    from axoplan.planner.specs import ModelSpec

    return ModelSpec(name=f"framework-{layers}l-{hidden}h", n_layers=layers, hidden=hidden, n_heads=heads,
                     vocab=vocab, seq_len=seq, vocab_multiple=vocab, description="calibration: framework overhead",
                     source="axoplan/calibrate/framework.py")


def _trainer(model, grad_acc: int, micro_batch: int, device, dtype):
    """A Trainer on a grid of one, whatever the world around it: no collective is issued."""
    from axoplan.runconfig import LaunchConfig
    from axoplan.runtime.grid import Coords, ParallelGrid
    from axoplan.runtime.train import Resolved, Trainer

    cfg = LaunchConfig(model=model, global_batch=grad_acc * micro_batch, micro_batch=micro_batch, metrics=None)
    grid = ParallelGrid(1, 1, 1, 1, "xyz", 0, Coords(0, 0, 0, 0))
    res = Resolved(device, "nccl" if device.type == "cuda" else "gloo", dtype, dtype, device.type == "cuda")
    return Trainer(cfg, grid, res)


def run(device, dtype, mean_over_ranks: Callable[[list[float]], list[float]],
        on_result: Callable[[FrameworkResult], None], repeats: int = 5, min_batch_s: float = 2e-3,
        barrier=None, configs=CONFIGS) -> None:
    """`mean_over_ranks` is collective: each rank's times in, the mean over ranks out."""
    cuda = device.type == "cuda"
    for layers, grad_acc, mb, hidden, heads, vocab, seq in configs:
        tr = _trainer(tiny_model(layers, hidden, heads, vocab, seq), grad_acc, mb, device, dtype)
        step = [0]

        def one(tr=tr, step=step):  # bound now: the closure runs inside this iteration only
            step[0] += 1
            tr.train_step(step[0])

        t = time_window([one], cuda=cuda, warmup=3, repeats=repeats, min_batch_s=min_batch_s, barrier=barrier)[0]
        sec = mean_over_ranks([t.seconds])[0]
        on_result(FrameworkResult(layers, hidden, heads, vocab, seq, mb, grad_acc, sec))
