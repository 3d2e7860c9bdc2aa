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

# placement orders of the three tensor axes, innermost first (data outside them, the pipeline axis outermost)
ORDERS = ("xyz", "xzy", "yxz", "yzx", "zxy", "zyx")
# the same with the pipeline axis p placed inside data, among or after the tensor axes (AxoNN's own is "xyzp":
# axonn/communication.py ranks inter-layer between intra-layer and data); a candidate's order indexes PLACEMENTS
PIPELINE_ORDERS = tuple(o[:i] + "p" + o[i:] for o in ORDERS for i in range(4))
PLACEMENTS = ORDERS + PIPELINE_ORDERS

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


def distinct_orders(grids: np.ndarray, pp: int = 1, orders: tuple = ORDERS) -> np.ndarray:
    """[N, len(orders)] bool: which of the orders (ORDERS, or PLACEMENTS with the pipeline of pp stages) are
    distinct placements for each grid: the first order naming each sequence of axes > 1 is kept."""
    sizes = {"x": grids[:, 0], "y": grids[:, 1], "z": grids[:, 2], "d": grids[:, 3],
             "p": np.full(len(grids), pp, dtype=np.int64)}
    keys = []
    for o in orders:
        key = np.zeros(len(grids), dtype=np.int64)
        pos = np.zeros(len(grids), dtype=np.int64)
        for a in layout(o):
            nonunit = sizes[a] > 1
            key += np.where(nonunit, ("xyzdp".index(a) + 1) * 6**pos, 0)
            pos += nonunit
        keys.append(key)
    keys = np.stack(keys, axis=1)
    keep = np.ones_like(keys, dtype=bool)
    for i in range(1, len(orders)):
        keep[:, i] = np.all(keys[:, :i] != keys[:, i : i + 1], axis=1)
    return keep


def layout(order: str) -> str:
    """The five axes of a placement, innermost first: the order's, data, and the pipeline axis outermost
    unless the order places it."""
    return order + "d" if "p" in order else order + "dp"


def placement_error(order: str, pp: int, order_key: str = "order", pp_key: str = "pp") -> str | None:
    """The one rule on a placement and its pipeline, as the sentence a user gets (keys as the user wrote
    them: a config's order and pp, the CLI's --order and --pp); None where the pair is valid."""
    if "p" in order and pp == 1:
        return f"{order_key} {order} places the pipeline axis, which needs {pp_key} of 2 or more"
    return None


def tensor_order(order: str) -> str:
    """The order of x, y and z alone (what a placement is without a pipeline)."""
    return order.replace("p", "")


def strides(gx, gy, gz, gdata, order_idx, pp) -> tuple[np.ndarray, ...]:
    """Rank distance between neighbours of each axis (the product of the sizes of the axes placed inside it),
    order_idx into PLACEMENTS: (stride_x, stride_y, stride_z, stride_data, stride_pipeline)."""
    gx = np.asarray(gx, dtype=np.int64)
    order_idx = np.broadcast_to(np.asarray(order_idx), gx.shape)
    sizes = {"x": gx, "y": gy, "z": gz, "d": gdata, "p": pp}
    sizes = {a: np.broadcast_to(np.asarray(v, dtype=np.int64), gx.shape) for a, v in sizes.items()}
    out = {a: np.ones(gx.shape, dtype=np.int64) for a in "xyzdp"}
    present = np.bincount(np.ravel(order_idx).astype(np.int64), minlength=len(PLACEMENTS)) > 0
    for i in np.nonzero(present)[0]:
        o = PLACEMENTS[i]
        sel = order_idx == i
        inner = np.ones(int(sel.sum()), dtype=np.int64)
        for a in layout(o):
            out[a][sel] = inner
            inner = inner * sizes[a][sel]
    return out["x"], out["y"], out["z"], out["d"], out["p"]


@dataclass
class Candidates:
    gx: np.ndarray
    gy: np.ndarray
    gz: np.ndarray
    gdata: np.ndarray
    order: np.ndarray  # index into PLACEMENTS (ORDERS first: the pipeline axis outermost)
    micro_batch: np.ndarray
    checkpointing: np.ndarray  # bool
    pp: np.ndarray | None = None  # pipeline stages (None: 1); outermost unless the order places the axis
    vpp: np.ndarray | None = None  # virtual stages per pipeline rank (interleaved; None: 1)
    schedule: np.ndarray | None = None  # index into pipeline.SCHEDULES (None: 1f1b)

    def __post_init__(self):
        n = np.shape(self.gx)
        for f, dtype in (("pp", np.int64), ("vpp", np.int64), ("schedule", np.int8)):
            if getattr(self, f) is None:
                setattr(self, f, np.full(n, 0 if f == "schedule" else 1, dtype=dtype))

    def __len__(self) -> int:
        return len(self.gx)

    @property
    def pipelined(self) -> bool:
        return bool(np.any(self.pp > 1))

    def take(self, idx) -> Candidates:
        return Candidates(**{f: getattr(self, f)[idx] for f in CANDIDATE_FIELDS})


