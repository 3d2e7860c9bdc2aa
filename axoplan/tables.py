"""Reading the CSV tables a profile names (GEMM, collective, attention times): every row complete,
every number finite, the file text; anything else one sentence naming the file and the row."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from axoplan.errors import UserError
from axoplan.yamlio import read_text

MAX_TABLE_BYTES = 64 * 2**20


class TableError(UserError):
    """A table that cannot be used; `detail` says why without the file's name (callers name it)."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.detail = detail


def read_rows(path: str | Path, need: set, ints=(), floats=()) -> list[dict]:
    """Rows of a CSV file as dicts; columns in `ints` become positive integers, those in `floats`
    finite non-negative floats (an optional column, not in `need`, may be empty: None)."""
    where = f"'{path}'"
    try:
        body = read_text(path, "it", MAX_TABLE_BYTES)
    except UserError as e:
        raise TableError(where, str(e).replace("cannot read it: ", "")) from None
    reader = csv.reader(io.StringIO(body, newline=""))
    try:
        rows = list(reader)
    except csv.Error as e:
        raise TableError(where, f"not a readable CSV file ({e})") from None
    rows = [r for r in rows if r]
    if not rows or not need <= set(rows[0]):
        raise TableError(where, f"needs columns {', '.join(sorted(need))}")
    head = rows[0]
    out = []
    for line, r in enumerate(rows[1:], start=2):
        if len(r) != len(head):
            raise TableError(where, f"line {line} has {len(r)} fields, the header {len(head)}")
        d = dict(zip(head, r))
        for c in ints:
            if c in d:
                d[c] = _int(d[c], c, where, line)
        for c in floats:
            if c in d:
                d[c] = None if d[c].strip() == "" and c not in need else _float(d[c], c, where, line)
        out.append(d)
    return out


def _float(s: str, col: str, where: str, line: int) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise TableError(where, f"line {line}: {col} must be a finite non-negative number, got {s!r}")
    return v


def _int(s: str, col: str, where: str, line: int) -> int:
    v = _float(s, col, where, line)
    if v != int(v) or v < 1 or v > 2**62:
        raise TableError(where, f"line {line}: {col} must be a positive whole number, got {s!r}")
    return int(v)
