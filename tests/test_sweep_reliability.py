"""Sweeps lose nothing and mix nothing (issue 16, section 3): the sweep's lock and the runs a killed
sweep leaves behind, infrastructure failures told apart from a candidate's own, unreadable sweep
files and bad --timeout values as one sentence, and `calibrate --parts` never harming the complete
run it adds to. Runs are stand-ins (bash, sleep): no torch, no training."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan.loop import validate as V
from axoplan.loop import validate_proc as P
from axoplan.cli.main import main
from axoplan.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def sweep(pm_path, top_k=3, timeout_s=60.0, repeats=1):
    return V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=top_k, steps=4,
                   warmup_steps=1, timeout_s=timeout_s, repeats=repeats)


def summary_cmd(t):
    return f"echo '{{\"summary\": true, \"median_batch_time_s\": {t}}}'"


def launcher_of(behaviour):
    def launcher(run_dir: Path, gpus: int):
        return ["bash", "-c", behaviour[int(run_dir.name[1:3]) - 1]], {}

    return launcher


def alive(pid: int) -> bool:
    return P.proc_start(pid) is not None


def wait_for(cond, timeout=30.0, what="condition"):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_sentence(code, err, *words):
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# ---- the lock, and runs a killed sweep left behind --------------------------------------------------------
SWEEP_SCRIPT = """
import sys
from pathlib import Path
from axoplan.loop import validate as V
sw = V.Sweep(model="gpt-tiny", machine=sys.argv[1], gpus=4, global_batch=8, top_k=3, steps=4, warmup_steps=1,
             timeout_s=120.0)
def launcher(run_dir, gpus):
    # torchrun's workers run in their own sessions: so does this grandchild
    return ["bash", "-c", "setsid sleep 300 & echo $! > grandchild.pid; exec sleep 300"], {}