# checkpointing last: evaluate() pairs the halves that differ only in it
CANDIDATE_FIELDS = ("gx", "gy", "gz", "gdata", "order", "micro_batch", "pp", "vpp", "schedule", "checkpointing")


def micro_batch_choices(global_batch: int, max_micro_batch: int = 64) -> np.ndarray:
    d = divisors(global_batch)
    return d[d <= max_micro_batch]


# where an execution splits the blocks unevenly (Execution.pipeline_even_split false), the vpp the space also tries
# that do not split them evenly: the powers of two, which bound the space (GPT-1T's 128 blocks split evenly at
# each of them, and Llama 3 405B's 126 at none beyond 2 stages, whose interleaving would be lost otherwise)
UNEVEN_VPP = (2, 4, 8)


def pipeline_choices(gpus: int, n_layers: int | None, pp="1", vpp=None, schedule: str = "all",
                     max_vpp: int = 8, uneven: bool = False) -> list[tuple[int, int, int]]:
    """(pp, vpp, schedule index) of the space: pp "all" every divisor of the GPUs up to the blocks (or one
    given), each with 1f1b and, for pp > 1, interleaved-1f1b with every vpp up to max_vpp that splits the
    blocks evenly over pp * vpp virtual stages, and with `uneven` every UNEVEN_VPP as well (or the vpp given)."""
    from axoplan.planner.pipeline import SCHEDULES

    if schedule != "all" and schedule not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)} or all, got '{schedule}'")
    if pp == "all":
        pps = [int(d) for d in divisors(gpus) if n_layers is None or d <= n_layers]
    else:
        p = int(pp)
        if p <= 0:
            raise UserError(f"--pp must be a positive integer or all, got {pp}")
        if gpus % p:
            raise UserError(f"--pp {p} does not divide --gpus {gpus}")
        if n_layers is not None and p > n_layers:
            raise UserError(f"--pp {p} asks for more pipeline stages than the model's {n_layers} blocks")
        pps = [p]
    if vpp is not None:
        if int(vpp) <= 0:
            raise UserError(f"--vpp must be a positive integer, got {vpp}")
        if int(vpp) > 1 and schedule == "1f1b":
            raise UserError(f"--vpp {vpp} needs --schedule interleaved-1f1b (1f1b runs one stage per rank)")
        if int(vpp) > 1 and pps == [1]:
            raise UserError(f"--vpp {vpp} needs --pp of 2 or more")
    out = []
    for p in pps:
        if schedule in ("all", "1f1b") and (vpp is None or int(vpp) == 1):
            out.append((p, 1, 0))
        if p == 1 or schedule == "1f1b":
            continue
        if vpp is not None:
            if int(vpp) > 1 or schedule == "interleaved-1f1b":
                out.append((p, int(vpp), 1))
            continue
        for v in range(2, max_vpp + 1):
            if n_layers is not None and (p * v > n_layers or (n_layers % (p * v) and not (uneven and v in UNEVEN_VPP))):
                continue
            out.append((p, v, 1))
    if not out:
        raise UserError(f"no pipeline configuration matches --pp {pp} --schedule {schedule}"
                        + (f" --vpp {vpp}" if vpp is not None else ""))
    return out


