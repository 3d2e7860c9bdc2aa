"""Profiles know their device: the loader reads `device:` as a name or a {name, count, source} section,
calibrate writes the section, and validate / train / calibrate --parts warn in one line elsewhere."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from axoplan.cli.main import main
from axoplan.device import Device, mismatch, results_mismatch, this_device
from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile

PROFILES = Path(__file__).resolve().parents[1] / "machine_profiles"


def _copy(tmp_path, device_line: str) -> Path:
    for f in PROFILES.glob("localhost-cpu*"):
        shutil.copy(f, tmp_path / f.name)
    p = tmp_path / "localhost-cpu.yaml"
    lines = p.read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if x.startswith("device:"))
    lines[i] = device_line
    p.write_text("\n".join(lines) + "\n")
    return p


def test_the_bundled_cpu_profile_records_its_device_and_count():
    p = load_profile("localhost-cpu")
    assert (p.device, p.device_count) == ("AMD EPYC", 2)
    assert load_profile("perlmutter").device == "A100-SXM4-40GB"  # the plain form stays valid


def test_another_cpu_model_or_core_count_is_one_sentence_and_the_same_is_silent():
    p = load_profile("localhost-cpu")
    assert mismatch(p, Device("AMD EPYC", 2)) is None
    for here in (Device("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz", 2), Device("AMD EPYC", 64)):
        line = mismatch(p, here)
        assert line and "\n" not in line and "AMD EPYC (2 CPUs)" in line and "calibrate" in line
    gpu = load_profile("perlmutter")
    assert mismatch(gpu, Device("NVIDIA A100-SXM4-40GB", 4)) is None  # torch's name carries the vendor
    assert "H100" in mismatch(gpu, Device("NVIDIA H100 80GB HBM3", 8))
    assert this_device("cpu").count


@pytest.mark.parametrize("line,needle", [("device: {count: 2, source: x}", "with a name"),
                                         ("device: {name: A, count: 0, source: x}", "positive whole"),
                                         ("device: {name: A, count: 2}", "no source"),
                                         ("device: {name: A, cores: 2, source: x}", "unknown key")])
def test_a_bad_device_section_is_one_sentence(tmp_path, line, needle):
    with pytest.raises(UserError, match=needle):
        load_profile(str(_copy(tmp_path, line)))


def test_validate_warns_in_one_line_on_another_device(tmp_path, capsys):
    prof = _copy(tmp_path, "device: {name: Some Other CPU 9000, count: 96, source: test}")
    with pytest.raises(SystemExit) as e:
        main(["validate", "--model", "gpt-tiny", "--machine", str(prof), "--gpus", "2", "--global-batch", "4",
              "--top", "2", "--slurm", "--out", str(tmp_path / "sweep")])
    assert e.value.code == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "Some Other CPU 9000 (96 CPUs)" in warnings[0]


def test_calibrate_parts_on_another_devices_results_warns(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"device": "Some Other CPU 9000"}))
    assert "mix two devices" in results_mismatch(tmp_path, cuda=False)
    (tmp_path / "meta.json").write_text(json.dumps({"device": this_device("cpu").name}))
    assert results_mismatch(tmp_path, cuda=False) is None


def test_calibrate_writes_the_device_section(tmp_path):
    from axoplan.calibrate import profile_writer

    from calib_synthetic import write

    built = profile_writer.build(write(tmp_path / "r"), "synthetic", "synthetic_gemm.csv")
    dev = built.profile["device"]
    assert set(dev) >= {"name", "source"} and dev["name"]


def test_train_warns_in_one_line_when_its_machine_profile_is_another_device(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    pytest.importorskip("torch")
    prof = _copy(tmp_path, "device: {name: Some Other CPU 9000, count: 96, source: test}")
    cfg = {"model": "gpt-tiny", "steps": 2, "warmup_steps": 1, "global_batch": 1, "micro_batch": 1, "seq_len": 16,
           "machine": str(prof), "metrics": str(tmp_path / "m.jsonl")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    r = subprocess.run([sys.executable, "-m", "axoplan.cli", "train", "--config", str(tmp_path / "run.yaml")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "Some Other CPU 9000" in warnings[0]
