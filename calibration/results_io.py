"""The raw-results folder of one calibration run: meta.json plus one CSV per microbenchmark.
Rows are appended (and flushed) as they are measured, so an interrupted run keeps what it did."""
from __future__ import annotations

import csv
import json
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
        return json.loads((self.path / "meta.json").read_text())

    def rows(self, table: str) -> list[dict]:
        p = self.csv_path(table)
        if not p.exists():
            return []
        with open(p, newline="") as f:
            return [_parse(r) for r in csv.DictReader(f)]


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
