"""`axoplan validate`: scoring on synthetic results with known answers, failure and timeout recording
with real subprocesses, resume after an interruption, the Slurm array and --collect, and one small
real end-to-end run of the trainer."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from axoplan.loop import validate as V
from axoplan.cli.main import main
from axoplan.errors import UserError


def synthetic(pred, meas, status=None):
    n = len(pred)
    return pd.DataFrame({"candidate": [f"c{i + 1}" for i in range(n)], "rank": np.arange(1, n + 1),
                         "batch_time_s": pred, "measured_time_s": meas,
                         "status": status or ["ok"] * n})


def test_score_known_tau_regret_and_error():
    # one discordant pair of ten: tau = (9 - 1) / 10; the measured best is predicted second
    s = V.score(synthetic([1.0, 2.0, 3.0, 4.0, 5.0], [1.1, 1.0, 3.3, 4.4, 5.5]))
    assert s["kendall_tau"] == pytest.approx(0.8)
    assert s["spearman_rho"] == pytest.approx(1 - 6 * 2 / (5 * 24))  # one adjacent swap
    assert s["measured_best"] == "c2" and s["measured_best_predicted_position"] == 2
    assert not s["best_in_top1"] and s["best_in_top3"]
    assert s["regret"] == pytest.approx(0.1)
    assert s["mean_abs_pct_error"] == pytest.approx(100 * (4 * 0.1 / 1.1 + 1.0) / 5)
    assert s["max_abs_pct_error"] == pytest.approx(100.0)


def test_score_perfect_and_reversed_and_failed_runs():
    s = V.score(synthetic([1.0, 2.0, 3.0], [2.0, 4.0, 6.0]))
    assert s["kendall_tau"] == pytest.approx(1.0) and s["regret"] == 0 and s["best_in_top1"]
    assert s["mean_abs_pct_error"] == pytest.approx(50.0)
    s = V.score(synthetic([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]))
    assert s["kendall_tau"] == pytest.approx(-1.0) and s["regret"] == pytest.approx(3.0)
    assert not s["best_in_top3"] and s["measured_best_predicted_position"] == 4
    # failed runs are counted and left out of the scores; the predicted best failing is said
    s = V.score(synthetic([1.0, 2.0, 3.0, 4.0], [np.nan, 3.0, 2.0, np.nan], ["oom", "ok", "ok", "timeout"]))
    assert s["ok"] == 2 and s["status_counts"] == {"ok": 2, "oom": 1, "failed": 0, "timeout": 1}
    assert s["predicted_best"] == "c2" and s["regret"] == pytest.approx(0.5) and "c1" in s["note"]
    assert V.score(synthetic([1.0], [np.nan], ["failed"]))["ok"] == 0


def test_parse_log_statuses():
    ok = V.parse_log('noise\n{"step": 0}\n{"summary": true, "median_batch_time_s": 0.25}\n')
    assert ok.status == "ok" and ok.measured_time_s == 0.25
    assert V.parse_log("RuntimeError: CUDA out of memory. Tried to allocate 2 GiB").status == "oom"
    f = V.parse_log("Traceback...\nerror: config cannot run model 'x': hidden 64 is not divisible by gx=3\nmore\n")
    assert f.status == "failed" and f.error.startswith("error: config cannot run")
    assert V.parse_log("slurmstepd: *** JOB 12 CANCELLED DUE TO TIME LIMIT ***").status == "timeout"


# ---- sweeps with stand-in launchers: real subprocesses, no torch ------------------------------------------
def fake_launcher(behaviour):
    """launcher(run_dir, gpus) -> a bash command per candidate index (c01 -> behaviour[0], ...)."""

    def launcher(run_dir: Path, gpus: int):
        i = int(run_dir.name[1:3]) - 1
        return ["bash", "-c", behaviour[i]], {}

    return launcher


def summary_cmd(t):
    return f"echo '{{\"summary\": true, \"median_batch_time_s\": {t}}}'"


def sweep(pm_path, top_k=4, timeout_s=60.0):
    return V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=top_k, steps=4,
                   warmup_steps=1, timeout_s=timeout_s)


def test_failures_and_hangs_are_recorded_and_the_sweep_goes_on(tmp_path, pm_path):
    pidfile = tmp_path / "grandchild.pid"
    hang = f"setsid sleep 300 & echo $! > '{pidfile}'; sleep 300"  # a grandchild in its own session, like torchrun's workers
    behaviour = ["echo 'error: boom happened' >&2; exit 3", hang,
                 "echo 'RuntimeError: CUDA out of memory. Tried to allocate' >&2; exit 1", summary_cmd(0.5)]
    out = tmp_path / "sw"
    lines = []
    t0 = time.monotonic()
    s = V.run_sweep(sweep(pm_path, timeout_s=3.0), out, echo=lines.append, launcher=fake_launcher(behaviour))
    assert time.monotonic() - t0 < 60
    res = V.read_results(out / "results.csv")
    assert list(res["status"]) == ["failed", "timeout", "oom", "ok"]
    assert res["error"][0] == "error: boom happened"
    assert "killed" in res["error"][1]
    assert res["measured_time_s"][3] == 0.5 and np.isnan(res["measured_time_s"][0])
    pid = int(pidfile.read_text())
    for _ in range(50):  # the hung run's whole process tree is gone
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("the hung candidate's grandchild survived the timeout")
    assert s["ok"] == 1 and json.loads((out / "summary.json").read_text())["ok"] == 1
    assert (out / "ranking.png").stat().st_size > 1000
    assert set(res.columns) >= {"gx", "gy", "gz", "gdata", "order", "batch_time_s", "measured_time_s", "status", "error"}


def test_resume_after_an_interruption(tmp_path, pm_path):
    out = tmp_path / "sw"
    calls = []

    def interrupted(run_dir, gpus, timeout_s, launcher):
        calls.append(run_dir.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return V.run_one(run_dir, gpus, timeout_s, launcher)

    behaviour = [summary_cmd(t) for t in (1.0, 2.0, 3.0, 4.0)]
    with pytest.raises(KeyboardInterrupt):
        V.run_sweep(sweep(pm_path), out, echo=lambda s: None, launcher=fake_launcher(behaviour), runner=interrupted)
    assert len(V.read_results(out / "results.csv")) == 2
    # a crash in the middle of writing a line leaves half a record: it is dropped, never merged
    with open(out / "results.csv", "a") as f:
        f.write("c03-half,gpt-tiny,")
    with pytest.raises(UserError, match="--resume"):
        V.run_sweep(sweep(pm_path), out, echo=lambda s: None, launcher=fake_launcher(behaviour))
    with pytest.raises(UserError, match="other arguments"):
        V.run_sweep(sweep(pm_path, top_k=3), out, resume=True, echo=lambda s: None, launcher=fake_launcher(behaviour))
    calls.clear()

    def counting(run_dir, gpus, timeout_s, launcher):
        calls.append(run_dir.name)
        return V.run_one(run_dir, gpus, timeout_s, launcher)

    s = V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=fake_launcher(behaviour),
                    runner=counting)
    assert [c[:3] for c in calls] == ["c03", "c04"]
    res = V.read_results(out / "results.csv")
    assert [c[:3] for c in res["candidate"]] == ["c01", "c02", "c03", "c04"]
    assert list(res["measured_time_s"]) == [1.0, 2.0, 3.0, 4.0] and s["ok"] == 4


def test_repeats_run_in_passes_take_the_median_and_resume(tmp_path, pm_path):
    """Three passes, round robin: every candidate once before any twice; a candidate that failed in
    the first pass is not run again; each candidate's time is the median of its runs; an interruption
    in the second pass resumes at the run it stopped at."""
    out = tmp_path / "sw"
    times = {"c01": [1.0, 1.4, 1.1], "c03": [3.0, 2.0, 3.3], "c04": [4.0, 4.0, 4.4]}
    calls = []
    interrupt = [True]

    def runner(run_dir, gpus, timeout_s, launcher):
        c = run_dir.name[:3]
        calls.append(c)
        if len(calls) == 6 and interrupt and interrupt.pop():
            raise KeyboardInterrupt
        if c == "c02":
            return V.RunResult(None, "oom", "out of memory", 0.1)
        return V.RunResult(times[c][calls.count(c) - 1], "ok", "", 0.1)

    sw = sweep(pm_path)
    sw.repeats = 3
    with pytest.raises(KeyboardInterrupt):
        V.run_sweep(sw, out, echo=lambda s: None, runner=runner)
    assert calls == ["c01", "c02", "c03", "c04", "c01", "c03"]
    runs = V.read_results(out / "results.csv", per_run=True)
    assert list(zip(runs["candidate"].str[:3], runs["repeat"])) == [("c01", 0), ("c02", 0), ("c03", 0), ("c04", 0),
                                                                      ("c01", 1)]
    calls[:] = ["c01", "c02", "c03", "c04", "c01"]  # what ran before; the counts index the times
    s = V.run_sweep(sw, out, resume=True, echo=lambda s: None, runner=runner)
    assert calls[5:] == ["c03", "c04", "c01", "c03", "c04"]  # c02 (oom) never again
    res = V.read_results(out / "results.csv")
    assert [c[:3] for c in res["candidate"]] == ["c01", "c02", "c03", "c04"]
    assert list(res["measured_time_s"][[0, 2, 3]]) == [1.1, 3.0, 4.0]
    assert list(res["measured_runs"]) == [3, 0, 3, 3] and res["status"][1] == "oom"
    assert res["measured_spread"][0] == pytest.approx(0.4) and s["ok"] == 3
    with pytest.raises(UserError, match="repeats"):
        V.write_slurm_array(sw, tmp_path / "slurm")
    sw.repeats = 0
    with pytest.raises(UserError, match="--repeats must be a positive integer"):
        V.run_sweep(sw, tmp_path / "zero", echo=lambda s: None, runner=runner)


def test_a_sweep_from_before_repeats_resumes(tmp_path, pm_path):
    """results.csv and sweep.json without the repeat column and key: the recorded runs count as the
    first pass, the file is rewritten in today's columns before anything is appended."""
    out = tmp_path / "old"
    done = []

    def runner(run_dir, gpus, timeout_s, launcher):
        done.append(run_dir.name[:3])
        return V.RunResult(float(run_dir.name[2]), "ok", "", 0.1)

    V.run_sweep(sweep(pm_path, top_k=2), out, echo=lambda s: None, runner=runner)
    lines = (out / "results.csv").read_text().splitlines()
    cut = lines[0].split(",").index("repeat")
    (out / "results.csv").write_text("\n".join(",".join(line.split(",")[:cut]) for line in lines[:2]) + "\n")
    sj = json.loads((out / "sweep.json").read_text())
    del sj["repeats"]
    (out / "sweep.json").write_text(json.dumps(sj))
    done.clear()
    V.run_sweep(sweep(pm_path, top_k=2), out, resume=True, echo=lambda s: None, runner=runner)
    assert done == ["c02"]
    assert (out / "results.csv").read_text().splitlines()[0].endswith(",repeat")
    assert list(V.read_results(out / "results.csv")["measured_time_s"]) == [1.0, 2.0]


