"""axoplan.rank(): the fixed columns, the ordering, the filters, and the errors a user can cause."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import axoplan
from axoplan.errors import UserError
from axoplan.planner.space import distinct_orders, factorizations4, micro_batch_choices

from conftest import tiny_model

# fixed from issue 2 on: written out here, not imported, so a change to rank.COLUMNS fails this test
COLUMNS = ["rank", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s", "compute_s",
           "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak", "feasible", "reason",
           "pp", "vpp", "schedule", "bubble_s", "batch_time_exact",
           "tied", "expected_error"]


@pytest.fixture
def model():
    return tiny_model()


def test_columns_and_sorting(model, pm_path):
    df = axoplan.rank(model, str(pm_path), 16, 32)
    assert list(df.columns) == COLUMNS
    assert len(df) > 10
    assert df["feasible"].all() and (df["reason"] == "").all()
    assert df["rank"].tolist() == list(range(1, len(df) + 1))
    t = df["batch_time_s"].to_numpy()
    assert np.all(np.diff(t) >= 0)
    assert np.all(df["gx"] * df["gy"] * df["gz"] * df["gdata"] * df["pp"] == 16)
    assert df.attrs["feasible"] == len(df)
    # no duplicate candidate
    key = ["gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "pp", "vpp", "schedule"]
    assert not df.duplicated(key).any()


def test_derived_columns_by_hand(model, pm):
    df = axoplan.rank(model, pm, 16, 32)
    r = df.iloc[0]
    # FLOP per GPU per step from the model's own accounting, then TFLOP/s and % of the 312 TFLOP/s peak
    flops = model.flops_per_token(64, recompute=bool(r.checkpointing)) * 32 * 64 / 16
    assert r.tflops_per_gpu == pytest.approx(flops / r.batch_time_s / 1e12, rel=1e-9)
    assert r.pct_of_peak == pytest.approx(100 * r.tflops_per_gpu / 312, rel=1e-9)


def test_top_k_is_the_head_of_the_full_ranking(model, pm):
    full = axoplan.rank(model, pm, 16, 32)
    top = axoplan.rank(model, pm, 16, 32, top=5)
    assert len(top) == 5
    assert top["rank"].tolist() == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(top["batch_time_s"], full["batch_time_s"][:5], rtol=1e-12)
    big = axoplan.rank(model, pm, 16, 32, top=10**6)
    assert len(big) == len(full)


def test_include_infeasible(model, pm):
    df = axoplan.rank(model, pm, 16, 32, include_infeasible=True, max_micro_batch=64, pp=1)  # the 4D space
    grids = factorizations4(16)
    expect = int(distinct_orders(grids).sum()) * len(micro_batch_choices(32)) * 2
    assert len(df) == expect == df.attrs["candidates"]
    feas = df["feasible"].to_numpy(dtype=bool)
    n = int(feas.sum())
    assert 0 < n < len(df)
    assert feas[:n].all() and not feas[n:].any(), "feasible rows first"
    assert df["rank"][:n].tolist() == list(range(1, n + 1))
    assert df["rank"][n:].isna().all()
    assert (df["reason"][n:].str.len() > 0).all()
    # e.g. gy=16 splits 8 heads
    bad = df[(df.gy == 16)]
    assert len(bad) and bad["reason"].str.contains("attention heads are not divisible by gy=16").all()


def test_order_and_micro_batch_filters(model, pm):
    df = axoplan.rank(model, pm, 8, 32, order="zyx", micro_batch=2, top=None)
    assert set(df["order"]) == {"zyx"}
    assert set(df["micro_batch"]) == {2}
    both = axoplan.rank(model, pm, 8, 32, checkpointing="on")
    assert both["checkpointing"].all()
    with pytest.raises(UserError, match="--order"):
        axoplan.rank(model, pm, 8, 32, order="abc")


def test_order_all_holds_only_distinct_placements(model, pm):
    df = axoplan.rank(model, pm, 8, 8, include_infeasible=True)
    # a grid with one non-unit tensor axis has one placement: xyz names it
    single = df[(df.gx == 8)]
    assert set(single["order"]) == {"xyz"}
    # gx=2, gy=2: x before y or y before x (z's place does not matter)
    two = df[(df.gx == 2) & (df.gy == 2) & (df.gz == 1)]
    assert set(two["order"]) == {"xyz", "yxz"}


def test_nothing_fits_in_memory(model, write_profile):
    prof = write_profile(capacity_gib=1e-6, headroom_gib=0)
    with pytest.raises(UserError, match="nothing fits") as e:
        axoplan.rank(model, str(prof), 4, 8)
    assert "pm-test" in str(e.value) and "GiB" in str(e.value)
    # with --all the rows come back, every one infeasible with the memory reason
    df = axoplan.rank(model, str(prof), 4, 8, include_infeasible=True)
    assert not df["feasible"].any()
    assert df["rank"].isna().all()


def test_explain_where_nothing_fits_shows_the_leanest_runnable_choice(model, write_profile):
    """With no micro-batch or checkpointing that fits, explain shows the choice that comes closest (its memory
    the reason), never one the job cannot run at all: global batch 12 on 2 data ranks leaves 6 sequences per
    GPU, which micro-batches 4 and 5 do not divide."""
    prof = write_profile(capacity_gib=1e-6, headroom_gib=0)
    every = axoplan.rank(model, str(prof), 2, 12, include_infeasible=True)
    grid = every[(every.gx == 1) & (every.gy == 1) & (every.gz == 1) & (every.gdata == 2)]
    runnable = grid[grid.reason.str.startswith("needs")]
    assert len(runnable) and len(runnable) < len(grid)  # some choices break a rule before memory
    ex = axoplan.explain(model, str(prof), 2, 12, (1, 1, 1, 2))
    s = ex.summary.iloc[0]
    assert not s.feasible and s.reason.startswith("needs")
    assert s.memory_gib == pytest.approx(runnable.memory_gib.min())


def test_no_configuration_divides_the_batch(model, pm):
    # 3 GPUs, global batch 2: gdata*gz = 1 forces gx*gy = 3, which divides neither hidden 64 nor 8 heads;
    # gdata*gz = 3 does not divide 2 sequences
    with pytest.raises(UserError, match="no configuration") as e:
        axoplan.rank(model, pm, 3, 2)
    assert "global batch 2" in str(e.value)
    # a fixed micro-batch that divides no per-GPU batch
    with pytest.raises(UserError, match="no configuration"):
        axoplan.rank(model, pm, 4, 4, micro_batch=3)


@pytest.mark.parametrize("gpus,batch,seq,word", [(0, 8, None, "--gpus"), (-3, 8, None, "--gpus"),
                                                  (4, 0, None, "--global-batch"), (4, 8, -1, "--seq-len")])
def test_bad_job(model, pm, gpus, batch, seq, word):
    with pytest.raises(UserError, match=word):
        axoplan.rank(model, pm, gpus, batch, seq_len=seq)


def test_seq_len_beyond_learned_positions(model, pm):
    with pytest.raises(UserError, match="learned positions"):
        axoplan.rank(model, pm, 4, 8, seq_len=128)


def test_names_and_paths_resolve(model_yaml, pm_path):
    path = model_yaml(name="from-yaml", hidden=128, n_heads=4)
    df = axoplan.rank(str(path), str(pm_path), 4, 8, top=3)
    assert len(df) == 3
    with pytest.raises(UserError, match="unknown model 'no-such-model'"):
        axoplan.rank("no-such-model", str(pm_path), 4, 8)


def test_explain_summary_matches_rank(model, pm):
    df = axoplan.rank(model, pm, 16, 32)
    best = df.iloc[0]
    ex = axoplan.explain(model, pm, 16, 32, (int(best.gx), int(best.gy), int(best.gz), int(best.gdata)),
                         order=best.order, micro_batch=int(best.micro_batch), checkpointing=bool(best.checkpointing))
    s = ex.summary.iloc[0]
    assert s.batch_time_s == pytest.approx(best.batch_time_s, rel=1e-12)
    assert s.memory_gib == pytest.approx(best.memory_gib, rel=1e-12)
    mem = ex.memory.set_index("kind")["gib"]
    assert mem["total (peak)"] == pytest.approx(best.memory_gib, rel=1e-9)
    parts = mem.drop(["total (peak)", "available (capacity - headroom)"]).sum()
    assert parts == pytest.approx(mem["total (peak)"], rel=1e-9)
    assert mem["available (capacity - headroom)"] == pytest.approx(37.0)
    # the layer windows hold the step's compute and are part of its time
    w = ex.windows
    assert isinstance(w, pd.DataFrame) and set(w["pass"]) == {"forward", "backward"}
    assert w["compute_s"].sum() <= s.compute_s * (1 + 1e-9)
    assert w["window_s"].sum() <= s.batch_time_s * (1 + 1e-9)
    assert (w["window_s"] >= w["compute_s"] * (1 - 1e-9)).all()
