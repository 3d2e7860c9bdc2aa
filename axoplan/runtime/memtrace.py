"""Live tensor bytes along a training step, by kind, and the moment of their peak.

A TorchDispatchMode sees every tensor an operator returns; each new storage is counted until the
storage is freed (a weak reference's finalizer). Works the same on real tensors and under
FakeTensorMode, where nothing is allocated, so one rank of a job of any size can be traced on a
laptop. Each allocation is charged to the kind in force when it was made (Runtime.memory_kind);
the peak keeps the bytes of every kind live at that moment and where the step was (Runtime.moment).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("states", "gathered weights", "gradient blocks", "activations", "logits", "transients", "pipeline buffers")


class MemoryTracer(TorchDispatchMode):
    def __init__(self, kind: str = "states"):
        super().__init__()
        self.current = kind
        self.where = "setup"
        self.live: dict[int, tuple[int, str]] = {}  # id(storage) -> (bytes, kind)
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_kind = dict(self.by_kind)
        self.peak_where = self.where
        self.moments: dict[str, tuple[int, dict]] = {}  # where -> its own peak and the kinds then

    @contextlib.contextmanager
    def kind(self, kind: str):
        before, self.current = self.current, kind
        try:
            yield
        finally:
            self.current = before

    def reset_peak(self) -> None:
        self.peak, self.peak_by_kind, self.peak_where = self.total, dict(self.by_kind), self.where
        self.moments = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = (nbytes, self.current)
        self.by_kind[self.current] = self.by_kind.get(self.current, 0) + nbytes
        self.total += nbytes
        weakref.finalize(st, self._free, key)
        if self.total > self.peak:
            self.peak, self.peak_by_kind, self.peak_where = self.total, dict(self.by_kind), self.where
        if self.total > self.moments.get(self.where, (-1,))[0]:
            self.moments[self.where] = (self.total, dict(self.by_kind))

    def _free(self, key: int) -> None:
        nbytes, kind = self.live.pop(key, (0, None))
        if kind is not None:
            self.by_kind[kind] -= nbytes
            self.total -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out
