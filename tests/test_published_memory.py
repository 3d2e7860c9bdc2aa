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
