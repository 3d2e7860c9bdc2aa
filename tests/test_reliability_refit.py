"""Issue 27, refit refuses what it should not fit: results of another machine, a row no run can have
(a micro-batch that does not divide its batch), a checkpointing that is not true or false, a measured
time out of range or negative (named as written, not as nan), a profile whose fit cannot converge."""
from __future__ import annotations

import pytest
from conftest import one_sentence, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability_inputs import results_csv


def _refit(tmp_path, capsys, res, machine="localhost-cpu"):
    out = tmp_path / "n.yaml"
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", machine, "--out", str(out), "--no-loo",
                            "--params", "step_overhead_s"], capsys)
    return code, err, out


def test_results_of_another_machine_are_refused(tmp_path, capsys):
    code, err, out = _refit(tmp_path, capsys, results_csv(tmp_path), machine="perlmutter")
    one_sentence(code, err)
    assert "localhost-cpu" in err and not out.exists()


def test_a_refit_profile_of_the_same_machine_is_accepted(tmp_path, capsys):
    res = results_csv(tmp_path)
    code, err, first = _refit(tmp_path, capsys, res)
    assert code == 0, err
    second = tmp_path / "m.yaml"
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", str(first), "--out", str(second),
                            "--no-loo", "--params", "step_overhead_s"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("edit, words", [
    (lambda df: df.__setitem__("micro_batch", [3, 3]), "micro-batch"),
    (lambda df: df.__setitem__("checkpointing", ["maybe", "False"]), "checkpointing"),
    (lambda df: df.__setitem__("measured_time_s", [1e308, 1.0]), "measured_time_s"),
    (lambda df: df.__setitem__("measured_time_s", [-1.5, 1.0]), "-1.5"),
])
def test_rows_refit_must_not_fit_are_refused(tmp_path, capsys, edit, words):
    code, err, out = _refit(tmp_path, capsys, results_csv(tmp_path, edit))
    one_sentence(code, err)
    assert words in err and "nan" not in err and not out.exists()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "x", "1e400", "-0"])))
def test_any_measured_time_is_fitted_or_named_as_written(tmp_path, capsys, t):
    res = results_csv(tmp_path, lambda df: df.__setitem__("measured_time_s", [t, 1.0]))
    code, err, out = _refit(tmp_path, capsys, res)
    if code == 0:
        assert 0 < float(t) <= 1e7
        out.unlink()
    else:
        one_sentence(code, err)
        assert "got nan" not in err


def test_a_fit_that_cannot_converge_is_one_sentence(tmp_path, capsys, monkeypatch):
    import numpy as np

    from axoplan.loop import refit as R

    def diverges(*a, **k):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(R, "fit", diverges)
    code, err, out = _refit(tmp_path, capsys, results_csv(tmp_path))
    one_sentence(code, err)
    assert "does not converge" in err and not out.exists()
