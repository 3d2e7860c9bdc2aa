"""Issue 27, injection and execution: no planted file kills or runs anything. A forged sweep.lock
signals nothing the sweep did not start; a profile's launch.env may set only what a launcher needs,
and validate prints what it sets before running anything; no text from a file reaches the terminal
with a control character."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from conftest import one_sentence, profile_dict, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan.errors import UserError
from axoplan.loop import validate_proc as P


def _forge_lock(folder, pid):
    folder.mkdir(parents=True, exist_ok=True)
    rec = {"pid": 1, "start": P.proc_start(1), "host": socket.gethostname(), "boot": P._boot_id(),
           "runs": [{"pgid": pid, "start": P.proc_start(pid), "candidate": "c01"}]}
    (folder / P.LOCK_FILE).write_text(json.dumps(rec) + "\n")


@pytest.fixture
def bystander():
    """An unrelated process of ours, in its own process group (as a run would be)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def test_a_forged_sweep_lock_signals_nothing(tmp_path, bystander, capsys):
    out = tmp_path / "sweep"
    _forge_lock(out, bystander.pid)
    with P.SweepLock(out) as lock:
        assert lock.end_orphans(print, grace_s=0.5) == 0
    assert bystander.poll() is None and P.proc_start(bystander.pid) is not None
    assert "ending" not in capsys.readouterr().out


def test_a_forged_sweep_lock_in_a_sweep_folder_kills_nothing(tmp_path, bystander, pm_path):
    from axoplan.loop import validate as V

    out = tmp_path / "sweep"
    _forge_lock(out, bystander.pid)
    said = []
    sw = V.Sweep(model="gpt-tiny", machine=str(pm_path), gpus=4, global_batch=8, top_k=1, steps=4,
                 warmup_steps=1, timeout_s=60.0)
    summary = "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"
    V.run_sweep(sw, out, echo=said.append, launcher=lambda run_dir, gpus: (["bash", "-c", summary], {}))
    assert not any("ending" in s for s in said), said
    assert bystander.poll() is None and P.proc_start(bystander.pid) is not None


def test_a_run_the_sweep_started_is_still_ended(tmp_path):
    """The real case the lock record is for: a process carrying the folder's marker is ended."""
    out = tmp_path / "sweep"
    out.mkdir()
    env = dict(os.environ, **{P.MARKER: str(out.resolve())})
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    try:
        _forge_lock(out, proc.pid)
        with P.SweepLock(out) as lock:
            assert lock.end_orphans(lambda s: None, grace_s=2.0) == 1
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait()


# ---- launch.env: what a profile may set ------------------------------------------------------------
CODE_CHOOSING = ["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME",
                 "PYTHON", "BASH_ENV", "ENV", "HOME", "IFS", "PS4", "SHELLOPTS", "PROMPT_COMMAND", "NNODES",
                 "MASTER_ADDR", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "FI_PROVIDER_PATH", "UCX_MODULE_DIR_PATH"]


def _profile_with_env(write_profile, env):
    d = profile_dict()
    d["launch"] = {"env": env, "source": "test"}
    return write_profile(raw=d, name="envprof")


@pytest.mark.parametrize("name", CODE_CHOOSING)
def test_a_profile_may_not_set_what_chooses_the_code_that_runs(write_profile, name):
    from axoplan.planner.profile_reader import load_profile

    with pytest.raises(UserError, match=f"launch.env.{name}"):
        load_profile(str(_profile_with_env(write_profile, {name: "/tmp/x"})))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.from_regex(r"[A-Z_][A-Z0-9_]{0,20}", fullmatch=True))
def test_any_name_a_profile_sets_is_a_network_or_threading_setting(write_profile, name):
    from axoplan.planner.profile_reader import LAUNCH_ENV_NAMES, LAUNCH_ENV_PREFIXES, load_profile

    try:
        load_profile(str(_profile_with_env(write_profile, {name: "1"})))
    except UserError as e:
        assert f"launch.env.{name}" in str(e) and "\n" not in str(e)
    else:
        assert name in LAUNCH_ENV_NAMES or (name.startswith(LAUNCH_ENV_PREFIXES) and "PATH" not in name
                                            and "PLUGIN" not in name and "LIB" not in name)


