"""Hypothesis properties of the cost model over whole candidate spaces: a faster machine never makes a
candidate slower, overlap never hurts, the time decomposition is consistent, and every infeasible
row says why."""
from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest
from conftest import profile_dict, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from axoplan.planner.execution import Execution
from axoplan.planner.batch import evaluate
from axoplan.planner.machine import GIB
from axoplan.planner.profile_reader import profile_from_dict
from axoplan.planner.rank import rank
from axoplan.planner.space import divisibility_masks, enumerate_space
from axoplan.planner.specs import Job, ModelSpec

SETTINGS = settings(max_examples=30, deadline=None)

MODELS = [
    tiny_model(),
    # Llama-shaped: GQA, SwiGLU, RMSNorm, RoPE, a vocabulary that needs padding
    ModelSpec("test-llama", n_layers=2, hidden=96, n_heads=12, vocab=1000, seq_len=64, n_kv_heads=4, ffn_hidden=256,
              mlp="swiglu", norm="rmsnorm", position="rope").validate(),
]
PARAMETRIC = profile_from_dict(profile_dict(), "test profile")


@pytest.fixture(scope="module")
def table_prof(tmp_path_factory):
    """A profile with a measured-style GEMM table (saturating throughput, layouts differing)."""
    d = tmp_path_factory.mktemp("table")
    grid = (16, 64, 256, 1024)
    with open(d / "gemm.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["m", "n", "k", "layout", "seconds"])
        for m, n, k in itertools.product(grid, grid, grid):
            tput = 2e14 * m / (m + 64) * n / (n + 128) * k / (k + 32)
            for lay, fac in (("NN", 1.0), ("NT", 0.8), ("TN", 1.1)):
                w.writerow([m, n, k, lay, 2 * m * n * k / (fac * tput)])
    return profile_from_dict(profile_dict(gemm_table="gemm.csv"), "table profile", base_dir=d)


jobs = st.tuples(st.sampled_from(range(len(MODELS))), st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64]),
                 st.sampled_from([1, 4, 8, 12, 32]), st.sampled_from([32, 64]))
scale_up = st.floats(min_value=1.0, max_value=16.0)
scale_any = st.floats(min_value=0.25, max_value=4.0)


def _space(job):
    mi, g, b, s = job
    return MODELS[mi], Job(g, b, s), enumerate_space(g, b, max_micro_batch=8)


def _divisible(model, job, c):
    bad = np.zeros(len(c), dtype=bool)
    for mask, _ in divisibility_masks(model, job.global_batch, job.seq_len, c):
        bad |= mask
    return ~bad


def _never_slower(fast, slow, rows):
    assert np.all(np.isfinite(fast[rows])) and np.all(np.isfinite(slow[rows]))
    assert np.all(fast[rows] <= slow[rows] * (1 + 1e-9) + 1e-15), np.max(fast[rows] - slow[rows])


@SETTINGS
@given(job=jobs, base_intra=scale_any, base_inter=scale_any, up_intra=scale_up, up_inter=scale_up,
       lat_down=st.floats(0.0, 1.0), overlap=st.booleans())
def test_more_bandwidth_never_slower(job, base_intra, base_inter, up_intra, up_inter, lat_down, overlap):
    m, j, c = _space(job)
    base = PARAMETRIC.with_corrections(intra_bw_scale=base_intra, inter_bw_scale=base_inter)
    slow = evaluate(m, base, j, c, overlap=overlap)
    rows = _divisible(m, j, c)
    # through the corrections
    fast = evaluate(m, base.with_corrections(intra_bw_scale=base_intra * up_intra, inter_bw_scale=base_inter * up_inter,
                                             latency_scale=lat_down), j, c, overlap=overlap)
    _never_slower(fast.batch_time, slow.batch_time, rows)
    _never_slower(fast.comm, slow.comm, rows)
    # through the profile's own numbers
    raw = base.replace(intra_groups=tuple((s, st_, bw * up_intra) for s, st_, bw in base.intra_groups),
                       inter_busbw=base.inter_busbw * up_inter)
    fast2 = evaluate(m, raw, j, c, overlap=overlap)
    _never_slower(fast2.batch_time, slow.batch_time, rows)
    # compute is untouched by the network
    np.testing.assert_allclose(fast.compute[rows], slow.compute[rows], rtol=1e-12)


