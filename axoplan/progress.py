"""Progress of long computations (refit's fits, calibrate's fitting stage) on stderr, one line: the
library reports stages through step(); only a command that opened on_stderr() prints them, so library
callers and tests stay silent. On a terminal the line is rewritten in place and cleared at the end (an
error after it is still the one line on stderr); piped, nothing, unless AXOPLAN_PROGRESS=1 asks for a line
per stage (at most one every 10 s) in a log."""
from __future__ import annotations

import contextvars
import os
import sys
import time
from contextlib import contextmanager

_sink: contextvars.ContextVar = contextvars.ContextVar("axoplan_progress", default=None)


class _Reporter:
    def __init__(self, prefix: str, stream):
        self.prefix, self.stream = prefix, stream
        self.tty = stream.isatty()
        self.t0 = self.last = time.perf_counter()
        self.stage = None
        self.width = 0

    def step(self, stage: str, done: int | None, total: int | None) -> None:
        now = time.perf_counter()
        new = stage != self.stage
        if not self.tty and not new and now - self.last < 10:
            return
        self.stage, self.last = stage, now
        count = f" {done}/{total}" if done is not None and total else ""
        text = f"{self.prefix}: {stage}{count} ({now - self.t0:.0f} s)"
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()


def step(stage: str, done: int | None = None, total: int | None = None) -> None:
    r = _sink.get()
    if r is not None:
        r.step(stage, done, total)


@contextmanager
def on_stderr(prefix: str, stream=None):
    """`stream` given: report there whatever it is (tests, logs)."""
    out = stream or sys.stderr
    if stream is None and not out.isatty() and os.environ.get("AXOPLAN_PROGRESS") != "1":
        yield None
        return
    r = _Reporter(prefix, out)
    token = _sink.set(r)
    try:
        yield r
    finally:
        _sink.reset(token)
        r.close()