def test_pipeline_options_choose_the_candidates_and_a_resume_must_keep_them(tmp_path, pm_path, capsys):
    """--pp/--vpp/--schedule restrict the candidates as they restrict rank; sweep.json keeps them, so a
    resume with others is refused; a sweep.json from before them reads as rank's defaults."""
    base = ["validate", "--model", "gpt-tiny", "--machine", str(pm_path), "--gpus", "4", "--global-batch", "8",
            "--all", "--slurm"]
    plans = {}
    for pp in ("1", "2", "all"):
        with pytest.raises(SystemExit) as e:
            main([*base, "--pp", pp, "--out", str(tmp_path / f"pp{pp}")])
        assert e.value.code == 0, capsys.readouterr().err
        plans[pp] = pd.read_csv(tmp_path / f"pp{pp}" / "plan.csv")
    assert set(plans["1"]["pp"]) == {1} and set(plans["2"]["pp"]) == {2}
    assert all(c.split("-")[1] == "pp2" for c in plans["2"]["candidate"])
    assert len(plans["all"]) == len(plans["1"]) + len(plans["2"])  # gpt-tiny's 2 blocks: at most 2 stages
    sj = json.loads((tmp_path / "pp2" / "sweep.json").read_text())
    assert (sj["pp"], sj["vpp"], sj["schedule"]) == (2, None, "all")
    sw = V.read_sweep_json(tmp_path / "pp2" / "sweep.json", V.Sweep)
    (tmp_path / "pp2" / "results.csv").write_text("x\n")  # a sweep under way
    with pytest.raises(UserError, match="other arguments.*pp"):
        V.run_sweep(V.Sweep(**{**sj, "pp": 1}), tmp_path / "pp2", resume=True, echo=lambda s: None)
    assert sw.pp == 2
    for key in ("pp", "vpp", "schedule"):
        del sj[key]
    (tmp_path / "old.json").write_text(json.dumps(sj))
    old = V.read_sweep_json(tmp_path / "old.json", V.Sweep)
    assert (old.pp, old.vpp, old.schedule) == ("all", None, "all")
    (tmp_path / "bad.json").write_text(json.dumps({**sj, "pp": "two"}))
    with pytest.raises(UserError, match="pp must be"):
        V.read_sweep_json(tmp_path / "bad.json", V.Sweep)


