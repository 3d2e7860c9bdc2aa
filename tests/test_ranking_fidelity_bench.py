"""benchmarks/ranking_fidelity.py's tie ceiling, on hand-computed cases."""
from __future__ import annotations

import pytest
from conftest import load_benchmark


def test_the_tie_ceiling_keeps_the_models_ties_and_orders_the_rest_as_measured():
    rf = load_benchmark("ranking_fidelity")
    # no ties: every distinct prediction ordered as measured, whatever the model's order
    assert rf.tie_ceiling([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(1.0)
    # candidates 0 and 1 predicted alike: 5 concordant pairs, one tied in the prediction -> 5 / sqrt(5 * 6)
    assert rf.tie_ceiling([1.0, 1.0, 2.0, 3.0], [2.0, 1.0, 4.0, 3.0]) == pytest.approx(5 / 30 ** 0.5)
    # alike within 1e-9 relative counts as tied; one candidate has no pair
    assert rf.tie_ceiling([1.0, 1.0 + 1e-12, 2.0], [2.0, 1.0, 3.0]) == pytest.approx(2 / 6 ** 0.5)
    assert rf.tie_ceiling([1.0], [1.0]) is None


def _sweep(folder, times, profile=b"name: p\n"):
    """A validate folder with one results line per (candidate, repeat) and each run's machine.yaml."""
    import pandas as pd

    rows = [{"candidate": c, "gx": 1, "measured_time_s": t, "status": "ok", "repeat": r, "wall_s": 1.0}
            for c, ts in times.items() for r, t in enumerate(ts)]
    folder.mkdir(parents=True)
    (folder / "results.csv").write_text(pd.DataFrame(rows).to_csv(index=False))
    for c in times:
        (folder / "runs" / c).mkdir(parents=True)
        (folder / "runs" / c / "machine.yaml").write_bytes(profile)


def test_pooled_sweeps_give_each_candidate_the_median_of_all_its_runs(tmp_path):
    from axoplan.errors import UserError
    from axoplan.loop.validate_files import read_results

    rf = load_benchmark("ranking_fidelity")
    _sweep(tmp_path / "a", {"c1": [1.0, 5.0], "c2": [2.0, 2.2]})
    _sweep(tmp_path / "b", {"c1": [1.2], "c2": [2.4]})
    assert rf.pool_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "p") == 6
    res = read_results(tmp_path / "p" / "results.csv").set_index("candidate")
    # c1: median of 1.0, 5.0 and 1.2 is 1.2 (each sweep's alone: 3.0 and 1.2); c2: of 2.0, 2.2, 2.4
    assert res.loc["c1", "measured_time_s"] == pytest.approx(1.2)
    assert res.loc["c2", "measured_time_s"] == pytest.approx(2.2)
    assert res.loc["c1", "measured_runs"] == 3
    # other candidates, or another profile, do not pool
    _sweep(tmp_path / "c", {"c1": [1.0]})
    _sweep(tmp_path / "d", {"c1": [1.0], "c2": [2.0]}, profile=b"name: q\n")
    for other in ("c", "d"):
        with pytest.raises(UserError):
            rf.pool_sweeps([tmp_path / "a", tmp_path / other], tmp_path / "q")
