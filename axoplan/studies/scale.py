"""What-if at scale: the best configuration at each GPU count (pipeline included, as rank searches it), its
speed, parallel efficiency and time to train a token budget. Pure functions over axoplan.planner.rank.rank(); no torch, no plotting here.

Strong scaling: one model, one global batch, several GPU counts. Weak scaling: (model, GPUs) pairs
that grow together, as in the AxoNN paper's tables.

Parallel efficiency is useful model work per GPU-second relative to the baseline (the smallest GPU
count that has a feasible configuration). Useful work counts the forward once (no recompute), so a
configuration that checkpoints is not credited for the FLOP it repeats; for one model and batch this
is exactly T(G0)·G0 / (T(G)·G).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.planner.machine import MachineProfile
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.specs import ModelSpec, load_model

COLUMNS = ["model", "gpus", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s",
           "tokens_per_s", "tflops_per_gpu", "pflops", "pct_of_peak", "speedup", "efficiency", "memory_gib",
           "time_to_train_s", "time_to_train", "feasible", "reason",
           # the best configuration's pipeline, as rank gives it (pp 1: none), after the first columns
           "pp", "vpp", "schedule", "bubble_s"]

# the columns that count (grid, micro-batch, pipeline)
COUNTS = ("gx", "gy", "gz", "gdata", "micro_batch", "pp", "vpp")
MAX_COUNTS = 64  # a longer list is almost certainly a typo in a range
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


# ---- parsing what users type -------------------------------------------------------------
def parse_gpus(spec: str) -> list[int]:
    """'128,256,512', '128..8192' (doubling), '96..768x2' or '8..64+8' (step), or a mix: sorted, unique."""
    s = str(spec).replace(" ", "")
    if not s:
        raise UserError("--gpus is empty; give counts like 128,256,512 or a range like 128..8192")
    out: set[int] = set()
    for part in s.split(","):
        m = re.fullmatch(r"([0-9]+)\.\.([0-9]+)(?:([x*+])([0-9]+))?", part, flags=re.ASCII)
        if m:
            lo, hi = (inputs.count(m.group(i), f"--gpus range '{part}'", 1, inputs.MAX_GPUS) for i in (1, 2))
            op, step = m.group(3) or "x", inputs.count(m.group(4) or "2", f"--gpus range '{part}' step", 1)
            if lo <= 0 or hi < lo:
                raise UserError(f"--gpus range '{part}' must go from a positive count up to a larger one")
            if (op in "x*" and step < 2) or (op == "+" and step < 1):
                raise UserError(f"--gpus range '{part}' needs a factor of at least 2 (x2) or a step of at least 1 (+8)")
            v = lo
            while v <= hi:
                out.add(v)
                if len(out) > MAX_COUNTS:
                    raise UserError(f"--gpus '{spec}' gives more than {MAX_COUNTS} counts; use a coarser range")
                v = v * step if op in "x*" else v + step
        elif re.fullmatch(r"[0-9]+", part, flags=re.ASCII):
            out.add(inputs.count(part, f"--gpus entry '{part}'", 1, inputs.MAX_GPUS))
        else:
            raise UserError(f"--gpus entry '{part}' is not a positive count or a range like 128..8192")
    if len(out) > MAX_COUNTS:
        raise UserError(f"--gpus '{spec}' gives more than {MAX_COUNTS} counts; use a coarser range")
    return sorted(out)


def parse_tokens(spec: str | float) -> float:
    """'2T', '300B', '1.5e12', '500M' -> tokens (decimal suffixes: K, M, B or G, T, P)."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value = float(spec)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([kKmMbBgGtTpP]?)\s*", str(spec))
        if not m:
            raise UserError(f"--tokens '{spec}' is not a token count like 2T, 300B or 1.5e12")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--tokens must be positive, got {spec!r}")
    return value


def parse_pairs(spec: str) -> list[tuple[str, int]]:
    """Weak-scaling pairs 'gpt-5b:512,gpt-10b:1024' -> [('gpt-5b', 512), ('gpt-10b', 1024)]."""
    pairs = []
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        model, sep, g = part.rpartition(":")
        if not sep or not model or not re.fullmatch(r"[0-9]+", g, flags=re.ASCII):
            raise UserError(f"--weak entry '{part}' must be MODEL:GPUS, e.g. gpt-5b:512")
        pairs.append((inputs.text(model, "--weak model"), inputs.count(g, f"--weak entry '{part}'", 1, inputs.MAX_GPUS)))
    if not pairs:
        raise UserError("--weak is empty; give pairs like gpt-5b:512,gpt-10b:1024")
    return pairs


def format_duration(seconds: float) -> str:
    """Hours under two days, days under a year and a half, else months/years: what a person plans with."""
    if seconds is None or not np.isfinite(seconds):
        return ""
    h = seconds / 3600
    if h < 48:
        return f"{h:.1f} hours"
    d = h / 24
    if d < 548:
        return f"{d:.1f} days"
    return f"{d / 365.25:.1f} years"


# ---- the sweep ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One (model, GPU count) to plan."""

    model: ModelSpec
    gpus: int


