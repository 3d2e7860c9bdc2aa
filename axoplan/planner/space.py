"""The candidate space as columnar numpy arrays: every ordered factorization G = gx*gy*gz*gdata,
every distinct placement order, micro-batch sizes and activation checkpointing on/off.

Orders that put the same GPUs together are the same configuration: an axis of size 1 takes no
place, so for each grid only orders that differ in the sequence of their non-unit axes are kept
(the first such order in ORDERS names it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from axoplan.errors import UserError
from axoplan.planner.specs import ModelSpec

# placement orders of the three tensor axes, innermost first (data is always outermost)
ORDERS = ("xyz", "xzy", "yxz", "yzx", "zxy", "zyx")

AXES = "xyz"
MAX_CANDIDATES = 2_000_000


def divisors(n: int) -> np.ndarray:
    if n <= 0:
        raise UserError(f"--gpus must be a positive integer, got {n}")
    small = np.arange(1, math.isqrt(n) + 1)
    small = small[n % small == 0]
    large = (n // small)[::-1]  # ascending, none below the largest small one; equal to it when n is a square
    # sorted and distinct without np.unique, whose plain form imports numpy.ma (~10 ms of every `axoplan rank`)
    return np.concatenate([small, large[1:] if large[0] == small[-1] else large])


def factorizations4(g: int) -> np.ndarray:
    """All ordered (gx, gy, gz, gdata) with product g, as an [N, 4] int64 array."""
    d = divisors(g)
    out = []
    for gx in d:
        r1 = g // gx
        d1 = d[(r1 % d == 0) & (d <= r1)]
        for gy in d1:
            r2 = r1 // gy
            d2 = d1[(r2 % d1 == 0) & (d1 <= r2)]
            gz = d2
            gd = r2 // d2
            out.append(np.stack([np.full_like(gz, gx), np.full_like(gz, gy), gz, gd], axis=1))
    return np.concatenate(out).astype(np.int64)


def distinct_orders(grids: np.ndarray) -> np.ndarray:
    """[N, 6] bool: which of ORDERS are distinct placements for each grid."""
    keys = []
    for o in ORDERS:
        key = np.zeros(len(grids), dtype=np.int64)
        pos = np.zeros(len(grids), dtype=np.int64)
        for a in o:
            nonunit = grids[:, AXES.index(a)] > 1
            key += np.where(nonunit, (AXES.index(a) + 1) * 4**pos, 0)
            pos += nonunit
        keys.append(key)
    keys = np.stack(keys, axis=1)
    keep = np.ones_like(keys, dtype=bool)
    for i in range(1, len(ORDERS)):
        keep[:, i] = np.all(keys[:, :i] != keys[:, i : i + 1], axis=1)
    return keep


def strides(gx, gy, gz, order_idx) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rank distance between neighbours of each axis (the product of the sizes of the axes placed
    inside it): (stride_x, stride_y, stride_z, stride_data)."""
    sizes = {"x": gx, "y": gy, "z": gz}
    out = {a: np.ones_like(gx) for a in AXES}
    order_idx = np.asarray(order_idx)
    for i, o in enumerate(ORDERS):
        sel = order_idx == i
        if not np.any(sel):
            continue
        inner = np.ones(int(sel.sum()), dtype=np.int64)
        for a in o:
            out[a][sel] = inner
            inner = inner * sizes[a][sel]
    return out["x"], out["y"], out["z"], gx * gy * gz


@dataclass
class Candidates:
    gx: np.ndarray
    gy: np.ndarray
    gz: np.ndarray
    gdata: np.ndarray
    order: np.ndarray  # index into ORDERS
    micro_batch: np.ndarray
    checkpointing: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.gx)

    def take(self, idx) -> Candidates:
        return Candidates(*(getattr(self, f)[idx] for f in CANDIDATE_FIELDS))


CANDIDATE_FIELDS = ("gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing")


def micro_batch_choices(global_batch: int, max_micro_batch: int = 64) -> np.ndarray:
    d = divisors(global_batch)
    return d[d <= max_micro_batch]


