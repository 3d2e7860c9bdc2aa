"""Issue 27, hangs and unbounded reads: every file axoplan reads is checked to be a regular file of
bounded size (a FIFO in its place would block, a link to /dev/zero never ends); the data-size message
counts the bytes the files hold."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import one_sentence, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan.errors import UserError

SUMMARY = "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"


def _plant(path, kind):
    """A FIFO, a link to /dev/zero, or a folder where a file is read."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()


KINDS = ["fifo", "zero", "folder"]


def _slurm_sweep(tmp_path, pm_path):
    from axoplan.loop import validate as V

    sw = V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=2, steps=4, warmup_steps=1,
                 timeout_s=60.0)
    out = tmp_path / "sw"
    V.write_slurm_array(sw, out)
    return sw, out, sorted((out / "runs").iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_collect_with_a_planted_run_log_finishes(tmp_path, pm_path, kind):
    _, out, runs = _slurm_sweep(tmp_path, pm_path)
    _plant(runs[0] / "run.log", kind)
    (runs[1] / "run.log").write_text(SUMMARY.split("'")[1] + "\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "axoplan.cli", "validate", "--collect", str(out)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert time.monotonic() - t0 < 120
    one_sentence(r.returncode, r.stderr)
    assert "not a regular file" in r.stderr


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_resume_replaces_a_planted_run_log(tmp_path, pm_path, kind):
    from axoplan.loop import validate as V

    sw, out, runs = _slurm_sweep(tmp_path, pm_path)
    for r in runs:
        _plant(r / "run.log", kind)
    said = []
    s = V.run_sweep(sw, out, resume=True, echo=said.append, launcher=lambda d, g: (["bash", "-c", SUMMARY], {}))
    assert s["ok"] == 2 and all((r / "run.log").is_file() and not (r / "run.log").is_symlink() for r in runs)


def _readers(tmp_path):
    """Every reader of a file a user can replace, as (file it reads, call)."""
    from calib_synthetic import write

    from axoplan.calibrate.results_io import ResultsDir
    from axoplan.loop.validate_files import read_plan, read_results
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import load_model
    from axoplan.runconfig import load_config
    from axoplan.runtime.data import open_source
    from axoplan.tables import read_rows

    rd = write(tmp_path / "cal")
    return {
        "profile": (tmp_path / "p.yaml", lambda p: load_profile(str(p))),
        "model": (tmp_path / "m.yaml", lambda p: load_model(str(p))),
        "run config": (tmp_path / "c.yaml", lambda p: load_config(str(p))),
        "results": (tmp_path / "results.csv", lambda p: read_results(p)),
        "plan": (tmp_path / "plan.csv", lambda p: read_plan(p)),
        "table": (tmp_path / "t.csv", lambda p: read_rows(p, {"a"})),
        "training data": (tmp_path / "data.txt", lambda p: open_source(str(p), 0, 8)),
        "calibration results": (rd.path / "gemm.csv", lambda p: ResultsDir(p.parent).rows("gemm")),
    }


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["profile", "model", "run config", "results", "plan", "table", "training data",
                              "calibration results"]),
       kind=st.sampled_from(KINDS))
def test_every_reader_refuses_what_is_not_a_regular_file_at_once(tmp_path, which, kind):
    import signal

    from axoplan.calibrate.results_io import ResultsError

    path, read = _readers(tmp_path)[which]
    path.parent.mkdir(parents=True, exist_ok=True)
    _plant(path, kind)

    def hang(*_):
        raise TimeoutError(f"reading a {kind} as the {which} did not return")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    try:
        with pytest.raises((UserError, ResultsError)):
            read(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()


@pytest.mark.parametrize("content, n", [(b"", 0), (b"x", 1), (b"abc", 3)])
def test_the_data_size_message_counts_the_bytes_the_files_hold(tmp_path, content, n):
    from axoplan.runtime.data import open_source

    p = tmp_path / "d.txt"
    p.write_bytes(content)
    with pytest.raises(UserError) as e:
        open_source(str(p), 0, 65)
    assert f"holds {n} byte{'' if n == 1 else 's'} of text" in str(e.value) and "65" in str(e.value)


def test_train_with_a_fifo_as_its_data_is_one_sentence(tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    os.mkfifo(tmp_path / "data")
    (tmp_path / "c.yaml").write_text(f"model: gpt-tiny\ndata: {tmp_path / 'data'}\nmetrics: null\n")
    code, _, err = run_cli(["train", "--config", str(tmp_path / "c.yaml")], capsys)
    one_sentence(code, err)
