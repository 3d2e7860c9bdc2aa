"""The candidate space: factorizations, distinct placements, strides and divisibility, checked
against brute force and the rank formula of reference §1."""
from __future__ import annotations

import itertools
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from axoplan.planner.batch import evaluate
from axoplan.errors import UserError
from axoplan.planner.space import (ORDERS, PLACEMENTS, distinct_orders, divisibility_masks, divisors, enumerate_space,
                           factorizations4, grid_problem, micro_batch_choices, placement_error, strides)
from axoplan.planner.specs import Job, ModelSpec

from conftest import tiny_model


def brute_factorizations(g: int) -> set:
    return {(a, b, c, g // (a * b * c)) for a in range(1, g + 1) for b in range(1, g + 1) for c in range(1, g + 1)
            if g % (a * b * c) == 0}


def n_ordered_4_factorizations(g: int) -> int:
    """d_4(g): multiplicative, comb(e + 3, 3) for each prime power p^e."""
    out, p = 1, 2
    while p * p <= g:
        e = 0
        while g % p == 0:
            g //= p
            e += 1
        out *= comb(e + 3, 3)
        p += 1
    if g > 1:
        out *= 4
    return out


def test_divisors_by_hand():
    assert list(divisors(1)) == [1]
    assert list(divisors(12)) == [1, 2, 3, 4, 6, 12]
    assert list(divisors(49)) == [1, 7, 49]
    assert list(divisors(97)) == [1, 97]
    for bad in (0, -4):
        with pytest.raises(UserError):
            divisors(bad)


@pytest.mark.parametrize("g", list(range(1, 41)) + [48, 60, 64, 72, 96])
def test_factorizations_match_brute_force(g):
    f = factorizations4(g)
    rows = [tuple(int(v) for v in r) for r in f]
    assert len(rows) == len(set(rows)), "duplicate grids"
    assert set(rows) == brute_factorizations(g)


def test_factorization_counts_by_hand():
    # 1: only (1,1,1,1); a prime: 4 places for it; 4 = 2^2: comb(5,3) = 10; 12 = 2^2*3: 10*4 = 40
    assert [len(factorizations4(g)) for g in (1, 7, 4, 12)] == [1, 4, 10, 40]


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=5000))
def test_every_grid_multiplies_to_g(g):
    f = factorizations4(g)
    assert f.dtype == np.int64 and f.shape[1] == 4
    assert np.all(np.prod(f, axis=1) == g)
    assert np.all(f >= 1)
    assert len(np.unique(f, axis=0)) == len(f)
    assert len(f) == n_ordered_4_factorizations(g)


# ---- placement ---------------------------------------------------------------------------
def world_rank(coord: dict, size: dict, order: str) -> int:
    """Reference §1 generalised by order: axes innermost first, data outermost.
    For xyz: x + gx*(y + gy*(z + gz*d))."""
    r, mult = 0, 1
    for a in order + "d":
        r += coord[a] * mult
        mult *= size[a]
    return r


def placement(grid, order: str):
    """The groups of every axis as sets of world ranks: what decides which GPUs talk together."""
    size = dict(zip("xyzd", (int(v) for v in grid)))
    out = []
    for axis in "xyzd":
        others = [a for a in "xyzd" if a != axis]
        groups = set()
        for fixed in itertools.product(*(range(size[a]) for a in others)):
            coord = dict(zip(others, fixed))
            groups.add(frozenset(world_rank({**coord, axis: v}, size, order) for v in range(size[axis])))
        out.append(frozenset(groups))
    return tuple(out)


@pytest.mark.parametrize("g", [1, 2, 4, 6, 8, 12, 16, 18, 24, 30])
def test_distinct_orders_keeps_exactly_distinct_placements(g):
    grids = factorizations4(g)
    keep = distinct_orders(grids)
    assert keep.shape == (len(grids), 6)
    for grid, k in zip(grids, keep):
        pl = [placement(grid, o) for o in ORDERS]
        kept = [pl[i] for i in range(6) if k[i]]
        assert len(set(kept)) == len(kept), f"{grid}: kept orders with the same placement"
        assert set(kept) == set(pl), f"{grid}: a distinct placement was dropped"
        assert k[0], "the first order naming a placement is the one kept"


