"""Reading a finished run back: the time per batch from the log each framework prints, and one emitted run folder
as a measured row of results.csv (what `validate --collect DIR` writes and `refit --results DIR` reads).

Log formats, from each framework's own code:
- the bundled trainer (and the emitted AxoNN entry point): JSON lines, the last with "summary": true and
  median_batch_time_s (axoplan/runtime/train.py);
- Megatron-LM: training_log() in megatron/training/training.py prints, every --log-interval iterations,
  " [date] iteration {:8d}/{:8d} | consumed samples: ... | elapsed time per iteration (ms): {:.1f} |"
  (newer versions "(ms): {:.1f}/{:.1f} |", the second number a running mean), the mean over the interval;
- torchtitan 0.2.2: MetricsProcessor.log() in torchtitan/components/metrics.py logs "step: {step:2}  loss: ...
  memory: ...GiB(...%)  tps: {round(tps):,}  tflops: ...  mfu: ...%" (in colour unless disabled), where tps is
  tokens per second per device: the tokens one data-parallel rank saw since the last line over the time times
  tp x pp x cp, so one step of the whole job takes global_batch x seq_len / (tps x GPUs) seconds.
Lines of the first `warmup` steps are left out and the median of the rest is the measured time.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from axoplan.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

EXTRA_COLUMNS = ["framework", "execution", "log_format", "pp", "vpp", "schedule"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
MEGATRON = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*([0-9.]+)")
TORCHTITAN = re.compile(r"\bstep:\s*(\d+)\s.*?\btps:\s*([0-9,]+)")


@dataclass
class Measured:
    seconds: float | None  # median time per batch after warm-up, or None
    steps: int  # logged steps it is the median of
    source: str  # the format read: axoplan, megatron, torchtitan, or "" when none matched


def megatron_steps(text: str) -> list[tuple[int, float]]:
    """(iteration, seconds per iteration) of Megatron-LM's training_log lines."""
    return [(int(m.group(1)), float(m.group(2)) / 1e3) for m in MEGATRON.finditer(_ANSI.sub("", text))]


def torchtitan_steps(text: str, tokens_per_batch: int, gpus: int) -> list[tuple[int, float]]:
    """(step, seconds per step) of torchtitan's step lines (validation lines, "validate step:", are not steps)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        if "validate step:" in line:
            continue
        m = TORCHTITAN.search(line)
        if m:
            tps = float(m.group(2).replace(",", ""))
            if tps > 0:
                out.append((int(m.group(1)), tokens_per_batch / (tps * gpus)))
    return out


def measured(text: str, tokens_per_batch: int | None = None, gpus: int | None = None, warmup: int = 2) -> Measured:
    """The measured time per batch in a run's output, whichever of the three formats it is in."""
    from axoplan.loop.validate import parse_log

    res = parse_log(text)
    if res.status == "ok" and res.measured_time_s is not None:
        steps = (res.summary or {}).get("steps")
        return Measured(res.measured_time_s, int(steps) if isinstance(steps, int) else 0, "axoplan")
    for source, steps in (("megatron", megatron_steps(text)),
                          ("torchtitan", torchtitan_steps(text, tokens_per_batch, gpus)
                           if tokens_per_batch and gpus else [])):
        if steps:
            last = {}
            for step, t in steps:  # a requeued run logs its steps again: the last record of a step wins
                last[step] = t
            kept = [t for step, t in sorted(last.items()) if step > warmup] or [t for _, t in sorted(last.items())]
            return Measured(float(statistics.median(kept)), len(kept), source)
    return Measured(None, 0, "")


# ---- one emitted run folder as a results row ---------------------------------------------------------
def _logs(folder: Path) -> str:
    from axoplan.loop.frameworks import LOG_NAME

    text = ""
    for p in [folder / LOG_NAME, folder / "metrics.jsonl", *sorted(folder.glob("slurm-*.out"))]:
        try:
            text += p.read_text(errors="replace") + "\n"
        except FileNotFoundError:
            pass
        except OSError as e:
            raise UserError(f"cannot read the run log '{p}': {(e.strerror or str(e)).lower()}") from None
    return text


