"""Issue 16 §2: one way to write outputs. Regular files are replaced atomically and keep their mode;
devices, FIFOs and symlink targets are written in place; an output that cannot be written is one
sentence and exit 2, with nothing half-written; two writers of one run folder never mix files."""
from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import time

import pytest
from conftest import one_sentence, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan import atomic
from axoplan.atomic import (
    OutputError,
    atomic_write_bytes,
    atomic_write_text,
    folder_lock,
    write_files,
)
from axoplan.cli.main import main

RANK = ["rank", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4",
        "--format", "csv"]



@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2000), mode=st.integers(0o400, 0o777))
def test_a_replaced_file_keeps_its_mode_and_gets_all_the_bytes(tmp_path, data, mode):
    p = tmp_path / "out.bin"
    p.write_bytes(b"old")
    os.chmod(p, mode | 0o200)
    atomic_write_bytes(p, data)
    assert p.read_bytes() == data and stat.S_IMODE(p.stat().st_mode) == mode | 0o200
    assert [q.name for q in tmp_path.iterdir()] == ["out.bin"]  # no temporary left behind


def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path):
    p = atomic_write_text(tmp_path / "new.txt", "x")
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~atomic._umask()


def test_dev_null_stays_a_device(capsys):
    code, _, err = run_cli(RANK + ["--output", os.devnull], capsys)
    assert code == 0, err
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_a_fifo_is_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []

    def read():
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read)
    reader.start()
    atomic_write_text(fifo, "through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_symlink_stays_a_link_and_its_target_is_replaced(tmp_path):
    target = tmp_path / "real.txt"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(OutputError, match="is a folder"):
        atomic_write_text(tmp_path, "x")


@pytest.mark.parametrize("argv", [
    RANK + ["--output", "{f}/x.csv"],
    ["emit", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4", "--out", "{f}/run"],
    ["scale", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2,4", "--global-batch", "8",
     "--output", "{f}/s.txt"],
    ["memorization", "--model", "gpt-tiny", "--out", "{f}/mem", "--repeats", "1"],
    ["scale", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2,4", "--global-batch", "8",
     "--plot", "{f}/p.png"],
    ["explain", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4",
     "--grid", "1,1,1,2", "--output", "{f}/e.txt"],
])
def test_an_output_under_a_file_is_one_sentence(tmp_path, capsys, argv):
    f = tmp_path / "afile"
    f.write_text("keep me")
    code, out, err = run_cli([a.replace("{f}", str(f)) for a in argv], capsys)
    one_sentence(code, err)
    assert f.read_text() == "keep me" and out == ""  # refused before any result was printed


def test_a_file_system_error_no_command_worded_is_still_one_sentence(capsys, monkeypatch):
    import axoplan.cli.plan

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "/some/where")

    monkeypatch.setattr(axoplan.cli.plan, "rank_api", denied)
    code, _, err = run_cli(RANK, capsys)
    one_sentence(code, err)
    assert "/some/where" in err


def test_refit_output_under_a_file_is_refused_before_the_fit(tmp_path, capsys):
    from test_reliability_inputs import results_csv

    res = results_csv(tmp_path)
    f = tmp_path / "afile"
    f.write_text("")
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", "localhost-cpu", "--out", f"{f}/n.yaml"],
                           capsys)
    one_sentence(code, err)


def test_train_metrics_that_cannot_be_written_are_refused_before_training(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    (tmp_path / "c.yaml").write_text("model: gpt-tiny\nmetrics: afile/m.jsonl\nsteps: 1\ntiming_warmup_steps: 0\n")
    code, _, err = run_cli(["train", "--config", "c.yaml"], capsys)
    one_sentence(code, err)
    assert "metrics" in err


@pytest.mark.parametrize("where", ["mkstemp", "replace"])
def test_a_read_only_file_system_is_one_sentence_and_the_old_file_is_intact(tmp_path, capsys, monkeypatch, where):
    out = tmp_path / "ranking.csv"
    out.write_text("previous ranking")

    def erofs(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile if where == "mkstemp" else os, where if where == "mkstemp" else "replace", erofs)
    code, _, err = run_cli(RANK + ["--output", str(out)], capsys)
    one_sentence(code, err)
    assert "read-only file system" in err
    assert out.read_text() == "previous ranking" and [p.name for p in tmp_path.iterdir()] == ["ranking.csv"]


def test_a_run_folder_is_written_all_or_nothing(tmp_path, monkeypatch):
    d = tmp_path / "run"
    write_files(d, {"a": ("old a", None), "b": ("old b", None), "c": ("old c", None)})
    real = atomic._write_temp
    calls = []

    def fail_third(target, data, mode):
        calls.append(target)
        if len(calls) == 3:
            raise OutputError("cannot write: disk full")
        return real(target, data, mode)

    monkeypatch.setattr(atomic, "_write_temp", fail_third)
    with pytest.raises(OutputError):
        write_files(d, {"a": ("new a", None), "b": ("new b", None), "c": ("new c", None)})
    assert sorted(p.name for p in d.iterdir()) == ["a", "b", "c"]
    assert [(d / n).read_text() for n in "abc"] == ["old a", "old b", "old c"]


def test_two_writers_of_one_run_folder_take_turns(tmp_path):
    d = tmp_path / "run"
    done = threading.Event()
    with folder_lock(d):
        t = threading.Thread(target=lambda: (write_files(d, {"config.yaml": ("second", None)}), done.set()))
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and not (d / "config.yaml").exists()  # waits for the first writer
    t.join(10)
    assert done.is_set() and (d / "config.yaml").read_text() == "second"


def test_emit_writes_its_files_under_the_folder_lock(tmp_path, capsys):
    out = tmp_path / "run"
    finished = threading.Event()

    def emit():
        with pytest.raises(SystemExit):
            main(["emit", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4",
                  "--out", str(out)])
        finished.set()

    with folder_lock(out):
        t = threading.Thread(target=emit)
        t.start()
        time.sleep(1.0)
        assert list(out.iterdir()) == []
    t.join(60)
    assert finished.is_set()
    # the four files, and the profile with its measured tables copied in (the folder can move)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["README.txt", "config.yaml", "launch_slurm.sbatch", "launch_torchrun.sh", "machine.yaml",
         "machine_localhost-cpu_gemm.csv", "machine_localhost-cpu_attention.csv",
         "machine_localhost-cpu_collectives.csv"])


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")
def test_a_read_only_file_is_not_replaced(tmp_path):
    p = tmp_path / "keep.txt"
    p.write_text("mine")
    os.chmod(p, 0o444)
    with pytest.raises(OutputError, match="read-only"):
        atomic_write_text(p, "other")
    assert p.read_text() == "mine"


def test_an_emit_folder_that_is_a_file_is_one_sentence(tmp_path):
    from axoplan.atomic import ensure_dir

    (tmp_path / "f").write_text("")
    with pytest.raises(OutputError, match="a file of that name exists"):
        ensure_dir(tmp_path / "f")


def test_dev_stdout_redirected_to_a_file_appends_through_the_stream(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "o.txt"
    out.write_text("first\n")
    with open(out, "a") as f:
        subprocess.run([sys.executable, "-c", ("from axoplan.atomic import atomic_write_text as w; "
                        "w('/dev/stdout', 'second\\n')")], stdout=f, check=True)
    assert out.read_text() == "first\nsecond\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_full_device_is_one_sentence(capsys):
    code, _, err = run_cli(RANK + ["--output", "/dev/full"], capsys)
    one_sentence(code, err)
    assert "no space left" in err and stat.S_ISCHR(os.stat("/dev/full").st_mode)
