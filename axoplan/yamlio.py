"""Reading the YAML files users give (models, machine profiles, run configs) without hanging or
crashing: bounded size, UTF-8 text only, no aliases (billion laughs), bounded nesting, and every
problem one sentence naming the file."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from axoplan.errors import UserError

MAX_BYTES = 4 * 2**20  # the largest bundled profile is 12 KiB; tables live in CSV files beside it
MAX_DEPTH = 64  # profiles nest four levels; deeper is a mistake, and 100k levels would overflow the stack
MAX_NODES = 100_000  # values in one file (a profile holds a few hundred); bounds the time to build them


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and deep nesting while composing, before anything is built."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise UserError("uses a YAML alias (*name); write the value out instead")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise UserError(f"nests deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_text(path: Any, where: str, max_bytes: int = MAX_BYTES) -> str:
    """A file's text: refused in one sentence if unreadable, too large, binary or not UTF-8."""
    try:
        if isinstance(path, (str, Path)):
            if not stat.S_ISREG(os.stat(path).st_mode):
                # a FIFO would block forever, a device never ends, a folder is not a file
                raise UserError(f"{where} is not a regular file")
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        else:  # a packaged resource (importlib.resources)
            data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {where}: {(e.strerror or str(e)).lower()}") from None
    if len(data) > max_bytes:
        raise UserError(f"{where} is larger than {max_bytes // 2**20} MiB; is it the right file?")
    if b"\x00" in data:
        raise UserError(f"{where} is not a text file (it holds NUL bytes; UTF-16 or binary?)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{where} is not UTF-8 text") from None


_FAST = getattr(yaml, "CSafeLoader", None)  # libyaml: the same safe loader, in C
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


def _prescan(text: str) -> None:
    """Walk the parser's events (no objects built): refuse aliases, deep nesting and huge node counts
    before anything is constructed."""
    depth = nodes = 0
    for ev in yaml.parse(text, Loader=_FAST):
        if isinstance(ev, yaml.AliasEvent):
            raise UserError("uses a YAML alias (*name); write the value out instead")
        if isinstance(ev, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                raise UserError(f"nests deeper than {MAX_DEPTH} levels")
        elif isinstance(ev, _CLOSE):
            depth -= 1
        if isinstance(ev, (yaml.ScalarEvent, *_OPEN)):
            nodes += 1
            if nodes > MAX_NODES:
                raise UserError(f"holds more than {MAX_NODES:,} values; is it the right file?")


def parse_yaml(text: str, where: str) -> Any:
    try:
        if _FAST is None:
            return yaml.load(text, Loader=_Loader)  # a SafeLoader that refuses aliases and deep nesting
        _prescan(text)
        return yaml.load(text, Loader=_FAST)  # a safe loader; aliases and depth were refused above
    except UserError as e:
        raise UserError(f"{where} {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{where}: malformed YAML{at}") from None
    except (ValueError, RecursionError, OverflowError):
        # e.g. an integer of more digits than Python converts
        raise UserError(f"{where}: a value cannot be read (a number too large?)") from None


def load_yaml(path: Any, where: str) -> Any:
    return parse_yaml(read_text(path, where), where)