def enumerate_space(gpus: int, global_batch: int, orders: str = "all", micro_batch: int | None = None,
                    checkpointing: str = "both", max_micro_batch: int = 64,
                    grid: tuple[int, int, int, int] | None = None, pipelines=((1, 1, 0),)) -> Candidates:
    """Every candidate of the space, infeasible ones included (feasibility is the cost model's job).
    pipelines: the (pp, vpp, schedule index) to combine with every grid of gpus / pp (pipeline_choices);
    a given grid multiplies to gpus / pp. orders: "all" (the distinct ORDERS, the pipeline axis outermost),
    "every" (for the pipelined candidates the distinct PLACEMENTS, the pipeline inside data too) or one of
    PLACEMENTS (one that places the pipeline axis applies to the pipelined candidates; the others take its
    order of x, y, z)."""
    if orders not in ("all", "every") and orders not in PLACEMENTS:
        raise UserError(f"--order must be one of {', '.join(PLACEMENTS)}, all or every, got '{orders}'")
    if micro_batch is not None:
        if micro_batch <= 0:
            raise UserError(f"--micro-batch must be a positive integer, got {micro_batch}")
        mbs = np.array([micro_batch], dtype=np.int64)
    else:
        mbs = micro_batch_choices(global_batch, max_micro_batch)
    ck = {"both": [False, True], "on": [True], "off": [False]}[checkpointing]
    blocks = []
    n = 0
    placed = {}  # pp -> (grids, their kept orders): the same for every vpp and schedule of one pp
    for pp, vpp, sched in pipelines:
        if grid is not None and int(np.prod(grid)) * pp != gpus:
            what = f"--pp {pp} x " if pp > 1 else ""
            raise UserError(f"{what}--grid {','.join(map(str, grid))} multiplies to {int(np.prod(grid)) * pp}, "
                            f"not --gpus {gpus}")
        if pp not in placed:
            grids = np.array([grid], dtype=np.int64) if grid is not None else factorizations4(gpus // pp)
            if orders == "all" or (orders == "every" and pp == 1):
                keep = distinct_orders(grids)
            elif orders == "every":  # the pipeline inside data too: every distinct placement of the five axes
                keep = distinct_orders(grids, pp, PLACEMENTS)
            else:
                keep = np.zeros((len(grids), len(PLACEMENTS)), dtype=bool)
                keep[:, PLACEMENTS.index(orders if pp > 1 else tensor_order(orders))] = True
            placed[pp] = (grids, *np.nonzero(keep))
        grids, gi, oi = placed[pp]
        blocks.append((pp, vpp, sched, grids, gi, oi))
        n += len(gi) * len(mbs) * len(ck)
    if n > MAX_CANDIDATES:
        # evaluation holds every candidate in memory at once (about 1 KiB each)
        raise UserError(f"{gpus} GPUs with global batch {global_batch} give {n:,} candidate configurations, more than "
                        f"the {MAX_CANDIDATES:,} axoplan evaluates at once; fix --micro-batch, --order, --pp or "
                        f"--checkpointing, or choose a GPU count with fewer factors")
    # checkpointing outermost: with "both" the second half repeats the first with it on, which lets the
    # cost model evaluate everything that does not depend on it once (see planner.batch.evaluate)
    cols = {f: [] for f in CANDIDATE_FIELDS if f != "checkpointing"}
    for pp, vpp, sched, grids, gi, oi in blocks:
        g = grids[np.repeat(gi, len(mbs))]
        for j, f in enumerate(("gx", "gy", "gz", "gdata")):
            cols[f].append(g[:, j])
        cols["order"].append(np.repeat(oi, len(mbs)).astype(np.int8))
        cols["micro_batch"].append(np.tile(mbs, len(gi)))
        k = len(gi) * len(mbs)
        cols["pp"].append(np.full(k, pp, dtype=np.int64))
        cols["vpp"].append(np.full(k, vpp, dtype=np.int64))
        cols["schedule"].append(np.full(k, sched, dtype=np.int8))
    base = {f: np.concatenate(v * len(ck)) for f, v in cols.items()}
    return Candidates(**base, checkpointing=np.repeat(np.array(ck), len(base["gx"]) // len(ck)))


# ---- divisibility: one rule set for planner and trainer -----------------------------------
def divisibility_masks(model: ModelSpec, global_batch: int, seq_len: int, c: Candidates) -> list[tuple[np.ndarray, str]]:
    """(violated mask, reason template) for every divisibility rule, then the pipeline's (pipeline_masks), in the
    order reasons are reported. Templates are formatted with the row's gx, gy, gz, gdata, micro_batch (and pp,
    vpp, m)."""
    gx, gy, gz, gd, mb = c.gx, c.gy, c.gz, c.gdata, c.micro_batch
    m = model
    dz = gd * gz
    batch_split = _indivisible(global_batch, dz)
    return [
        (_indivisible(m.hidden, gx), f"hidden {m.hidden} is not divisible by gx={{gx}}"),
        (_indivisible(m.n_heads, gy), f"{m.n_heads} attention heads are not divisible by gy={{gy}}"),
        (_indivisible(m.kv_heads, gy), f"{m.kv_heads} KV heads are not divisible by gy={{gy}}"),
        (_indivisible(m.ffn, gy), f"ffn size {m.ffn} is not divisible by gy={{gy}}"),
        (_indivisible(m.padded_vocab, gy), f"padded vocabulary {m.padded_vocab} is not divisible by gy={{gy}}"),
        (batch_split, f"global batch {global_batch} is not divisible by gdata*gz={{gdata}}*{{gz}}"),
        (~batch_split & ((global_batch // np.maximum(dz, 1)) % mb != 0),
         f"micro-batch {{micro_batch}} does not divide the {global_batch}/(gdata*gz) sequences per GPU"),
        (np.full(len(gx), m.position == "learned" and seq_len > m.seq_len),
         f"seq_len {seq_len} exceeds the model's {m.seq_len} learned positions"),
    ] + pipeline_masks(m, global_batch, c)


def _indivisible(n: int, x) -> np.ndarray:
    """n % x != 0 for positive integers x: through a table of every divisor up to x's largest where that is
    small (a take instead of an integer division per candidate: 722,470 of them in gpt-1t's 5D space)."""
    x = np.asarray(x)
    if x.ndim == 1 and x.size > 4096 and x.dtype.kind in "iu":
        lo, hi = int(x.min()), int(x.max())
        if 1 <= lo and hi <= 2**20:
            return (n % np.arange(1, hi + 1) != 0).take(x - 1)
    return n % x != 0


def micro_batches(global_batch: int, c: Candidates) -> np.ndarray:
    """Micro-batches each pipeline (or, without one, each GPU) runs per step: B / (micro-batch * gz * gdata)."""
    return global_batch // np.maximum(c.gdata * c.gz * c.micro_batch, 1)


def pipeline_masks(model: ModelSpec, global_batch: int, c: Candidates) -> list[tuple[np.ndarray, str]]:
    """The pipeline's rules (templates also take pp, vpp and m, the micro-batches per step): no more virtual
    stages than blocks; 1f1b needs at least pp micro-batches (torch's Schedule1F1B refuses fewer); interleaved
    needs a multiple of pp (Megatron-LM's rule; torch's ScheduleInterleaved1F1B's whenever m >= pp)."""
    from axoplan.planner.pipeline import SCHEDULES

    m = micro_batches(global_batch, c)
    interleaved = c.schedule == SCHEDULES.index("interleaved-1f1b")
    return [
        (c.pp * c.vpp > model.n_layers,
         f"pp={{pp}} x vpp={{vpp}} virtual stages are more than the model's {model.n_layers} blocks"),
        ((c.pp > 1) & ~interleaved & (m < c.pp), "1f1b over pp={pp} stages needs at least {pp} micro-batches, "
                                                  "the step has {m}"),
        (interleaved & ((m < c.pp) | (m % np.maximum(c.pp, 1) != 0)),
         "interleaved-1f1b over pp={pp} stages needs a multiple of {pp} micro-batches, the step has {m}"),
    ]


def one_candidate(gx: int, gy: int, gz: int, gdata: int, micro_batch: int, order: int = 0, checkpointing: bool = False,
                  pp: int = 1, vpp: int = 1, schedule: str = "1f1b") -> Candidates:
    """One configuration as Candidates of length one (order: an index into PLACEMENTS)."""
    from axoplan.planner.pipeline import SCHEDULES

    return Candidates(*(np.array([v]) for v in (gx, gy, gz, gdata, order, micro_batch)), np.array([checkpointing]),
                      np.array([pp]), np.array([vpp]), np.array([SCHEDULES.index(schedule)], dtype=np.int8))


def first_violation(rules: list, c: Candidates, global_batch: int) -> str | None:
    """The first of rules (violated mask, reason template) that the one candidate c breaks, its template filled
    from c (gx, gy, gz, gdata, micro_batch, pp, vpp and m, its micro-batches per step), or None."""
    for mask, template in rules:
        if np.ravel(mask)[0]:
            fields = {f: int(getattr(c, f)[0]) for f in ("gx", "gy", "gz", "gdata", "micro_batch", "pp", "vpp")}
            return template.format(**fields, m=int(micro_batches(global_batch, c)[0]))
    return None


def grid_problem(model: ModelSpec, gx: int, gy: int, gz: int, gdata: int, global_batch: int, micro_batch: int,
                 seq_len: int | None = None, pp: int = 1, vpp: int = 1, schedule: str = "1f1b") -> str | None:
    """The first divisibility or pipeline rule one configuration breaks, as a sentence, or None."""
    c = one_candidate(gx, gy, gz, gdata, micro_batch, pp=pp, vpp=vpp, schedule=schedule)
    return first_violation(divisibility_masks(model, global_batch, seq_len or model.seq_len, c), c, global_batch)
