"""Issue 27, silent wrong answers: validate --resume refuses inputs that changed; emit refuses a layout
its launcher cannot start; every key of a profile is checked at every level; every quantity a command
prints or writes is finite, or the input that made it otherwise is refused; refit and train refuse what
they cannot honour; preset names are names, not paths."""
from __future__ import annotations

import json
import math
import os

import pytest
from conftest import one_sentence, profile_dict, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan.errors import UserError

SUMMARY = "echo '{\"summary\": true, \"median_batch_time_s\": 0.1}'"


def _sweep(machine, top_k=2):
    from axoplan.loop import validate as V

    return V.Sweep(model="gpt-tiny", machine=str(machine), gpus=4, global_batch=8, top_k=top_k, steps=4,
                   warmup_steps=1, timeout_s=60.0)


def test_validate_resume_refuses_a_profile_that_changed(tmp_path, write_profile):
    from axoplan.loop import validate as V

    prof = write_profile()
    out = tmp_path / "sweep"
    calls = []

    def launcher(run_dir, gpus):
        calls.append(run_dir.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the sweep is interrupted after its first run
        return ["bash", "-c", SUMMARY], {}

    with pytest.raises(KeyboardInterrupt):
        V.run_sweep(_sweep(prof), out, echo=lambda s: None, launcher=launcher)
    # the profile is edited before the resume: every prediction grows alike, the ranking stays
    write_profile(corrections={"step_overhead_s": 0.05})
    with pytest.raises(UserError, match="changed since the sweep") as e:
        V.run_sweep(_sweep(prof), out, resume=True, echo=lambda s: None, launcher=launcher)
    assert "\n" not in str(e.value) and len(calls) == 2


# ---- emit: a layout its launcher can start -------------------------------------------------------------
@pytest.mark.parametrize("gpus", [5, 6, 7, 10, 12 + 2])
def test_emit_refuses_gpus_that_do_not_fill_whole_nodes(tmp_path, capsys, gpus):
    code, _, err = run_cli(["emit", "--model", "gpt-tiny", "--machine", "perlmutter", "--gpus", str(gpus),
                            "--global-batch", "840", "--out", str(tmp_path / "run")], capsys)
    one_sentence(code, err)
    assert "whole number of nodes" in err and not (tmp_path / "run").exists()


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 4096), per=st.integers(1, 64))
def test_every_layout_the_launcher_accepts_starts_exactly_the_grid(gpus, per):
    from types import SimpleNamespace

    from axoplan.loop.launch import check_layout

    prof = SimpleNamespace(gpus_per_node=per, name="p")
    try:
        nodes, ranks = check_layout(gpus, prof)
    except UserError:
        assert gpus > per and gpus % per
    else:
        assert nodes * ranks == gpus and ranks <= per


def test_emit_refuses_warmup_not_below_steps(tmp_path, capsys):
    code, _, err = run_cli(["emit", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4",
                            "--global-batch", "8", "--steps", "3", "--warmup", "3", "--out", str(tmp_path / "r")],
                           capsys)
    one_sentence(code, err)
    assert "--warmup" in err and not (tmp_path / "r").exists()


# ---- train: what it cannot honour ----------------------------------------------------------------------
@pytest.mark.parametrize("cfg, key", [({"lr": 1e30}, "lr"), ({"lr": 2.0}, "lr"),
                                      ({"steps": 3, "timing_warmup_steps": 3}, "timing_warmup_steps"),
                                      ({"steps": 2, "timing_warmup_steps": 5}, "timing_warmup_steps")])
def test_train_config_refuses_what_the_trainer_cannot_honour(cfg, key):
    from axoplan.runconfig import config_from_dict

    with pytest.raises(UserError, match=key):
        config_from_dict(cfg)


@pytest.mark.parametrize("env", [{"RANK": "0", "WORLD_SIZE": "1"},
                                 {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "notaport"},
                                 {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "70000"},
                                 {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "", "MASTER_PORT": "29500"}])
def test_a_torchrun_style_environment_is_checked_like_srun(tmp_path, capsys, monkeypatch, env):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "c.yaml").write_text(f"model: gpt-tiny\nmetrics: {tmp_path / 'm.jsonl'}\nsteps: 2\ntiming_warmup_steps: 1\n")
    code, _, err = run_cli(["train", "--config", str(tmp_path / "c.yaml")], capsys)
    one_sentence(code, err)
    assert "MASTER_" in err


