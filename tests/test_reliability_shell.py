"""Issue 16 §1: no value reaches an emitted script unquoted. Control characters in names and paths are
a user error (exit 2); any other text, however hostile, is quoted so that the script only does its job."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import profile_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan.cli.main import main
from axoplan.errors import UserError
from axoplan.loop.launch import (
    config_from_row,
    launch_env,
    slurm_script,
    torchrun_script,
)
from axoplan.planner.profile_reader import load_profile
from axoplan.runconfig import LaunchConfig
from axoplan.shell import comment, quote
from axoplan.calibrate.slurm import sbatch_script

ROW = {"gx": 1, "gy": 1, "gz": 1, "gdata": 2, "order": "xyz", "micro_batch": 2, "checkpointing": False,
       "batch_time_s": 0.1, "compute_s": 0.05, "comm_s": 0.05, "exposed_comm_s": 0.05, "memory_gib": 0.1,
       "tflops_per_gpu": 1.0, "pct_of_peak": 10.0, "rank": 1}
CONTROL = [chr(c) for c in range(0x20)] + ["\x7f", "\x85", "\u2028", "\u2029"]
# printable text with every shell metacharacter, quotes and non-ASCII letters, no control characters
hostile = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")) | st.sampled_from(
    list("$`'\"\\;&|<>(){}[]*?!#~ %")), min_size=1, max_size=40)


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def _scripts(tmp_path: Path, model: str, profile=None) -> list[str]:
    profile = profile or load_profile("localhost-cpu")
    cfg = config_from_row(ROW, model, 4)
    return [torchrun_script(cfg, profile), slurm_script(cfg, profile, tmp_path)]


def _runs_clean(script: str, tmp_path: Path) -> None:
    """bash -n accepts it, and running it (python replaced by `true`) creates nothing."""
    d = tmp_path / "sandbox"
    d.mkdir(exist_ok=True)
    path = d / "s.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, check=False).returncode == 0
    before = set(os.listdir(d))
    env = {"PATH": os.environ["PATH"], "PYTHON": "true", "HOME": str(d)}
    subprocess.run(["bash", str(path)], cwd=d, env=env, capture_output=True, timeout=30, check=False)
    assert set(os.listdir(d)) == before


@pytest.mark.parametrize("c", CONTROL)
def test_a_control_character_in_any_shell_value_is_refused(c):
    for f in (lambda v: quote(v, "x"), lambda v: comment(v, "x")):
        with pytest.raises(UserError, match="control character"):
            f(f"a{c}b")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=hostile)
def test_hostile_text_in_a_model_path_stays_inert_in_every_script(tmp_path, name):
    plain = _scripts(tmp_path, "/nonexistent/plain.yaml")
    for script, ref in zip(_scripts(tmp_path, f"/nonexistent/{name}.yaml"), plain):
        path = tmp_path / "check.sh"
        path.write_text(script)
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True, check=False).returncode == 0
        # every value stayed inside its line: the script has exactly the lines it has for a plain name
        assert len(script.split("\n")) == len(ref.split("\n"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=hostile, ctl=st.sampled_from(CONTROL))
def test_any_control_character_in_a_model_path_is_a_user_error(tmp_path, name, ctl):
    with pytest.raises(UserError, match="control character"):
        _scripts(tmp_path, f"/x/{name}{ctl}touch PWNED.yaml")


def test_the_issue_example_newline_model_path_is_refused_with_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = "evil\ntouch PWNED\n#.yaml"
    (tmp_path / evil).write_text((Path(__file__).parent.parent / "axoplan/presets/gpt-tiny.yaml").read_text())
    code, _, err = run_cli(["emit", "--model", evil, "--machine", "localhost-cpu", "--gpus", "2", "--global-batch",
                            "4", "--out", "run_nl"], capsys)
    assert code == 2 and "control character" in err and err.count("\n") == 1
    assert not (tmp_path / "run_nl").exists() and not (tmp_path / "PWNED").exists()


def test_shell_metacharacters_in_paths_are_emitted_and_execute_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = "m $(touch PWNED) `touch PWNED2` ;touch PWNED3 '\"#.yaml"
    (tmp_path / model).write_text((Path(__file__).parent.parent / "axoplan/presets/gpt-tiny.yaml").read_text())
    out = tmp_path / "r $(touch P4) `x` ';#"
    code, _, err = run_cli(["emit", "--model", model, "--machine", "localhost-cpu", "--gpus", "2", "--global-batch",
                            "4", "--out", str(out)], capsys)
    assert code == 0, err
    for f in ("launch_torchrun.sh", "launch_slurm.sbatch"):
        _runs_clean((out / f).read_text(), tmp_path)
    assert not any(p.name.startswith(("PWNED", "P4")) for p in tmp_path.rglob("*"))


def _profile_with(tmp_path, name="evil", launch=None):
    d = profile_dict(name=name)
    if launch is not None:
        d["launch"] = launch
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


@pytest.mark.parametrize("field", ["name", "source", "env_value"])
def test_a_newline_in_a_profile_name_or_launch_section_is_refused(tmp_path, field):
    launch = {"env": {"NCCL_X": "1"}, "source": "ok"}
    name = "pm"
    if field == "name":
        name = "pm\ntouch PWNED"
    elif field == "source":
        launch["source"] = "vendor\ntouch PWNED"
    else:
        launch["env"]["NCCL_X"] = "1\ntouch PWNED"
    with pytest.raises(UserError, match="control character"):
        load_profile(str(_profile_with(tmp_path, name, launch)))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(source=hostile, value=hostile)
def test_hostile_launch_source_and_values_stay_inert(tmp_path, source, value):
    prof = load_profile(str(_profile_with(tmp_path, "pm", {"env": {"NCCL_AXO_X": value}, "source": source})))
    assert launch_env(prof)[0][1] == value
    for script in _scripts(tmp_path, "gpt-tiny", prof):
        _runs_clean(script.replace('exec "$PYTHON"', '"$PYTHON"').replace("srun ", "true "), tmp_path)


def test_an_env_name_bash_cannot_export_is_refused(tmp_path):
    with pytest.raises(UserError, match="not a valid shell name"):
        load_profile(str(_profile_with(tmp_path, "pm", {"env": {"é": "1"}, "source": "s"})))


def test_calibrate_emit_slurm_quotes_out_and_refuses_control_characters(tmp_path):
    out = "machine_profiles/a $(touch PWNED) `b`;c'.yaml"
    script = sbatch_script(2, 4, out, "calibration/results/x", quick=True, models=None)
    path = tmp_path / "c.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, check=False).returncode == 0
    for line in script.splitlines():
        if line.startswith("#") and not line.startswith("#SBATCH") and not line.startswith("##"):
            continue
        assert "$(touch" not in line or "'" in line  # outside comments the path is always quoted
    with pytest.raises(UserError, match="control character"):
        sbatch_script(2, 4, "a\ntouch PWNED\n#.yaml", "r", quick=False, models=None)


def test_readme_and_config_carry_no_control_characters():
    cfg = LaunchConfig(model="x\ny.yaml")
    with pytest.raises(UserError, match="control character"):
        cfg.validate()


@pytest.mark.parametrize("argv", [
    ["validate", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4", "--slurm",
     "--out", "v\ntouch PWNED"],
    ["calibrate", "--out", "a\ntouch PWNED\n#.yaml", "--emit-slurm", "2"],
    ["emit", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4",
     "--out=r\rx"],
    ["memorization", "--model", "gpt-tiny", "--out", "m\x00"],
    ["scale", "--machine", "localhost-cpu", "--weak", "gpt-tiny\x1b:2", "--global-batch", "8"],
    ["train", "--config", "c\x85.yaml"],
])
def test_every_command_refuses_control_characters_in_its_arguments(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "control character" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())
