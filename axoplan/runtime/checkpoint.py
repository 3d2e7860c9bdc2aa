"""Sharded checkpoints through torch.distributed.checkpoint (DCP), resumable on the same grid.

Each rank puts its own state in the DCP state dict: its weight shards and their AdamW moments under
keys named by its (x, y, z) coordinates (identical over D, so DCP writes one copy of each), the
replicated norm and position slices under their X coordinate, and its RNG state under its rank. The
step (the data position: the batch is a function of the step) and what the run was (run id, model,
grid, batch) go in meta.json beside DCP's files.

A checkpoint is written to a hidden temporary folder and renamed to `step_NNNNNNNN` once every rank's
shards and DCP's metadata are on disk, so a crash mid-save leaves the previous checkpoint whole; the
oldest are removed only after that, keeping the newest `checkpoint_keep`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from axoplan.atomic import atomic_write_text, ensure_dir
from axoplan.errors import UserError

FORMAT = "axoplan-checkpoint/1"
META = "meta.json"
PREFIX = "step_"


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under root, oldest first (a temporary or half-written folder is not one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()
             and (p / META).is_file() and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def read_meta(path: str | Path) -> dict:
    try:
        meta = json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint '{path}' cannot be read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"checkpoint '{path}' is not an axoplan checkpoint ({META} has no format {FORMAT})")
    return meta


def run_identity(cfg, seq_len: int) -> dict:
    """What must be equal for a checkpoint to continue this run: the same shards and the same batches."""
    g = cfg.grid
    return {"model": cfg.model, "grid": {"gx": g.gx, "gy": g.gy, "gz": g.gz, "gdata": g.gdata}, "order": cfg.order,
            "pp": cfg.pp, "vpp": cfg.vpp, "schedule": cfg.schedule,
            "global_batch": cfg.global_batch, "seq_len": seq_len, "data": cfg.data, "seed": cfg.seed}


# what a checkpoint written before the pipeline keys were recorded ran: no pipeline
NO_PIPELINE = {"pp": 1, "vpp": 1, "schedule": "1f1b"}


def check_resumable(meta: dict, cfg, seq_len: int, path: Path) -> None:
    """One sentence for a checkpoint this config cannot continue (before any process group exists)."""
    want = run_identity(cfg, seq_len)
    for key, v in want.items():
        if meta.get(key, NO_PIPELINE.get(key)) != v:
            show = (lambda d: "x".join(str(d[k]) for k in ("gx", "gy", "gz", "gdata"))) if key == "grid" else str
            raise UserError(f"checkpoint '{path}' was written with {key} {show(meta.get(key, NO_PIPELINE.get(key)))}, "
                            f"this config has "
                            f"{show(v)}: a run resumes only with the same model, grid, order, pipeline, batch and data")
    if meta["step"] >= cfg.steps:
        raise UserError(f"checkpoint '{path}' is at step {meta['step']} and the config's steps is {cfg.steps}: "
                        f"nothing left to train (raise steps to continue)")


def _params(trainer) -> list[tuple[str, torch.Tensor]]:
    c = trainer.grid.coords
    m = trainer.model
    out = [(f"{name}/x{c.x}.y{c.y}.z{c.z}", w.param) for name, w in m.weights.items()]
    return out + [(f"{name}/x{c.x}", p) for name, p in m.replicated.items()]


def _optimizer_state(trainer, p: torch.Tensor, create: bool) -> dict:
    state = trainer.opt.state[p]
    if create and not state:  # before the first step AdamW has no state: the shapes it would create, to load into
        fused = trainer.res.fused_optimizer
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def state_dict(trainer, create: bool = False) -> dict[str, torch.Tensor]:
    """This rank's part of the checkpoint (create: allocate AdamW's state so that DCP can load into it)."""
    sd: dict[str, torch.Tensor] = {}
    for key, p in _params(trainer):
        sd[f"model/{key}"] = p
        for name, t in _optimizer_state(trainer, p, create).items():
            sd[f"optim/{key}/{name}"] = t
    rank = trainer.grid.rank
    sd[f"rng/rank{rank}/cpu"] = torch.get_rng_state()
    if trainer.res.device.type == "cuda":
        sd[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state(trainer.res.device)
    return sd


def _barrier(trainer) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(trainer, root: str | Path, meta: dict, keep: int) -> Path:
    """Every rank calls this at the same step. Returns the checkpoint's folder."""
    root, step = Path(root), int(meta["step"])
    final, tmp = step_folder(root, step), root / f".{PREFIX}{step:08d}.tmp"
    rank0 = trainer.grid.rank == 0
    if rank0:
        ensure_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
    _barrier(trainer)
    import torch.distributed.checkpoint as dcp  # seconds to import (DTensor): only when a run checkpoints

    dcp.save(state_dict(trainer), checkpoint_id=str(tmp))  # returns once every rank's shards and the metadata are written
    if rank0:
        atomic_write_text(tmp / META, json.dumps({"format": FORMAT, **meta}, indent=1) + "\n")
        old = None
        if final.exists():  # the same step saved before (a resumed run passing it again): replace it whole
            old = root / f".{final.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep > 0:
            for p in checkpoints(root)[:-keep]:
                shutil.rmtree(p, ignore_errors=True)
    _barrier(trainer)
    return final


def load(trainer, path: str | Path) -> dict:
    """Every rank calls this: its shards, AdamW state and RNG from the checkpoint. Returns meta.json."""
    import torch.distributed.checkpoint as dcp

    meta = read_meta(path)
    sd = state_dict(trainer, create=True)
    dcp.load(sd, checkpoint_id=str(path))
    rank = trainer.grid.rank
    torch.set_rng_state(sd[f"rng/rank{rank}/cpu"])
    if f"rng/rank{rank}/cuda" in sd:
        torch.cuda.set_rng_state(sd[f"rng/rank{rank}/cuda"], trainer.res.device)
    return meta


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