def test_distinct_orders_by_hand():
    grids = np.array([[1, 1, 1, 8], [2, 1, 1, 4], [2, 2, 1, 2], [2, 2, 2, 1]])
    keep = distinct_orders(grids)
    assert keep.sum(axis=1).tolist() == [1, 1, 2, 6]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.integers(0, 5)),
                min_size=1, max_size=8))
def test_strides_agree_with_the_rank_formula(rows):
    gx, gy, gz, oi = (np.array(v, dtype=np.int64) for v in zip(*rows))
    sx, sy, sz, sd, _ = strides(gx, gy, gz, 1, oi, 1)
    for i, (x, y, z, o) in enumerate(rows):
        size = {"x": x, "y": y, "z": z, "d": 1}
        zero = {"x": 0, "y": 0, "z": 0, "d": 0}
        r0 = world_rank(zero, size, ORDERS[o])
        for a, s in (("x", sx), ("y", sy), ("z", sz), ("d", sd)):
            step = world_rank({**zero, a: 1}, size, ORDERS[o]) - r0
            assert s[i] == step, (rows[i], a)


def test_strides_by_hand():
    one = lambda v: np.array([v])  # noqa: E731
    # xyz: x + 2*(y + 3*(z + 4*d))
    assert [int(s[0]) for s in strides(one(2), one(3), one(4), 1, one(ORDERS.index("xyz")), 1)[:4]] == [1, 2, 6, 24]
    # zyx: z + 4*(y + 3*(x + 2*d))
    assert [int(s[0]) for s in strides(one(2), one(3), one(4), 1, one(ORDERS.index("zyx")), 1)[:4]] == [12, 4, 1, 24]


# ---- the enumerated space ------------------------------------------------------------------
def test_enumerate_space_size_and_contents():
    c = enumerate_space(12, 8)
    grids = factorizations4(12)
    n_orders = int(distinct_orders(grids).sum())
    mbs = [1, 2, 4, 8]
    assert list(micro_batch_choices(8)) == mbs
    assert len(c) == n_orders * len(mbs) * 2
    assert np.all(c.gx * c.gy * c.gz * c.gdata == 12)
    assert set(c.micro_batch.tolist()) == set(mbs)
    assert c.checkpointing.sum() == len(c) // 2
    keys = set(zip(c.gx.tolist(), c.gy.tolist(), c.gz.tolist(), c.gdata.tolist(), c.order.tolist(),
                   c.micro_batch.tolist(), c.checkpointing.tolist()))
    assert len(keys) == len(c), "duplicate candidates"


def test_enumerate_space_filters_and_errors():
    c = enumerate_space(8, 16, orders="zxy", micro_batch=2, checkpointing="on")
    assert len(c) == len(factorizations4(8))
    assert set(c.order.tolist()) == {ORDERS.index("zxy")}
    assert set(c.micro_batch.tolist()) == {2} and c.checkpointing.all()
    assert micro_batch_choices(1000, 64).tolist() == [1, 2, 4, 5, 8, 10, 20, 25, 40, 50]
    one = enumerate_space(8, 16, grid=(2, 2, 1, 2))
    assert set(zip(one.gx.tolist(), one.gy.tolist(), one.gz.tolist(), one.gdata.tolist())) == {(2, 2, 1, 2)}
    with pytest.raises(UserError, match="multiplies to 4"):
        enumerate_space(8, 16, grid=(2, 2, 1, 1))
    with pytest.raises(UserError, match="--order"):
        enumerate_space(8, 16, orders="xxy")
    with pytest.raises(UserError, match="--micro-batch"):
        enumerate_space(8, 16, micro_batch=0)


# ---- divisibility --------------------------------------------------------------------------
GQA = ModelSpec("gqa", n_layers=2, hidden=96, n_heads=12, vocab=1000, seq_len=32, n_kv_heads=4, ffn_hidden=240,
                vocab_multiple=128).validate()  # padded vocabulary 1024


