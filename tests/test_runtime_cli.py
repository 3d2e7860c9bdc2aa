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
    assert r.returncode == 2 and r.stderr.startswith("error: --gpus shapes the printed example")


def test_world_of_one_trains_and_writes_metrics(tmp_path):
    # the YAML says 9 steps and lr 1e-9; the command line's --steps, --lr, --out and --log-every win
    cfg = {"model": "gpt-tiny", "steps": 9, "timing_warmup_steps": 1, "global_batch": 4, "micro_batch": 2,
           "seq_len": 32, "lr": 1e-9, "goldfish": {"k": 4, "h": 13}, "save": "final.pt", "tensorboard": None,
           "checkpoint_every": 2}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = _run(CLI + ["--config", str(tmp_path / "run.yaml"), "--steps", "4", "--lr", "3e-3", "--out",
                    str(tmp_path / "run"), "--log-every", "2"])
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert [x.split(" |")[0] for x in out if x.startswith("step ")] == ["step 2/4", "step 4/4"]
    assert out[-2].startswith("done: 4 steps") and json.loads(out[-1])["summary"] is True
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps, summary = [x for x in lines if x["event"] == "step"], lines[-1]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for s in steps:
        assert s["batch_time_s"] > 0 and s["tokens_per_s"] > 0 and s["peak_memory_gib"] > 0
    assert steps[0]["lr"] == pytest.approx(3e-3)
    assert summary["summary"] is True and summary["median_batch_time_s"] > 0
    assert summary["final_loss"] < summary["first_loss"]
    assert (tmp_path / "run" / "final.pt").is_file()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    # --resume continues the same run (its id) from the newest checkpoint, up to the new --steps
    r = _run(CLI + ["--config", str(tmp_path / "run.yaml"), "--steps", "5", "--lr", "3e-3", "--out",
                    str(tmp_path / "run"), "--resume"])
    assert r.returncode == 0, r.stderr
    assert [x.split(" |")[0] for x in r.stdout.splitlines() if x.startswith("step ")] == ["step 5/5"]
    more = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][len(lines):]
    assert [(x["event"], x.get("step")) for x in more] == [("start", None), ("step", 4), ("checkpoint", 5),
                                                          ("summary", None)]
    assert more[0]["resumed_from_step"] == 4 and {x["run_id"] for x in more} == {lines[0]["run_id"]}
    # checkpoint_keep (default 2): the oldest went once the newest was complete
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]


@pytest.mark.parametrize("args, words", [
    (["--grid", "2,1"], "--grid must be four positive integers"),
    (["--lr", "0"], "--lr must be"),
    (["--steps", "many"], "--steps must be a whole number"),
    (["--micro-batch", "3"], "does not divide"),
])
def test_bad_overrides_are_one_sentence_exit_2(args, words):
    r = _run(CLI + args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines


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
