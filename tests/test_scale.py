"""axoplan scale: parsing, limiting cases of the scaling sweep, and the CLI's outputs and errors."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from axoplan.cli.main import main
from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile
from axoplan.studies.scale import (COLUMNS, format_duration, parse_gpus, parse_pairs, parse_tokens, strong_scaling,
                           weak_scaling)
from axoplan.planner.specs import load_model

INF = 1e30  # bytes/s: "unlimited" bandwidth, finite so that nothing divides inf by inf


def unlimited(name="dgx-h100"):
    """A profile whose communication costs nothing: huge bandwidth everywhere, zero latency per ring
    step, and no fixed cost per kernel launch (a launch overhead is a latency too)."""
    import dataclasses

    p = load_profile(name)
    return p.replace(inter_busbw=INF, intra_groups=tuple((s, st, INF) for s, st, _ in p.intra_groups),
                     intra_latency=0.0, inter_latency=0.0, kernel_overhead=0.0,
                     # NCCL's per-call base too, and no protocol model (its latencies live in network.protocols)
                     physics=dataclasses.replace(p.physics, base_latency=0.0, protocols=None))


# ---- parsing -----------------------------------------------------------------------------
def test_parse_gpus_lists_and_ranges():
    assert parse_gpus("128..8192") == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert parse_gpus("512,128,256,128") == [128, 256, 512]
    assert parse_gpus("96..768x2") == [96, 192, 384, 768]
    assert parse_gpus("8..32+8,64") == [8, 16, 24, 32, 64]
    assert parse_gpus("100..300") == [100, 200]  # the range stops at or below its end


@pytest.mark.parametrize("bad", ["", "0", "-8", "abc", "64..8", "8..64x1", "1..1000000+1", "8,,x"])
def test_parse_gpus_rejects_bad_input(bad):
    with pytest.raises(UserError):
        parse_gpus(bad)


def test_parse_tokens():
    assert parse_tokens("2T") == 2e12
    assert parse_tokens("300B") == 300e9
    assert parse_tokens("1.5e12") == 1.5e12
    assert parse_tokens("500m") == 500e6
    assert parse_tokens(1000) == 1000.0
    for bad in ("two", "2X", "0", "-1T", ""):
        with pytest.raises(UserError):
            parse_tokens(bad)


def test_parse_pairs_and_duration():
    assert parse_pairs("gpt-5b:512, gpt-10b:1024") == [("gpt-5b", 512), ("gpt-10b", 1024)]
    assert parse_pairs("./my:model.yaml:64") == [("./my:model.yaml", 64)]
    for bad in ("gpt-5b", "gpt-5b:0", ":64", ""):
        with pytest.raises(UserError):
            parse_pairs(bad)
    assert format_duration(3600 * 5) == "5.0 hours"
    assert format_duration(86400 * 10) == "10.0 days"
    assert format_duration(86400 * 365.25 * 2) == "2.0 years"
    assert format_duration(float("nan")) == ""


# ---- limiting cases ------------------------------------------------------------------------
def test_free_communication_time_falls_as_one_over_gpus():
    """With communication and memory traffic free and the micro-batch fixed, every GEMM keeps its shape
    ([mb*S, k/gx] x [k/gx, n/gy] with the best grid putting all GPUs on Z/data), so only the per-GPU share
    of the batch changes: T(G)*G must stay constant. (Memory-bound work does not scale so: each
    micro-batch accumulates its gradient into a Z shard that shrinks with G, so it is free here.)"""
    counts = [8, 16, 32, 64, 128, 256]
    df = strong_scaling("gpt-1b", unlimited().replace(mem_bandwidth=INF), counts, global_batch=1024, micro_batch=1)
    assert list(df["gpus"]) == counts and df["feasible"].all()
    t = df["batch_time_s"].to_numpy()
    work = t * np.array(counts)
    np.testing.assert_allclose(work / work[0], 1.0, rtol=1e-3)
    np.testing.assert_allclose(df["efficiency"], 1.0, rtol=1e-3)
    np.testing.assert_allclose(df["speedup"], np.array(counts) / counts[0], rtol=1e-3)
    # the same sweep on the real machine profile pays for communication: strictly less efficient at the top
    real = strong_scaling("gpt-1b", "dgx-h100", counts, global_batch=1024, micro_batch=1)
    assert real["efficiency"].iloc[-1] < 0.999
    assert (real["batch_time_s"].to_numpy() >= t * (1 - 1e-9)).all()


def test_efficiency_is_one_at_the_baseline_and_time_to_train_follows_the_batches():
    df = strong_scaling("gpt-5b", "perlmutter", [64, 128, 256], global_batch=512, tokens=2e12)
    assert df.attrs["baseline_gpus"] == 64
    assert df["efficiency"].iloc[0] == 1.0 and df["speedup"].iloc[0] == 1.0
    assert (df["efficiency"] <= 1.0 + 1e-9).all()
    tokens_per_batch = 512 * 2048
    expected = 2e12 / tokens_per_batch * df["batch_time_s"]
    np.testing.assert_allclose(df["time_to_train_s"], expected)
    np.testing.assert_allclose(df["tokens_per_s"], tokens_per_batch / df["batch_time_s"])
    np.testing.assert_allclose(df["pflops"], df["tflops_per_gpu"] * df["gpus"] / 1e3)
    assert all(s.endswith(("hours", "days", "years")) for s in df["time_to_train"])
    assert list(df.columns) == COLUMNS


def test_an_infeasible_count_keeps_its_reason_and_the_baseline_moves_up():
    # GPT-5B does not fit on one 40 GB A100 (weights + Adam state alone are ~80 GB)
    df = strong_scaling("gpt-5b", "perlmutter", [1, 64, 128], global_batch=512)
    assert not bool(df["feasible"].iloc[0]) and df["reason"].iloc[0]
    assert np.isnan(df["efficiency"].iloc[0])
    assert df.attrs["baseline_gpus"] == 64 and df["efficiency"].iloc[1] == 1.0


def test_nothing_feasible_anywhere_is_a_user_error():
    with pytest.raises(UserError):
        strong_scaling("gpt-175b", "perlmutter", [1, 2], global_batch=8)


def test_weak_scaling_pairs():
    df = weak_scaling([("gpt-5b", 64), ("gpt-10b", 128)], unlimited("perlmutter"), global_batch=512)
    assert list(df["model"]) == ["gpt-5b", "gpt-10b"] and list(df["gpus"]) == [64, 128]
    assert df["efficiency"].iloc[0] == 1.0
    # efficiency is useful FLOP per GPU-second relative to the baseline
    t = df["batch_time_s"].to_numpy()
    useful = np.array([load_model(m).flops_per_token(2048) for m in ("gpt-5b", "gpt-10b")]) * 512 * 2048
    per_gpu = useful / t / np.array([64, 128])
    assert df["efficiency"].iloc[1] == pytest.approx(per_gpu[1] / per_gpu[0])


# ---- the command ----------------------------------------------------------------------------
def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["scale", *args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_cli_table_csv_json_and_plot(tmp_path, capsys):
    base = ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64..256", "--global-batch", "512"]
    code, out, err = run_cli(base + ["--tokens", "2T"], capsys)
    assert code == 0 and "efficiency" in out and "time to train" in out and "days" in out
    code, out, _ = run_cli(base + ["--format", "csv"], capsys)
    assert code == 0
    df = pd.read_csv(__import__("io").StringIO(out))
    assert list(df.columns) == COLUMNS and list(df["gpus"]) == [64, 128, 256]
    out_json = tmp_path / "s.json"
    png = tmp_path / "s.png"
    code, out, err = run_cli(base + ["--format", "json", "--output", str(out_json), "--plot", str(png)], capsys)
    assert code == 0 and out == ""
    rows = json.loads(out_json.read_text())
    assert [r["gpus"] for r in rows] == [64, 128, 256] and rows[0]["efficiency"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_count_keeps_ranks_best_pipeline_and_its_grid_times_stages_is_the_count():
    # GPT-175B as Megatron-Core runs it on DGX H100: rank's best at these counts pipelines
    from axoplan.planner.rank import rank

    df = strong_scaling("gpt-175b", "dgx-h100", [512, 1024], global_batch=1536, execution="megatron-core")
    for _, r in df.iterrows():
        best = rank("gpt-175b", "dgx-h100", int(r["gpus"]), 1536, top=1, execution="megatron-core").iloc[0]
        assert (r["pp"], r["vpp"], r["schedule"]) == (best["pp"], best["vpp"], best["schedule"])
        assert r["batch_time_s"] == best["batch_time_s"] and r["bubble_s"] == best["bubble_s"]
        assert r["gx"] * r["gy"] * r["gz"] * r["gdata"] * r["pp"] == r["gpus"]
    assert (df["pp"] > 1).all()
    flat = strong_scaling("gpt-175b", "dgx-h100", [512, 1024], global_batch=1536, execution="megatron-core", pp=1)
    assert (flat["pp"] == 1).all() and (flat["gx"] * flat["gy"] * flat["gz"] * flat["gdata"] == flat["gpus"]).all()
    # the pipeline only where it is the best: never slower than the search without it
    assert (df["batch_time_s"] <= flat["batch_time_s"]).all()


def test_cli_shows_the_pipeline_and_takes_rank_s_pipeline_options(capsys):
    base = ["--model", "gpt-175b", "--machine", "dgx-h100", "--gpus", "8,512", "--global-batch", "1536",
            "--execution", "megatron-core"]
    code, out, _ = run_cli(base, capsys)
    head = out.splitlines()[0].split()
    assert code == 0 and "pp" in head
    row = out.splitlines()[2]  # 512 GPUs (8 GPUs: nothing fits, its reason below the table)
    assert row.split()[1] == "512" and " v" in row  # interleaved: 'pp vV'
    code, out, _ = run_cli(base + ["--pp", "1"], capsys)
    assert code == 0 and "pp" not in out.splitlines()[0].split()
    code, out, _ = run_cli(base + ["--pp", "4", "--schedule", "1f1b", "--format", "csv"], capsys)
    df = pd.read_csv(__import__("io").StringIO(out))
    ok = df[df["feasible"]]
    assert code == 0 and list(ok["pp"]) == [4] and list(ok["schedule"]) == ["1f1b"]
    # counts stay integers beside a count where nothing fits (no '1.0' cells)
    cells = dict(zip(out.splitlines()[0].split(","), out.splitlines()[2].split(",")))
    assert all(cells[c].isdigit() for c in ("gx", "gy", "gz", "gdata", "micro_batch", "pp", "vpp"))
    code, out, err = run_cli(base + ["--order", "xyzp", "--pp", "4"], capsys)
    assert code == 0, err


def test_cli_weak_mode(capsys):
    code, out, _ = run_cli(["--weak", "gpt-5b:64,gpt-10b:128", "--machine", "perlmutter", "--global-batch", "512",
                            "--format", "csv"], capsys)
    assert code == 0 and "gpt-10b,128" in out


@pytest.mark.parametrize("args", [
    ["--model", "no-such-model", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "512"],
    ["--model", "gpt-5b", "--machine", "no-such-machine", "--gpus", "64", "--global-batch", "512"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64..8", "--global-batch", "512"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "0", "--global-batch", "512"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "0"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "512", "--tokens", "lots"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "512", "--plot", "x.jpg"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--global-batch", "512"],
    ["--weak", "gpt-5b:64", "--model", "gpt-5b", "--machine", "perlmutter", "--global-batch", "512"],
    ["--weak", "gpt-5b", "--machine", "perlmutter", "--global-batch", "512"],
    ["--model", "gpt-175b", "--machine", "perlmutter", "--gpus", "1,2", "--global-batch", "8"],
    ["--model", "gpt-5b", "--machine", "perlmutter", "--gpus", "64", "--global-batch", "512", "--format", "xml"],
])
def test_cli_errors_exit_2_with_one_sentence(args, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