@SETTINGS
@given(job=jobs, ceiling_up=scale_up, gemm_up=scale_up, overlap=st.booleans(), use_table=st.booleans())
def test_more_gemm_throughput_never_slower(table_prof, job, ceiling_up, gemm_up, overlap, use_table):
    m, j, c = _space(job)
    base = table_prof if use_table else PARAMETRIC
    rows = _divisible(m, j, c)
    slow = evaluate(m, base, j, c, overlap=overlap)
    fast = evaluate(m, base.with_corrections(gemm_scale=gemm_up), j, c, overlap=overlap)
    _never_slower(fast.batch_time, slow.batch_time, rows)
    _never_slower(fast.compute, slow.compute, rows)
    if not use_table:
        fast2 = evaluate(m, base.replace(gemm_ceiling=base.gemm_ceiling * ceiling_up), j, c, overlap=overlap)
        _never_slower(fast2.batch_time, slow.batch_time, rows)


@SETTINGS
@given(job=jobs, gemm=scale_any, bw=scale_any, overhead=st.floats(0.0, 0.01), use_table=st.booleans())
def test_no_overlap_never_faster_and_decomposition(table_prof, job, gemm, bw, overhead, use_table):
    m, j, c = _space(job)
    p = (table_prof if use_table else PARAMETRIC).with_corrections(gemm_scale=gemm, inter_bw_scale=bw,
                                                                   step_overhead_s=overhead)
    rows = _divisible(m, j, c)
    on = evaluate(m, p, j, c, overlap=True)
    off = evaluate(m, p, j, c, overlap=False)
    # OAR/ORS/OAG; the D buckets' extra calls: tests/test_dp_overlap.py
    _never_slower(evaluate(m, p, j, c, overlap=True, execution=Execution(overlap_grad_reduce=False)).batch_time,
                  off.batch_time, rows)
    for ev in (on, off):
        bt, comp, comm, exp = (a[rows] for a in (ev.batch_time, ev.compute, ev.comm, ev.exposed_comm))
        tiny = 1e-9 * bt
        assert np.all(comp > 0) and np.all(comm >= 0)
        assert np.all(bt >= comp - tiny)
        assert np.all(exp >= 0)
        assert np.all(exp <= comm + tiny)
        assert np.all(bt >= comp + exp + overhead - tiny - 1e-15)
    # without overlap nothing is hidden: every second of communication is exposed
    np.testing.assert_allclose(off.exposed_comm[rows], off.comm[rows], rtol=1e-9, atol=1e-15)


@SETTINGS
@given(job=jobs, capacity_mib=st.floats(0.2, 20.0), headroom_frac=st.floats(0.0, 0.5), overlap=st.booleans())
def test_every_infeasible_row_has_a_reason_and_memory_is_consistent(job, capacity_mib, headroom_frac, overlap):
    mi, g, b, s = job
    cap = capacity_mib * 2**20
    p = PARAMETRIC.replace(mem_capacity=cap, mem_headroom=cap * headroom_frac)
    limit_gib = cap * (1 - headroom_frac) / GIB
    df = rank(MODELS[mi], p, g, b, seq_len=s, include_infeasible=True, overlap=overlap, max_micro_batch=8)
    assert len(df) == df.attrs["candidates"]
    feas = df["feasible"].to_numpy(dtype=bool)
    reason = df["reason"].to_numpy(dtype=object)
    assert all(isinstance(r, str) and r.strip() for r in reason[~feas])
    assert all(r == "" for r in reason[feas])
    assert df["rank"][feas].notna().all() and df["rank"][~feas].isna().all()
    mem = df["memory_gib"].to_numpy(dtype=float)
    assert np.all(mem[feas] <= limit_gib * (1 + 1e-12))
    over = mem > limit_gib * (1 + 1e-12)
    assert not np.any(feas & over)
    mem_rows = np.array(["GiB per GPU" in r for r in reason])
    assert np.all(over[mem_rows])
    # a row that breaks no divisibility rule is infeasible exactly when it does not fit
    m = MODELS[mi]
    from axoplan.planner.space import grid_problem
    for r in df.itertuples(index=False):
        if grid_problem(m, r.gx, r.gy, r.gz, r.gdata, b, r.micro_batch, s) is None:
            assert r.feasible == (r.memory_gib <= limit_gib * (1 + 1e-12)), r