def enumerate_space(gpus: int, global_batch: int, orders: str = "all", micro_batch: int | None = None,
                    checkpointing: str = "both", max_micro_batch: int = 64,
                    grid: tuple[int, int, int, int] | None = None) -> Candidates:
    """Every candidate of the space, infeasible ones included (feasibility is the cost model's job)."""
    if grid is not None:
        if int(np.prod(grid)) != gpus:
            raise UserError(f"--grid {','.join(map(str, grid))} multiplies to {int(np.prod(grid))}, not --gpus {gpus}")
        grids = np.array([grid], dtype=np.int64)
    else:
        grids = factorizations4(gpus)
    if orders == "all":
        keep = distinct_orders(grids)
    else:
        if orders not in ORDERS:
            raise UserError(f"--order must be one of {', '.join(ORDERS)} or all, got '{orders}'")
        keep = np.zeros((len(grids), len(ORDERS)), dtype=bool)
        keep[:, ORDERS.index(orders)] = True
    gi, oi = np.nonzero(keep)
    if micro_batch is not None:
        if micro_batch <= 0:
            raise UserError(f"--micro-batch must be a positive integer, got {micro_batch}")
        mbs = np.array([micro_batch], dtype=np.int64)
    else:
        mbs = micro_batch_choices(global_batch, max_micro_batch)
    ck = {"both": [False, True], "on": [True], "off": [False]}[checkpointing]
    n = len(gi) * len(mbs) * len(ck)
    if n > MAX_CANDIDATES:
        # evaluation holds every candidate in memory at once (about 1 KiB each)
        raise UserError(f"{gpus} GPUs with global batch {global_batch} give {n:,} candidate configurations, more than "
                        f"the {MAX_CANDIDATES:,} axoplan evaluates at once; fix --micro-batch, --order or "
                        f"--checkpointing, or choose a GPU count with fewer factors")
    # checkpointing outermost: with "both" the second half repeats the first with it on, which lets the
    # cost model evaluate everything that does not depend on it once (see planner.batch.evaluate)
    base_g = np.repeat(gi, len(mbs))
    base_o = np.repeat(oi, len(mbs)).astype(np.int8)
    mb = np.tile(mbs, len(gi))
    g = grids[base_g]
    parts = [Candidates(g[:, 0].copy(), g[:, 1].copy(), g[:, 2].copy(), g[:, 3].copy(), base_o.copy(), mb.copy(),
                        np.full(len(mb), flag)) for flag in ck]
    if len(parts) == 1:
        return parts[0]
    return Candidates(*(np.concatenate([getattr(p, f) for p in parts]) for f in CANDIDATE_FIELDS))


# ---- divisibility: one rule set for planner and trainer -----------------------------------
def divisibility_masks(model: ModelSpec, global_batch: int, seq_len: int, c: Candidates) -> list[tuple[np.ndarray, str]]:
    """(violated mask, reason template) for every divisibility rule, in the order reasons are reported.
    Templates are formatted with the row's gx, gy, gz, gdata, micro_batch."""
    gx, gy, gz, gd, mb = c.gx, c.gy, c.gz, c.gdata, c.micro_batch
    m = model
    return [
        (m.hidden % gx != 0, f"hidden {m.hidden} is not divisible by gx={{gx}}"),
        (m.n_heads % gy != 0, f"{m.n_heads} attention heads are not divisible by gy={{gy}}"),
        (m.kv_heads % gy != 0, f"{m.kv_heads} KV heads are not divisible by gy={{gy}}"),
        (m.ffn % gy != 0, f"ffn size {m.ffn} is not divisible by gy={{gy}}"),
        (m.padded_vocab % gy != 0, f"padded vocabulary {m.padded_vocab} is not divisible by gy={{gy}}"),
        (global_batch % (gd * gz) != 0, f"global batch {global_batch} is not divisible by gdata*gz={{gdata}}*{{gz}}"),
        ((global_batch % (gd * gz) == 0) & ((global_batch // np.maximum(gd * gz, 1)) % mb != 0),
         f"micro-batch {{micro_batch}} does not divide the {global_batch}/(gdata*gz) sequences per GPU"),
        (np.full(len(gx), m.position == "learned" and seq_len > m.seq_len),
         f"seq_len {seq_len} exceeds the model's {m.seq_len} learned positions"),
    ]


def grid_problem(model: ModelSpec, gx: int, gy: int, gz: int, gdata: int, global_batch: int, micro_batch: int,
                 seq_len: int | None = None) -> str | None:
    """The first divisibility rule one configuration breaks, as a sentence, or None."""
    c = Candidates(*(np.array([v]) for v in (gx, gy, gz, gdata, 0, micro_batch)), np.array([False]))
    for mask, template in divisibility_masks(model, global_batch, seq_len or model.seq_len, c):
        if mask[0]:
            return template.format(gx=gx, gy=gy, gz=gz, gdata=gdata, micro_batch=micro_batch)
    return None
