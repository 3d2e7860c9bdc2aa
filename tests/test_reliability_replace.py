"""Issue 27, outputs appended where they should be replaced: an output's mode is decided by the file's
type, never by the folder it is in (/dev/shm is an ordinary file system); a command's outputs are
replaced as one set or not at all; an output that cannot be written is refused before the work."""
from __future__ import annotations

import json
import os
import uuid

import pytest
import yaml
from conftest import one_sentence, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st

from axoplan import atomic

RANK = ["rank", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4"]
SHM = "/dev/shm"
needs_shm = pytest.mark.skipif(not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)), reason="needs a writable /dev/shm")


@pytest.fixture
def shm():
    """A fresh folder on /dev/shm (a tmpfs under /dev/), removed afterwards."""
    import shutil

    d = os.path.join(SHM, f"axoplan-test-{uuid.uuid4().hex}")
    os.mkdir(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("path", ["/dev/stdout", "/dev/stderr", "/dev/fd/1", "/proc/self/fd/1", "/proc/self/fd/2"])
def test_names_of_open_streams_are_streams(path):
    assert atomic._is_stream(path)


@settings(max_examples=50, deadline=None)
@given(folder=st.sampled_from(["/dev/shm", "/dev/mqueue", "/dev/hugepages", "/proc/sys/x", "/dev"]),
       name=st.from_regex(r"[a-z][a-z0-9_.-]{0,12}", fullmatch=True))
def test_a_path_that_names_no_open_stream_is_decided_by_its_type(folder, name):
    """Whatever folder a path sits in (its type decides: a regular file is replaced, a device written in
    place), it is a stream only if it names an open file descriptor."""
    if name in ("stdin", "stdout", "stderr", "fd"):
        return
    assert not atomic._is_stream(f"{folder}/{name}")


def test_a_link_to_an_open_stream_is_a_stream(tmp_path):
    link = tmp_path / "out"
    link.symlink_to("/dev/stdout")
    assert atomic._is_stream(link)
    plain = tmp_path / "plain"
    plain.symlink_to(tmp_path / "target")
    assert not atomic._is_stream(plain)


@needs_shm
def test_rank_output_on_dev_shm_twice_has_one_header(shm, capsys):
    out = os.path.join(shm, "x.csv")
    for _ in range(2):
        code, _, err = run_cli(RANK + ["--format", "csv", "-o", out], capsys)
        assert code == 0, err
    lines = open(out).read().splitlines()
    assert sum(line.startswith("rank,") for line in lines) == 1


@needs_shm
def test_emit_on_dev_shm_twice_writes_one_config(shm, capsys):
    out = os.path.join(shm, "run")
    for _ in range(2):
        code, _, err = run_cli(["emit", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4",
                                "--global-batch", "8", "--out", out], capsys)
        assert code == 0, err
    text = open(os.path.join(out, "config.yaml")).read()
    assert text.count("\nmodel:") + text.startswith("model:") == 1
    yaml.safe_load(text)


@needs_shm
def test_scale_plot_on_dev_shm_twice_is_one_png(shm, capsys):
    png = os.path.join(shm, "s.png")
    sizes = []
    for _ in range(2):
        code, _, err = run_cli(["scale", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2,4",
                                "--global-batch", "8", "--plot", png], capsys)
        assert code == 0, err
        sizes.append(os.path.getsize(png))
    assert sizes[0] == sizes[1]


# ---- a command's outputs as one set -----------------------------------------------------------------
MEM_MODEL = dict(name="mem-mini", n_layers=1, hidden=32, n_heads=4, vocab=256, seq_len=64, vocab_multiple=64)
MEM_FILES = ("summary.json", "per_document.csv", "generations.jsonl", "memorization.png")


def test_memorization_outputs_are_replaced_as_one_set(tmp_path, capsys, monkeypatch):
    from axoplan.studies import memorization as M

    model = tmp_path / "mem-mini.yaml"
    model.write_text(yaml.safe_dump(MEM_MODEL))
    docs = tmp_path / "docs"
    docs.mkdir()
    text = b"".join(t for _, t in M.stdlib_texts()[:3])
    (docs / os.fsdecode(b"caf\xe9-latin1.txt")).write_bytes(text)  # a name that is not UTF-8
    out = tmp_path / "out"
    argv = ["memorization", "--model", str(model), "--docs", str(docs), "--n-docs", "2", "--n-heldout", "1",
            "--repeats", "1", "--batch", "2", "--threads", "1", "--out", str(out)]
    kept = {}
    real = M.measure_on_ranks

    def measure_once(job):  # the second run reuses the first one's training
        if "runs" not in kept:
            kept["runs"] = real(job)
        return kept["runs"]

    monkeypatch.setattr(M, "measure_on_ranks", measure_once)
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert "caf\\xe9-latin1.txt" in (out / "per_document.csv").read_text()
    before = {f: (out / f).read_bytes() for f in MEM_FILES}

    # a second run whose last output cannot be made: nothing of the first run's set is replaced
    def broken(summary):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(M, "plot_png", broken)
    with pytest.raises(OSError):
        M.run_study(M.StudySettings(model=str(model), docs=str(docs), n_docs=2, n_heldout=1, repeats=1,
                                    global_batch=2, threads=1, out=str(out)), echo=lambda s: None)
    assert {f: (out / f).read_bytes() for f in MEM_FILES} == before


def test_memorization_refuses_a_learning_rate_adam_cannot_take(tmp_path, capsys):
    code, _, err = run_cli(["memorization", "--model", "gpt-tiny", "--lr", "1e300", "--out", str(tmp_path / "o")],
                           capsys)
    one_sentence(code, err)
    assert "--lr" in err and not (tmp_path / "o").exists()


# ---- refused before the work ------------------------------------------------------------------------
@pytest.fixture
def read_only(monkeypatch, tmp_path):
    """A folder whose file system refuses new files (as a read-only mount does, for root too)."""
    import errno
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and os.path.realpath(dir).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*a, dir=dir, **kw)

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    return ro


