"""benchmarks/published_fidelity.py's memory comparison: the source's memory per GPU (BLOOM's nvidia-smi
readings) parsed as GiB and summarised against the model's peak, by hand."""
from __future__ import annotations

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def pf():
    return load_benchmark("published_fidelity")


def test_memory_cells_parse_as_gib_and_blanks_as_none(pf):
    assert pf.memory_gib("56GB") == 56.0
    assert pf.memory_gib(" 66.5GB ") == 66.5
    for blank in ("", "GB", "OOM", "56", None):
        assert pf.memory_gib(blank) is None


def test_summary_compares_memory_only_where_the_source_gives_it(pf):
    def row(pred_gib, meas_gib):
        return {"ratio": 1.0, "group": "g", "config": "c", "tokens_per_gpu_pred": 1.0, "tokens_per_gpu_meas": 1.0,
                "feasible": True, "pred_pct_peak": 50.0, "meas_pct_peak": 50.0, "exposed_share": 0.0,
                "memory_gib": pred_gib, "measured_mem_gib": meas_gib}

    s = pf.summarise([row(40.0, 50.0), row(30.0, 60.0), row(20.0, None), row(45.0, 50.0)])
    assert s["memory_rows"] == 3
    assert s["memory_median_ratio"] == pytest.approx(0.8)  # 0.8, 0.5, 0.9
    assert s["memory_gap_gib"] == pytest.approx((15.0, 5.0, 30.0))
    assert pf.summarise([row(20.0, None)])["memory_gap_gib"] is None


def test_bloom_rows_carry_the_sources_memory(pf):
    runs, _ = pf.bloom()
    mem = [r.measured_mem_gib for r in runs if r.measured_mem_gib is not None]
    assert len(mem) > 40 and all(20 < m <= 80 for m in mem)
    assert all(r.measured_mem_gib is None for r in runs if r.oom)


def test_a_row_repeating_another_with_time_and_tflops_swapped_is_found(pf):
    """Rows 0 and 2 are one run with its two numbers in each other's columns (as BLOOM's ZeRO-stage table prints
    the 48-node contenders' 134.02 s at 120.29 TFLOP/s): the later one is the repeat; another configuration with
    the same two numbers (row 3) and a plain repeat (row 1) are not."""
    base = dict(model="m", layers="72", hidden="14336", heads="64", micro_batch="2", global_batch="2048", tp="8",
                pp="12", dp="4", date_2022="02-21")
    rows = [dict(base, time_per_iteration="134.02", tflops_per_gpu_reported="120.29"),
            dict(base, time_per_iteration="134.02", tflops_per_gpu_reported="120.29"),
            dict(base, time_per_iteration="120.29", tflops_per_gpu_reported="134.02"),
            dict(base, micro_batch="4", time_per_iteration="120.29", tflops_per_gpu_reported="134.02")]
    assert pf._swapped(rows) == {2}


def test_bloom_leaves_out_the_swapped_and_zero_stage_0_rows_and_reads_the_single_node_batch(pf):
    """The source's ZeRO-stage table: its ZeRO-1 row is the contenders' run swapped, its ZeRO-0 row's time unknown;
    the single-node 18B rows agree with their TFLOP/s at global batch 512 (the source's heading), not the 2048 of
    its table, and form a group of their own."""
    runs, out = pf.bloom()
    reasons = [why for _, label, why in out if "181B L72 tp8 pp12 dp4 mb2 02-21" in label]
    assert len(reasons) == 2 and any("swapped" in w for w in reasons) and any("ZeRO stage 0" in w for w in reasons)
    same = [r.measured_s for r in runs if r.label == "BLOOM-prototype 181B L72 tp8 pp12 dp4 mb2 02-21"]
    assert same == [134.02]
    one = [r for r in runs if r.gpus == 8]
    assert len(one) == 3 and {r.global_batch for r in one} == {512}
    assert {r.group for r in one} == {"bloom-jeanzay:02-21 one node"}


def test_unexplained_time_is_spread_over_the_micro_batch_steps_and_blocks_of_a_stage_by_hand(pf):
    # 2048 sequences over dp 8 at micro-batch 4: 64 micro-batches, 64 + 6 - 1 = 69 steps; 72 layers / 6 = 12 blocks
    r = {"global_batch": 2048, "dp": 8, "micro_batch": 4, "pp": 6, "layers": 72, "measured_s": 120.0,
         "predicted_s": 111.72}
    assert pf.unexplained_per_block_step(r) == pytest.approx(8.28 / (69 * 12))
    # no pipeline: every micro-batch a step, every layer a block
    flat = dict(r, pp=1, global_batch=64, dp=1, micro_batch=2, layers=10, measured_s=2.0, predicted_s=1.68)
    assert pf.unexplained_per_block_step(flat) == pytest.approx(0.32 / (32 * 10))


def test_rows_grouped_by_tensor_parallel_size_stages_and_micro_batch(pf):
    rows = [{"tp": 8, "pp": 6, "micro_batch": 4, "i": 0}, {"tp": 4, "pp": 12, "micro_batch": 2, "i": 1},
            {"tp": 8, "pp": 6, "micro_batch": 4, "i": 2}, {"tp": 4, "pp": 12, "micro_batch": 4, "i": 3}]
    groups = pf.by_grid(rows)
    assert [k for k, _ in groups] == [(4, 12, 2), (4, 12, 4), (8, 6, 4)]
    assert [r["i"] for r in groups[2][1]] == [0, 2]