def test_train_refuses_a_model_too_large_for_this_host(tmp_path, capsys, monkeypatch):
    from axoplan.runtime import train as T

    monkeypatch.setattr(T, "host_memory_available", lambda: 8 * 2**30)
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "c.yaml").write_text(f"model: gpt-10b\nbackend: gloo\nglobal_batch: 1\nmicro_batch: 1\n"
                                     f"metrics: {tmp_path / 'm.jsonl'}\n")
    code, _, err = run_cli(["train", "--config", str(tmp_path / "c.yaml")], capsys)
    one_sentence(code, err)
    assert "GiB" in err and "available" in err


def test_a_diverged_loss_stops_training_instead_of_writing_nan(tmp_path, monkeypatch):
    import torch

    from axoplan.runconfig import config_from_dict
    from axoplan.runtime import train as T

    metrics = tmp_path / "m.jsonl"
    cfg = config_from_dict({"model": "gpt-tiny", "steps": 3, "timing_warmup_steps": 1, "global_batch": 2, "micro_batch": 1,
                            "seq_len": 16, "metrics": str(metrics), "backend": "gloo", "out": str(tmp_path)})
    trainer = T.Trainer.from_config(cfg)
    real = trainer.train_step

    def diverging(step):
        out = real(step)
        return dict(out, loss=float("nan")) if step == 1 else out

    monkeypatch.setattr(trainer, "train_step", diverging)
    try:
        with pytest.raises(UserError, match="loss became nan"):
            trainer.fit()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for line in metrics.read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))


# ---- preset names are names ----------------------------------------------------------------------------
def test_a_preset_name_that_is_a_path_is_refused(tmp_path, capsys, monkeypatch):
    from axoplan.planner.specs import _preset_dir

    d = tmp_path / "x"
    d.mkdir()
    (d / "m.yaml").write_text("name: m\nn_layers: 2\nhidden: 64\nn_heads: 8\nvocab: 256\nseq_len: 64\n")
    rel = os.path.relpath(d / "m", str(_preset_dir()))
    monkeypatch.chdir(tmp_path.parent)  # the relative name exists nowhere from here
    for cmd in (["rank", "--gpus", "2", "--global-batch", "4"],
                ["emit", "--gpus", "2", "--global-batch", "4", "--out", str(tmp_path / "run")]):
        code, _, err = run_cli([cmd[0], "--model", rel, "--machine", "localhost-cpu"] + cmd[1:], capsys)
        one_sentence(code, err)
        assert "unknown model" in err
    assert not (tmp_path / "run").exists()