def test_checkpointing_trades_time_for_memory():
    """Same grid and micro-batch: checkpointing needs less memory at its peak and recomputes the forward."""
    m = tiny_model(n_layers=8)
    c = enumerate_space(8, 16, orders="xyz", max_micro_batch=8)
    ev = evaluate(m, PARAMETRIC, Job(8, 16, 64), c)
    on = c.checkpointing
    assert np.all(ev.memory.total[on] < ev.memory.total[~on])
    assert np.all(ev.compute[on] > ev.compute[~on])


def test_run_windows_by_hand():
    """prefix [A], block [B1, B2] x 3, suffix [C]. With OAG+ORS a window takes
    max(compute + blocking, next window's all-gather + own reduce-scatter), plus the first all-gather:
    0.5 + A 3 + 2 * (B1 2.1 + B2 3.3) + (B1 2.1 + B2 1.0) + C 1.2 = 18.6.
    Without overlap every window is ag + compute + blocking + rs: 1.5 + 3 * 7.0 + 1.9 = 24.4."""
    from axoplan.planner.timing import Timed, run_windows

    def w(name, c, b, ag, rs):
        return Timed(name, np.array([c]), np.array([b]), np.array([ag]), np.array([rs]))

    A, B1, B2, C = w("A", 1, 0, 0.5, 0), w("B1", 2, 0.1, 3, 0.2), w("B2", 1, 0, 0.4, 0.3), w("C", 1, 0.2, 0.6, 0.1)
    rec = []
    assert float(run_windows([A], [B1, B2], [C], 3, True, True, rec)[0]) == pytest.approx(18.6)
    assert float(run_windows([A], [B1, B2], [C], 3, False, False)[0]) == pytest.approx(24.4)
    # the record holds every window once, blocks with their count, totals without the first prefetch
    assert [(r[0].name, r[2]) for r in rec] == [("A", 1), ("B1", 3), ("B2", 3), ("C", 1)]
    assert sum(float(np.asarray(r[1])[0]) for r in rec) == pytest.approx(18.6 - 0.5)


def test_switching_seconds_stay_exposed_beside_compute_by_hand():
    """CPU ranks sharing cores, overlap efficiency 0.5: block [B] x 2 with compute 4, the next all-gather 3 of
    which 2 are switching seconds (a group wider than the cores), its reduce-scatter 1. The interior window hides
    half of min(compute, Z stream less switching): 4 + (3 + 1) - 0.5 x min(4, 2) = 7 (6 if nothing were
    switching); the last one only its reduce-scatter: 4 + 1 - 0.5 = 4.5; with the first all-gather 3 + 7 + 4.5."""
    import functools

    from axoplan.planner.timing import Timed, overlapped, run_windows

    side = functools.partial(overlapped, eta=0.5)
    B = Timed("B", np.array([4.0]), np.array([0.0]), np.array([3.0]), np.array([1.0]), np.array([2.0]), 0.0)
    assert float(run_windows([], [B], [], 2, True, True, side_by_side=side)[0]) == pytest.approx(14.5)
    plain = Timed("B", B.compute, B.blocking, B.ag, B.rs)
    assert float(run_windows([], [plain], [], 2, True, True, side_by_side=side)[0]) == pytest.approx(13.5)
    # without OAG the all-gather blocks in front of its window; only the reduce-scatter's switching counts
    R = Timed("B", B.compute, B.blocking, B.ag, B.rs, B.ag_switching, np.array([1.0]))
    assert float(run_windows([], [R], [], 2, False, True, side_by_side=side)[0]) == pytest.approx(2 * (3 + 5))
    assert float(run_windows([], [plain], [], 2, False, True, side_by_side=side)[0]) == pytest.approx(2 * (3 + 4.5))
    # more switching than the call: nothing hidden, never a negative share
    assert overlapped(4.0, 1.0, 0.5, 0.0, 3.0) == 5.0