def test_dryrun_output_into_a_read_only_folder_is_refused_before_the_trace(read_only, capsys, monkeypatch):
    from axoplan.runtime import dryrun as D

    traced = []
    monkeypatch.setattr(D, "compare", lambda *a, **k: traced.append(1))
    code, _, err = run_cli(["dryrun", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2",
                            "--global-batch", "4", "--grid", "1,1,1,2", "-o", str(read_only / "d.txt")], capsys)
    one_sentence(code, err)
    assert "read-only" in err and not traced


def test_calibrate_out_into_a_read_only_folder_is_refused_before_measuring(read_only, tmp_path, capsys, monkeypatch):
    from axoplan.cli import calibrate as C

    measured = []
    monkeypatch.setattr(C, "_run_workers", lambda *a, **k: measured.append(1) or (1.0, 0.0))
    code, _, err = run_cli(["calibrate", "--nproc", "2", "--parts", "gemm", "--out", str(read_only / "m.yaml"),
                            "--results", str(tmp_path / "res")], capsys)
    one_sentence(code, err)
    assert "read-only" in err and not measured and not (tmp_path / "res").exists()


def test_an_output_too_large_for_the_file_size_limit_is_one_sentence(tmp_path, capsys, monkeypatch):
    """Under `ulimit -f`, a write fails with EFBIG and no file name: still one sentence."""
    import errno

    def too_large(*a, **k):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(atomic.os, "fsync", too_large)
    code, _, err = run_cli(RANK + ["--format", "csv", "-o", str(tmp_path / "x.csv")], capsys)
    one_sentence(code, err)
    assert "too large" in err


def test_calibrate_from_results_under_a_file_size_limit_is_one_sentence(tmp_path):
    import resource
    import subprocess
    import sys

    from calib_synthetic import write

    rd = write(tmp_path / "r")
    limit = 4096  # smaller than the profile (7 KB)

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "axoplan.cli", "calibrate", "--out", str(tmp_path / "p.yaml"),
                        "--from-results", str(rd.path)], preexec_fn=cap, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()), timeout=120)
    one_sentence(r.returncode, r.stderr)
    assert "too large" in r.stderr


def test_calibrate_names_the_results_folder_not_a_deleted_temporary_file(tmp_path, capsys, monkeypatch):
    from calib_synthetic import write

    from axoplan.errors import UserError
    from axoplan.planner import profile_reader as machine

    rd = write(tmp_path / "r")
    seen = []

    def refuse(path):
        seen.append(path)
        raise UserError(f"machine profile '{path}': field 'memory.capacity_gib' must be positive, got 0.0")

    monkeypatch.setattr(machine, "load_profile", refuse)
    code, _, err = run_cli(["calibrate", "--out", str(tmp_path / "p.yaml"), "--from-results", str(rd.path)], capsys)
    one_sentence(code, err)
    assert str(rd.path) in err and os.path.dirname(seen[0]) not in err and "memory.capacity_gib" in err


@needs_shm
def test_validate_sweep_files_on_dev_shm_stay_readable(shm, pm_path):
    from axoplan.loop import validate as V

    sw = V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=1, steps=4, warmup_steps=1,
                 timeout_s=60.0)
    out = os.path.join(shm, "sweep")
    summary = "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"
    for i in range(3):
        V.run_sweep(sw, out, resume=i > 0, echo=lambda s: None, launcher=lambda d, g: (["bash", "-c", summary], {}))
    assert json.load(open(os.path.join(out, "sweep.json")))["gpus"] == 4
    assert len(open(os.path.join(out, "plan.csv")).read().splitlines()) == 2


def test_validate_scores_and_plot_are_replaced_together(tmp_path, pm_path, monkeypatch):
    from axoplan.loop import validate as V

    sw = V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=1, steps=4, warmup_steps=1,
                 timeout_s=60.0)
    out = tmp_path / "sweep"
    summary = "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"
    V.run_sweep(sw, out, echo=lambda s: None, launcher=lambda d, g: (["bash", "-c", summary], {}))
    (out / "summary.json").write_text("{\"old\": true}\n")

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(V, "plot_png", broken)
    with pytest.raises(OSError):
        V.finish(out, echo=lambda s: None)
    assert json.loads((out / "summary.json").read_text()) == {"old": True}


def test_scale_writes_neither_output_when_its_plot_cannot_be_made(tmp_path, capsys, monkeypatch):
    from axoplan.cli import scale as S

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(S, "plot_png", broken)
    out = tmp_path / "s.csv"
    code, _, err = run_cli(["scale", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2,4",
                            "--global-batch", "8", "--format", "csv", "--output", str(out), "--plot",
                            str(tmp_path / "s.png")], capsys)
    assert code != 0 and not out.exists()
