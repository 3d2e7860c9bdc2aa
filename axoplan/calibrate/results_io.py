"""The raw-results folder of one calibration run: meta.json plus one CSV per microbenchmark.
Rows are appended (and flushed) as they are measured, so an interrupted run keeps what it did."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from axoplan.atomic import append_line, atomic_write_text

COLUMNS = {
    "gemm": ["m", "n", "k", "layout", "seconds", "tflops", "seconds_min_rank", "seconds_max_rank"],
    "collectives": ["collective", "size", "stride", "crosses_nodes", "bytes", "seconds", "seconds_min_rank",
                    "busbw_gbs", "burst_s"],
    "memory": ["kind", "op", "elements", "bytes", "seconds"],
    "attention": ["batch", "heads", "seq", "head_dim", "causal", "pass", "seconds"],
    "overlap": ["collective", "size", "stride", "bytes", "burst_s", "collective_s", "together_s", "efficiency"],
    "framework": ["layers", "hidden", "heads", "vocab", "seq", "micro_batch", "grad_acc", "seconds"],
    "trainer": ["layers", "hidden", "heads", "vocab", "seq", "global_batch", "micro_batch", "gx", "gy", "gz", "gdata",
                "order", "seconds"],
}


TEXT_COLUMNS = {"layout", "collective", "kind", "op", "pass", "order"}
BOOL_COLUMNS = {"crosses_nodes", "causal"}
SIGNED_COLUMNS = {"efficiency"}  # a collective can run slower beside compute than alone


class ResultsError(ValueError):
    """A results file that is not what the workers write: one sentence naming the file (and line)."""


class ResultsDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def csv_path(self, table: str) -> Path:
        return self.path / f"{table}.csv"

    def start(self, meta: dict, tables=None) -> None:
        """A fresh run: old tables are removed so rows of two runs never mix. With `tables`, only those
        are started again (parts re-measured on top of an earlier run; the others are kept)."""
        self.path.mkdir(parents=True, exist_ok=True)
        for table, cols in COLUMNS.items():
            if tables is not None and table not in tables:
                continue
            p = self.csv_path(table)
            if p.exists():
                p.unlink()
            append_line(p, ",".join(cols))
        self.write_meta(meta)

    def columns(self, table: str) -> list[str]:
        return COLUMNS[table]

    def append(self, table: str, row: dict) -> None:
        cols = COLUMNS[table]
        append_line(self.csv_path(table), ",".join(_fmt(row[c]) for c in cols))

    def write_meta(self, meta: dict) -> None:
        atomic_write_text(self.path / "meta.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")

    def meta(self) -> dict:
        p = self.path / "meta.json"
        try:
            m = json.loads(_text(p))
        except (json.JSONDecodeError, RecursionError):
            raise ResultsError(f"{p} is not JSON") from None
        if not isinstance(m, dict):
            raise ResultsError(f"{p} is not a JSON object (a calibration run's meta.json)")
        return m

    def rows(self, table: str) -> list[dict]:
        """The rows of one table, each checked: every column present, numbers finite (times positive),
        text and flags where the workers write them; anything else is a ResultsError naming the line."""
        p = self.csv_path(table)
        if not p.exists():
            return []
        reader = csv.DictReader(io.StringIO(_text(p), newline=""))
        cols = COLUMNS[table]
        missing = [c for c in cols if c not in (reader.fieldnames or [])]
        if missing:
            raise ResultsError(f"{p} lacks the column(s) {', '.join(missing)}")
        out = []
        for r in reader:
            line = reader.line_num
            if None in r or any(r.get(c) is None for c in cols):
                raise ResultsError(f"{p} line {line} has {'too many' if None in r else 'too few'} fields")
            row = _parse(r)
            for c in cols:
                v = row[c]
                if c in BOOL_COLUMNS:
                    ok = isinstance(v, bool)
                elif c in TEXT_COLUMNS:
                    ok = isinstance(v, str) and v != ""
                else:
                    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
                        c in SIGNED_COLUMNS or v > 0 or (v == 0 and c != "seconds"))
                if not ok:
                    raise ResultsError(f"{p} line {line}: {c} is {r[c]!r}, not what the workers write")
            out.append(row)
        return out


def _text(p: Path) -> str:
    from axoplan.errors import UserError
    from axoplan.yamlio import read_bytes

    try:
        data = read_bytes(p, str(p), 1 << 30)  # a FIFO or device in the folder is refused, never read
    except UserError as e:
        raise ResultsError(str(e)) from None
    except OSError as e:
        raise ResultsError(f"cannot read {p}: {(e.strerror or str(e)).lower()}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ResultsError(f"{p} is not UTF-8 text (a binary file?)") from None
    if "\0" in text:
        raise ResultsError(f"{p} holds NUL bytes (a binary file?)")
    return text


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _parse(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if v in ("true", "false"):
            out[k] = v == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out