def test_a_planted_sitecustomize_never_runs_under_emit(tmp_path, write_profile, capsys):
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    prof = _profile_with_env(write_profile, {"PYTHONPATH": str(planted)})
    code, _, err = run_cli(["emit", "--model", "gpt-tiny", "--machine", str(prof), "--gpus", "4",
                            "--global-batch", "8", "--out", str(tmp_path / "run")], capsys)
    one_sentence(code, err)
    assert "PYTHONPATH" in err and not (tmp_path / "run").exists() and not (tmp_path / "ran").exists()


def test_what_a_profile_sets_is_printed_before_validate_runs_anything(tmp_path, write_profile):
    from axoplan.loop import validate as V

    prof = _profile_with_env(write_profile, {"NCCL_IB_HCA": "mlx5_0", "OMP_NUM_THREADS": "2"})
    said = []

    def launcher(run_dir, gpus):
        said.append("RUN")
        return ["bash", "-c", "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"], {}

    sw = V.Sweep(model="gpt-tiny", machine=str(prof), gpus=4, global_batch=8, top_k=1, steps=4, warmup_steps=1,
                 timeout_s=60.0)
    V.run_sweep(sw, tmp_path / "out", echo=said.append, launcher=launcher)
    first = next(i for i, s in enumerate(said) if "NCCL_IB_HCA=mlx5_0" in s)
    assert "OMP_NUM_THREADS=2" in said[first] and first < said.index("RUN")


# ---- terminal escapes ------------------------------------------------------------------------------
CONTROL = st.sampled_from(["\x1b", "\x07", "\x08", "\r", "\x9b", "\x7f", "\x00", "\u2028"])


def _escaped(c: str) -> str:
    """c as a YAML double-quoted escape (the way a file smuggles it past the YAML reader)."""
    return f"\\u{ord(c):04x}"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=CONTROL, field=st.sampled_from(["device", "description", "name"]))
def test_a_control_character_in_any_profile_text_is_refused(write_profile, c, field):
    from axoplan.planner.profile_reader import load_profile

    text = yaml.safe_dump(profile_dict(), sort_keys=False).replace(
        f"{field}: ", f'{field}: "x{_escaped(c)}[31m"\nold_{field}: ', 1)
    text = "\n".join(line for line in text.splitlines() if not line.startswith(f"old_{field}"))
    with pytest.raises(UserError) as e:
        load_profile(str(write_profile(raw=text, name="esc")))
    assert c not in str(e.value) and "\n" not in str(e.value)


def test_profiles_prints_no_escape_from_a_hostile_profile(tmp_path, capsys, monkeypatch):
    d = tmp_path / "profs"
    d.mkdir()
    text = yaml.safe_dump(profile_dict(), sort_keys=False).replace("device: test-gpu", 'device: "\\e]0;pwned\\a"')
    (d / "hostile.yaml").write_text(text)
    monkeypatch.setenv("AXOPLAN_PROFILES", str(d))
    code, out, err = run_cli(["profiles"], capsys)
    assert "\x1b" not in out + err and "\x07" not in out + err


@pytest.mark.parametrize("text", ['weights: "\\e[2J"\n', 'base: "\\e[2J"\n', 'source: "x\\x9by"\n',
                                  "base: [1]\n", "base: {a: 1}\n", "? [1, 2]\n: true\n", "1: true\n"])
def test_any_execution_file_is_loaded_or_one_sentence_without_escapes(tmp_path, capsys, text):
    p = tmp_path / "exe.yaml"
    p.write_text(text)
    code, out, err = run_cli(["rank", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2",
                              "--global-batch", "4", "--execution", str(p)], capsys)
    one_sentence(code, err)
    assert "\x1b" not in err and "\x9b" not in err


def test_a_run_log_escape_reaches_the_screen_inert():
    from axoplan.loop.validate import error_line

    assert error_line("boom\nerror: \x1b[2Jwiped\n") == "error: \\x1b[2Jwiped"


@settings(max_examples=40, deadline=None)
@given(mant=st.floats(0.001, 1000, allow_nan=False), exp=st.integers(-30, 30), upper=st.booleans(),
       sign=st.sampled_from(["", "+", "-"]))
def test_exponent_numbers_read_as_numbers(mant, exp, upper, sign):
    from axoplan.yamlio import parse_yaml

    for m in (f"{mant:g}".split("e")[0], str(int(mant))):
        text = f"{sign}{m}{'E' if upper else 'e'}{exp}"
        assert parse_yaml(f"x: {text}\n", "t")["x"] == float(text)
