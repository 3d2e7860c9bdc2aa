"""`axoplan refit`: recovers known corrections from measurements the planner itself generated with
them, reports before/after/leave-one-out error, writes a new valid profile and never the old one."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from axoplan.cli.main import main
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import rank
from axoplan.loop.refit import PARAMS, choose_params, predict, refit, runs_from_results
from axoplan.loop.validate import RESULT_COLUMNS, distinct_configs

TRUE = {"gemm_scale": 0.6, "intra_bw_scale": 0.7, "inter_bw_scale": 0.4, "latency_scale": 3.0,
        "step_overhead_s": 2e-4}


def synthetic_results(path, model, profile_path, true: dict, jobs, noise: float = 0.0, seed: int = 0, every: int = 1):
    """results.csv as validate writes it, with measured times = the planner's prediction under `true`
    corrections (times a log-normal noise factor)."""
    prof = load_profile(str(profile_path))
    rng = np.random.default_rng(seed)
    rows = []
    for gpus, gb in jobs:
        # the 4D space: these tests fit corrections (test_pipeline_trainer refits pipelined runs)
        df = distinct_configs(rank(str(model), prof, gpus, gb, pp=1)).iloc[::every]
        for i, r in enumerate(df.to_dict("records")):
            r.update(candidate=f"g{gpus}b{gb}c{i:02d}", model=str(model), machine=str(profile_path), gpus=gpus,
                     global_batch=gb, seq_len="", status="ok", error="", steps=10, warmup_steps=3, wall_s=1.0,
                     repeat=0)
            rows.append(r)
    df = pd.DataFrame(rows)
    runs = runs_from_results(df.assign(measured_time_s=1.0, seq_len=None))
    df["measured_time_s"] = predict(prof, runs, true) * np.exp(noise * rng.standard_normal(len(df)))
    df[RESULT_COLUMNS].to_csv(path, index=False)
    return df


@pytest.fixture
def setup(tmp_path, write_profile, model_yaml):
    # a model big enough that compute, bandwidth and latency all show; 2 GPUs per node so 8 GPUs span nodes
    model = model_yaml(name="mid", n_layers=4, hidden=1024, n_heads=16, vocab=4096, seq_len=512)
    prof = write_profile(name="two-per-node", gpus_per_node=2, intra_groups=((2, 1, 100),), inter_busbw_gbs=20)
    return tmp_path, model, prof


def test_refit_recovers_known_corrections(setup):
    tmp, model, prof = setup
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, TRUE, [(8, 32), (8, 64), (4, 16)])
    out = tmp / "refit.yaml"
    r = refit(str(res), str(prof), str(out), params=list(TRUE))
    for k, v in TRUE.items():
        assert r.after[k] == pytest.approx(v, rel=0.02), k
    assert r.mape_after < 0.5 and r.mape_before > 20 and r.mape_loo < 1.0
    new = load_profile(str(out))
    assert new.corrections.gemm_scale == pytest.approx(TRUE["gemm_scale"], rel=0.02)
    src = yaml.safe_load(out.read_text())["corrections"]["source"]
    assert "axoplan refit" in src and str(res) in src and f"{r.n_runs} ok runs" in src
    assert new.name == "refit"


def test_auto_params_fit_what_the_runs_determine_and_generalise(setup):
    tmp, model, prof = setup
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, TRUE, [(8, 32), (8, 64), (4, 16)], noise=0.03, every=3)
    p = load_profile(str(prof))
    df = pd.read_csv(res)
    chosen = choose_params(p, runs_from_results(df))
    assert chosen and set(chosen) <= set(PARAMS)
    assert {"gemm_scale", "inter_bw_scale", "latency_scale"} <= set(chosen)  # the corrections that are off
    r = refit(str(res), str(prof), str(tmp / "auto.yaml"))
    # forward selection by BIC keeps, from the corrections the runs determine, enough to explain them
    assert set(r.params) <= set(chosen) and {"inter_bw_scale", "latency_scale"} <= set(r.params)
    # 3% noise: after refit and leave-one-out the error is near the noise, far below before
    assert r.mape_after < 6 and r.mape_loo < 8 and r.mape_before > 4 * r.mape_loo


def test_auto_fits_nothing_when_the_profile_is_already_right(setup):
    """Measurements that are exactly the planner's own predictions: no correction lowers the
    criterion, so nothing is fitted and the leave-one-out error is the error before (zero)."""
    tmp, model, prof = setup
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, {}, [(8, 32), (4, 16)], every=3)
    r = refit(str(res), str(prof), str(tmp / "same.yaml"))
    assert r.params == [] and r.mape_loo == r.mape_before == r.mape_after == pytest.approx(0, abs=1e-9)


def test_auto_on_unbiased_noise_does_not_generalise_worse(setup):
    """The planner's predictions times 5% noise: whatever BIC keeps, predicting a run it did not see
    is no worse than not refitting at all (by more than a tenth)."""
    tmp, model, prof = setup
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, {}, [(8, 32), (8, 64), (4, 16)], noise=0.05, every=3)
    r = refit(str(res), str(prof), str(tmp / "same.yaml"))
    assert r.mape_loo <= 1.1 * r.mape_before


def test_one_node_runs_cannot_fit_inter_node_bandwidth(tmp_path, write_profile, model_yaml):
    model = model_yaml(name="mid", n_layers=4, hidden=1024, n_heads=16, vocab=4096, seq_len=512)
    prof = write_profile(name="four", gpus_per_node=4)
    res = tmp_path / "r.csv"
    synthetic_results(res, model, prof, {"gemm_scale": 0.5}, [(4, 16), (4, 32)])
    chosen = choose_params(load_profile(str(prof)), runs_from_results(pd.read_csv(res)))
    assert "inter_bw_scale" not in chosen  # no group leaves the node: it changes no prediction


def test_refit_cli_never_edits_the_old_profile(setup, capsys, monkeypatch):
    tmp, model, prof = setup
    monkeypatch.setenv("AXOPLAN_PROGRESS", "1")  # progress lines although stderr is not a terminal
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, TRUE, [(8, 32)], every=2)
    before = prof.read_text()
    with pytest.raises(SystemExit) as e:
        main(["refit", "--results", str(res), "--machine", str(prof), "--out", str(prof)])
    assert e.value.code == 2 and "never edits" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["refit", "--results", str(res), "--machine", str(prof), "--out", str(tmp / "new.yaml"),
              "--params", "gemm_scale,latency_scale"])
    captured = capsys.readouterr()
    out = captured.out
    assert e.value.code == 0 and "leave-one-out" in out and "gemm_scale" in out
    assert prof.read_text() == before
    # progress on stderr through the fits (stdout keeps the report alone)
    stages = [x for x in captured.err.splitlines() if x.startswith("refit: ")]
    assert any("fitting gemm_scale, latency_scale" in x for x in stages)
    assert any("leave-one-out fits 1/" in x for x in stages)
    with pytest.raises(SystemExit) as e:
        main(["refit", "--results", str(res), "--machine", str(prof), "--out", str(tmp / "n2.yaml"), "--params", "bogus"])
    assert e.value.code == 2 and "unknown correction" in capsys.readouterr().err


def test_refit_writes_the_profiles_tables_beside_the_new_profile(tmp_path, write_profile, model_yaml):
    rows = ["m,n,k,layout,seconds"]
    for m in (64, 4096):
        for n in (64, 4096):
            for k in (64, 4096):
                for lay in ("NN", "NT", "TN"):
                    rows.append(f"{m},{n},{k},{lay},{2 * m * n * k / 1e14:.6g}")
    (tmp_path / "tab.csv").write_text("\n".join(rows) + "\n")
    prof = write_profile(name="withtab", gemm_table="tab.csv")
    model = model_yaml(name="mid", n_layers=2, hidden=512, n_heads=8, vocab=1024, seq_len=256)
    res = tmp_path / "r.csv"
    synthetic_results(res, model, prof, {"gemm_scale": 0.5}, [(4, 16)])
    (tmp_path / "sub").mkdir()
    out = tmp_path / "sub" / "new.yaml"
    refit(str(res), str(prof), str(out), params=["gemm_scale"])
    assert load_profile(str(out)).gemm_table is not None
    # a copy beside it, named relatively: the new profile's folder can move without the old one
    assert yaml.safe_load(out.read_text())["compute"]["gemm"]["table"]["path"] == "new_tab.csv"
    assert (tmp_path / "sub" / "new_tab.csv").read_text() == (tmp_path / "tab.csv").read_text()
    (tmp_path / "tab.csv").unlink()
    assert load_profile(str(out)).gemm_table is not None


def test_refit_errors_are_one_sentence(tmp_path, pm_path, capsys):
    bad = tmp_path / "r.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit) as e:
        main(["refit", "--results", str(bad), "--machine", str(pm_path), "--out", str(tmp_path / "n.yaml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err
    cols = ",".join(RESULT_COLUMNS)
    failed = tmp_path / "f.csv"
    failed.write_text(cols + "\n")  # a header and no finished run
    with pytest.raises(SystemExit) as e:
        main(["refit", "--results", str(failed), "--machine", str(pm_path), "--out", str(tmp_path / "n.yaml")])
    assert e.value.code == 2 and "no run that finished ok" in capsys.readouterr().err


def test_refit_recovers_the_trainers_overlap_with_a_per_call_cost(tmp_path, write_profile, model_yaml):
    """The calibration's overlap (a synthetic burst beside a collective) says 0.2 of a background
    collective hides; the trainer hides 0.8 and pays a fixed cost per call. Neither correction alone
    explains such runs well; the best subset by BIC holds both and recovers them."""
    from conftest import profile_dict

    d = profile_dict(name="ovl", gpus_per_node=8, intra_groups=((2, 1, 20), (4, 1, 20), (8, 1, 20)))
    d["network"]["overlap_efficiency"] = {"value": 0.2, "source": "test"}
    prof = write_profile(raw=d, name="ovl")
    model = model_yaml(name="mid", n_layers=4, hidden=1024, n_heads=16, vocab=4096, seq_len=512)
    true = {"overlap_efficiency": 0.8, "collective_overhead_s": 3e-4}
    res = tmp_path / "r.csv"
    synthetic_results(res, model, prof, true, [(8, 32), (8, 64), (4, 16)], every=2)
    out = tmp_path / "new.yaml"
    r = refit(str(res), str(prof), str(out))
    assert set(true) <= set(r.params)
    assert r.after["overlap_efficiency"] == pytest.approx(0.8, abs=0.02)
    assert r.after["collective_overhead_s"] == pytest.approx(3e-4, rel=0.05)
    assert r.before["overlap_efficiency"] == 0.2 and r.mape_loo < 1.0 < r.mape_before
    new = load_profile(str(out))
    assert new.overlap_efficiency == 0.2  # the measured value stays; the correction overrides it
    assert new.corrections.overlap_efficiency == pytest.approx(0.8, abs=0.02) and new.overlap == new.corrections.overlap_efficiency


def test_a_correction_pressed_against_its_bound_is_the_bound(tmp_path, write_profile, model_yaml):
    """Runs made with no overlap at all: the fit presses overlap_efficiency against 0, where the solver stops a
    hair inside (4.5e-26 in a calibration of 2026-12-06); the profile says 0, not a number nobody can read."""
    from conftest import profile_dict

    d = profile_dict(name="ovl0", gpus_per_node=8, intra_groups=((2, 1, 20), (4, 1, 20), (8, 1, 20)))
    d["network"]["overlap_efficiency"] = {"value": 0.5, "source": "test"}
    prof = write_profile(raw=d, name="ovl0")
    model = model_yaml(name="mid0", n_layers=4, hidden=1024, n_heads=16, vocab=4096, seq_len=512)
    res = tmp_path / "r.csv"
    synthetic_results(res, model, prof, {"overlap_efficiency": 0.0, "collective_overhead_s": 3e-4},
                      [(8, 32), (8, 64), (4, 16)], every=2)
    r = refit(str(res), str(prof), str(tmp_path / "new.yaml"), params=["overlap_efficiency", "collective_overhead_s"])
    assert r.after["overlap_efficiency"] == 0.0
    assert r.after["collective_overhead_s"] == pytest.approx(3e-4, rel=0.05)


def test_an_unset_overlap_correction_is_not_written_and_a_bad_one_is_refused(setup, write_profile, capsys):
    tmp, model, prof = setup
    res = tmp / "results.csv"
    synthetic_results(res, model, prof, {"gemm_scale": 0.5}, [(8, 32)], every=2)
    out = tmp / "new.yaml"
    refit(str(res), str(prof), str(out), params=["gemm_scale"])
    assert "overlap_efficiency" not in yaml.safe_load(out.read_text())["corrections"]
    assert load_profile(str(out)).corrections.overlap_efficiency is None
    d = yaml.safe_load(out.read_text())
    d["corrections"]["overlap_efficiency"] = 1.5
    bad = write_profile(raw=d, name="bad-overlap")
    with pytest.raises(SystemExit) as e:
        main(["rank", "-m", str(model), "-p", str(bad), "-g", "4", "-b", "16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "corrections.overlap_efficiency" in err and "between 0 and 1" in err
