"""The measured tables beside a machine profile (GEMM, intra-node collectives, attention): loading a
calibration's CSVs and looking shapes up in them. profile_reader loads them, MachineProfile reads them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from axoplan.tables import TableError, read_rows

if TYPE_CHECKING:
    from axoplan.planner.profile_reader import _Reader

LAYOUTS = ("NN", "NT", "TN")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMM times: a full cartesian grid (interpolated in log space) plus exact extra shapes."""

    m: np.ndarray  # grid values, ascending
    n: np.ndarray
    k: np.ndarray
    log_tput: dict  # layout -> array [len(m), len(n), len(k)] of log(FLOP/s)
    exact: dict  # (m, n, k) -> {layout: seconds}
    path: str = ""
    # ((m, n, k), layout) -> (seconds, extrapolated) of the small lookups: a refit evaluates the same few
    # shapes hundreds of times, where one lookup's interpolation costs ~0.4 ms of numpy overhead
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def swappable(self) -> bool:
        return self.m.shape == self.n.shape and bool(np.all(self.m == self.n))


@dataclass(frozen=True)
class CollectiveTable:
    """Measured seconds per call of each collective on each intra-node group shape, every group of
    the shape busy at once (the calibration's collectives.csv), for log-log interpolation in bytes.
    Where ranks share cores the calibration times calls after compute bursts of several lengths
    (`burst_s`, 0 = back to back): a call waits longer for peers the OS descheduled the longer
    they computed, so the planner interpolates in burst length too."""

    curves: dict  # (kind, size, stride) -> ((burst s, log bytes ascending, log seconds), ...) by burst
    path: str = ""
    # (kind, size, stride, bytes, slope) -> each burst's (t0, t) before the corrections, for small lookups
    # (comm.table_seconds): a refit times the same few calls hundreds of times
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    def covers(self, kind: str, size: int, stride: int) -> bool:
        return (kind, int(size), int(stride)) in self.curves


@dataclass(frozen=True)
class AttentionTable:
    """Measured causal attention per local shape (batch, heads, seq, head_dim): forward seconds and
    backward seconds, all ranks at once. Where a shape was measured the planner takes it as it is:
    throughput varies by an order of magnitude with head_dim and sequence on CPUs and small GPUs."""

    shapes: dict  # (batch, heads, seq, head_dim) -> (forward s, backward s)
    path: str = ""

    def seconds(self, batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float] | None:
        """The measured shape itself; else, where the same (seq, head_dim) was measured with other batch
        and head counts, interpolated in n = batch x heads: the kernel runs the n (sequence, head) pairs
        as one batch of identical independent problems, so time follows n (log-log between measured n,
        proportional to n beyond them). None where that sequence and head size were never measured."""
        hit = self.shapes.get((batch, heads, seq, head_dim))
        if hit:
            return hit
        pts = sorted((b * h, f, bw) for (b, h, s, d), (f, bw) in self.shapes.items() if s == seq and d == head_dim)
        if not pts:
            return None
        by_n: dict = {}
        for n0, f, bw in pts:  # shapes of equal n (4 x 2, 1 x 8) measured the same problem: geometric mean
            by_n.setdefault(n0, []).append((f, bw))
        ns = np.array(sorted(by_n), dtype=np.float64)
        logs = np.array([[np.mean(np.log(np.maximum([v[i] for v in by_n[n0]], 1e-12))) for i in (0, 1)]
                         for n0 in sorted(by_n)])
        n = float(batch * heads)
        if n <= ns[0] or n >= ns[-1]:
            j = 0 if n <= ns[0] else -1
            return tuple(float(np.exp(logs[j, i]) * n / ns[j]) for i in (0, 1))
        x = np.log(n)
        return tuple(float(np.exp(np.interp(x, np.log(ns), logs[:, i]))) for i in (0, 1))


# lookups of at most this many shapes go through GemmTable.memo (which holds at most MEMO_MAX entries)
MEMO_SHAPES = 64
MEMO_MAX = 100_000


def _memo_lookup(tab: GemmTable, pts: np.ndarray, layout: str | None):
    """_table_lookup of the rows of pts, each distinct shape interpolated once per table and layout."""
    keys = [(tuple(r), layout) for r in pts.tolist()]
    todo = list(dict.fromkeys(k for k in keys if k not in tab.memo))
    if todo:
        t, ext = _table_lookup(tab, np.array([k[0] for k in todo], dtype=np.float64), layout)
        found = dict(zip(todo, zip(t.tolist(), ext.tolist())))
        if len(tab.memo) + len(found) <= MEMO_MAX:
            tab.memo.update(found)
    else:
        found = {}
    got = [tab.memo.get(k) or found[k] for k in keys]
    return np.array([g[0] for g in got], dtype=np.float64), np.array([g[1] for g in got], dtype=bool)


