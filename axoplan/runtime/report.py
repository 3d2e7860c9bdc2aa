"""What a run reports (rank 0 only): a line a person reads every `log_every` steps, one JSON record per
step appended to the metrics file, and TensorBoard scalars.

Every JSON record carries the run's id, its wall-clock time (UTC, ISO 8601) and the seconds since this
process started the run. A new run into the same folder appends under a new id (nothing earlier is
lost); a resumed run keeps the id of the run it continues and says so in its start record. Floats
are rounded to the digits they carry, and a value that is not finite is written as null (never NaN).
"""
from __future__ import annotations

import json
import math
import secrets
import sys
import time
from datetime import datetime, timezone

from axoplan.atomic import append_line

# significant digits per field; others get DEFAULT_DIGITS
DIGITS = {"loss": 6, "grad_norm": 4, "lr": 4, "batch_time_s": 4, "tokens_per_s": 4, "model_tflops_per_gpu": 4,
          "pct_of_peak": 3, "peak_memory_gib": 4, "median_batch_time_s": 4, "median_tokens_per_s": 4,
          "first_loss": 6, "final_loss": 6}
DEFAULT_DIGITS = 6
# what peak_memory_gib measured, per device type
MEMORY_KIND = {"cuda": "cuda_max_allocated", "cpu": "process_peak_rss"}
_MEMORY_LABEL = {"cuda_max_allocated": "max allocated", "process_peak_rss": "peak RSS"}


def new_run_id() -> str:
    """Sortable by start time, unique across runs that start in the same second."""
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def rounded(value, digits: int = DEFAULT_DIGITS):
    """A value for a JSON record: floats to `digits` significant digits, non-finite floats null."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: rounded(v, DIGITS.get(k, DEFAULT_DIGITS)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value


def _flops(tflops: float) -> str:
    return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"


def human_line(rec: dict, total_steps: int, memory_kind: str) -> str:
    """One step as a person reads it."""
    parts = [f"step {rec['step'] + 1:>{len(str(total_steps))}}/{total_steps}", f"loss {rec['loss']:.4f}",
             f"lr {rec['lr']:.2e}", f"{rec['batch_time_s'] * 1e3:,.1f} ms/step", f"{rec['tokens_per_s']:,.0f} tok/s"]
    flops = _flops(rec["model_tflops_per_gpu"]) + "/rank"
    if rec.get("pct_of_peak") is not None:
        flops += f" ({rec['pct_of_peak']:.1f}% of peak)"
    parts += [flops, f"mem {rec['peak_memory_gib']:.2f} GiB {_MEMORY_LABEL.get(memory_kind, memory_kind)}"]
    return " | ".join(parts)


def summary_line(s: dict) -> str:
    peak = f" ({s['pct_of_peak']:.1f}% of peak)" if s.get("pct_of_peak") is not None else ""
    return (f"done: {s['steps']} steps, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, median "
            f"{s['median_batch_time_s'] * 1e3:,.1f} ms/step (after {s['timing_warmup_steps']} timing warm-up), "
            f"{s['median_tokens_per_s']:,.0f} tok/s, {_flops(s['model_tflops_per_gpu'])}/rank{peak}, "
            f"mem {s['peak_memory_gib']:.2f} GiB")


def open_tensorboard(folder: str, purge_step: int | None):
    """A SummaryWriter, or None with one warning line when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: tensorboard is not installed (pip install tensorboard, or the 'runtime' extra): "
              "no TensorBoard events for this run", file=sys.stderr, flush=True)
        return None
    return SummaryWriter(log_dir=folder, purge_step=purge_step)


TB_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
              "batch_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s",
              "model_tflops_per_gpu": "perf/tflops_per_rank", "pct_of_peak": "perf/pct_of_peak",
              "peak_memory_gib": "memory/peak_gib"}


class Reporter:
    """Rank 0's outputs of one run; on the other ranks every method does nothing."""

    def __init__(self, cfg, *, active: bool, run_id: str, total_steps: int, memory_kind: str,
                 resumed_from: int | None = None, start: dict | None = None):
        self.cfg, self.active, self.run_id = cfg, active, run_id
        self.total_steps, self.memory_kind = total_steps, memory_kind
        self.metrics = cfg.path(cfg.metrics)
        self.t0 = time.perf_counter()
        self.tb = None
        if not active:
            return
        if cfg.tensorboard:
            # one TensorBoard run per run id; a resumed run drops the events its predecessor wrote after the checkpoint
            self.tb = open_tensorboard(str(cfg.path(cfg.tensorboard)) + f"/{run_id}", resumed_from)
        self.write({"event": "start", "resumed_from_step": resumed_from, **(start or {})})
        how = f"resumed at step {resumed_from}" if resumed_from is not None else "started"
        print(f"run {run_id} {how}: metrics {self.metrics or '(none)'}, TensorBoard "
              f"{self.tb.log_dir if self.tb else '(none)'}", flush=True)

    def write(self, record: dict) -> dict:
        rec = {"run_id": self.run_id, "time": utc_now(), "elapsed_s": round(time.perf_counter() - self.t0, 3),
               **rounded(record)}
        if self.active and self.metrics:
            append_line(self.metrics, json.dumps(rec, allow_nan=False))
        return rec

    def step(self, rec: dict) -> None:
        if not self.active:
            return
        self.write({"event": "step", **rec, "memory_kind": self.memory_kind})
        s = rec["step"]
        if self.tb is not None:
            for key, tag in TB_SCALARS.items():
                v = rec.get(key)
                if v is not None and math.isfinite(v):
                    self.tb.add_scalar(tag, v, s)
        if (s + 1) % self.cfg.log_every == 0 or s + 1 == self.total_steps:
            print(human_line(rec, self.total_steps, self.memory_kind), flush=True)
            if self.tb is not None:
                self.tb.flush()

    def event(self, kind: str, **fields) -> None:
        if self.active:
            self.write({"event": kind, **fields})

    def summary(self, summary: dict) -> None:
        """The human summary, then the summary record on stdout as one JSON line (validate reads it) and in the file."""
        if not self.active:
            return
        rec = self.write({"event": "summary", **summary, "memory_kind": self.memory_kind})
        print(summary_line(summary), flush=True)
        print(json.dumps(rec, allow_nan=False), flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