def reference_problem(m: ModelSpec, gx, gy, gz, gd, batch, mb, seq_len) -> bool:
    """DESIGN's divisibility rules written out independently: True when the grid is invalid."""
    return bool(m.hidden % gx or m.n_heads % gy or m.kv_heads % gy or m.ffn % gy or m.padded_vocab % gy
                or batch % (gd * gz) or (batch // (gd * gz)) % mb
                or (m.position == "learned" and seq_len > m.seq_len))


@pytest.mark.parametrize("g,batch", [(12, 12), (16, 8), (24, 24), (30, 10)])
def test_grid_problem_agrees_with_masks_and_rules(pm, g, batch):
    m = GQA
    c = enumerate_space(g, batch, max_micro_batch=8)
    ev = evaluate(m, pm, Job(g, batch, 32), c)
    n_rules = len(divisibility_masks(m, batch, 32, c))
    for i in range(len(c)):
        args = (int(c.gx[i]), int(c.gy[i]), int(c.gz[i]), int(c.gdata[i]), batch, int(c.micro_batch[i]))
        bad = reference_problem(m, *args, 32)
        prob = grid_problem(m, *args)
        assert (prob is not None) == bad, args
        if bad:
            assert 0 <= ev.reason_code[i] < n_rules
            assert prob == ev.reasons[ev.reason_code[i]].format(gx=args[0], gy=args[1], gz=args[2], gdata=args[3],
                                                                  micro_batch=args[5])
        else:
            assert ev.reason_code[i] in (-1, n_rules)  # feasible, or out of memory only


def test_grid_problem_sentences():
    m = GQA
    assert grid_problem(m, 1, 1, 1, 1, 8, 1) is None
    assert grid_problem(m, 5, 1, 1, 1, 8, 1) == "hidden 96 is not divisible by gx=5"
    assert grid_problem(m, 1, 8, 1, 1, 8, 1) == "12 attention heads are not divisible by gy=8"
    assert grid_problem(m, 1, 6, 1, 1, 8, 1) == "4 KV heads are not divisible by gy=6"
    assert grid_problem(m, 1, 1, 3, 1, 8, 1) == "global batch 8 is not divisible by gdata*gz=1*3"
    assert grid_problem(m, 1, 1, 2, 2, 8, 4) == "micro-batch 4 does not divide the 8/(gdata*gz) sequences per GPU"
    assert grid_problem(m, 1, 1, 1, 1, 8, 1, seq_len=64) == "seq_len 64 exceeds the model's 32 learned positions"
    # ffn 240 is divisible by 4 and 12 but hidden and heads allow gy=4: fine; vocab 1000 pads to 1024
    assert grid_problem(m, 1, 4, 1, 1, 8, 1) is None
    rope = tiny_model(position="rope")
    assert grid_problem(rope, 1, 1, 1, 1, 8, 1, seq_len=4096) is None


def test_pipeline_placement_strides_by_hand():
    def st(order, pp=6):
        return [int(s[0]) for s in strides(np.array([2]), 3, 4, 5, np.array([PLACEMENTS.index(order)]), pp)]

    # xyz, the pipeline outermost: x + 2*(y + 3*(z + 4*(d + 5*p)))
    assert st("xyz") == [1, 2, 6, 24, 120]
    # xypz: x + 2*(y + 3*(p + 6*(z + 4*d)))
    assert st("xypz") == [1, 2, 36, 144, 6]
    # xyzp, AxoNN's: x + 2*(y + 3*(z + 4*(p + 6*d)))
    assert st("xyzp") == [1, 2, 6, 144, 24]
    # pzyx, the pipeline innermost: p + 6*(z + 4*(y + 3*(x + 2*d)))
    assert st("pzyx") == [72, 24, 6, 144, 1]
    assert len(set(PLACEMENTS)) == 30 and PLACEMENTS[:6] == ORDERS


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3),
                          st.integers(1, 3), st.integers(0, 29)), min_size=1, max_size=8))