def _interp_log_tput(tab: GemmTable, lm, ln, lk, grid):
    """Trilinear interpolation of log throughput on the log2 grid; coordinates already clamped."""
    idx, wts = [], []
    for vals, x in ((tab.m, lm), (tab.n, ln), (tab.k, lk)):
        g = np.log2(vals)
        if len(g) == 1:
            i = np.zeros_like(x, dtype=np.int64)
            w = np.zeros_like(x)
        else:
            i = np.clip(np.searchsorted(g, x, side="right") - 1, 0, len(g) - 2)
            w = (x - g[i]) / (g[i + 1] - g[i])
        idx.append(i)
        wts.append(w)
    res = np.zeros_like(lm)
    for dm in (0, 1):
        for dn in (0, 1):
            for dk in (0, 1):
                im = np.minimum(idx[0] + dm, grid.shape[0] - 1)
                in_ = np.minimum(idx[1] + dn, grid.shape[1] - 1)
                ik = np.minimum(idx[2] + dk, grid.shape[2] - 1)
                w = (wts[0] if dm else 1 - wts[0]) * (wts[1] if dn else 1 - wts[1]) * (wts[2] if dk else 1 - wts[2])
                res += w * grid[im, in_, ik]
    return res


def _table_lookup(tab: GemmTable, shapes: np.ndarray, layout: str | None):
    m, n, k = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    flop = 2.0 * m * n * k
    forms = [(m, n, k)]
    if layout is None and tab.swappable:
        forms.append((n, m, k))
    layouts = LAYOUTS if layout is None else (layout,)
    best = np.full(len(m), np.inf)
    ext = np.zeros(len(m), dtype=bool)
    for (a, b, c) in forms:
        la, lb, lc = np.log2(a), np.log2(b), np.log2(c)
        outside = np.zeros(len(m), dtype=bool)
        clamped = []
        for vals, x in ((tab.m, la), (tab.n, lb), (tab.k, lc)):
            lo, hi = np.log2(vals[0]), np.log2(vals[-1])
            outside |= (x < lo - 1e-9) | (x > hi + 1e-9)
            clamped.append(np.clip(x, lo, hi))
        for lay in layouts:
            if lay not in tab.log_tput:
                continue
            t = flop / np.exp(_interp_log_tput(tab, *clamped, tab.log_tput[lay]))
            better = t < best
            best = np.where(better, t, best)
            ext = np.where(better, outside, ext)
    if tab.exact:
        for i, (a, b, c) in enumerate(shapes):
            hit = tab.exact.get((int(a), int(b), int(c)))
            if hit:
                cands = [hit[layout] for layout in layouts if layout in hit]
                if layout is None and tab.swappable:
                    other = tab.exact.get((int(b), int(a), int(c)), {})
                    cands += list(other.values())
                if cands:
                    best[i] = min(cands)
                    ext[i] = False
    return best, ext


def _load_gemm_table(path: Path, rd: _Reader) -> GemmTable:
    rows = _read_csv(path, rd, "compute.gemm.table.path", {"m", "n", "k", "layout", "seconds"},
                     ints=("m", "n", "k"), floats=("seconds",))
    data: dict = {}
    for r in rows:
        key, sec = (r["m"], r["n"], r["k"]), r["seconds"]
        lay = r["layout"].strip().upper()
        if lay not in LAYOUTS or sec <= 0:
            continue
        slot = data.setdefault(key, {})
        slot[lay] = min(sec, slot.get(lay, np.inf))
    # The cartesian grid: drop the axis value with the poorest coverage until the product is complete.
    vals = [sorted({s[i] for s in data}) for i in range(3)]
    while True:
        total = len(vals[0]) * len(vals[1]) * len(vals[2])
        present = {s for s in data if s[0] in vals[0] and s[1] in vals[1] and s[2] in vals[2]}
        if len(present) == total or total == 0:
            break
        worst, worst_cov = None, 2.0
        for ax in range(3):
            for v in vals[ax]:
                others = total // len(vals[ax])
                cov = sum(1 for s in present if s[ax] == v) / others
                if cov < worst_cov:
                    worst, worst_cov = (ax, v), cov
        vals[worst[0]].remove(worst[1])
    if any(len(v) == 0 for v in vals):
        rd.fail("compute.gemm.table.path", f"'{path}' holds no complete cartesian grid of m, n, k")
    grid_m, grid_n, grid_k = (np.array(v, dtype=np.float64) for v in vals)
    log_tput = {}
    for lay in LAYOUTS:
        arr = np.empty((len(grid_m), len(grid_n), len(grid_k)))
        ok = True
        for i, a in enumerate(vals[0]):
            for j, b in enumerate(vals[1]):
                for kk, c in enumerate(vals[2]):
                    sec = data[(a, b, c)].get(lay)
                    if sec is None:
                        ok = False
                        break
                    arr[i, j, kk] = np.log(2.0 * a * b * c / sec)
        if ok:
            log_tput[lay] = arr
    if not log_tput:
        rd.fail("compute.gemm.table.path", f"'{path}' has no layout measured on the whole grid")
    grid_set = {(a, b, c) for a in vals[0] for b in vals[1] for c in vals[2]}
    exact = {s: v for s, v in data.items() if s not in grid_set}
    return GemmTable(grid_m, grid_n, grid_k, log_tput, exact, str(path))