def test_calls_issued_ahead_do_not_pay_the_per_call_overhead():
    """timed(), by hand, with a per-call overhead in every call's seconds (Collective.overhead: a pair's 1.2 ms,
    a group of 4's 2.6 ms): a blocking all-reduce of 2.0 ms keeps it; with overlap on, the Z stream's prefetched
    all-gather (1.5 ms, a pair) and reduce-scatter left in flight (2.0 ms, a group of 4) were issued ahead and
    shed theirs: 0.3 ms and 0 (never below zero); without overlap each is waited for as it is issued and keeps
    its whole time. Measured on the bundled trainer (4 gloo ranks, calib-4l on 1x1x2x2 and 1x2x2x1): a blocking
    Y all-reduce waited 2.1 ms a call against the 0.8 ms its table gives, a prefetched Z all-gather 0.86 ms,
    about its table's 0.75-0.9 ms."""
    from types import SimpleNamespace

    from axoplan.planner.comm import Collective
    from axoplan.planner.schedule import Window
    from axoplan.planner.timing import overlapped, timed

    def call(kind, axis, ms, over_ms):
        over = None if over_ms is None else np.array([over_ms * 1e-3])
        return Collective("qkv", "fwd", kind, axis, np.array([1024.0]), np.array([ms * 1e-3]), overhead=over)

    def window(ag_over, rs_over):
        return Window("qkv", {"gemm fwd": SimpleNamespace(seconds=np.array([0.5e-3]))},
                      blocking=[call("all_reduce", "y", 2.0, ag_over)], gather=[call("all_gather", "z", 1.5, ag_over)],
                      scatter=[call("reduce_scatter", "z", 2.0, rs_over)])

    w = window(1.2, 2.6)
    on, off, none = timed(w, overlapped, True), timed(w, overlapped, False), timed(window(None, None), overlapped, True)
    assert float(on.blocking[0]) == pytest.approx(2.0e-3) and float(off.blocking[0]) == pytest.approx(2.0e-3)
    assert float(on.ag[0]) == pytest.approx(0.3e-3) and float(on.rs[0]) == 0.0
    assert (float(off.ag[0]), float(off.rs[0])) == pytest.approx((1.5e-3, 2.0e-3))
    assert (float(none.ag[0]), float(none.rs[0])) == pytest.approx((1.5e-3, 2.0e-3))  # no overhead: nothing shed


def test_the_per_call_overhead_grows_with_the_group_as_its_last_arrival():
    """rank_skew by hand: a rank waits E[max of p exponential latenesses] - E[its own] = H_p - 1 mean
    latenesses, a pair's 1/2; in a pair's units 2 (H_p - 1): 0 for one rank, 1 for 2, 5/3 for 3, 13/6 for 4,
    481/140 for 8 (H_8 = 761/280), and past the summed table (64) the series agrees with the sum. A measured
    group shape pays collective_overhead_s times it on top of its table (comm.table_seconds)."""
    from axoplan.planner.comm import rank_skew

    assert rank_skew([1, 2, 3, 4, 8]) == pytest.approx([0.0, 1.0, 5 / 3, 13 / 6, 481 / 140])
    for p in (64, 65, 1000):
        assert float(rank_skew(p)) == pytest.approx(2 * (sum(1 / i for i in range(1, p + 1)) - 1), rel=1e-9)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["dgx-a100", "perlmutter", "dgx-h100"]), st.integers(0, 2**31 - 1), st.booleans())
def test_gemms_once_per_distinct_grid_equal_every_candidates_own(machine, seed, tuning):
    """block_gemms evaluates each distinct (gx, gy, tokens) once and hands it back: every time, shape and flag
    equals linear_gemms on the candidates themselves (300 candidates over a few grids, as orders repeat them)."""
    from axoplan.planner.compute import block_gemms, linear_gemms
    from axoplan.planner.profile_reader import load_profile
    rng = np.random.default_rng(seed)
    prof, m = load_profile(machine), tiny_model()
    gx, gy = rng.choice([1, 2, 4], 300), rng.choice([1, 2, 8], 300)
    tokens = rng.choice([64.0, 128.0, 512.0], 300)
    lins = [*m.block_linears(), m.lm_head()]
    once = block_gemms(prof, lins, gx, gy, tokens, tuning)
    for lin, got in zip(lins, once):
        own = linear_gemms(prof, lin, gx, gy, tokens, tuning)
        for a, b in ((got.fwd, own.fwd), (got.dgrad, own.dgrad), (got.wgrad, own.wgrad),
                     (got.extrapolated, own.extrapolated)):
            np.testing.assert_array_equal(a, b)
        for w in own.shapes:
            for a, b in zip(got.shapes[w], own.shapes[w]):
                np.testing.assert_array_equal(np.broadcast_to(a, (300,)), np.broadcast_to(b, (300,)))
        assert got.layouts == own.layouts
