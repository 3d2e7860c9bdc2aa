"""The trainer's basics: the LR schedule (hand-computed), the renamed timing warm-up key, what a run
reports (readable lines, JSON records with run ids, TensorBoard events, never NaN), a non-finite loss
stopping the run, and checkpoints that resume bit for bit (gloo, 4 ranks, grids splitting X, Y, Z, D)."""
import json
import math

import pytest

from axoplan.errors import UserError
from axoplan.runconfig import LaunchConfig, config_from_dict
from axoplan.runtime.lr_schedule import config_lr, lr_at


def test_cosine_schedule_hand_computed():
    # lr 1, floor 0.1, 2 warm-up steps, decay over steps 2..6: warm-up (s+1)/3, then 0.1 + 0.45*(1 + cos(pi*p))
    got = [lr_at(s, 1.0, warmup=2, decay_steps=6, min_lr=0.1) for s in range(9)]
    want = [1 / 3, 2 / 3, 1.0, 0.868198, 0.55, 0.231802, 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-6)
    assert [lr_at(s, 1.0, 2, 6, 0.1, "linear") for s in (2, 3, 4, 6)] == pytest.approx([1.0, 0.775, 0.55, 0.1])
    assert [lr_at(s, 1.0, 2, 6, 0.1, "constant") for s in (0, 2, 5, 9)] == pytest.approx([1 / 3, 1.0, 1.0, 1.0])


def test_config_schedule_decays_over_the_run_by_default():
    cfg = LaunchConfig(steps=4, lr=2.0, min_lr=0.0)
    # no warm-up, decay over 4 steps: p = s/4, the last step just above the floor
    assert [config_lr(cfg, s) for s in range(4)] == pytest.approx([2.0, 1 + 2 ** -0.5, 1.0, 1 - 2 ** -0.5])


def test_old_timing_warmup_key_reads_with_a_note(capsys, monkeypatch):
    for name in ("RANK", "SLURM_PROCID"):  # the note is rank 0's
        monkeypatch.delenv(name, raising=False)
    cfg = config_from_dict({"warmup_steps": 3})
    assert cfg.timing_warmup_steps == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note:") and "timing_warmup_steps" in err[0]
    with pytest.raises(UserError, match="give timing_warmup_steps only"):
        config_from_dict({"warmup_steps": 3, "timing_warmup_steps": 1})


