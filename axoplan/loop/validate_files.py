"""The files of one `axoplan validate` sweep: results.csv (appended as runs finish), plan.csv and
sweep.json. Every reader says in one sentence which file is wrong (UserError), never a traceback."""
from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from axoplan.atomic import append_line
from axoplan.errors import UserError
from axoplan.planner.rank import COLUMNS

# a candidate's own outcomes, final: a resumed sweep never runs them again
FINAL_STATUSES = ("ok", "oom", "failed", "timeout")
# a run stopped by something outside the candidate (disk full, run.log not writable, torchrun could not
# start, a signal from outside): not the candidate's result, run again on --resume
INFRA = "infra"
STATUSES = FINAL_STATUSES + (INFRA,)
JOB_COLUMNS = ["candidate", "model", "machine", "gpus", "global_batch", "seq_len"]
RESULT_COLUMNS = JOB_COLUMNS + COLUMNS + ["measured_time_s", "status", "error", "steps", "warmup_steps", "wall_s",
                                          "repeat"]
_NUMERIC = ["gpus", "global_batch", "seq_len", "rank", "gx", "gy", "gz", "gdata", "pp", "vpp", "micro_batch",
            "batch_time_s",
            "compute_s", "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak",
            "measured_time_s", "steps", "warmup_steps", "wall_s"]


MAX_SWEEP_FILE_BYTES = 256 * 2**20  # a results.csv of a million runs is about 300 MiB less than this


def _text(path: Path, what: str) -> str:
    """A sweep file's text, or one sentence saying why it cannot be read as text."""
    from axoplan.yamlio import read_bytes

    try:
        data = read_bytes(path, f"{what} '{path}'", MAX_SWEEP_FILE_BYTES)
    except FileNotFoundError:
        raise UserError(f"{what} '{path}' does not exist") from None
    if b"\0" in data:
        raise UserError(f"{what} '{path}' is a binary file, not the text axoplan validate writes")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark from a spreadsheet is not part of the header
    except UnicodeDecodeError:
        raise UserError(f"{what} '{path}' is not UTF-8 text (binary or another encoding)") from None


# ---- results.csv -------------------------------------------------------------------------------
def csv_line(values: list) -> str:
    buf = io.StringIO()
    # one record per physical line (newlines inside values become spaces), so a line cut short by a
    # crash can never swallow the next record
    csv.writer(buf, lineterminator="\n").writerow(
        ["" if v is None or (isinstance(v, float) and math.isnan(v)) else " ".join(v.splitlines())
         if isinstance(v, str) else v for v in values])
    return buf.getvalue()


def append_result(path: Path, row: dict) -> None:
    """One finished run, appended and flushed: an interrupted sweep keeps every finished record."""
    line = csv_line([row.get(c) for c in RESULT_COLUMNS])
    if not path.exists() or path.stat().st_size == 0:
        append_line(path, csv_line(RESULT_COLUMNS))
    else:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a line cut short by a crash: end it, read_results drops it
                line = "\n" + line
    append_line(path, line)


def read_results(path: str | Path, per_run: bool = False) -> pd.DataFrame:
    """results.csv as a DataFrame, one row per candidate (per_run: one per run, i.e. per candidate and
    repeat); a line cut short by a crash is dropped. A candidate measured in several repeats has the
    median of its ok runs as measured_time_s (the spread in measured_spread: max/min - 1) and the
    count in measured_runs."""
    p = Path(path)
    text = _text(p, "results file")
    lines = text.split("\n")
    if len(lines) > 1:  # every record is appended with its newline: a last line without one was cut short
        lines = lines[:-1]
    rows = []
    for line in lines:
        try:
            rows.append(next(csv.reader([line]), []))
        except csv.Error:
            rows.append([])
    if not rows or not {"candidate", "gx", "measured_time_s", "status"} <= set(rows[0]):
        raise UserError(f"'{p}' is not an axoplan validate results file (no header with candidate, gx, "
                        f"measured_time_s, status)")
    head = rows[0]
    good = [r for r in rows[1:] if len(r) == len(head) and r[head.index("status")] in STATUSES]
    df = pd.DataFrame(good, columns=head)
    # the cells as written, for messages: the numeric and boolean columns below lose what was there
    df["measured_time_text"] = df["measured_time_s"].astype(str)
    for c in ("checkpointing", "feasible"):
        if c in df:
            bad = ~df[c].astype(str).str.strip().str.lower().isin(("true", "false", "1", "0", ""))
            if bad.any():
                raise UserError(f"results file '{p}': column {c} holds {df[c][bad].iloc[0]!r}, not true or false")
    for c in _NUMERIC:
        if c in df:
            df[c] = pd.to_numeric(df[c].replace("", np.nan), errors="coerce")
    # a time that is not a positive finite number measured nothing: such a run counts as not measured
    t = df["measured_time_s"].to_numpy(float)
    df.loc[~np.isfinite(t) | (t <= 0), "measured_time_s"] = np.nan
    for c in ("checkpointing", "feasible"):
        if c in df:
            df[c] = df[c].astype(str).str.lower().isin(("true", "1"))
    # files written before repeats existed hold one run per candidate
    df["repeat"] = pd.to_numeric(df["repeat"], errors="coerce").fillna(0).astype(int) if "repeat" in df else 0
    # the last record of a run wins (a collect after a re-run, a run again after an infrastructure failure)
    df = df.drop_duplicates(subset=["candidate", "repeat"], keep="last").reset_index(drop=True)
    return df if per_run else _per_candidate(df)


