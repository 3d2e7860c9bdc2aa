"""Tables that fit the terminal (100 columns when output is not a terminal and $COLUMNS is unset): the
names a user types are never cut, and columns are left out in a stated priority, lowest first, with a
note naming them (--format csv/json keep every column)."""
from __future__ import annotations

import os
import shutil
import sys

from rich.table import Table

DEFAULT_WIDTH = 100


def width() -> int:
    """The terminal's width, or $COLUMNS, or 100 (piped output reads in a 100-column terminal or pager)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) >= 40:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


def _natural(col) -> int:
    cells = [str(c) for c in col._cells]
    return max([len(str(col.header))] + [max((len(x) for x in c.splitlines()), default=0) for c in cells])


def keep_whole(table: Table, *headers: str) -> None:
    """Never wrap nor cut these columns (the names to type): their width is their longest cell."""
    for col in table.columns:
        if col.header in headers:
            col.no_wrap = True
            col.min_width = _natural(col)
            col.overflow = "ignore"


def fit(table: Table, cols: int, drop_first: list[str], wrap: tuple[str, ...] = ()) -> list[str]:
    """Leave out columns of `table`, in the order of `drop_first`, until its natural width fits `cols`
    (a column in `wrap` counts at 14 characters: rich wraps it, folding what has no spaces, never cutting it).
    Returns the headers left out."""
    for c in table.columns:
        if c.header in wrap:
            c.overflow = "fold"

    def need() -> int:  # each cell: padding 1 + 1 and a border; one more border at the end
        return 1 + sum(min(_natural(c), 14 if c.header in wrap else 10**6) + 3 for c in table.columns)

    dropped = []
    for header in drop_first:
        if need() <= cols:
            break
        for i, c in enumerate(table.columns):
            if c.header == header:
                del table.columns[i]
                dropped.append(header)
                break
    return dropped


def dropped_note(dropped: list[str], cols: int, more: str = "") -> str | None:
    if not dropped:
        return None
    return f"left out to fit {cols} columns: {', '.join(dropped)} (COLUMNS=200 shows them{more})"
