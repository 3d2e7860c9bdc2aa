"""`axoplan calibrate` error paths (one sentence, exit 2) and the Slurm script."""
import json
import shutil
import subprocess

import pytest
from calib_synthetic import write

from axoplan.cli.main import main


def run(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", *args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


@pytest.mark.parametrize("args, msg", [
    ([], "--out is required"),
    (["--out", "x.txt"], "must name a .yaml file"),
    (["--out", "p.yaml", "--nproc", "0"], "--nproc must be at least 1"),
    (["--out", "p.yaml", "--nproc", "1"], "at least 2"),
    (["--out", "p.yaml", "--models", "no-such-model"], "unknown model"),
    (["--out", "p.yaml", "--from-results", "/nonexistent/dir"], "is not a folder"),
    (["--out", "p.yaml", "--emit-slurm", "2"], "needs --nproc"),
    (["--out", "p.yaml", "--emit-slurm", "0", "--nproc", "4"], "--emit-slurm must be at least 1"),
    (["--out", "p.yaml", "--nproc", "99999999999999999999"], "--nproc must be at most"),
    (["--out", "p.yaml", "--emit-slurm", "99999999999999999999", "--nproc", "4"], "--emit-slurm must be at most"),
    (["--out", "p.yaml", "--parts", "gemm,bogus"], "--parts takes a comma-separated list"),
    (["--out", "p.yaml", "--parts", "trainer", "--results", "no-such-dir"], "holds none"),
    (["--out", "p.yaml", "--parts", "trainer", "--from-results", "."], "goes with neither"),
])
def test_user_errors_are_one_sentence_exit_2(capsys, tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *args)
    assert code == 2 and msg in err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_from_results_refuses_an_unfinished_run(capsys, tmp_path):
    rd = write(tmp_path / "r")
    m = rd.meta()
    m["status"] = "running"
    rd.write_meta(m)
    code, _, err = run(capsys, "--out", str(tmp_path / "p.yaml"), "--from-results", str(rd.path))
    assert code == 2 and "did not finish" in err and not (tmp_path / "p.yaml").exists()


def test_from_results_writes_the_profile(capsys, tmp_path):
    rd = write(tmp_path / "r")
    code, out, _ = run(capsys, "--out", str(tmp_path / "p.yaml"), "--from-results", str(rd.path))
    assert code == 0 and (tmp_path / "p.yaml").exists() and (tmp_path / "p_gemm.csv").exists()
    assert "busbw" in out


def test_worker_failure_is_one_sentence(capsys, tmp_path):
    code, _, err = run(capsys, "--out", str(tmp_path / "p.yaml"), "--nproc", "2", "--results", str(tmp_path / "r"),
                       "--worker-arg=--no-such-flag")
    assert code == 2 and "calibration workers failed" in err and "worker.log" in err
    assert err.count("\n") == 1


def test_emit_slurm_script_is_valid_bash(capsys, tmp_path):
    script = tmp_path / "cal.sbatch"
    code, out, _ = run(capsys, "--emit-slurm", "4", "--nproc", "4", "--out", "machine_profiles/cluster.yaml",
                       "--script", str(script), "--quick")
    assert code == 0 and "sbatch" in out
    text = script.read_text()
    assert "#SBATCH --nodes=4" in text and "--nproc-per-node=4" in text and "--rdzv-backend=c10d" in text
    assert "axoplan.calibrate.worker" in text and "--from-results" in text and "--quick" in text
    assert "RESULTS=machine_profiles/cluster_results" in text  # the raw results go beside the profile
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0


def test_parts_need_the_ranks_of_the_earlier_run(capsys, tmp_path):
    write(tmp_path / "r")  # 4 ranks per node
    code, _, err = run(capsys, "--out", str(tmp_path / "p.yaml"), "--parts", "trainer", "--results", str(tmp_path / "r"),
                       "--nproc", "2")
    assert code == 2 and "differs from the 4 ranks" in err and err.count("\n") == 1


def test_the_results_folder_is_beside_the_profile_by_default(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "profiles" / "p_results")  # 4 ranks per node
    code, _, err = run(capsys, "--out", "profiles/p.yaml", "--parts", "trainer", "--nproc", "2")
    assert code == 2 and "differs from the 4 ranks of the earlier run in profiles/p_results" in err


def _fake_cluster(tmp_path, worker_exit: int):
    """A bin folder with srun (runs the 'worker': writes meta.json and attention.csv into the folder after
    --results, or fails) and scontrol/axoplan stand-ins that only record that they ran."""
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = f"""#!/bin/bash
while [ $# -gt 0 ]; do [ "$1" = --results ] && dir="$2"; shift; done
[ {worker_exit} -eq 0 ] || exit {worker_exit}
echo new > "$dir/attention.csv"; echo '{{"status": "complete"}}' > "$dir/meta.json"
"""
    for name, text in (("srun", srun), ("scontrol", "#!/bin/bash\necho node1\n"),
                       ("axoplan", f"#!/bin/bash\necho fitted > {tmp_path}/fitted\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    return bin_dir


@pytest.mark.parametrize("worker_exit", [0, 1])
def test_emit_slurm_replaces_an_earlier_run_only_when_the_new_one_finished(tmp_path, worker_exit):
    """The batch script measures into a staging folder beside the earlier complete run: a failed
    measurement leaves that run untouched; a finished one replaces its files, meta.json last."""
    import os
    import subprocess

    from axoplan.calibrate.slurm import sbatch_script

    results = tmp_path / "results"
    results.mkdir()
    (results / "attention.csv").write_text("old\n")
    (results / "meta.json").write_text('{"status": "complete", "old": true}\n')
    script = tmp_path / "cal.sbatch"
    script.write_text(sbatch_script(2, 4, str(tmp_path / "p.yaml"), str(results), quick=True, models=None))
    env = dict(os.environ, PATH=f"{_fake_cluster(tmp_path, worker_exit)}:{os.environ['PATH']}",
               SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node1", SLURM_NNODES="2")
    r = subprocess.run(["bash", str(script)], check=False, env=env, capture_output=True, text=True, cwd=tmp_path)
    if worker_exit:
        assert r.returncode != 0
        assert (results / "attention.csv").read_text() == "old\n" and '"old"' in (results / "meta.json").read_text()
        assert not (tmp_path / "fitted").exists()
    else:
        assert r.returncode == 0, r.stderr
        assert (results / "attention.csv").read_text() == "new\n" and '"old"' not in (results / "meta.json").read_text()
        assert not (results / ".measuring-slurm-77").exists() and (tmp_path / "fitted").exists()


@pytest.mark.parametrize("omp", [None, "3"])
def test_workers_get_the_trainers_thread_count(tmp_path, monkeypatch, omp):
    """The workers' threads follow the trainer's rule (dist_env.cpu_threads): the node's cores shared by
    the ranks, or the user's OMP_NUM_THREADS."""
    import os

    from axoplan.cli import calibrate as C

    seen = {}

    class Workers:  # a torchrun that finishes at once, keeping the environment it was given
        stdout = iter(())

        def __init__(self, args, env, **kw):
            seen.update(env)

        def wait(self):
            return 0

    monkeypatch.setattr(C.subprocess, "Popen", Workers)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    C._run_workers(2, tmp_path / "r", True, None, "cpu", "axoplan calibrate --test", [])
    assert seen["OMP_NUM_THREADS"] == (omp or str(max(1, (os.cpu_count() or 1) // 2)))


def test_the_busy_warning_counts_other_programs_not_the_workers_own_threads():
    """This VM's quiet 4-rank calibration (2026-12-04): load average 0.42 at the start, 7.34 at the end (the
    workers' gloo and torch threads), other programs 0.05 cores: no warning; 1.2 cores of other work: one."""
    from axoplan.cli.calibrate import busy_warning

    meta = {"cpu_count": 2, "world": 4, "loadavg_start": [0.42, 0.29, 0.17], "loadavg_end": [7.34, 6.21, 3.16]}
    assert busy_warning(meta, 0.05) is None
    w = busy_warning(meta, 1.2)
    assert w.startswith("warning: the machine was busy") and "1.2 of its 2 cores" in w
    # fitting earlier results (nothing measured here): the load before any worker ran decides
    assert busy_warning(meta, None) is None
    assert "load average 3.0 on 2 cores" in busy_warning(dict(meta, loadavg_start=[3.0, 2, 1]), None)
    assert busy_warning(dict(meta, cuda=True), 1.9) is None  # a GPU's rates are not the cores'


def test_other_work_is_the_machines_cpu_less_the_calibrations_own():
    import sys

    from axoplan.cli.calibrate import machine_busy_seconds, other_work_cores, own_cpu_seconds

    assert other_work_cores(100.0, 90.0, 20.0) == 0.5
    assert other_work_cores(80.0, 90.0, 20.0) == 0.0  # clock ticks round: never below zero
    assert other_work_cores(None, 1.0, 20.0) is None
    busy0, own0 = machine_busy_seconds(), own_cpu_seconds()
    subprocess.run([sys.executable, "-c", "sum(range(3 * 10**7))"], check=True)  # a child that ends, as the workers
    busy1, own1 = machine_busy_seconds(), own_cpu_seconds()
    assert own1 - own0 > 0.2  # the child's CPU counts as the calibration's own
    assert busy1 - busy0 >= 0.5 * (own1 - own0)  # and as the machine's (ticks of 10 ms, other cores idle or not)


@pytest.mark.parametrize("wrote", ["complete", "running", "earlier"])
def test_workers_that_fail_only_in_teardown_keep_a_complete_run(tmp_path, monkeypatch, capsys, wrote):
    """gloo once aborted a worker as its groups were destroyed (CI, 2026-12-06: "terminate called without an
    active exception", exit 1) after every measurement was written. A run whose workers marked it complete is
    kept, with a warning; one they left running, or the earlier run's complete meta a --parts run starts
    from, is still a failure, and the log says which part was under way."""
    from axoplan.cli import calibrate as C
    from axoplan.errors import UserError

    res = tmp_path / "r"
    res.mkdir()
    if wrote == "earlier":
        (res / "meta.json").write_text(json.dumps({"status": "complete", "date": "2026-12-01T00:00:00Z"}))

    class Workers:  # a torchrun whose rank 0 writes the meta, then a rank aborts
        def __init__(self, args, env, **kw):
            self.stdout = iter(["AXOPLAN_PROGRESS 1 2 trainer 2x1x1x1 xyz\n", "terminate called without an active exception\n"])
            if wrote != "earlier":
                (res / "meta.json").write_text(json.dumps({"status": wrote, "date": "2026-12-06T18:35:00Z"}))

        def wait(self):
            return 1

    monkeypatch.setattr(C.subprocess, "Popen", Workers)
    if wrote == "complete":
        C._run_workers(2, res, True, None, "cpu", "axoplan calibrate --test", [])
        err = capsys.readouterr().err
        assert "exited with code 1 after finishing every measurement" in err and "results are complete" in err
    else:
        with pytest.raises(UserError, match=r"the calibration workers failed \(exit code 1\)"):
            C._run_workers(2, res, True, None, "cpu", "axoplan calibrate --test", [])
    log = (res / "worker.log").read_text()
    assert "axoplan calibrate: measuring trainer (1 of 2 done)" in log and "terminate called" in log
