"""Byte-level training data (vocab 256, no downloads): a text file or a folder of them, or a
deterministic synthetic stream. Sequence g of step t is the same whatever the grid, so the
reference model and every grid see the same global batch; each (data, z) coordinate reads only
its own slice: global index (d*gz + z)*local + j for its local sample j."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from axoplan.errors import UserError


def local_indices(global_batch: int, gdata: int, gz: int, d: int, z: int) -> np.ndarray:
    local = global_batch // (gdata * gz)
    return (d * gz + z) * local + np.arange(local)


class SyntheticText:
    """Words from a fixed random lexicon of 64 words, separated by spaces: learnable (the loss falls
    well below ln 256) and generated per sequence from (seed, step, index)."""

    def __init__(self, seed: int):
        rng = np.random.default_rng([seed, 7])
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
        self.words = [np.append(rng.choice(letters, size=int(rng.integers(2, 8))), np.uint8(32)) for _ in range(64)]
        self.seed = seed

    def sequences(self, step: int, indices, length: int) -> np.ndarray:
        out = np.empty((len(indices), length), dtype=np.int64)
        for row, g in enumerate(indices):
            rng = np.random.default_rng([self.seed, step, int(g)])
            picks = rng.integers(0, len(self.words), size=length // 3 + 1)  # words are >= 3 bytes
            out[row] = np.concatenate([self.words[i] for i in picks])[:length]
        return out


MAX_DATA_BYTES = 4 * 2**30  # one data file, read whole into memory


def _short_data(path: str, text_bytes: int, length: int) -> UserError:
    s = "" if text_bytes == 1 else "s"
    return UserError(f"data '{path}' holds {text_bytes} byte{s} of text, fewer than the {length} one training "
                     f"sequence needs (seq_len tokens and the next token of each)")


class ByteFiles:
    """The bytes of one file or of every file under a folder (sorted, joined by newlines);
    each sequence starts at a seeded random offset."""

    def __init__(self, path: str, seed: int):
        p = Path(path)
        if not p.exists():
            raise UserError(f"data path '{path}' does not exist (use 'synthetic' or a text file or folder)")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        from axoplan.yamlio import read_bytes

        parts = []
        for f in files:
            parts.append(np.frombuffer(read_bytes(f, f"data file '{f}'", MAX_DATA_BYTES), dtype=np.uint8))
            parts.append(np.array([10], dtype=np.uint8))  # one newline between files
        self.data = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        self.text_bytes = len(self.data) - len(files)  # what the files hold, without the separators
        self.seed, self.path = seed, path

    def sequences(self, step: int, indices, length: int) -> np.ndarray:
        n = len(self.data)
        if n < length:
            raise _short_data(self.path, self.text_bytes, length)
        out = np.empty((len(indices), length), dtype=np.int64)
        for row, g in enumerate(indices):
            start = int(np.random.default_rng([self.seed, step, int(g)]).integers(0, n - length + 1))
            out[row] = self.data[start:start + length]
        return out


def open_source(data: str, seed: int, length: int):
    """The token source of a config; a file source must hold at least one sequence of `length`."""
    if data == "synthetic":
        return SyntheticText(seed)
    src = ByteFiles(data, seed)
    if len(src.data) < length:
        raise _short_data(data, src.text_bytes, length)
    return src
