"""Proof that a run resumed from a checkpoint is the run that was never stopped: on each grid, train 6
steps without a stop; then train 3 with a checkpoint, start a fresh trainer that resumes from it, and
train to 6. Every loss and gradient norm must be equal bit for bit (gloo ranks, the tiny model).

    python -m axoplan.runtime.resumecheck        # a world of 4: grids 1x2x2x1, 2x1x1x2 and 1x1x2x1 x pp 2
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from axoplan.runconfig import Grid, LaunchConfig
from axoplan.runtime.grid import build_grid
from axoplan.runtime.selfcheck import TINY, _free_port, spawn_world
from axoplan.runtime.train import Resolved, Trainer

# (grid, pp): together they split X, Y, Z, D and the layers over two pipeline stages (each stage's own shards)
CASES = (((1, 2, 2, 1), 1), ((2, 1, 1, 2), 1), ((1, 1, 2, 1), 2))
STEPS, STOP = 6, 3


def _train(cfg: LaunchConfig, steps: int | None = None) -> tuple[list[dict], bool]:
    """The run's records on this rank, and whether it is the rank that reports them (a pipeline's loss is on
    its last stage)."""
    g = cfg.grid
    res = Resolved(torch.device("cpu"), "gloo", torch.float32, torch.float32, blas_tuning=False)
    trainer = Trainer.for_grid(cfg, build_grid(g.gx, g.gy, g.gz, g.gdata, cfg.order, pp=cfg.pp), res)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the step lines: only the verdict is printed
            trainer.fit(steps)
        return trainer.records, trainer.reporting
    finally:
        trainer.close()


def resume_case(grid: tuple, pp: int, model_path: str, folder: Path) -> dict:
    """On every rank: the uninterrupted and the resumed run's per-step losses and norms (as float.hex), and
    whether this rank reports them."""
    base = LaunchConfig(model=model_path, grid=Grid(*grid), pp=pp, global_batch=8, micro_batch=2, seq_len=16,
                        steps=STEPS, lr=3e-3, lr_warmup_steps=2, min_lr=3e-4, tensorboard=None, seed=0)
    whole, reporting = _train(dataclasses.replace(base, out=str(folder / "whole")))
    part = dataclasses.replace(base, out=str(folder / "part"), checkpoint_every=STOP)
    first, _ = _train(part, STOP)
    resumed, _ = _train(dataclasses.replace(part, resume=True))

    def hexes(recs):
        return [(r["step"], float(r["loss"]).hex(), float(r["grad_norm"]).hex()) for r in recs]

    return {"grid": list(grid), "pp": pp, "whole": hexes(whole), "resumed": hexes(first + resumed),
            "reporting": reporting}


def _worker(rank: int, world: int, port: int, cases, out_path: str, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = []
    for i, (grid, pp) in enumerate(cases):
        results.append(resume_case(grid, pp, str(Path(tmp) / "tiny.yaml"), Path(tmp) / f"grid{i}"))
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:  # per case, the reporting rank's (the one whose losses are the run's)
        Path(out_path).write_text(json.dumps([next(r[i] for r in every if r[i]["reporting"])
                                              for i in range(len(cases))]))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int = 4, cases=CASES, folder: str | None = None, timeout: float = 300.0) -> list[dict]:
    """Spawn `world` gloo ranks; rank 0's results per grid. The run folders are kept under `folder` if given."""
    import yaml

    with tempfile.TemporaryDirectory() as scratch:
        tmp = folder or scratch
        (Path(tmp) / "tiny.yaml").write_text(yaml.safe_dump(dataclasses.asdict(TINY)))
        out = str(Path(tmp) / "resume.json")
        spawn_world(_worker, (world, _free_port(), list(cases), out, tmp), world, timeout)
        return json.loads(Path(out).read_text())


def main() -> int:
    ok = True
    for r in run_world():
        same = r["whole"] == r["resumed"]
        ok &= same
        print(f"{'ok  ' if same else 'FAIL'} grid {'x'.join(map(str, r['grid']))}"
              f"{' pp ' + str(r['pp']) if r['pp'] > 1 else ''}: "
              f"{len(r['whole'])} steps, resumed at {STOP}, losses {'equal bit for bit' if same else 'differ'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