def header(path: Path) -> list[str]:
    text = _text(path, "results file")
    return next(csv.reader([text.split("\n", 1)[0]]), [])


def _per_candidate(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per candidate, in first-run order: its first ok run (else its first run) with the
    median measured time of its ok runs."""
    rows = []
    for _, g in runs.groupby("candidate", sort=False):
        ok = g[(g["status"] == "ok") & g["measured_time_s"].notna()]
        row = (ok if len(ok) else g).iloc[0].copy()
        t = ok["measured_time_s"].to_numpy(float)
        row["measured_time_s"] = float(np.median(t)) if len(t) else row["measured_time_s"]
        row["measured_runs"] = len(t)
        row["measured_spread"] = float(t.max() / t.min() - 1) if len(t) > 1 else np.nan
        row["wall_s"] = float(pd.to_numeric(g["wall_s"], errors="coerce").sum())
        rows.append(row)
    if not rows:
        return runs.assign(measured_runs=pd.Series(dtype=int), measured_spread=pd.Series(dtype=float))
    return pd.DataFrame(rows).reset_index(drop=True)


# ---- plan.csv and sweep.json ------------------------------------------------------------------------
def read_plan(path: str | Path, need_rows: bool = True) -> pd.DataFrame:
    """plan.csv: the candidate id and the rank columns, one row per candidate."""
    p = Path(path)
    text = _text(p, "plan file")
    if not text.strip():
        raise UserError(f"plan file '{p}' is empty (a sweep's plan.csv lists its candidates under a header)")
    try:
        df = pd.read_csv(io.StringIO(text))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise UserError(f"plan file '{p}' is not a CSV table: {' '.join(str(e).split())}") from None
    missing = [c for c in ["candidate"] + COLUMNS if c not in df.columns]
    if missing:
        raise UserError(f"plan file '{p}' lacks the column(s) {', '.join(missing[:6])}"
                        + (" ..." if len(missing) > 6 else "") + " that axoplan validate writes")
    if need_rows and df.empty:
        raise UserError(f"plan file '{p}' lists no candidates")
    if df["candidate"].isna().any() or df["candidate"].astype(str).duplicated().any():
        raise UserError(f"plan file '{p}' has an empty or repeated candidate id")
    for c in ("rank", "gx", "gy", "gz", "gdata", "micro_batch", "batch_time_s"):
        v = pd.to_numeric(df[c], errors="coerce")
        if not np.isfinite(v.to_numpy(float)).all() or (v <= 0).any():
            raise UserError(f"plan file '{p}': column {c} holds a value that is not a positive number")
        df[c] = v
    df["candidate"] = df["candidate"].astype(str)
    return df


def read_sweep_json(path: str | Path, cls):
    """sweep.json as the Sweep dataclass cls (a sweep begun before repeats existed counts as one pass)."""
    p = Path(path)
    try:
        d = json.loads(_text(p, "sweep file"))
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nesting deeper than any sweep's
        raise UserError(f"sweep file '{p}' is not JSON of a sweep's arguments") from None
    if not isinstance(d, dict):
        raise UserError(f"sweep file '{p}' is not a JSON object of the sweep's arguments")
    for k in ("repeats", "pp", "vpp", "schedule"):  # a sweep begun before these: the Sweep's defaults (rank's)
        d.setdefault(k, cls.__dataclass_fields__[k].default)
    fields = set(cls.__dataclass_fields__)
    unknown = sorted(set(d) - fields)
    missing = sorted(f for f in ("model", "machine", "gpus", "global_batch") if f not in d)
    if unknown or missing:
        raise UserError(f"sweep file '{p}' is not an axoplan validate sweep ("
                        + (f"unknown key(s) {', '.join(unknown[:4])}" if unknown else f"no {', '.join(missing)}") + ")")
    ints = ("gpus", "global_batch", "seq_len", "top_k", "steps", "warmup_steps", "micro_batch", "repeats", "vpp")
    for k in ints:
        v = d.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise UserError(f"sweep file '{p}': {k} must be an integer, got {v!r}")
    for k in ("model", "machine", "checkpointing", "schedule"):
        if k in d and not isinstance(d[k], str):
            raise UserError(f"sweep file '{p}': {k} must be a string, got {d[k]!r}")
    if d["pp"] != "all" and (isinstance(d["pp"], bool) or not isinstance(d["pp"], int)):
        raise UserError(f"sweep file '{p}': pp must be \"all\" or an integer, got {d['pp']!r}")
    t = d.get("timeout_s", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise UserError(f"sweep file '{p}': timeout_s must be a number, got {t!r}")
    return cls(**d)