def _record(folder: Path) -> dict:
    """What was planned for the folder: run.yaml (a framework's) or config.yaml (the bundled trainer's)."""
    from axoplan.loop.frameworks import RECORD_NAME
    from axoplan.loop.launch import CONFIG_NAME
    from axoplan.yamlio import load_yaml

    if (folder / RECORD_NAME).is_file():
        d = load_yaml(folder / RECORD_NAME, f"run record '{folder / RECORD_NAME}'")
        if not isinstance(d, dict) or not isinstance(d.get("plan"), dict):
            raise UserError(f"run record '{folder / RECORD_NAME}' is not what `axoplan emit --framework` writes")
        plan = d["plan"]
        machine = d.get("machine")
        if isinstance(machine, str) and (folder / machine).is_file():
            machine = str((folder / machine).resolve())
        return {"framework": d.get("framework"), "execution": d.get("execution"),
                "model": _ref(folder, d.get("model")), "machine": machine,
                "gpus": d.get("gpus"), "global_batch": d.get("global_batch"), "seq_len": d.get("seq_len"),
                "predicted": d.get("predicted") or {}, **{k: plan.get(k) for k in
                                                          ("gx", "gy", "gz", "gdata", "order", "micro_batch",
                                                           "checkpointing", "pp", "vpp", "schedule")}}
    if (folder / CONFIG_NAME).is_file():
        from axoplan.runconfig import load_config

        cfg = load_config(folder / CONFIG_NAME)
        g = cfg.grid
        return {"framework": "axoplan", "execution": "axoplan", "model": cfg.model, "machine": cfg.machine, "gpus": g.size,
                "global_batch": cfg.global_batch, "seq_len": cfg.seq_len, "predicted": {}, "gx": g.gx, "gy": g.gy,
                "gz": g.gz, "gdata": g.gdata, "order": cfg.order, "micro_batch": cfg.micro_batch,
                "checkpointing": cfg.checkpointing, "pp": 1, "vpp": 1, "schedule": "1f1b"}
    raise UserError(f"'{folder}' is not a run folder of `axoplan emit` (no run.yaml or config.yaml)")


def _ref(folder: Path, model):
    if isinstance(model, str) and model.endswith((".yaml", ".yml")) and (folder / model).is_file():
        return str((folder / model).resolve())
    return model


def run_row(folder: str | Path) -> dict:
    """The results.csv row (validate_files.RESULT_COLUMNS) of one emitted run folder, measured from its log."""
    from axoplan.planner.specs import load_model

    folder = Path(folder)
    r = _record(folder)
    seq = r["seq_len"] or load_model(r["model"]).seq_len
    text = _logs(folder)
    m = measured(text, int(r["global_batch"]) * int(seq), int(r["gpus"]))
    if m.seconds is not None:
        status, error = "ok", ""
    elif not text.strip():
        status, error = "infra", "no run log: not run yet, or its output was lost"
    else:
        from axoplan.loop.validate import error_line, parse_log

        res = parse_log(text)
        status, error = (res.status, res.error) if res.status != "ok" else ("failed", error_line(text))
        if status == "failed" and not error:
            error = error_line(text)
    row = {k: r[k] for k in ("model", "machine", "gpus", "global_batch", "gx", "gy", "gz", "gdata", "order",
                             "micro_batch", "checkpointing")}
    row.update(candidate=folder.resolve().name, seq_len=seq, measured_time_s=m.seconds, status=status, error=error,
               steps=m.steps, warmup_steps=None, wall_s=0.0, repeat=0, feasible=True,
               batch_time_s=r["predicted"].get("batch_time_s"), memory_gib=r["predicted"].get("memory_gib"))
    row["framework"], row["log_format"], row["execution"] = r["framework"], m.source, r["execution"]
    if int(r.get("pp") or 1) > 1:
        row["pp"], row["vpp"], row["schedule"] = r["pp"], r["vpp"], r["schedule"]
    return row


def results_frame(paths) -> pd.DataFrame:
    """The measured rows of results.csv files (axoplan validate) and emitted run folders, one table."""
    import pandas as pd

    from axoplan.loop.refit import check_results_file
    from axoplan.loop.validate import read_results

    frames = []
    for p in ([paths] if isinstance(paths, (str, Path)) else list(paths)):
        if is_run_folder(p):
            frames.append(pd.DataFrame([run_row(p)]))
        elif Path(p).is_dir():
            raise UserError(f"'{p}' is a folder but not a run folder of `axoplan emit` (no run.yaml or config.yaml)")
        else:
            check_results_file(p)
            frames.append(read_results(p))
    if not frames:
        raise UserError("--results: give at least one results.csv or run folder")
    return pd.concat(frames, ignore_index=True)


def is_run_folder(path: str | Path) -> bool:
    from axoplan.loop.frameworks import RECORD_NAME
    from axoplan.loop.launch import CONFIG_NAME

    p = Path(path)
    return p.is_dir() and ((p / RECORD_NAME).is_file() or (p / CONFIG_NAME).is_file())


def collect_run(folder: str | Path, echo=print) -> dict:
    """`validate --collect` on one emitted run folder: its measured row, written to FOLDER/results.csv."""
    from axoplan.atomic import atomic_write_text
    from axoplan.loop.validate_files import RESULT_COLUMNS, csv_line

    folder = Path(folder)
    row = run_row(folder)
    cols = RESULT_COLUMNS + EXTRA_COLUMNS  # read by header: refit predicts the run with its execution
    atomic_write_text(folder / "results.csv", csv_line(cols) + csv_line([row.get(c) for c in cols]))
    if row["status"] == "ok":
        pred = row.get("batch_time_s")
        echo(f"{row['candidate']}: measured {row['measured_time_s']:.4g} s per batch (median of {row['steps']} "
             f"steps after warm-up, {row['log_format']} log format)"
             + (f", predicted {float(pred):.4g} s ({float(pred) / row['measured_time_s']:.2f}x)" if pred else ""))
    else:
        echo(f"{row['candidate']}: {row['status']}: {row['error']}")
    echo(f"wrote {folder / 'results.csv'}")
    return row