# ---- every key of a profile, at every level ------------------------------------------------------------
def _key_paths(node, path=()):
    """Every (path to a mapping, key) in a profile dict, through lists too."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("calibration",) or (path and path[-1] == "launch" and k == "env"):
                continue
            yield path, k
            yield from _key_paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _key_paths(v, path + (i,))


def _rename(d, path, key, new):
    node = d
    for p in path:
        node = node[p]
    node[new] = node.pop(key)


FULL = profile_dict(collectives={"all_gather": {"bandwidth_scale": 1.0, "latency_scale": 1.0}},
                    corrections={"gemm_scale": 1.0})
PATHS = list(_key_paths(FULL))


@pytest.mark.parametrize("path, key, typo", [(("memory",), "headroom_gib", "headroom_gb"),
                                             (("compute", "gemm"), "dim_half", "dim_halff"),
                                             (("compute", "attention"), "backward_factor", "backwrd_factor"),
                                             (("network", "intra_node", "groups", 0), "stride", "strde")])
def test_the_issue_misspellings_are_refused(write_profile, path, key, typo):
    from axoplan.planner.profile_reader import load_profile

    d = profile_dict()
    _rename(d, path, key, typo)
    with pytest.raises(UserError, match=typo) as e:
        load_profile(str(write_profile(raw=d, name="typo")))
    assert f"did you mean '{key}'" in str(e.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(i=st.integers(0, len(PATHS) - 1), extra=st.sampled_from(["x", "_", "s", "2"]))
def test_a_misspelled_key_at_any_level_is_refused(write_profile, i, extra):
    import copy

    from axoplan.planner.profile_reader import load_profile

    path, key = PATHS[i]
    d = copy.deepcopy(FULL)
    _rename(d, path, key, f"{key}{extra}")
    with pytest.raises(UserError) as e:  # never loaded with a default in its place
        load_profile(str(write_profile(raw=d, name="typo")))
    assert f"{key}{extra}'" in str(e.value) or f"{key}' " in str(e.value), str(e.value)


def test_the_declared_corrections_are_the_fitted_ones():
    import dataclasses

    from axoplan.planner.machine import Corrections
    from axoplan.planner.profile_reader import CORRECTIONS_KEYS

    assert set(CORRECTIONS_KEYS) - {"source"} == {f.name for f in dataclasses.fields(Corrections)}


@pytest.mark.parametrize("name", ["alps", "dgx-a100", "dgx-h100", "dgx-h200", "frontier", "localhost-cpu",
                                  "perlmutter"])
def test_every_bundled_profile_keeps_to_the_schema(name):
    from axoplan.planner.profile_reader import load_profile

    load_profile(name)


# ---- every quantity shown is finite ----------------------------------------------------------------
NUMERIC_FIELDS = [("memory", "bandwidth_gbs"), ("memory", "elementwise_efficiency"), ("memory", "capacity_gib"),
                  ("compute", "peak_tflops"), ("compute", "kernel_overhead_us"), ("compute", "gemm", "ceiling_tflops"),
                  ("compute", "gemm", "dim_half"), ("compute", "attention", "tflops"),
                  ("compute", "attention", "backward_factor"), ("network", "intra_node", "latency_us"),
                  ("network", "intra_node", "groups", 0, "busbw_gbs"), ("network", "inter_node", "busbw_gbs"),
                  ("network", "inter_node", "latency_us")]
EXTREMES = [1e-300, 1e-30, 1e-12, 1e-9, 1e9, 1e12, 1e30, 1e300, 1e308]


def _set(d, path, v):
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = v


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(NUMERIC_FIELDS), value=st.sampled_from(EXTREMES), fmt=st.sampled_from(["csv", "json"]))
def test_rank_shows_only_finite_numbers_or_refuses_the_profile(write_profile, capsys, path, value, fmt):
    d = profile_dict()
    _set(d, path, value)
    if path[-1] == "peak_tflops":  # the ceilings may not exceed the peak: scale them along
        d["compute"]["gemm"]["ceiling_tflops"] = d["compute"]["attention"]["tflops"] = min(value, 280)
    prof = write_profile(raw=d, name="extreme")
    code, out, err = run_cli(["rank", "--model", "gpt-tiny", "--machine", str(prof), "--gpus", "4",
                              "--global-batch", "8", "--format", fmt], capsys)
    if code != 0:
        one_sentence(code, err)
        return
    if fmt == "json":
        rows = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))
        values = [r[k] for r in rows for k in ("batch_time_s", "comm_s", "exposed_comm_s", "pct_of_peak")]
        assert all(v is not None and math.isfinite(v) for v in values), rows[0]
    else:
        body = out.lower()
        assert "inf" not in body and "nan" not in body, out[:300]


def test_an_attention_throughput_above_the_peak_is_refused(write_profile):
    from axoplan.planner.profile_reader import load_profile

    d = profile_dict()
    d["compute"]["attention"]["throughput"] = [{"seq": 64, "head_dim": 8, "fwd_tflops": 400, "bwd_tflops": 100,
                                                "source": "test"}]
    with pytest.raises(UserError, match="above compute.peak_tflops"):
        load_profile(str(write_profile(raw=d, name="attn")))


@settings(max_examples=30, deadline=None)
@given(seconds=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**12)))
def test_the_slurm_time_limit_is_a_time_or_one_sentence(seconds):
    from axoplan.slurm import slurm_time

    try:
        t = slurm_time(seconds)
    except UserError as e:
        assert "\n" not in str(e) and not (math.isfinite(seconds) and seconds <= 365 * 86400)
    else:
        h, m, s = map(int, t.split(":"))
        assert h * 3600 + m * 60 + s >= seconds
