"""The one input-validation layer: bounds on counts, finite numbers, printable text, and the click
parameter types every command uses for them. Each refusal is one sentence naming the input."""
from __future__ import annotations

import math
import numbers
import re
import unicodedata
from typing import Any

import click

from axoplan.errors import UserError

# The largest counts axoplan enumerates: the planner lists every factorization and divisor of these,
# so a bound keeps every command fast and every integer inside int64 arithmetic.
MAX_GPUS = 2**20
MAX_GLOBAL_BATCH = 2**24
MAX_SEQ_LEN = 2**24
MAX_STEPS = 10**9
MAX_SEED = 2**32 - 1  # numpy's seed range, which the trainer and the studies share with torch
MAX_GPUS_PER_NODE = 4096
MAX_COUNT = 2**31 - 1  # any other count (layers, heads, ...): a C int
MAX_TEXT = 4096  # characters in a name or path
# AdamW moves each weight by about lr per step: above 1 every weight leaves its scale in one step, and
# the losses become inf or NaN (1e300 overflows Adam's own arithmetic)
MAX_LR = 1.0

_INT = re.compile(r"^[+-]?[0-9]+$")


def count(value: Any, name: str, lo: int = 1, hi: int = MAX_COUNT) -> int:
    """value as an integer in [lo, hi] (an int, or ASCII digits), else UserError naming `name`."""
    if isinstance(value, bool):
        raise UserError(f"{name} must be a whole number, got {show(value)}")
    if isinstance(value, str):
        s = value.strip().replace("_", "")
        if not _INT.match(s) or len(s) > 30:
            raise UserError(f"{name} must be a whole number written in digits, got {show(value)}")
        value = int(s)
    elif isinstance(value, numbers.Integral):
        value = int(value)  # numpy integers from tables
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise UserError(f"{name} must be a whole number, got {show(value)}")
    if value < lo:
        raise UserError(f"{name} must be at least {lo}, got {_short(value)}")
    if value > hi:
        raise UserError(f"{name} must be at most {hi:,} (the largest count axoplan enumerates), got {_short(value)}")
    return value


def number(value: Any, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    """value as a finite float in the given range, else UserError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UserError(f"{name} must be a number, got {show(value)}")
    try:
        v = float(value)
    except (ValueError, OverflowError):
        raise UserError(f"{name} must be a number, got {show(value)}") from None
    if not math.isfinite(v):
        raise UserError(f"{name} must be a finite number, got {show(value)}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise UserError(f"{name} must be {'greater than' if lo_open else 'at least'} {lo:g}, got {v:g}")
    if hi is not None and v > hi:
        raise UserError(f"{name} must be at most {hi:g}, got {v:g}")
    return v


def _short(v: int) -> str:
    s = str(v)
    return s if len(s) <= 24 else f"a number of {len(s)} digits"


def show(v: Any) -> str:
    """repr(v) for an error sentence, cut short: a pasted megabyte must not become the message."""
    r = repr(v)
    return r if len(r) <= 60 else f"{r[:40]}... ({len(r)} characters)"


def bad_char(s: str) -> str | None:
    """The first character that must not reach a script or a one-line record: control characters
    (C0, DEL, C1), line and paragraph separators, and undecodable bytes (lone surrogates)."""
    for c in s:
        if unicodedata.category(c) in ("Cc", "Zl", "Zp", "Cs"):
            return c
    return None


def printable(s: str) -> str:
    """s with every character bad_char refuses written as an escape (\\x1b): text from a run's log
    or any other file reaches the terminal inert."""
    return "".join(c.encode("unicode_escape", "backslashreplace").decode("ascii") if bad_char(c) else c
                   for c in s)


def text(value: Any, name: str, allow_empty: bool = False) -> str:
    """A name, path or label: a string without control characters, of reasonable length."""
    if not isinstance(value, str):
        raise UserError(f"{name} must be text, got {show(value)}")
    if not value and not allow_empty:
        raise UserError(f"{name} must not be empty")
    c = bad_char(value)
    if c is not None:
        what = "an undecodable byte" if unicodedata.category(c) == "Cs" else f"a control character ({c!r})"
        raise UserError(f"{name} contains {what}; names and paths must be printable text")
    if len(value) > MAX_TEXT:
        raise UserError(f"{name} is {len(value)} characters long; at most {MAX_TEXT} are accepted")
    return value


def check_argv(args: list[str]) -> None:
    """No command-line argument may hold a control character: every name and path a command takes
    can reach a script, a YAML file or a one-line record. Names the option the value belongs to."""
    for i, a in enumerate(args):
        if bad_char(a) is None:
            continue
        if a.startswith("--") and "=" in a:
            name = a.split("=", 1)[0]
        elif i > 0 and args[i - 1].startswith("-") and bad_char(args[i - 1]) is None:
            name = args[i - 1]
        else:
            name = f"argument {i + 1}"
        text(a, name)


# ---- click parameter types: the CLI's side of the same checks (a UserError passes through click to
# the CLI's one-sentence handler, naming the option) ---------------------------------------------------
def _label(param, ctx) -> str:  # the option as the user typed it, e.g. --gpus
    if param is None:
        return "value"
    opts = getattr(param, "opts", None)
    long = [o for o in opts or () if o.startswith("--")]  # the first long name: an alias is listed after it
    return long[0] if long else (max(opts, key=len) if opts else param.name)


class Count(click.ParamType):
    """A whole number in [lo, hi], written in ASCII digits (no 1e3, no ², no 2^10)."""

    name = "integer"

    def __init__(self, lo: int = 1, hi: int = MAX_COUNT):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        return count(value, _label(param, ctx), self.lo, self.hi)


class Number(click.ParamType):
    """A finite float in a range (no nan, no inf)."""

    name = "number"

    def __init__(self, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        return number(value, _label(param, ctx), self.lo, self.hi, self.lo_open)


class Text(click.ParamType):
    """A name or path without control characters."""

    name = "text"

    def convert(self, value, param, ctx):
        return text(value, _label(param, ctx))


class SafePath(click.Path):
    """click.Path that first refuses control characters in the path."""

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            text(value, _label(param, ctx))
        return super().convert(value, param, ctx)


GPUS = Count(1, MAX_GPUS)
GLOBAL_BATCH = Count(1, MAX_GLOBAL_BATCH)
SEQ_LEN = Count(1, MAX_SEQ_LEN)
MICRO_BATCH = Count(1, MAX_GLOBAL_BATCH)
STEPS = Count(1, MAX_STEPS)
SEED = Count(0, MAX_SEED)
TEXT = Text()