V.run_sweep(sw, sys.argv[2], echo=print, launcher=launcher)
"""


def test_kill_9_then_a_second_sweep_is_refused_and_resume_ends_the_orphans(tmp_path, pm_path, capsys):
    out = tmp_path / "sw"
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    sub = subprocess.Popen([sys.executable, str(script), str(pm_path), str(out)], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    gpid = out / "runs"
    try:
        wait_for(lambda: any(gpid.glob("*/grandchild.pid")) and next(gpid.glob("*/grandchild.pid")).read_text().strip(),
                 what="the first run to start")
        run_dir = next(gpid.glob("*/grandchild.pid")).parent
        grandchild = int((run_dir / "grandchild.pid").read_text())
        def record():
            try:
                return json.loads((out / "sweep.lock").read_text()).get("runs")
            except ValueError:  # caught between the truncate and the write of an update
                return None

        wait_for(record, what="the lock to record the run")
        rec = json.loads((out / "sweep.lock").read_text())
        assert rec["pid"] == sub.pid and rec["runs"][0]["candidate"] == run_dir.name
        leader = rec["runs"][0]["pgid"]
        assert alive(leader) and alive(grandchild)

        # while the sweep lives, a second one on its folder is refused, in one sentence, touching nothing
        with pytest.raises(UserError, match=f"another axoplan validate \\(pid {sub.pid} .*is running in"):
            V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None)
        code, _, err = cli(capsys, "validate", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "4", "-b", "8",
                           "--top-k", "3", "--steps", "4", "--warmup", "1", "--timeout", "120", "--out", str(out),
                           "--resume")
        one_sentence(code, err, "another axoplan validate", str(out))

        os.kill(sub.pid, signal.SIGKILL)
        sub.wait()
        assert alive(leader) and alive(grandchild)  # what kill -9 leaves: the run goes on, unnoticed

        calls = []

        def runner(run_dir, gpus, timeout_s, launcher):
            # nothing the killed sweep started may still run beside the runs of this one
            assert not alive(leader) and not alive(grandchild)
            calls.append(run_dir.name)
            return V.run_one(run_dir, gpus, timeout_s, launcher)

        lines = []
        s = V.run_sweep(sweep(pm_path, timeout_s=120.0), out, resume=True, echo=lines.append, runner=runner,
                        launcher=launcher_of([summary_cmd(t) for t in (1.0, 2.0, 3.0)]))
        assert any(line.startswith("ending ") and str(grandchild) in line for line in lines), lines
        assert len(calls) == 3 and s["ok"] == 3
        log = (run_dir / "run.log").read_text()
        assert log.count('"summary": true') == 1  # one run's output, not two runs mixed
        assert json.loads((out / "sweep.lock").read_text())["runs"] == []
    finally:
        if sub.poll() is None:
            sub.kill()
        for p in out.glob("runs/*/grandchild.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass


def test_a_stale_or_unreadable_lock_is_taken_over(tmp_path, pm_path):
    out = tmp_path / "sw"
    out.mkdir()
    # a dead sweep's record: a pid that is not running (or is another process by now: its start time differs)
    here = {"pid": 999999, "start": "1", "host": os.uname().nodename, "boot": P._boot_id()}
    (out / "sweep.lock").write_text(json.dumps(dict(here, runs=[{"pgid": os.getpid(), "start": "1",
                                                                  "candidate": "c01"}])))
    s = V.run_sweep(sweep(pm_path, top_k=1), out, echo=lambda s: None, launcher=launcher_of([summary_cmd(1.0)]))
    assert s["ok"] == 1  # this test's own process (whose pid the record names) was left alone
    # a recorded run group still alive (same pid and start time) that this folder's sweep started (it
    # carries the folder's marker) is ended; one without the marker is not (issue 27: a forged lock)
    orphan = subprocess.Popen(["sleep", "300"], start_new_session=True,
                              env=dict(os.environ, **{P.MARKER: str(out.resolve())}))
    try:
        (out / "sweep.lock").write_text(json.dumps(dict(here, runs=[{"pgid": orphan.pid,
                                                                      "start": P.proc_start(orphan.pid)}])))
        lines = []
        V.run_sweep(sweep(pm_path, top_k=1), out, resume=True, echo=lines.append)
        assert orphan.wait(timeout=5) == -signal.SIGTERM and any(str(orphan.pid) in line for line in lines)
    finally:
        orphan.kill()
    (out / "sweep.lock").write_bytes(b"\xff\x00garbage")
    s = V.run_sweep(sweep(pm_path, top_k=1), out, resume=True, echo=lambda s: None,
                    launcher=launcher_of([summary_cmd(1.0)]))
    assert s["ok"] == 1


def test_without_flock_the_recorded_holder_decides(tmp_path, pm_path, monkeypatch):
    """A file system without flock: a record naming a live process refuses, a dead one is taken over."""
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    from types import SimpleNamespace

    monkeypatch.setattr(P, "fcntl", SimpleNamespace(flock=no_flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    out = tmp_path / "sw"
    good = launcher_of([summary_cmd(1.0)])
    V.run_sweep(sweep(pm_path, top_k=1), out, echo=lambda s: None, launcher=good)
    holder = subprocess.Popen(["sleep", "300"])
    try:
        rec = {"pid": holder.pid, "start": P.proc_start(holder.pid), "host": os.uname().nodename,
               "boot": P._boot_id(), "runs": []}
        (out / "sweep.lock").write_text(json.dumps(rec))
        with pytest.raises(UserError, match=f"pid {holder.pid}"):
            V.run_sweep(sweep(pm_path, top_k=1), out, resume=True, echo=lambda s: None, launcher=good)
    finally:
        holder.kill()
        holder.wait()
    V.run_sweep(sweep(pm_path, top_k=1), out, resume=True, echo=lambda s: None, launcher=good)


def test_sigterm_to_the_sweep_ends_its_run(tmp_path, pm_path):
    out = tmp_path / "sw"
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP_SCRIPT)
    sub = subprocess.Popen([sys.executable, str(script), str(pm_path), str(out)], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(p.read_text().strip() for p in out.glob("runs/*/grandchild.pid")),
                 what="the first run to start")
        grandchild = int(next(out.glob("runs/*/grandchild.pid")).read_text())
        sub.send_signal(signal.SIGTERM)
        sub.wait(timeout=30)
        wait_for(lambda: not alive(grandchild), timeout=10, what="the run to be ended")
    finally:
        if sub.poll() is None:
            sub.kill()


def test_a_stop_while_a_run_is_being_started_still_ends_it(tmp_path, pm_path, monkeypatch):
    """SIGTERM between starting a run and holding its handle (here: while its pid is being recorded)
    is held back a moment and then ends the run like any other stop."""
    out = tmp_path / "sw"
    real = P.SweepLock.started
    seen = {}

    def started(self, pid, candidate=""):
        real(self, pid, candidate)
        pidfile = out / "runs" / candidate / "grandchild.pid"
        wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the run to start")
        seen["grandchild"] = int(pidfile.read_text())
        os.kill(os.getpid(), signal.SIGTERM)  # arrives now, inside the window

    monkeypatch.setattr(P.SweepLock, "started", started)
    launcher = launcher_of(["setsid sleep 300 & echo $! > grandchild.pid; exec sleep 300"])
    with pytest.raises(KeyboardInterrupt):
        V.run_sweep(sweep(pm_path, top_k=1), out, echo=lambda s: None, launcher=launcher)
    try:
        wait_for(lambda: not alive(seen["grandchild"]), timeout=10, what="the run to be ended")
    finally:
        if alive(seen["grandchild"]):
            os.kill(seen["grandchild"], signal.SIGKILL)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the sweep's handlers are gone with it


# ---- infrastructure failures are not the candidate's ----------------------------------------------------
def test_infrastructure_failures_are_retried_on_resume_own_failures_are_final(tmp_path, pm_path, monkeypatch):
    out = tmp_path / "sw"
    enospc = "echo 'OSError: [Errno 28] No space left on device' >&2; exit 1"
    own = "echo 'error: boom happened' >&2; exit 3"
    behaviour = [summary_cmd(1.0), enospc, own]
    with pytest.raises(UserError, match="c02.*outside the candidate.*--resume"):
        V.run_sweep(sweep(pm_path), out, echo=lambda s: None, launcher=launcher_of(behaviour))
    runs = V.read_results(out / "results.csv", per_run=True)
    assert list(runs["status"]) == ["ok", "infra"] and "No space left on device" in runs["error"][1]

    # each way the machine, not the candidate, stops a run; each is recorded as infra and run again
    causes = {
        "killed from outside": ("kill -TERM $$", "killed by SIGTERM from outside"),
        "launcher missing": ("exit 127", "could not start"),
        "torchrun's worker terminated": ("echo 'exitcode  : -15 (pid: 12)' >&2; exit 1", "not the candidate's"),
    }
    for script, msg in causes.values():
        behaviour[1] = script
        with pytest.raises(UserError, match="outside the candidate"):
            V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=launcher_of(behaviour))
        assert msg in V.read_results(out / "results.csv", per_run=True)["error"].iloc[-1]

    # disk full with no output at all: the run folder cannot take writes
    behaviour[1] = "exit 1"
    monkeypatch.setattr(V, "no_space", lambda folder: "no space left on device")
    with pytest.raises(UserError, match="cannot take writes"):
        V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=launcher_of(behaviour))
    monkeypatch.undo()

    # run.log cannot be written (here: a folder stands where it goes), and the launcher cannot be executed
    c02 = next(p for p in (out / "runs").iterdir() if p.name.startswith("c02"))
    (c02 / "run.log").unlink()
    (c02 / "run.log").mkdir()
    with pytest.raises(UserError, match="cannot write run.log"):
        V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=launcher_of(behaviour))
    (c02 / "run.log").rmdir()

    def no_launcher(run_dir, gpus):
        return [str(tmp_path / "no-such-launcher")], {}

    with pytest.raises(UserError, match="launcher could not start"):
        V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=no_launcher)

    # the machine is fine again: the infra run is retried, the candidates' own results stay final
    behaviour[1] = summary_cmd(2.0)
    calls = []

    def counting(run_dir, gpus, timeout_s, launcher):
        calls.append(run_dir.name[:3])
        return V.run_one(run_dir, gpus, timeout_s, launcher)

    s = V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=launcher_of(behaviour),
                    runner=counting)
    assert calls == ["c02", "c03"]
    res = V.read_results(out / "results.csv")
    assert list(res["status"]) == ["ok", "ok", "failed"] and list(res["measured_time_s"][:2]) == [1.0, 2.0]
    assert s["ok"] == 2 and "infra" not in s["status_counts"]
    calls.clear()
    V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None, launcher=launcher_of(behaviour),
                runner=counting)
    assert calls == []  # the failed candidate (its own error) is final


def test_a_record_that_cannot_be_written_stops_the_sweep_and_is_run_again(tmp_path, pm_path, monkeypatch):
    out = tmp_path / "sw"
    real = V.append_result
    n = []

    def full(path, row):
        n.append(row["candidate"])
        if len(n) == 2:
            raise OSError(28, "No space left on device", str(path))
        real(path, row)

    monkeypatch.setattr(V, "append_result", full)
    with pytest.raises(UserError, match="cannot record run c02.*no space left on device.*--resume"):
        V.run_sweep(sweep(pm_path), out, echo=lambda s: None, launcher=launcher_of([summary_cmd(t) for t in (1, 2, 3)]))
    monkeypatch.undo()
    s = V.run_sweep(sweep(pm_path), out, resume=True, echo=lambda s: None,
                    launcher=launcher_of([summary_cmd(t) for t in (1, 2, 3)]))
    assert s["ok"] == 3


def test_a_record_cut_short_is_dropped_whatever_its_field_count(tmp_path, pm_path):
    out = tmp_path / "sw"
    V.run_sweep(sweep(pm_path, top_k=2), out, echo=lambda s: None, launcher=launcher_of([summary_cmd(1.0), summary_cmd(2.0)]))
    text = (out / "results.csv").read_text()
    last = text.splitlines()[-1]
    # cut just before the repeat number: as many fields as a whole record, but no newline
    (out / "results.csv").write_text(text + last.replace("c02", "c03", 1).rsplit(",", 1)[0] + ",")
    assert len(V.read_results(out / "results.csv", per_run=True)) == 2


# ---- sweep files that cannot be read, bad arguments ------------------------------------------------------
_HEADER = ",".join(V.RESULT_COLUMNS) + "\n"
_texts = st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                   st.text(alphabet=",\"\n\r0123456789.-eEinfatoksl\x00", max_size=300).map(lambda t: (_HEADER + t).encode()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_texts)
def test_any_bytes_in_a_sweep_file_read_or_one_sentence(tmp_path, data):
    """Whatever a sweep file holds, reading it gives a table or a UserError naming it, nothing else."""
    for name, read in (("results.csv", lambda p: V.read_results(p)), ("plan.csv", V.read_plan),
                       ("sweep.json", lambda p: V.read_sweep_json(p, V.Sweep))):
        path = tmp_path / name
        path.write_bytes(data)
        try:
            got = read(path)
        except UserError as e:
            assert name in str(e) and "\n" not in str(e)
            continue
        if name == "results.csv":
            assert set(got["status"]) <= set(V.STATUSES)
            t = got["measured_time_s"].dropna().to_numpy(float)
            assert (t > 0).all() and (t < float("inf")).all()


def _base(pm_path, out):
    return ["validate", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "4", "-b", "8", "--top-k", "2", "--steps", "4",
            "--warmup", "1", "--out", str(out)]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e300"])
def test_bad_timeout_is_refused_before_anything_is_written(tmp_path, pm_path, capsys, value):
    out = tmp_path / "sw"
    code, _, err = cli(capsys, *_base(pm_path, out), "--timeout", value)
    one_sentence(code, err, "--timeout")
    assert not out.exists()
    code, _, err = cli(capsys, *_base(pm_path, out), "--timeout", value, "--slurm")
    one_sentence(code, err, "--timeout")
    assert not out.exists()


@pytest.mark.parametrize("name, content, words", [
    ("results.csv", b"\x89PNG\r\n\x1a\n\x00\x00binary\xff", ["results file", "results.csv"]),
    ("results.csv", "cand\u00e9,x\n".encode("utf-16"), ["results.csv"]),
    ("results.csv", b"just,some,csv\n1,2,3\n", ["results.csv", "not an axoplan validate results file"]),
    ("plan.csv", b"", ["plan file", "plan.csv", "empty"]),
    ("plan.csv", b"a,b\n1,2\n", ["plan.csv", "lacks the column"]),
    ("plan.csv", b"\x00\x01\x02\xff", ["plan.csv"]),
    ("sweep.json", b"\x00\xff\xfe binary", ["sweep file", "sweep.json"]),
    ("sweep.json", b"[1, 2]", ["sweep.json", "not a JSON object"]),
    ("sweep.json", b"[" * 100000 + b"]" * 100000, ["sweep.json", "not JSON"]),
    ("sweep.json", b'{"model": "gpt-tiny", "machine": "x", "gpus": "four", "global_batch": 8}', ["sweep.json", "gpus"]),
])
def test_unreadable_sweep_files_are_one_sentence_on_resume_and_collect(tmp_path, pm_path, capsys, name, content,
                                                                       words):
    out = tmp_path / "sw"
    code, _, err = cli(capsys, *_base(pm_path, out), "--slurm")
    assert code == 0, err
    (out / "runs" / min(os.listdir(out / "runs")) / "run.log").write_text(summary_cmd(1.0)[6:-1] + "\n")
    code, _, err = cli(capsys, "validate", "--collect", str(out))
    assert code == 0, err  # a good sweep collects; results.csv now exists
    (out / name).write_bytes(content)
    if name != "results.csv":
        code, _, err = cli(capsys, "validate", "--collect", str(out))
        one_sentence(code, err, *words)
    code, _, err = cli(capsys, *_base(pm_path, out), "--resume")
    one_sentence(code, err, *words)


def test_collect_with_an_empty_plan_or_no_sweep_is_one_sentence(tmp_path, pm_path, capsys):
    out = tmp_path / "sw"
    code, _, err = cli(capsys, *_base(pm_path, out), "--slurm")
    assert code == 0, err
    plan = (out / "plan.csv").read_text()
    (out / "plan.csv").write_text(plan.splitlines()[0] + "\n")
    code, _, err = cli(capsys, "validate", "--collect", str(out))
    one_sentence(code, err, "plan.csv", "lists no candidates")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(capsys, "validate", "--collect", str(empty))
    one_sentence(code, err, "holds no validate sweep")


# ---- calibrate: measuring beside a complete run, never over it -------------------------------------------
def _fake_workers(interrupt: bool, seconds: float):
    """Stand-in for the calibration workers: re-measures attention in the folder it is given (as the
    worker does with --add), then is interrupted half-way or finishes."""
    from axoplan.calibrate.results_io import ResultsDir

    def run(nproc, results, quick, models, device, command, extra, log_path=None, append=False, env_extra=None):
        rd = ResultsDir(results)
        meta = dict(rd.meta(), status="running", part_dates={"attention": "2026-12-01T00:00:00Z"})
        rd.start(meta, tables={"attention"})
        rd.append("attention", {"batch": 1, "heads": 8, "seq": 64, "head_dim": 8, "causal": True,
                                "pass": "forward", "seconds": seconds})
        if interrupt:
            raise KeyboardInterrupt
        for b in (1, 4):
            for causal in (False, True):
                for pass_, f in (("forward", 1.0), ("forward_backward", 3.5)):
                    rd.append("attention", {"batch": b, "heads": 8, "seq": 64, "head_dim": 8, "causal": causal,
                                            "pass": pass_, "seconds": seconds * b * f})
        rd.write_meta(dict(meta, status="complete"))
        return 1.0, 0.0

    return run


def test_interrupted_calibrate_parts_leaves_the_complete_run_whole(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from calib_synthetic import write

    from axoplan.cli import calibrate as cli_calibrate

    results = tmp_path / "r"
    write(results)
    (results / ".measuring-999999").mkdir()  # left by a calibration that was killed
    before = {f.name: f.read_bytes() for f in results.iterdir() if f.is_file()}
    args = ["calibrate", "--out", str(tmp_path / "p.yaml"), "--results", str(results), "--parts", "attention"]

    monkeypatch.setattr(cli_calibrate, "_run_workers", _fake_workers(interrupt=True, seconds=1e-3))
    code, _, _ = cli(capsys, *args)
    assert code == 130
    assert {f.name: f.read_bytes() for f in results.iterdir() if f.is_file()} == before
    assert not list(results.glob(".measuring-*")) and not (tmp_path / "p.yaml").exists()

    # the folder is still a complete run: both --from-results and --parts take it
    code, _, err = cli(capsys, "calibrate", "--out", str(tmp_path / "q.yaml"), "--from-results", str(results))
    assert code == 0, err
    monkeypatch.setattr(cli_calibrate, "_run_workers", _fake_workers(interrupt=False, seconds=2e-3))
    code, _, err = cli(capsys, *args)
    assert code == 0, err
    from axoplan.calibrate.results_io import ResultsDir

    rd = ResultsDir(results)
    assert rd.meta()["status"] == "complete" and rd.meta()["part_dates"] == {"attention": "2026-12-01T00:00:00Z"}
    assert len(rd.rows("attention")) == 9 and rd.rows("attention")[0]["seconds"] == 2e-3
    assert (results / "gemm.csv").read_bytes() == before["gemm.csv"]  # the parts not measured again are kept
    assert (tmp_path / "p.yaml").exists() and not list(results.glob(".measuring-*"))


def test_a_failed_whole_calibration_keeps_the_earlier_complete_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from calib_synthetic import write

    from axoplan.cli import calibrate as cli_calibrate
    from axoplan.errors import UserError as UE

    results = tmp_path / "r"
    write(results)
    before = {f.name: f.read_bytes() for f in results.iterdir() if f.is_file()}

    def failing(nproc, results_dir, *a, **kw):
        (results_dir / "gemm.csv").write_text("m,n,k\n")  # half a new run, then the workers fail
        raise UE("the calibration workers failed (exit code 1)")

    monkeypatch.setattr(cli_calibrate, "_run_workers", failing)
    code, _, err = cli(capsys, "calibrate", "--out", str(tmp_path / "p.yaml"), "--results", str(results), "--nproc", "2")
    one_sentence(code, err, "workers failed")
    assert {f.name: f.read_bytes() for f in results.iterdir() if f.is_file()} == before


def test_sweep_files_with_bad_numbers_or_a_bom(tmp_path, pm_path, capsys):
    out = tmp_path / "sw"
    V.run_sweep(sweep(pm_path, top_k=2), out, echo=lambda s: None,
                launcher=launcher_of([summary_cmd(1.0), summary_cmd(2.0)]))
    # a spreadsheet's byte-order mark is read through; an infinite or negative time measured nothing
    text = (out / "results.csv").read_text()
    (out / "results.csv").write_bytes(b"\xef\xbb\xbf" + text.replace(",1.0,ok,", ",inf,ok,").encode())
    res = V.read_results(out / "results.csv")
    assert list(res["status"]) == ["ok", "ok"] and res["measured_time_s"].isna().tolist() == [True, False]
    assert V.score(res)["ok"] == 1
    plan = (out / "plan.csv").read_text().splitlines()
    head = plan[0].split(",")
    row = plan[1].split(",")
    row[head.index("batch_time_s")] = "fast"
    (out / "plan.csv").write_text("\n".join([plan[0], ",".join(row), *plan[2:]]) + "\n")
    code, _, err = cli(capsys, "validate", "--collect", str(out))
    one_sentence(code, err, "plan.csv", "batch_time_s")


def test_calibrate_is_one_at_a_time_and_ends_workers_a_killed_one_left(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from calib_synthetic import write

    from axoplan.cli import calibrate as cli_calibrate

    results = tmp_path / "r"
    write(results)
    args = ["calibrate", "--out", str(tmp_path / "p.yaml"), "--results", str(results), "--parts", "attention"]
    monkeypatch.setattr(cli_calibrate, "_run_workers", _fake_workers(interrupt=False, seconds=2e-3))
    with P.FolderLock(results, "axoplan calibrate", "AXOPLAN_CALIBRATE_RESULTS", "name another folder"):
        code, _, err = cli(capsys, *args)
    one_sentence(code, err, "another axoplan calibrate is running", str(results))
    # a worker of a calibration that was killed (kill -9 leaves torchrun and its workers running)
    env = dict(os.environ, AXOPLAN_CALIBRATE_RESULTS=str(results.resolve()))
    orphan = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        wait_for(lambda: P.marked(results.resolve(), "AXOPLAN_CALIBRATE_RESULTS"), what="the orphan's environment")
        code, out, err = cli(capsys, *args)
        assert code == 0, err
        assert "ending 1 process(es) left running by an interrupted axoplan calibrate" in out and str(orphan.pid) in out
        assert orphan.wait(timeout=5) == -signal.SIGTERM
    finally:
        orphan.kill()


def _edit_line(text: str, col: str, value: str) -> str:
    lines = text.splitlines()
    head = lines[0].split(",")
    row = lines[1].split(",")
    row[head.index(col)] = value
    return "\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n"


@pytest.mark.parametrize("name, edit, words", [
    ("meta.json", lambda t: b"\x00\xff\xfe", ["meta.json"]),
    ("meta.json", lambda t: b"[1, 2]", ["meta.json", "not a JSON object"]),
    ("meta.json", lambda t: b"[" * 100000 + b"]" * 100000, ["meta.json", "not JSON"]),
    ("attention.csv", lambda t: b"\x89PNG\x00\xff", ["attention.csv", "not UTF-8"]),
    ("gemm.csv", lambda t: b"", ["gemm.csv", "lacks the column"]),
    ("collectives.csv", lambda t: b"a,b\n1,2\n", ["collectives.csv", "lacks the column"]),
    ("gemm.csv", lambda t: _edit_line(t, "seconds", "inf").encode(), ["gemm.csv line 2", "seconds"]),
    ("memory.csv", lambda t: _edit_line(t, "seconds", "nan").encode(), ["memory.csv line 2", "seconds"]),
    ("attention.csv", lambda t: _edit_line(t, "seconds", "-1").encode(), ["attention.csv line 2", "seconds"]),
    ("gemm.csv", lambda t: _edit_line(t, "layout", "").encode(), ["gemm.csv line 2", "layout"]),
    ("gemm.csv", lambda t: (t.splitlines()[0] + "\n8,8\n").encode(), ["gemm.csv line 2", "too few fields"]),
])
def test_a_broken_calibration_folder_is_one_sentence(tmp_path, capsys, name, edit, words):
    from calib_synthetic import write

    results = tmp_path / "r"
    write(results)
    p = results / name
    p.write_bytes(edit(p.read_text()))
    code, _, err = cli(capsys, "calibrate", "--out", str(tmp_path / "p.yaml"), "--from-results", str(results))
    one_sentence(code, err, *words)
    assert not (tmp_path / "p.yaml").exists()


def test_calibrate_refuses_more_ranks_than_a_cpu_node_can_hold(tmp_path, capsys):
    pytest.importorskip("torch")
    code, _, err = cli(capsys, "calibrate", "--out", str(tmp_path / "p.yaml"), "--results", str(tmp_path / "r"),
                       "--nproc", str(16 * (os.cpu_count() or 1) + 1), "--device", "cpu")
    one_sentence(code, err, "--nproc", "ranks per core")
    assert not (tmp_path / "r").exists()