def _best(point: Point, profile: MachineProfile, global_batch: int, seq_len: int | None, rank_kw: dict,
          rank_fn) -> dict:
    m = point.model
    row = {"model": m.name, "gpus": point.gpus}
    try:
        df = rank_fn(m, profile, point.gpus, global_batch, seq_len=seq_len, top=1, **rank_kw)
    except UserError as e:  # nothing feasible at this count: keep the row and say why
        return {**row, "feasible": False, "reason": str(e)}
    if len(df) == 0 or not bool(df["feasible"].iloc[0]):
        return {**row, "feasible": False, "reason": "no feasible configuration"}
    best = df.iloc[0]
    for c in COUNTS:
        row[c] = int(best[c])
    row.update(order=str(best["order"]), schedule=str(best["schedule"]), bubble_s=float(best["bubble_s"]),
               checkpointing=bool(best["checkpointing"]),
               batch_time_s=float(best["batch_time_s"]), tflops_per_gpu=float(best["tflops_per_gpu"]),
               pct_of_peak=float(best["pct_of_peak"]), memory_gib=float(best["memory_gib"]), feasible=True, reason="")
    return row


def sweep(points: list[Point], machine: str | MachineProfile, global_batch: int, seq_len: int | None = None,
          tokens: float | None = None, progress=None, rank_fn=None, **rank_kw) -> pd.DataFrame:
    """The best feasible configuration for each point, with speed, efficiency and time to train.

    rank_kw go to axoplan.planner.rank.rank (order, micro_batch, overlap, ...). progress(i, n, row) is called
    after each point. Raises UserError when no point has a feasible configuration.
    """
    if rank_fn is None:
        from axoplan.planner.rank import rank as rank_fn
    profile = load_profile(machine)
    if not points:
        raise UserError("nothing to plan: give at least one GPU count")
    rows = []
    for i, p in enumerate(points):
        rows.append(_best(p, profile, global_batch, seq_len, rank_kw, rank_fn))
        if progress is not None:
            progress(i + 1, len(points), rows[-1])
    df = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in df:
            df[c] = np.nan
    for c in COUNTS:  # counts stay integers beside a count with none
        df[c] = df[c].astype("Int64")
    feasible = df["feasible"].astype(bool).to_numpy()
    if not feasible.any():
        raise UserError(f"no GPU count has a feasible configuration: {df['reason'].iloc[0]}")

    seqs = [p.model.seq_len if seq_len is None else seq_len for p in points]
    tokens_per_batch = np.array([global_batch * s for s in seqs], dtype=np.float64)
    useful = np.array([p.model.flops_per_token(s, recompute=False) for p, s in zip(points, seqs)]) * tokens_per_batch
    gpus = df["gpus"].to_numpy(dtype=np.float64)
    t = df["batch_time_s"].to_numpy(dtype=np.float64)
    df["tokens_per_s"] = np.where(feasible, tokens_per_batch / t, np.nan)
    df["pflops"] = df["tflops_per_gpu"].to_numpy(dtype=np.float64) * gpus / 1e3
    per_gpu = useful / t / gpus
    base = int(np.nonzero(feasible)[0][np.argmin(gpus[feasible])])
    df["efficiency"] = np.where(feasible, per_gpu / per_gpu[base], np.nan)
    # speedup: work rate relative to the baseline (for strong scaling, T(G0)/T(G))
    df["speedup"] = np.where(feasible, (useful / t) / (useful[base] / t[base]), np.nan)
    if tokens is not None:
        df["time_to_train_s"] = np.where(feasible, tokens / tokens_per_batch * t, np.nan)
    else:
        df["time_to_train_s"] = np.nan
    df["time_to_train"] = [format_duration(x) for x in df["time_to_train_s"]]
    df["reason"] = df["reason"].fillna("")
    df.attrs["baseline_gpus"] = int(gpus[base])
    df.attrs["machine"] = profile.name
    df.attrs["peak_tflops"] = profile.peak_tflops
    df.attrs["global_batch"] = int(global_batch)
    df.attrs["tokens"] = tokens
    return df[COLUMNS]


def strong_scaling(model: str | ModelSpec, machine: str | MachineProfile, gpus: list[int], global_batch: int,
                   seq_len: int | None = None, tokens: float | None = None, progress=None, rank_fn=None,
                   **rank_kw) -> pd.DataFrame:
    """One model and batch on several GPU counts."""
    m = load_model(model)
    counts = sorted({int(g) for g in gpus})
    if not counts or counts[0] <= 0:
        raise UserError("GPU counts must be positive integers")
    return sweep([Point(m, g) for g in counts], machine, global_batch, seq_len, tokens, progress, rank_fn, **rank_kw)


def weak_scaling(pairs: list[tuple[str | ModelSpec, int]], machine: str | MachineProfile, global_batch: int,
                 seq_len: int | None = None, tokens: float | None = None, progress=None, rank_fn=None,
                 **rank_kw) -> pd.DataFrame:
    """(model, GPUs) pairs growing together, in the order given; efficiency against the smallest count."""
    if not pairs:
        raise UserError("nothing to plan: give at least one MODEL:GPUS pair")
    points = []
    for model, g in pairs:
        if int(g) <= 0:
            raise UserError(f"GPU count for {model} must be positive, got {g}")
        points.append(Point(load_model(model), int(g)))
    return sweep(points, machine, global_batch, seq_len, tokens, progress, rank_fn, **rank_kw)