def test_slurm_array_and_collect(tmp_path, pm_path):
    out = tmp_path / "slurm sweep"
    path = V.write_slurm_array(sweep(pm_path, top_k=3), out)
    text = path.read_text()
    assert "#SBATCH --array=0-2" in text and "#SBATCH --nodes=1" in text and "#SBATCH --ntasks=4" in text
    assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-s", "bash", str(path)], check=False, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 3 and all((r / "config.yaml").exists() for r in runs)
    (runs[0] / "run.log").write_text('{"summary": true, "median_batch_time_s": 0.3}\n')
    (out / "runs" / "slurm-77_1.out").write_text("slurmstepd: *** JOB 78 CANCELLED DUE TO TIME LIMIT ***\n")
    s = V.collect(out, echo=lambda s: None)
    res = V.read_results(out / "results.csv")
    assert list(res["status"]) == ["ok", "timeout", "infra"] and "no run log" in res["error"][2]
    assert s["ok"] == 1


# ---- one real run of the trainer, through the CLI -----------------------------------------------------
def test_validate_end_to_end_with_the_trainer(tmp_path, pm_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "e2e"
    with pytest.raises(SystemExit) as e:
        main(["validate", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "2", "-b", "4", "--top-k", "2", "--steps", "3",
              "--warmup", "1", "--timeout", "240", "--checkpointing", "off", "--out", str(out)])
    text = capsys.readouterr()
    assert e.value.code == 0, text.err
    res = V.read_results(out / "results.csv")
    assert list(res["status"]) == ["ok", "ok"], res["error"].tolist()
    assert (res["measured_time_s"] > 0).all()
    summ = json.loads((out / "summary.json").read_text())
    assert summ["ok"] == 2 and summ["kendall_tau"] in (-1.0, 1.0)
    log = (out / "runs" / res["candidate"][0] / "run.log").read_text()
    assert '"summary": true' in log
    assert "Kendall tau" in text.out


def test_repeats_flag_reaches_the_sweep_and_bad_values_are_one_sentence(tmp_path, pm_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["validate", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "4", "-b", "8", "--repeats", "0",
              "--out", str(tmp_path / "z")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--repeats must be a positive integer" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["validate", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "4", "-b", "8", "--repeats", "2", "--slurm",
              "--out", str(tmp_path / "s")])
    assert e.value.code == 2 and "Slurm array runs each candidate once" in capsys.readouterr().err
