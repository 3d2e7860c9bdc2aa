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
