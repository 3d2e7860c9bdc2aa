"""LaunchConfig: the one schema for a training run. `emit` writes it, `axoplan train` reads it,
`validate` produces it, and the planner reads its defaults (the trainer's overlap). Torch-free, so the
planner can write configs on a login node."""
from __future__ import annotations

import dataclasses
import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.planner.pipeline import SCHEDULES
from axoplan.planner.space import PLACEMENTS, placement_error
from axoplan.yamlio import load_yaml

LR_DECAY_STYLES = ("cosine", "linear", "constant")
# keys of earlier versions: old name -> (new name, the one-line note printed when a config uses it)
RENAMED = {"warmup_steps": ("timing_warmup_steps", "steps left out of the timing median; the LR warm-up is "
                                                   "lr_warmup_steps")}


@dataclass
class Grid:
    gx: int = 1
    gy: int = 1
    gz: int = 1
    gdata: int = 1

    @property
    def size(self) -> int:
        return self.gx * self.gy * self.gz * self.gdata


@dataclass
class Overlap:
    all_reduce: bool = True  # OAR: dI all-reduce under the dW GEMM
    reduce_scatter: bool = True  # ORS: dW reduce-scatters issued non-blocking, behind the backward compute
    all_gather: bool = True  # OAG: next layer's weight all-gather prefetched one layer ahead
    max_inflight_reduce_scatters: int = 2  # ORS: at most this many in flight; the oldest is waited for first
    data_parallel: bool = True  # gradient D all-reduces launched per layer in the last backward, waited before clipping


@dataclass
class Goldfish:
    k: int = 4
    h: int = 13


