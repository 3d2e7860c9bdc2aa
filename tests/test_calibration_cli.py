"""`axoplan calibrate` error paths (one sentence, exit 2) and the Slurm script."""
import shutil
import subprocess

import pytest

from axoplan.cli import main

from calib_synthetic import write


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
    assert "calibration.worker" in text and "--from-results" in text and "--quick" in text
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_parts_need_the_ranks_of_the_earlier_run(capsys, tmp_path):
    write(tmp_path / "r")  # 4 ranks per node
    code, _, err = run(capsys, "--out", str(tmp_path / "p.yaml"), "--parts", "trainer", "--results", str(tmp_path / "r"),
                       "--nproc", "2")
    assert code == 2 and "differs from the 4 ranks" in err and err.count("\n") == 1
