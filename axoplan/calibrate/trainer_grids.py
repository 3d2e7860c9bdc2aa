"""Trainer microbenchmark on parallel grids: whole optimizer steps of the bundled trainer on every
4D grid and placement of the calibration world, for three small calibration models.

The collective tables time each call alone (or after a synthetic compute burst); inside the trainer a
call also pays what the tables cannot see: the Python and autograd around it, ranks arriving at it at
different times, and (ranks sharing cores) the compute of the other groups on the same cores. How much
of a background collective hides behind the trainer's own compute is also a property of the trainer
(many small kernels with Python between them), not of one dense burst. Both are measured here, on the
trainer, as the framework part measures its per-kernel cost on a grid of one; the profile writer fits
the profile's corrections to these steps (profile_writer.trainer_part).

The models are made for calibration only (not presets a user validates against): small enough that
a step takes tens of milliseconds, with layers, widths, vocabularies and sequence lengths unlike each
other so that compute, collective count and message sizes do not move together."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

# (layers, hidden, heads, vocab, seq). The third has blocks for a Z gather to be prefetched behind and compute
# to hide it: without it the steps rarely decided overlap_efficiency (4-rank calibrations of 2026-12-06 left the
# dense-burst 0.10 in place, where the trainer's steps on gpt-tiny showed 0.9-1)
MODELS = ((2, 32, 4, 128, 32), (1, 96, 4, 192, 48), (4, 48, 4, 160, 96))
WARMUP, STEPS = 5, 15  # the trainer's summary: median time per batch after warm-up
MAX_GRIDS = 24  # per model: more ranks have many more grids; an even spread of them is timed


@dataclass(frozen=True)
class GridStep:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    micro_batch: int
    gx: int
    gy: int
    gz: int
    gdata: int
    order: str
    seconds: float  # median seconds per optimizer step after warm-up, mean over ranks


def calibration_model(layers: int, hidden: int, heads: int, vocab: int, seq: int):
    from axoplan.planner.specs import ModelSpec

    return ModelSpec(name=f"calib-{layers}l-{hidden}h-{vocab}v-{seq}s", n_layers=layers, hidden=hidden,
                     n_heads=heads, vocab=vocab, seq_len=seq, vocab_multiple=vocab,
                     description="calibration: the trainer on parallel grids", source="axoplan/calibrate/trainer_grids.py")


def global_batch(world: int) -> int:
    return 2 * world


def grids(world: int, model) -> list[tuple[int, int, int, int, str, int]]:
    """(gx, gy, gz, gdata, order, micro_batch) of every distinct grid and placement the model divides,
    micro-batch = all of a rank's sequences (one micro-step); at most MAX_GRIDS, evenly spread."""
    import numpy as np

    from axoplan.planner.space import ORDERS
    from axoplan.planner.space import enumerate_space, grid_problem

    gb = global_batch(world)
    c = enumerate_space(world, gb, orders="all", micro_batch=1, checkpointing="off")
    out = []
    for gx, gy, gz, gd, o in zip(c.gx, c.gy, c.gz, c.gdata, c.order):
        if gx * gy * gz * gd == 1:
            continue
        mb = int(gb // (gd * gz))
        if grid_problem(model, int(gx), int(gy), int(gz), int(gd), gb, mb) is None:
            out.append((int(gx), int(gy), int(gz), int(gd), ORDERS[int(o)], mb))
    if len(out) > MAX_GRIDS:
        out = [out[i] for i in np.unique(np.linspace(0, len(out) - 1, MAX_GRIDS).round().astype(int))]
    return out


def plan(world: int) -> list[tuple[tuple, tuple]]:
    return [(m, g) for m in MODELS for g in grids(world, calibration_model(*m))]


def run(world: int, device, dtype, mean_over_ranks: Callable[[list[float]], list[float]],
        on_result: Callable[[GridStep], None], warmup: int = WARMUP, steps: int = STEPS) -> None:
    """Every rank calls this at once (the grids' process groups are made by all ranks together)."""
    from axoplan.runconfig import LaunchConfig
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Resolved, Trainer

    res = Resolved(device, "nccl" if device.type == "cuda" else "gloo", dtype, dtype, device.type == "cuda")
    gb = global_batch(world)
    for m, (gx, gy, gz, gd, order, mb) in plan(world):
        model = calibration_model(*m)
        cfg = LaunchConfig(model=model, global_batch=gb, micro_batch=mb, metrics=None)
        tr = Trainer(cfg, build_grid(gx, gy, gz, gd, order), res)
        try:
            times = [tr.timed_step(s)[1] for s in range(warmup + steps)]
        finally:
            tr.close()
        sec = mean_over_ranks([statistics.median(times[warmup:])])[0]
        on_result(GridStep(*m, gb, mb, gx, gy, gz, gd, order, sec))