@dataclass
class LaunchConfig:
    model: str = "gpt-tiny"  # preset name or path to a model YAML
    grid: Grid = field(default_factory=Grid)  # each pipeline stage's 4D grid: gx*gy*gz*gdata*pp = world size
    order: str = "xyz"  # placement of x, y, z, innermost first, data outside them; p among them places the pipeline
    pp: int = 1  # pipeline stages (without p in order outermost: world rank = stage * grid size + the rank in it)
    vpp: int = 1  # virtual stages per pipeline rank (interleaved-1f1b only)
    schedule: str = "1f1b"  # pipeline order (pp > 1): 1f1b or interleaved-1f1b (torch.distributed.pipelining)
    global_batch: int = 8  # sequences per optimizer step, over all GPUs
    micro_batch: int = 1  # sequences per GPU per micro-step; grad_acc = global_batch / (gdata*gz*micro_batch)
    seq_len: int | None = None  # None: the model's seq_len
    steps: int = 10  # optimizer steps of the whole run (a resumed run continues up to it)
    timing_warmup_steps: int = 2  # first steps left out of the summary's median time (not the LR warm-up)
    lr: float = 3e-4  # peak learning rate
    lr_warmup_steps: int = 0  # linear LR warm-up: lr*(s+1)/(lr_warmup_steps+1) at step s < lr_warmup_steps
    lr_decay_style: str = "cosine"  # after warm-up: cosine or linear to min_lr, or constant
    lr_decay_steps: int | None = None  # the step where the decay reaches min_lr (and stays); null: steps
    min_lr: float = 0.0  # the floor of the decay (Megatron's --min-lr)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    overlap: Overlap = field(default_factory=Overlap)
    checkpointing: bool = False  # full activation checkpointing per block
    goldfish: Goldfish | None = None  # null: standard loss
    data: str = "synthetic"  # 'synthetic' or a path to a text file or a folder of text files
    seed: int = 0
    out: str = "."  # the run folder: relative metrics, tensorboard, checkpoint_dir and save paths are inside it
    metrics: str | None = "metrics.jsonl"  # JSON-lines records, appended, one run id per run (rank 0); null: none
    log_every: int = 1  # a line a person reads on stdout every this many steps (and the last step)
    tensorboard: str | None = "tensorboard"  # TensorBoard event folder (rank 0); null: none
    checkpoint_every: int = 0  # a sharded torch.distributed.checkpoint every this many steps; 0: none
    checkpoint_dir: str = "checkpoints"  # one step_NNNNNNNN folder per checkpoint
    checkpoint_keep: int = 2  # the newest this many are kept; 0: all
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir (same grid)
    machine: str | None = None  # profile name or path, for % of peak in metrics; null: no %
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; or fp32, bf16
    collective_dtype: str = "auto"  # auto: the compute dtype; or fp32, bf16
    blas_tuning: str = "auto"  # auto: on with CUDA, off on CPU; or on, off
    backend: str = "auto"  # auto: nccl with CUDA, gloo otherwise; or nccl, gloo
    save: str | None = None  # path to write the final parameters (a torch file), or null

    @property
    def world(self) -> int:
        """Processes the run needs: every pipeline stage's grid."""
        return self.grid.size * self.pp

    def validate(self, where: str = "config") -> LaunchConfig:
        def bad(msg):
            raise UserError(f"{where}: {msg}")

        for name in ("gx", "gy", "gz", "gdata"):
            v = getattr(self.grid, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"grid.{name} must be a positive integer, got {inputs.show(v)}")
        if self.order not in PLACEMENTS:
            bad(f"order must be an order of x, y, z, innermost first, with p among them to place the pipeline axis "
                f"inside data (one of {', '.join(PLACEMENTS)}), got {inputs.show(self.order)}")
        for name, hi in (("global_batch", inputs.MAX_GLOBAL_BATCH), ("micro_batch", inputs.MAX_GLOBAL_BATCH),
                         ("steps", inputs.MAX_STEPS)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive integer, got {inputs.show(v)}")
            if v > hi:
                bad(f"{name} must be at most {hi:,}, got {inputs._short(v)}")
        for name in ("pp", "vpp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive integer, got {inputs.show(v)}")
            if v > inputs.MAX_GPUS:
                bad(f"{name} must be at most {inputs.MAX_GPUS:,}, got {inputs._short(v)}")
        if self.grid.size * self.pp > inputs.MAX_GPUS:
            bad(f"the grid has {self.grid.size * self.pp:,} ranks; at most {inputs.MAX_GPUS:,} are supported")
        if (why := placement_error(self.order, self.pp)) is not None:
            bad(why)
        if self.schedule not in SCHEDULES:
            bad(f"schedule must be one of {', '.join(SCHEDULES)}, got {inputs.show(self.schedule)}")
        if self.vpp > 1 and self.schedule != "interleaved-1f1b":
            bad(f"vpp={self.vpp} needs schedule interleaved-1f1b (the {self.schedule} schedule runs one stage per rank)")
        for name in ("timing_warmup_steps", "lr_warmup_steps", "checkpoint_every", "checkpoint_keep", "log_every"):
            v, lo = getattr(self, name), 1 if name == "log_every" else 0
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= inputs.MAX_STEPS:
                bad(f"{name} must be {'a positive' if lo else 'a non-negative'} integer, got {inputs.show(v)}")
        if self.timing_warmup_steps >= self.steps:
            bad(f"timing_warmup_steps ({self.timing_warmup_steps}) must be smaller than steps ({self.steps}): the "
                f"summary's median is taken over the steps after it")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool)
                                         or not 0 < self.seq_len <= inputs.MAX_SEQ_LEN):
            bad(f"seq_len must be a positive integer (at most {inputs.MAX_SEQ_LEN:,}) or null, got {inputs.show(self.seq_len)}")
        self._validate_training(bad)
        self._validate_text(bad, where)
        for name, allowed in (("dtype", ("auto", "fp32", "bf16")), ("collective_dtype", ("auto", "fp32", "bf16")),
                              ("blas_tuning", ("auto", "on", "off")), ("backend", ("auto", "nccl", "gloo"))):
            if getattr(self, name) not in allowed:
                bad(f"{name} must be one of {', '.join(allowed)}, got {inputs.show(getattr(self, name))}")
        mif = self.overlap.max_inflight_reduce_scatters
        if not isinstance(mif, int) or isinstance(mif, bool) or mif < 1:
            bad(f"overlap.max_inflight_reduce_scatters must be a positive integer, got {inputs.show(mif)}")
        if self.goldfish is not None:
            if not isinstance(self.goldfish.k, int) or isinstance(self.goldfish.k, bool) or self.goldfish.k < 2:
                bad(f"goldfish.k must be an integer >= 2, got {inputs.show(self.goldfish.k)}")
            if not isinstance(self.goldfish.h, int) or isinstance(self.goldfish.h, bool) or self.goldfish.h < 1:
                bad(f"goldfish.h must be a positive integer, got {inputs.show(self.goldfish.h)}")
        return self

    def _validate_training(self, bad) -> None:
        """Optimizer numbers and switches: a string, nan or inf here would train to NaN or crash mid-run."""
        def num(name, v, lo_open):
            ok = not isinstance(v, (bool, str))
            try:
                ok = ok and inputs.number(v, name, lo=0, lo_open=lo_open) is not None
            except UserError:
                ok = False
            if not ok:
                bad(f"{name} must be a finite number {'> 0' if lo_open else '>= 0'}, got {inputs.show(v)}")

        num("lr", self.lr, True)
        if self.lr > inputs.MAX_LR:
            bad(f"lr must be at most {inputs.MAX_LR:g} (AdamW moves every weight by about lr per step), got {self.lr:g}")
        num("weight_decay", self.weight_decay, False)
        num("grad_clip", self.grad_clip, False)  # 0 turns clipping off
        num("min_lr", self.min_lr, False)
        if self.min_lr > self.lr:
            bad(f"min_lr ({self.min_lr:g}) must not exceed lr ({self.lr:g})")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            bad(f"lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, got {inputs.show(self.lr_decay_style)}")
        d = self.lr_decay_steps
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= inputs.MAX_STEPS):
            bad(f"lr_decay_steps must be a positive integer or null, got {inputs.show(d)}")
        if d is not None and d <= self.lr_warmup_steps and self.lr_decay_style != "constant":
            bad(f"lr_decay_steps ({d}) must be larger than lr_warmup_steps ({self.lr_warmup_steps})")
        if not isinstance(self.resume, bool):
            bad(f"resume must be true or false, got {inputs.show(self.resume)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= inputs.MAX_SEED:
            bad(f"seed must be an integer from 0 to {inputs.MAX_SEED}, got {inputs.show(self.seed)}")
        for name in ("all_reduce", "reduce_scatter", "all_gather", "data_parallel"):
            if not isinstance(getattr(self.overlap, name), bool):
                bad(f"overlap.{name} must be true or false, got {inputs.show(getattr(self.overlap, name))}")
        if not isinstance(self.checkpointing, bool):
            bad(f"checkpointing must be true or false, got {inputs.show(self.checkpointing)}")

    def _validate_text(self, bad, where: str) -> None:
        """Names and paths: text without control characters (they reach scripts and one-line records)."""
        for name, optional in (("model", False), ("data", False), ("metrics", True), ("machine", True),
                               ("save", True), ("out", False), ("tensorboard", True), ("checkpoint_dir", False)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if not isinstance(v, str) or not v:
                bad(f"{name} must be {'a path or null' if optional else 'a name or path'}, got {inputs.show(v)}")
            inputs.text(v, f"{where}: {name}")
        for name in ("metrics", "save"):
            v = getattr(self, name)
            if v is not None and (v.endswith("/") or Path(self.path(v)).is_dir()):
                bad(f"{name} '{v}' is a folder; give a file name")
        if Path(self.out).exists() and not Path(self.out).is_dir():
            bad(f"out '{self.out}' is a file; give a folder for the run")

    def path(self, p: str | None) -> str | None:
        """A path of the config as the trainer uses it: relative ones are inside the run folder `out`."""
        return None if p is None else str(Path(self.out) / p)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def write(self, path: str | Path) -> Path:
        from axoplan.atomic import atomic_write_text

        return atomic_write_text(path, self.to_yaml())


_NESTED = {"grid": Grid, "overlap": Overlap, "goldfish": Goldfish}


def _build(cls, d: Any, where: str, prefix: str = ""):
    if not isinstance(d, dict):
        raise UserError(f"{where}: '{prefix.rstrip('.') or 'top level'}' must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is LaunchConfig:
        d = _renamed(d, where)
    unknown = sorted(str(k) for k in set(d) - names)
    if unknown:
        raise UserError(f"{where}: unknown key '{prefix}{unknown[0]}' (known: {', '.join(sorted(names))})")
    kw = {}
    for k, v in d.items():
        if k in _NESTED and cls is LaunchConfig:
            kw[k] = None if v is None and k == "goldfish" else _build(_NESTED[k], v, where, f"{k}.")
        else:
            kw[k] = v
    return cls(**kw)


def _renamed(d: dict, where: str) -> dict:
    """A config written with an old key name reads as the new one, with a note on stderr (rank 0 only)."""
    d = dict(d)
    for old, (new, what) in RENAMED.items():
        if old not in d:
            continue
        if new in d:
            raise UserError(f"{where}: give {new} only ('{old}' is its old name)")
        d[new] = d.pop(old)
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(f"note: {where}: key '{old}' is now '{new}' ({what}); read as {new}", file=sys.stderr)
    return d


def config_from_dict(d: Any, where: str = "config") -> LaunchConfig:
    return _build(LaunchConfig, d, where).validate(where)


def load_config(path: str | Path) -> LaunchConfig:
    p = Path(inputs.text(str(path), "--config"))
    where = f"config '{p}'"
    d = load_yaml(p, where)
    cfg = config_from_dict(d if d is not None else {}, where)
    # a run folder names its copies of the model and profile relatively (emit): they are read from the
    # config's own folder, wherever it was moved and whichever folder the trainer starts in
    for name in ("model", "machine"):
        v = getattr(cfg, name)
        if v and v.endswith((".yaml", ".yml")) and not Path(v).is_absolute() and (p.parent / v).is_file():
            setattr(cfg, name, str((p.parent / v).resolve()))
    return cfg


def example_config_yaml(cfg: LaunchConfig | None = None, note: str = "") -> str:
    """A complete example with every key at its default (or as `cfg` sets it), commented for people."""
    buf = io.StringIO()
    buf.write("# axoplan train config: every key with its default (axoplan train --print-config)\n")
    if note:
        buf.write(f"# {note}\n")
    buf.write((cfg or LaunchConfig(goldfish=None)).to_yaml())
    buf.write("# goldfish loss instead of the standard loss:\n# goldfish: {k: 4, h: 13}\n")
    return buf.getvalue()