@pytest.mark.parametrize("d, words", [
    ({"lr_decay_style": "step"}, "lr_decay_style must be one of"),
    ({"min_lr": 1.0, "lr": 0.1}, "min_lr (1) must not exceed lr"),
    ({"lr_warmup_steps": 5, "lr_decay_steps": 5}, "must be larger than lr_warmup_steps"),
    ({"log_every": 0}, "log_every must be a positive integer"),
    ({"checkpoint_every": -1}, "checkpoint_every must be a non-negative integer"),
    ({"resume": "yes"}, "resume must be true or false"),
])
def test_bad_basics_are_one_sentence(d, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict(d)


def test_records_are_rounded_and_never_nan():
    from axoplan.runtime.report import human_line, rounded

    rec = rounded({"loss": 5.558123456789, "grad_norm": float("nan"), "lr": 3.0000000001e-4,
                   "batch_time_s": 0.0123456789, "nested": {"x": float("inf")}})
    assert rec == {"loss": 5.55812, "grad_norm": None, "lr": 3e-4, "batch_time_s": 0.01235, "nested": {"x": None}}
    json.dumps(rec, allow_nan=False)
    line = human_line({"step": 4, "loss": 5.5581, "lr": 3e-4, "batch_time_s": 0.25, "tokens_per_s": 4096.0,
                       "model_tflops_per_gpu": 0.0123, "pct_of_peak": 12.34, "peak_memory_gib": 1.5}, 20,
                      "process_peak_rss")
    assert line == ("step  5/20 | loss 5.5581 | lr 3.00e-04 | 250.0 ms/step | 4,096 tok/s | "
                    "12.3 GFLOP/s/rank (12.3% of peak) | mem 1.50 GiB peak RSS")


def test_missing_tensorboard_is_one_warning(monkeypatch, capsys):
    import sys

    from axoplan.runtime.report import open_tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    assert open_tensorboard("unused", None) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: tensorboard is not installed")


@pytest.fixture
def world_of_one():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield torch
    dist.destroy_process_group()


def _trainer(torch, **kw):
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Resolved, Trainer

    cfg = LaunchConfig(model="gpt-tiny", global_batch=2, micro_batch=1, seq_len=16, lr=3e-3, timing_warmup_steps=0,
                       **kw).validate()
    return Trainer(cfg, build_grid(1, 1, 1, 1), Resolved(torch.device("cpu"), "gloo", torch.float32, torch.float32,
                                                         False))


def test_runs_report_lines_records_and_tensorboard(world_of_one, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for _ in range(2):  # two runs into the same folder: appended, told apart by their run ids
        tr = _trainer(world_of_one, steps=3, log_every=2, out=str(tmp_path))
        tr.fit()
        tr.close()
    out = capsys.readouterr().out.splitlines()
    steps = [x for x in out if x.startswith("step ")]
    assert [x.split(" |")[0] for x in steps] == ["step 2/3", "step 3/3"] * 2  # every 2nd and the last
    assert all("tok/s" in x and "ms/step" in x and "FLOP/s/rank" in x and "GiB peak RSS" in x for x in steps)
    assert json.loads(out[-1])["summary"] is True  # validate reads the last stdout line
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    recs = [json.loads(x) for x in text.splitlines()]
    runs = list(dict.fromkeys(r["run_id"] for r in recs))
    assert len(runs) == 2
    for run in runs:
        mine = [r for r in recs if r["run_id"] == run]
        assert [r["event"] for r in mine] == ["start", "step", "step", "step", "summary"]
        assert all(r["time"].endswith("Z") and r["elapsed_s"] >= 0 for r in mine)
        ea = EventAccumulator(str(tmp_path / "tensorboard" / run))
        ea.Reload()
        assert [e.step for e in ea.Scalars("train/loss")] == [0, 1, 2]
        assert [e.value for e in ea.Scalars("train/loss")] == pytest.approx([r["loss"] for r in mine[1:4]], rel=1e-5)


def test_a_non_finite_loss_stops_the_run_in_one_sentence(world_of_one, tmp_path):
    tr = _trainer(world_of_one, steps=3, out=str(tmp_path), tensorboard=None)
    with world_of_one.no_grad():
        tr.model.replicated["norm_f"].fill_(math.nan)
    with pytest.raises(UserError, match=r"the loss became nan at step 1 \(lr 3.00e-03\); training stopped"):
        tr.fit()
    tr.close()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in recs] == ["start", "error"]


def test_resume_is_refused_on_another_grid(world_of_one, tmp_path):
    from axoplan.runtime.train import check_config

    tr = _trainer(world_of_one, steps=2, checkpoint_every=1, out=str(tmp_path), tensorboard=None)
    tr.fit()
    tr.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    cfg = config_from_dict({"model": "gpt-tiny", "global_batch": 2, "seq_len": 16, "steps": 4, "resume": True,
                            "out": str(tmp_path), "grid": {"gdata": 2}})
    with pytest.raises(UserError, match="was written with grid 1x1x1x1, this config has 1x1x1x2"):
        check_config(cfg, 2)
    # the same stage grid over two pipeline stages holds other shards: refused too
    cfg = config_from_dict({"model": "gpt-tiny", "global_batch": 2, "seq_len": 16, "steps": 4, "resume": True,
                            "out": str(tmp_path), "pp": 2})
    with pytest.raises(UserError, match="was written with pp 1, this config has 2"):
        check_config(cfg, 2)
    with pytest.raises(UserError, match="is at step 2 and the config's steps is 2: nothing left"):
        check_config(config_from_dict({"model": "gpt-tiny", "global_batch": 2, "seq_len": 16, "steps": 2,
                                       "timing_warmup_steps": 0, "resume": True, "out": str(tmp_path)}), 1)


def test_only_complete_checkpoints_count(tmp_path):
    pytest.importorskip("torch")
    from axoplan.runtime.checkpoint import META, checkpoints

    def folder(name, files):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")

    folder("step_00000002", [META, ".metadata"])
    folder("step_00000010", [META, ".metadata"])
    folder(".step_00000012.tmp", [META, ".metadata"])  # a save that had not finished
    folder("step_00000011", [".metadata"])  # no meta.json: not an axoplan checkpoint
    folder("notes", [META, ".metadata"])
    assert [p.name for p in checkpoints(tmp_path)] == ["step_00000002", "step_00000010"]


def test_resumed_runs_equal_uninterrupted_ones_bit_for_bit(tmp_path):
    pytest.importorskip("torch")
    from axoplan.runtime import resumecheck

    results = resumecheck.run_world(4, folder=str(tmp_path))
    assert [(r["grid"], r["pp"]) for r in results] == [(list(g), pp) for g, pp in resumecheck.CASES]
    for r in results:
        assert len(r["whole"]) == resumecheck.STEPS
        assert r["resumed"] == r["whole"], r["grid"]
    # each rank wrote its own shards; the continued run kept its run id and recorded the resume
    ckpt = tmp_path / "grid0" / "part" / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    recs = [json.loads(x) for x in (tmp_path / "grid0" / "part" / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in recs if r["event"] == "start"]
    assert [s["resumed_from_step"] for s in starts] == [None, 3] and len({r["run_id"] for r in recs}) == 1
    # a pipeline's checkpoint holds both stages' blocks (each stage's own keys), and its losses are real ones
    from torch.distributed.checkpoint import FileSystemReader

    i = next(i for i, (_, pp) in enumerate(resumecheck.CASES) if pp > 1)
    keys = FileSystemReader(str(tmp_path / f"grid{i}" / "part" / "checkpoints" / "step_00000003")).read_metadata()
    blocks = {k.split("/")[1].split(".")[1] for k in keys.state_dict_metadata if k.startswith("model/blocks.")}
    assert blocks == {"0", "1"} and all(float.fromhex(loss) > 0 for _, loss, _ in results[i]["whole"])
