"""Reading the YAML files users give (models, machine profiles, run configs) without hanging or
crashing: bounded size, UTF-8 text only, no aliases (billion laughs), bounded nesting, and every
problem one sentence naming the file."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.inputs import bad_char

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


def read_bytes(path: str | Path, where: str, max_bytes: int = MAX_BYTES, tail: bool = False) -> bytes:
    """The one way axoplan reads a file a user can put in its place: refused in one sentence unless it
    is a regular file (a FIFO would block forever, /dev/zero never ends, a folder is not a file) of at
    most max_bytes; with tail, the last max_bytes of a longer one (a log whose last line matters).
    Opened without blocking and checked on the open descriptor, so nothing swapped in between is read.
    A missing file raises FileNotFoundError (callers word "not there yet" their own way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UserError(f"cannot read {where}: {(e.strerror or str(e)).lower()}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{where} is not a regular file")
        if st.st_size > max_bytes:
            if not tail:
                raise UserError(f"{where} is larger than {_size(max_bytes)}; is it the right file?")
            os.lseek(fd, st.st_size - max_bytes, os.SEEK_SET)
        chunks, left = [], max_bytes + 1  # one byte more: a file that grew while read is still caught
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise UserError(f"cannot read {where}: {(e.strerror or str(e)).lower()}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        if not tail:
            raise UserError(f"{where} is larger than {_size(max_bytes)}; is it the right file?")
        data = data[-max_bytes:]
    return data


def _size(n: int) -> str:
    return f"{n // 2**30} GiB" if n >= 2**30 and n % 2**30 == 0 else f"{n // 2**20} MiB"


def read_text(path: Any, where: str, max_bytes: int = MAX_BYTES) -> str:
    """A file's text: refused in one sentence if unreadable, too large, binary or not UTF-8."""
    try:
        if isinstance(path, (str, Path)):
            data = read_bytes(path, where, max_bytes)
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


# YAML 1.1 (PyYAML) reads 1e3 and 3E-5 as strings: its floats need a dot. People write exponents
# without one (YAML 1.2 and JSON read them as numbers), so both loaders resolve those as floats too.
_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


def _with_exponents(cls):
    cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789"))
    return cls


@_with_exponents
class _Loader(_Loader):
    pass


_FAST = getattr(yaml, "CSafeLoader", None)  # libyaml: the same safe loader, in C
if _FAST is not None:
    _FAST = _with_exponents(type("_FastLoader", (_FAST,), {}))
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


def _check_text(node: Any, path: str) -> None:
    """No text in a file may carry a control character (an escaped "\\e" or "\\x9b" in a quoted string
    would reach the terminal raw when a name or device is printed); newlines and tabs stay allowed
    in values (a description may span lines)."""
    if isinstance(node, dict):
        for k, v in node.items():
            p = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and bad_char(k) is not None:
                raise UserError(f"has a key holding a control character ({inputs.show(k)})")
            _check_text(v, p)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_text(v, f"{path}[{i}]")
    elif isinstance(node, str):
        c = bad_char(node.replace("\n", "").replace("\t", ""))
        if c is not None:
            what = "an undecodable character" if c > "\ud7ff" and c < "\ue000" else f"a control character ({c!r})"
            raise UserError(f"field '{path or '(top level)'}' holds {what}; text in a file must be printable")


def parse_yaml(text: str, where: str) -> Any:
    try:
        if _FAST is None:
            data = yaml.load(text, Loader=_Loader)  # a SafeLoader that refuses aliases and deep nesting
        else:
            _prescan(text)
            data = yaml.load(text, Loader=_FAST)  # a safe loader; aliases and depth were refused above
        _check_text(data, "")
        return data
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