def test_pipeline_strides_agree_with_the_rank_formula(rows):
    gx, gy, gz, gd, pp, oi = (np.array(v, dtype=np.int64) for v in zip(*rows))
    got = strides(gx, gy, gz, gd, oi, pp)
    for i, (x, y, z, d, p, o) in enumerate(rows):
        order = PLACEMENTS[o]
        axes = list(order) + ["d"] + ([] if "p" in order else ["p"])  # data after x, y, z; p outermost unless placed
        size = dict(zip("xyzdp", (x, y, z, d, p)))
        for a, s in zip("xyzdp", got):
            inner = int(np.prod([size[b] for b in axes[:axes.index(a)]]))
            assert s[i] == inner, (rows[i], a)


def test_every_keeps_exactly_the_distinct_pipeline_placements():
    """Placements with the pipeline: by hand, the positions p can take among the axes > 1 (data after x, y, z),
    and, over many grids, the kept ones are exactly the distinct sets of groups of the five axes."""
    def count(grid, pp):
        return int(distinct_orders(np.array([grid]), pp, PLACEMENTS)[0].sum())

    assert count((2, 1, 1, 2), 2) == 3  # p before x, between x and d, after d
    assert count((2, 2, 1, 1), 2) == 6  # x, y in 2 orders x p in 3 places (after y: inside or outside data alike)
    assert count((1, 1, 1, 4), 2) == 2
    assert count((2, 2, 2, 2), 2) == 30

    def groups(grid, pp, order):
        size = dict(zip("xyzdp", (*map(int, grid), pp)))
        axes = list(order) + ["d"] + ([] if "p" in order else ["p"])

        def rank(c):
            r, mult = 0, 1
            for a in axes:
                r, mult = r + c[a] * mult, mult * size[a]
            return r
        out = []
        for axis in "xyzdp":
            others = [a for a in "xyzdp" if a != axis]
            out.append(frozenset(frozenset(rank({**dict(zip(others, f)), axis: v}) for v in range(size[axis]))
                                 for f in itertools.product(*(range(size[a]) for a in others))))
        return tuple(out)

    for g in (4, 8, 12):
        for grid in factorizations4(g):
            keep = distinct_orders(np.array([grid]), 2, PLACEMENTS)[0]
            pl = [groups(grid, 2, o) for o in PLACEMENTS]
            kept = [pl[i] for i in range(len(PLACEMENTS)) if keep[i]]
            assert len(set(kept)) == len(kept) and set(kept) == set(pl), grid


def test_rank_every_adds_the_placements_to_the_pipelined_candidates_only():
    c_all = enumerate_space(16, 16, "all", micro_batch=1, checkpointing="off", pipelines=((1, 1, 0), (2, 1, 0)))
    c_every = enumerate_space(16, 16, "every", micro_batch=1, checkpointing="off", pipelines=((1, 1, 0), (2, 1, 0)))
    assert int((c_every.pp == 1).sum()) == int((c_all.pp == 1).sum())
    assert int((c_every.pp == 2).sum()) > int((c_all.pp == 2).sum())
    assert set(c_every.order[c_every.pp == 1].tolist()) <= set(range(len(ORDERS)))


def test_placement_error_one_rule_for_config_and_cli():
    """Only an order that places the pipeline axis, without a pipeline, is refused; the config's and the CLI's
    sentences differ only in how the user spelt the keys."""
    for order in PLACEMENTS:
        for pp in (1, 2, 8):
            why = placement_error(order, pp)
            assert (why is not None) == ("p" in order and pp == 1)
    assert placement_error("xpyz", 1) == "order xpyz places the pipeline axis, which needs pp of 2 or more"
    assert placement_error("xpyz", 1, "--order", "--pp") == (
        "--order xpyz places the pipeline axis, which needs --pp of 2 or more")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 10**6), st.integers(0, 2**31 - 1))
def test_divisibility_by_table_equals_the_modulo(n, seed):
    """space._indivisible's table (taken for large candidate arrays) says what n % x != 0 says."""
    from axoplan.planner.space import _indivisible
    x = np.random.default_rng(seed).integers(1, 5000, 6000)
    np.testing.assert_array_equal(_indivisible(n, x), n % x != 0)
    assert _indivisible(n, 7) == (n % 7 != 0)  # a scalar: the modulo itself
