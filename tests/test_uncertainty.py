"""Honest uncertainty: rank and explain state the expected error of a time for its regime, from the stored
leave-one-dataset-out residuals of benchmarks/published_fidelity.py (GPU) or the profile's own leave-one-out
error (CPU); rank marks what is within it of the best as tied; validate runs the tied set by default."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from axoplan.cli.main import main
from axoplan.planner import uncertainty as U
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import ranking


def test_the_stored_residuals_name_their_commit_and_cover_the_regimes():
    doc = json.loads(U.DATA.read_text())
    assert len(doc["commit"]) >= 7 and "published_fidelity.py --write-uncertainty" in doc["source"]
    cells = {(r["family"], r["scale"]) for r in doc["regimes"]}
    assert {("all", "all"), ("fsdp", "all"), ("megatron", "all")} <= cells
    for r in doc["regimes"]:  # the mean over datasets, each counted once
        assert r["expected_error"] == pytest.approx(np.mean(list(r["per_dataset"].values())), abs=1e-4)


def test_regimes_by_family_and_scale_with_fallbacks():
    gpu = load_profile("perlmutter")
    fs = U.expected_error(gpu, "llm-foundry", 32)
    assert "fsdp executions on <=64 GPUs" in fs.regime and fs.expected_error > 0
    mg = U.expected_error(gpu, "megatron-core", 100000)  # held-out AxoNN runs that large: their larger error
    assert mg.expected_error == pytest.approx(0.23) and "held outside the repository" in mg.regime
    assert re.search(r"than the \d+% of megatron executions on >512 GPUs", mg.regime)  # two datasets there
    wide = U.expected_error(gpu, "llm-foundry", 100000)  # no FSDP run published that large: the family's own
    assert "fsdp executions; none published on >512 GPUs" in wide.regime and wide.expected_error > 0
    bundled = U.expected_error(gpu, "axoplan", 64)  # no published run of the bundled trainer: pooled, held-out mean
    assert bundled.expected_error == pytest.approx((0.22 + 0.305) / 2) and "every framework" in bundled.regime


def test_held_out_evidence_is_the_regimes_error_where_larger():
    """The model misses more on runs it never saw (shared/reference/gpu-gaps.md): that error, not the smaller one
    of the runs it was shown, is what a prediction in such a regime carries; a regime without held-out runs keeps
    its own."""
    gpu = load_profile("dgx-a100")
    tp = U.expected_error(gpu, "megatron-lm", 64)
    assert tp.expected_error == pytest.approx((0.22 + 0.305) / 2) and "GPT-5.9B" in tp.regime
    fs = U.expected_error(gpu, "llm-foundry", 64)
    assert fs.expected_error < 0.1 and "held outside" not in fs.regime
    cpu = U.expected_error(load_profile("localhost-cpu"), "axoplan", 4)
    assert cpu.expected_error == pytest.approx(0.082) and "leave-one-out" in cpu.regime


def test_tied_is_within_the_error_of_the_best_and_feasible():
    t = np.array([1.0, 1.04, 1.06, 0.5, 1.2])
    ok = np.array([True, True, True, False, True])
    assert list(U.tied(t, ok, 0.05)) == [True, True, False, False, False]
    assert list(U.tied(t, ok, None)) == [True, False, False, False, False]


def test_rank_carries_tied_and_expected_error_and_validate_runs_the_tied_set(tmp_path, capsys):
    r = ranking("gpt-tiny", "localhost-cpu", 4, 16)
    df = r.frame()
    assert list(df.columns[-2:]) == ["tied", "expected_error"]
    assert df["expected_error"].iloc[0] == pytest.approx(0.082) and bool(df["tied"].iloc[0])
    best = df["batch_time_s"].iloc[0]
    assert (df["tied"] == (df["batch_time_s"] <= best * 1.082 * (1 + 1e-12))).all()
    with pytest.raises(SystemExit) as e:
        main(["validate", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4", "--global-batch", "16",
              "--slurm", "--out", str(tmp_path / "s")])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("validating 3 grid(s)/order(s): the best, the ")
    assert len(list((tmp_path / "s" / "runs").iterdir())) == 3
    with pytest.raises(SystemExit):
        main(["rank", "--model", "gpt-20b", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "512"])
    assert "expected error of these times: +/-" in capsys.readouterr().out