def _non_decreasing(y: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks = []  # [sum, count]
    for v in y:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, n2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += n2
    return np.concatenate([np.full(n, s_ / n) for s_, n in blocks])


def _pool_strides(points: dict) -> dict:
    """Where ranks share cores (the table was timed after compute bursts) no rank is pinned to a core,
    so which ranks form a group cannot matter: the groups of one size but different strides measured
    the same thing, and their differences are noise. Pooled per burst level (the calibration runs the
    same bursts on every shape; level i of each stride is one measurement of it): geometric mean time
    per size, mean burst length."""
    by_size: dict = {}
    for key, by_burst in points.items():
        by_size.setdefault((key[0], key[1]), []).append((key, by_burst))
    out = {}
    for members in by_size.values():
        levels: dict = {}
        for _, by_burst in members:
            for i, burst in enumerate(sorted(by_burst)):
                levels.setdefault(i, []).append((burst, by_burst[burst]))
        pooled = {}
        for runs in levels.values():
            sizes = sorted({b for _, pts in runs for b in pts})
            pooled[float(np.mean([burst for burst, _ in runs]))] = {
                b: float(np.exp(np.mean([np.log(pts[b]) for _, pts in runs if b in pts]))) for b in sizes}
        for key, _ in members:
            out[key] = pooled
    return out


def _load_collective_table(path: Path, rd: _Reader, gpus_per_node: int) -> CollectiveTable:
    where = "network.intra_node.table.path"
    rows = _read_csv(path, rd, where, {"collective", "size", "stride", "bytes", "seconds"},
                     ints=("size", "stride"), floats=("bytes", "seconds", "burst_s"))
    points: dict = {}
    for r in rows:
        key = (r["collective"].strip(), r["size"], r["stride"])
        nbytes, sec = r["bytes"], r["seconds"]
        burst = r.get("burst_s") or 0.0
        if key[0] not in COLLECTIVES:
            rd.fail(where, f"'{path}' names an unknown collective {key[0]!r}")
        # only groups inside one node: across nodes the rings share NICs, which the alpha-beta model handles
        if nbytes <= 0 or sec <= 0 or key[1] < 2 or key[1] * key[2] > gpus_per_node or gpus_per_node % (key[1] * key[2]):
            continue
        points.setdefault(key, {}).setdefault(burst, {})[nbytes] = sec
    if any(burst > 0 for by_burst in points.values() for burst in by_burst):
        points = _pool_strides(points)
    curves = {}
    for key, by_burst in points.items():
        cs = []
        for burst, pts in sorted(by_burst.items()):
            if len(pts) < 2:
                continue
            b = np.array(sorted(pts), dtype=np.float64)
            # a collective never gets cheaper with more bytes: a dip is timing noise, pooled away
            cs.append((burst, np.log(b), np.log(_non_decreasing(np.array([pts[x] for x in sorted(pts)])))))
        if cs:
            curves[key] = tuple(cs)
    if not curves:
        rd.fail(where, f"'{path}' holds no intra-node group with two or more sizes")
    return CollectiveTable(curves, str(path))


def _read_csv(path: Path, rd: _Reader, where: str, need: set, ints=(), floats=()) -> list[dict]:
    try:
        return read_rows(path, need, ints=ints, floats=floats)
    except TableError as e:
        rd.fail(where, f"names '{path}', which cannot be read ({e.detail})")


def _load_attention_table(path: Path, rd: _Reader) -> AttentionTable:
    where = "compute.attention.table.path"
    rows = _read_csv(path, rd, where, {"batch", "heads", "seq", "head_dim", "causal", "pass", "seconds"},
                     ints=("batch", "heads", "seq", "head_dim"), floats=("seconds",))
    t = {}
    for r in rows:
        key = tuple(r[k] for k in ("batch", "heads", "seq", "head_dim"))
        sec = r["seconds"]
        if str(r["causal"]).strip().lower() in ("true", "1") and sec > 0:
            t[key + (str(r["pass"]).strip(),)] = sec
    shapes = {}
    for key in {k[:4] for k in t}:
        f, fb = t.get(key + ("forward",)), t.get(key + ("forward_backward",))
        if f and fb:
            shapes[key] = (f, max(fb - f, 0.0))
    if not shapes:
        rd.fail(where, f"'{path}' holds no shape with causal forward and forward_backward times")
    return AttentionTable(shapes, str(path))