def test_bloom_head_dim_108_slowdown_comes_from_the_published_unaligned_gemm_rate(pf):
    """BLOOM's 13824-wide model with 128 heads (head size 108, not a whole number of 16-byte bf16 vectors) ran
    42-44% (44 and 47 s) slower than with 64 heads on the same grid; the A100 profiles' compute.gemm.unaligned_tflops
    (12.2 TFLOP/s, pytorch#83272), nothing fitted to BLOOM, gives 35 and 37 s of it: the extra seconds, which time
    the two runs share (tensor-parallel traffic, the pipeline) leaves alone, at 75-100% of the measured."""
    runs, _ = pf.bloom()
    prof = pf.machine_profiles()["bloom-jeanzay"]
    assert prof.gemm_unaligned == pytest.approx(12.2e12)
    by = {}
    for r in runs:
        if r.model.hidden == 13824 and r.group == "bloom-jeanzay:02-26" and r.grid == (1, 4, 1, 8):
            by.setdefault((r.micro_batch, r.model.n_heads), []).append(r)
    for mb in (2, 4):
        slow, fast = by[(mb, 128)][0], by[(mb, 64)][0]
        assert slow.model.head_dim == 108 and fast.model.head_dim == 216
        measured = slow.measured_s - fast.measured_s
        predicted = pf.predict(slow, prof)["predicted_s"] - pf.predict(fast, prof)["predicted_s"]
        assert 1.34 < slow.measured_s / fast.measured_s < 1.45 and 0.75 < predicted / measured < 1.0
        # without the field the model has no slowdown to speak of
        flat = prof.replace(gemm_unaligned=None)
        assert pf.predict(slow, flat)["predicted_s"] - pf.predict(fast, flat)["predicted_s"] < 0.2 * measured


def test_rows_are_reported_per_machine_state_only_where_the_source_records_a_change(pf):
    """BLOOM's source improved its nodes' PCIe/NUMA setup on 02-25: the rows before and after are reported apart
    (medians by hand), and a dataset with one state gets no such report."""
    rows = [{"machine_state": s, "ratio": x}
            for s, x in [("before", 0.8), ("after", 1.0), ("before", 0.9), ("after", 0.9), ("before", 0.85)]]
    assert pf.machine_states(rows) == [("before", 3, pytest.approx(0.85)), ("after", 2, pytest.approx(0.95))]
    assert pf.machine_states([{"machine_state": "", "ratio": 1.0}] * 3) == []
    runs, _ = pf.bloom()
    states = {r.label.split()[-1][:5]: r.machine_state for r in runs if "(batch" not in r.label}
    assert states["02-21"] == states["02-24"] == pf.BLOOM_FIX[0] and states["02-25"] == states["02-28"] == pf.BLOOM_FIX[2]


def test_narayanan_times_come_from_their_eq3_by_hand(pf):
    """Table 1's 1T row: 163 TFLOP/s per GPU on 3,072 GPUs at batch 3,072, 128 layers of width 25,600, s = 2048,
    V = 51,200: 96 B s l h^2 (1 + s/6h + V/16lh) = 5.139e19 FLOP per iteration (their Eq. 3), so 102.63 s."""
    runs, out = pf.narayanan()
    assert out == [] and len(runs) == 10
    one_t = next(r for r in runs if r.gpus == 3072)
    flop = 96 * 3072 * 2048 * 128 * 25600 ** 2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert flop == pytest.approx(5.139e19, rel=1e-4)
    assert one_t.measured_s == pytest.approx(102.63, abs=0.01)
    assert (one_t.grid, one_t.pp, one_t.micro_batch, one_t.schedule) == ((1, 8, 1, 6), 64, None, "all")
    assert one_t.execution.pipeline_p2p_split and not one_t.execution.tp_backward_overlap


def test_the_ablation_summarises_like_the_main_table(pf):
    """--ablate's rows carry what the main table's do (the configuration the tau ceiling groups repeats by): a
    summary per ablation and dataset, on two of Narayanan et al.'s runs."""
    runs = pf.narayanan()[0][:2]
    res = pf.ablation(runs, pf.machine_profiles())
    assert set(pf.ABLATIONS) <= set(res) and "all, bundled execution" in res
    for per in res.values():
        assert per["narayanan-selene"]["rows"] == 2 and per["overall"]["mean_err_pct"] >= 0


def test_tau_is_reported_per_named_group_with_its_size(pf):
    """Issue 23 judges BLOOM per date block of at least 5 rows: each group's tau comes with its name and size.
    By hand: block A orders 5 rows with one pair swapped, (9 - 1) / 10 = 0.8; block B (3 rows) reversed, -1."""
    def row(group, i, pred, meas):
        return {"ratio": 1.0, "group": f"ds:{group}", "config": (group, i), "tokens_per_gpu_pred": pred,
                "tokens_per_gpu_meas": meas, "feasible": True, "pred_pct_peak": 50.0, "meas_pct_peak": 50.0,
                "exposed_share": 0.0, "memory_gib": 1.0, "measured_mem_gib": None}

    rows = [row("A", i, p, m) for i, (p, m) in enumerate(zip([1, 2, 3, 4, 5], [1, 2, 3, 5, 4]))]
    rows += [row("B", i, p, m) for i, (p, m) in enumerate(zip([1, 2, 3], [3, 2, 1]))]
    s = pf.summarise(rows)
    assert [(g, n) for g, n, _, _ in s["tau_groups_named"]] == [("A", 5), ("B", 3)]
    assert [t for _, _, t, _ in s["tau_groups_named"]] == pytest.approx([0.8, -1.0])
    assert [c for _, _, _, c in s["tau_groups_named"]] == pytest.approx([1.0, 1.0])  # every configuration distinct
    assert s["kendall_tau"] == pytest.approx(-0.1)
    assert pf.TAU_BLOCK_ROWS == 5
