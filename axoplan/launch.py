"""LaunchConfig: the one schema for a training run. `emit` writes it, `axoplan train` reads it,
`validate` produces it. Torch-free, so the planner can write configs on a login node."""
from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError

ORDERS = ("xyz", "xzy", "yxz", "yzx", "zxy", "zyx")


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
    reduce_scatter: bool = True  # ORS: dW reduce-scatters collected at the end of backward
    all_gather: bool = True  # OAG: next layer's weight all-gather prefetched one layer ahead


@dataclass
class Goldfish:
    k: int = 4
    h: int = 13


@dataclass
class LaunchConfig:
    model: str = "gpt-tiny"  # preset name or path to a model YAML
    grid: Grid = field(default_factory=Grid)
    order: str = "xyz"  # placement of x, y, z, innermost first; data is always outermost
    global_batch: int = 8  # sequences per optimizer step, over all GPUs
    micro_batch: int = 1  # sequences per GPU per micro-step; grad_acc = global_batch / (gdata*gz*micro_batch)
    seq_len: int | None = None  # None: the model's seq_len
    steps: int = 10
    warmup_steps: int = 2  # steps left out of the summary's median
    lr: float = 3e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    overlap: Overlap = field(default_factory=Overlap)
    checkpointing: bool = False  # full activation checkpointing per block
    goldfish: Goldfish | None = None  # null: standard loss
    data: str = "synthetic"  # 'synthetic' or a path to a text file or a folder of text files
    seed: int = 0
    metrics: str | None = "metrics.jsonl"  # JSON-lines file (rank 0 writes); null: stdout only
    machine: str | None = None  # profile name or path, for % of peak in metrics; null: no %
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; or fp32, bf16
    collective_dtype: str = "auto"  # auto: the compute dtype; or fp32, bf16
    blas_tuning: str = "auto"  # auto: on with CUDA, off on CPU; or on, off
    backend: str = "auto"  # auto: nccl with CUDA, gloo otherwise; or nccl, gloo
    save: str | None = None  # path to write the final parameters (a torch file), or null

    def validate(self, where: str = "config") -> "LaunchConfig":
        def bad(msg):
            raise UserError(f"{where}: {msg}")

        for name in ("gx", "gy", "gz", "gdata"):
            v = getattr(self.grid, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"grid.{name} must be a positive integer, got {v!r}")
        if self.order not in ORDERS:
            bad(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        for name in ("global_batch", "micro_batch", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad(f"warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len <= 0):
            bad(f"seq_len must be a positive integer or null, got {self.seq_len!r}")
        for name, allowed in (("dtype", ("auto", "fp32", "bf16")), ("collective_dtype", ("auto", "fp32", "bf16")),
                              ("blas_tuning", ("auto", "on", "off")), ("backend", ("auto", "nccl", "gloo"))):
            if getattr(self, name) not in allowed:
                bad(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.goldfish is not None:
            if not isinstance(self.goldfish.k, int) or self.goldfish.k < 2:
                bad(f"goldfish.k must be an integer >= 2, got {self.goldfish.k!r}")
            if not isinstance(self.goldfish.h, int) or self.goldfish.h < 1:
                bad(f"goldfish.h must be a positive integer, got {self.goldfish.h!r}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def write(self, path: str | Path) -> Path:
        from .atomic import atomic_write_text

        return atomic_write_text(path, self.to_yaml())


_NESTED = {"grid": Grid, "overlap": Overlap, "goldfish": Goldfish}


def _build(cls, d: Any, where: str, prefix: str = ""):
    if not isinstance(d, dict):
        raise UserError(f"{where}: '{prefix.rstrip('.') or 'top level'}' must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise UserError(f"{where}: unknown key '{prefix}{unknown[0]}' (known: {', '.join(sorted(names))})")
    kw = {}
    for k, v in d.items():
        if k in _NESTED and cls is LaunchConfig:
            kw[k] = None if v is None and k == "goldfish" else _build(_NESTED[k], v, where, f"{k}.")
        else:
            kw[k] = v
    return cls(**kw)


def config_from_dict(d: Any, where: str = "config") -> LaunchConfig:
    return _build(LaunchConfig, d, where).validate(where)


def load_config(path: str | Path) -> LaunchConfig:
    p = Path(path)
    where = f"config '{p}'"
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or e}") from None
    try:
        d = yaml.safe_load(text)
    except yaml.YAMLError:
        raise UserError(f"{where}: malformed YAML") from None
    return config_from_dict(d if d is not None else {}, where)


def example_config_yaml() -> str:
    """A complete example with every key at its default, commented for people."""
    buf = io.StringIO()
    buf.write("# axoplan train config: every key with its default (axoplan train --print-config)\n")
    buf.write(LaunchConfig(goldfish=None).to_yaml())
    buf.write("# goldfish loss instead of the standard loss:\n# goldfish: {k: 4, h: 13}\n")
    return buf.getvalue()
