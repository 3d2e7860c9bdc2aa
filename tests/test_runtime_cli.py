"""`axoplan train`: example config, a short real run at world size 1, and bad configs ending in one
sentence and exit code 2 (under torchrun: on every rank, printed once, no hang)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("torch")

CLI = [sys.executable, "-m", "axoplan.cli", "train"]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}


def _run(args, timeout=120):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV)


def test_print_config_is_a_complete_config(tmp_path):
    from axoplan.runconfig import LaunchConfig, load_config

    r = _run(CLI + ["--print-config"])
    assert r.returncode == 0
    p = tmp_path / "c.yaml"
    p.write_text(r.stdout)
    assert load_config(p) == LaunchConfig()


def test_print_config_for_n_ranks_is_a_config_those_ranks_run(tmp_path):
    """The README's `--print-config --gpus 4` then torchrun with 4 processes: the grid matches, the batch divides."""
    from axoplan.runconfig import load_config
    from axoplan.runtime.train import check_config

    r = _run(CLI + ["--print-config", "--gpus", "12", "--model", "gpt-small"])
    assert r.returncode == 0, r.stderr
    p = tmp_path / "c.yaml"
    p.write_text(r.stdout)
    cfg = load_config(p)
    assert cfg.model == "gpt-small" and cfg.grid.size == 12 and cfg.global_batch == 12
    check_config(cfg, 12)
    with pytest.raises(Exception, match="print-config --gpus 4' or start 12"):
        check_config(cfg, 4)
    r = _run(CLI + ["--gpus", "4"])
    assert r.returncode == 2 and r.stderr.startswith("error: --gpus and --model shape the printed example")


def test_world_of_one_trains_and_writes_metrics(tmp_path):
    cfg = {"model": "gpt-tiny", "steps": 4, "warmup_steps": 1, "global_batch": 4, "micro_batch": 2, "seq_len": 32,
           "lr": 3e-3, "metrics": str(tmp_path / "m.jsonl"), "goldfish": {"k": 4, "h": 13},
           "save": str(tmp_path / "final.pt")}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = _run(CLI + ["--config", str(tmp_path / "run.yaml")])
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps, summary = lines[:-1], lines[-1]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert s["batch_time_s"] > 0 and s["tokens_per_s"] > 0 and s["peak_memory_gib"] > 0
    assert summary["summary"] is True and summary["median_batch_time_s"] > 0
    assert summary["final_loss"] < summary["first_loss"]
    assert (tmp_path / "final.pt").is_file()


@pytest.mark.parametrize("cfg, words", [
    ({"grid": {"gx": 2}}, "does not match"),
    ({"grid": {"gw": 2}}, "unknown key"),
    ({"data": "/nonexistent/corpus"}, "does not exist"),
    ({"model": "no-such-model"}, "unknown model"),
])
def test_bad_config_one_sentence_exit_2(tmp_path, cfg, words):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    r = _run(CLI + ["--config", str(tmp_path / "bad.yaml")])
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_bad_config_under_torchrun_exits_2_everywhere_without_hang(tmp_path):
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"name": "three-heads", "n_layers": 1, "hidden": 48,
                                                     "n_heads": 3, "vocab": 256, "seq_len": 32}))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"model": str(tmp_path / "m.yaml"), "grid": {"gy": 2}}))
    r = _run(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "axoplan.cli", "train",
              "--config", str(tmp_path / "bad.yaml")], timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert out.count("error: config cannot run model 'three-heads': 3 attention heads are not divisible by gy=2") == 1
    assert "exitcode  : 2" in out  # the first rank to stop exited with 2, not a crash
