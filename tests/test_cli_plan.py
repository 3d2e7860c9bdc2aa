"""`axoplan rank | explain | models | profiles` through the real entry point (axoplan.cli.main.main):
output formats parse, --output writes the file, and every error a user can cause is one line
"error: ..." with exit code 2 and no traceback."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import axoplan
from axoplan.cli.main import main


COLUMNS = ["rank", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "batch_time_s", "compute_s",
           "comm_s", "exposed_comm_s", "memory_gib", "tflops_per_gpu", "pct_of_peak", "feasible", "reason",
           "pp", "vpp", "schedule", "bubble_s", "batch_time_exact",
           "tied", "expected_error"]


@pytest.fixture
def cli(capsys):
    def _run(*args):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        return e.value.code, out, err

    return _run


@pytest.fixture
def job(model_yaml, pm_path):
    """Options for a tiny model on 16 GPUs of the fixture machine, global batch 32."""
    return ["-m", model_yaml(), "-p", pm_path, "-g", "16", "-b", "32"]


def assert_user_error(code, out, err, *words):
    assert code == 2, (code, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    for w in words:
        assert str(w) in lines[0], (w, err)


# ---- output ------------------------------------------------------------------------------------
def test_rank_table(cli, job):
    code, out, err = cli("rank", *job, "--top", "3")
    assert code == 0, err
    assert "test-tiny on 16 x pm-test GPUs" in out
    assert "feasible" in out and "candidates" in out
    body = [line for line in out.splitlines() if " x " in line and "│" in line]
    assert len(body) == 3


def test_rank_csv_matches_api(cli, job):
    code, out, _ = cli("rank", *job, "--format", "csv")
    assert code == 0
    df = pd.read_csv(io.StringIO(out))
    assert list(df.columns) == COLUMNS
    assert df["rank"].tolist() == list(range(1, 11))  # --top defaults to 10
    api = axoplan.rank(job[1], job[3], 16, 32, top=10)
    np.testing.assert_allclose(df["batch_time_s"], api["batch_time_s"], rtol=1e-9)
    assert df[["gx", "gy", "gz", "gdata"]].values.tolist() == api[["gx", "gy", "gz", "gdata"]].values.tolist()


def test_rank_json_all(cli, job):
    code, out, _ = cli("rank", *job, "--format", "json", "--all")
    assert code == 0
    recs = json.loads(out)
    assert all(list(r) == COLUMNS for r in recs)
    feas = [r for r in recs if r["feasible"]]
    infeas = [r for r in recs if not r["feasible"]]
    assert feas and infeas
    assert [r["rank"] for r in feas] == list(range(1, len(feas) + 1))
    assert all(r["rank"] is None and r["reason"] for r in infeas)
    times = [r["batch_time_s"] for r in feas]
    assert times == sorted(times)


def test_rank_output_file(cli, job, tmp_path):
    dest = tmp_path / "sub" / "ranked.csv"
    dest.parent.mkdir()
    code, out, err = cli("rank", *job, "--format", "csv", "--top", "4", "--output", dest)
    assert code == 0 and out == ""
    assert f"wrote {dest}" in err
    df = pd.read_csv(dest)
    assert list(df.columns) == COLUMNS and len(df) == 4
    code, _, _ = cli("rank", *job, "--output", tmp_path / "table.txt")
    assert code == 0 and "test-tiny on 16" in (tmp_path / "table.txt").read_text()


def test_rank_no_overlap_and_filters(cli, job):
    code, out, _ = cli("rank", *job, "--no-overlap")
    assert code == 0 and "overlap (OAR/ORS/OAG) modelled as off" in out
    _, on, _ = cli("rank", *job, "--format", "csv", "--top", "1")
    _, off, _ = cli("rank", *job, "--format", "csv", "--top", "1", "--no-overlap")
    assert pd.read_csv(io.StringIO(off))["batch_time_s"][0] >= pd.read_csv(io.StringIO(on))["batch_time_s"][0]
    code, out, _ = cli("rank", *job, "--format", "csv", "--order", "yxz", "--micro-batch", "2", "--checkpointing", "on")
    df = pd.read_csv(io.StringIO(out))
    assert code == 0 and set(df["order"]) == {"yxz"} and set(df["micro_batch"]) == {2} and df["checkpointing"].all()


def test_explain_table_and_json(cli, job):
    code, out, err = cli("explain", *job, "--grid", "2,4,1,2", "--order", "yxz")
    assert code == 0, err
    for title in ("configuration", "collectives per step", "layer windows", "memory per GPU"):
        assert title in out
    code, out, _ = cli("explain", *job, "--grid", "2,4,1,2", "--order", "yxz", "--format", "json",
                       "--micro-batch", "2", "--checkpointing", "off")
    assert code == 0
    ex = json.loads(out)
    assert list(ex["summary"]) == COLUMNS
    s = ex["summary"]
    assert (s["gx"], s["gy"], s["gz"], s["gdata"], s["order"], s["micro_batch"], s["checkpointing"]) == \
        (2, 4, 1, 2, "yxz", 2, False)
    rows = {(c["layer"], c["phase"], c["collective"]): c for c in ex["collectives"]}
    # qkv forward all-reduce over X: T * (192/gy) * 2 bytes with T = 2 * 64 tokens
    assert rows[("qkv", "fwd", "all_reduce")]["bytes"] == 128 * 48 * 2
    assert rows[("qkv", "fwd", "all_reduce")]["axis"] == "x"
    assert not any(c["axis"] == "z" for c in ex["collectives"])  # gz = 1: no Z collectives
    assert {m["kind"] for m in ex["memory"]} >= {"total (peak)", "activations"}


def test_explain_shows_a_deep_pipelines_like_stages_once(cli, monkeypatch):
    """GPT-1T over 64 stages of 2 virtual stages each: the 126 middle virtual stages time alike, so the table shows
    each pass as its first stage, one row for the middle ones and its last stage, and says so; the JSON keeps every
    stage."""
    monkeypatch.setenv("COLUMNS", "200")
    job = ["-m", "gpt-1t", "-p", "dgx-a100", "-g", "3072", "-b", "3072", "--grid", "1,8,1,6", "--pp", "64",
           "--vpp", "2", "-e", "megatron-core"]
    code, out, err = cli("explain", *job)
    assert code == 0, err
    table = out[out.index("layer windows"):out.index("memory per GPU")]
    assert table.count("stages 1-126, 1 block each") == 2 and table.count("stage 127 (rank 63, 1 block)") == 2
    assert "stage 5 " not in table
    assert "256 stage rows as 6; --format json lists every stage" in out
    code, out, _ = cli("explain", *job, "--format", "json")
    layers = [w["layer"] for w in json.loads(out)["windows"]]
    assert len(layers) == 256 and layers[2] == "stage 1 (rank 1, 1 block)"


def test_models_and_profiles(cli, pm_path, monkeypatch):
    code, out, _ = cli("models")
    assert code == 0 and "gpt-tiny" in out and "hidden" in out
    monkeypatch.setenv("AXOPLAN_PROFILES", str(pm_path.parent))
    code, out, _ = cli("profiles")
    assert code == 0 and "pm-test" in out


# ---- errors --------------------------------------------------------------------------------------
def test_unknown_model(cli, pm_path):
    assert_user_error(*cli("rank", "-m", "no-such-model", "-p", pm_path, "-g", 4, "-b", 8),
                      "unknown model 'no-such-model'", "gpt-tiny")


def test_unknown_machine(cli, model_yaml):
    assert_user_error(*cli("rank", "-m", model_yaml(), "-p", "no-such-machine", "-g", 4, "-b", 8),
                      "unknown machine 'no-such-machine'")


def test_malformed_model_yaml(cli, tmp_path, pm_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: broken\nhidden: [64\nn_layers: 2\n")
    assert_user_error(*cli("rank", "-m", bad, "-p", pm_path, "-g", 4, "-b", 8), str(bad), "malformed YAML")


def test_unknown_and_bad_model_fields(cli, model_yaml, pm_path):
    path = model_yaml(name="typo", hiden=64)
    assert_user_error(*cli("rank", "-m", path, "-p", pm_path, "-g", 4, "-b", 8), str(path), "unknown field 'hiden'")
    path = model_yaml(name="oddheads", hidden=64, n_heads=6)
    assert_user_error(*cli("rank", "-m", path, "-p", pm_path, "-g", 4, "-b", 8), str(path), "n_heads")
    path = model_yaml(name="missing", n_layers=None)
    assert_user_error(*cli("rank", "-m", path, "-p", pm_path, "-g", 4, "-b", 8), str(path), "n_layers")


def test_malformed_profile(cli, model_yaml, write_profile):
    path = write_profile(raw="name: x\nmemory: {capacity_gib: 40\n", name="brokenprof")
    assert_user_error(*cli("rank", "-m", model_yaml(), "-p", path, "-g", 4, "-b", 8), str(path), "malformed YAML")


@pytest.mark.parametrize("gpus", [0, -3])
def test_bad_gpus(cli, model_yaml, pm_path, gpus):
    assert_user_error(*cli("rank", "-m", model_yaml(), "-p", pm_path, "--gpus", gpus, "-b", 8), "--gpus")


def test_batch_no_configuration_divides(cli, model_yaml, pm_path):
    # 3 GPUs, 2 sequences: gx*gy = 3 breaks hidden 64 and 8 heads, gdata*gz = 3 does not divide 2
    assert_user_error(*cli("rank", "-m", model_yaml(), "-p", pm_path, "-g", 3, "-b", 2),
                      "no configuration", "global batch 2")


def test_nothing_fits(cli, model_yaml, write_profile):
    prof = write_profile(capacity_gib=1e-6, headroom_gib=0)
    assert_user_error(*cli("rank", "-m", model_yaml(), "-p", prof, "-g", 4, "-b", 8), "nothing fits")


@pytest.mark.parametrize("grid,words", [("2,2", "--grid"), ("a,b,c,d", "--grid"), ("2,2,0,4", "--grid"),
                                        ("2,2,2,4", "multiplies to 32")])
def test_bad_grid(cli, job, grid, words):
    assert_user_error(*cli("explain", *job, "--grid", grid), words)


def test_bad_top_and_usage_errors(cli, job):
    assert_user_error(*cli("rank", *job, "--top", 0), "--top")
    assert_user_error(*cli("rank", "-m", "gpt-tiny"), "Missing option")
    assert_user_error(*cli("rank", *job, "--order", "abc"), "--order")
    assert_user_error(*cli("rank", *job, "--gpus", "many"), "many")


def test_real_process_exit_code_and_stderr(model_yaml, pm_path):
    """The installed entry point as a user runs it: a separate Python process."""
    bad = subprocess.run([sys.executable, "-m", "axoplan.cli", "rank", "-m", "no-such-model", "-p", str(pm_path),
                          "-g", "4", "-b", "8"], capture_output=True, text=True, timeout=120)
    assert_user_error(bad.returncode, bad.stdout, bad.stderr, "unknown model")
    ok = subprocess.run([sys.executable, "-m", "axoplan.cli", "rank", "-m", str(model_yaml()), "-p", str(pm_path),
                         "-g", "8", "-b", "16", "--format", "json", "--top", "2"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert [r["rank"] for r in json.loads(ok.stdout)] == [1, 2]


def test_one_option_vocabulary_across_commands(cli, job):
    """A count of candidates is --top everywhere (validate's --top-k an alias); every command that plans or runs
    a configuration takes --execution, and those running the bundled trainer refuse another in one sentence."""
    import click

    from axoplan.cli.main import cli as group

    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        for p in group.get_command(ctx, name).params:
            if "top" in p.name:
                assert p.opts[0] == "--top", (name, p.opts)
        if name in ("rank", "explain", "scale", "validate", "dryrun"):
            assert "--execution" in [o for p in group.get_command(ctx, name).params for o in p.opts], name
    validate = group.get_command(ctx, "validate")
    for alias in ("--top", "--top-k", "-k"):
        assert validate.make_context("validate", [alias, "3"]).params["top_k"] == 3
    for command, extra in (("validate", ["--top", "3"]), ("dryrun", ["--grid", "1,1,16,1"])):
        code, out, err = cli(command, *job, *extra, "--execution", "megatron-core")
        assert_user_error(code, out, err, "runs the bundled trainer", "megatron-core")


def test_tables_fit_100_columns_names_whole_units_scaled(cli, monkeypatch):
    """At 100 columns: every line fits, every profile and model name is printed whole, the rank table leaves
    out columns by priority and says which, and CPU-sized numbers read in MiB and GFLOP/s."""
    from axoplan.planner.profile_reader import profile_names
    from axoplan.planner.specs import preset_names

    monkeypatch.setenv("COLUMNS", "100")
    for command, names in (("profiles", profile_names()), ("models", preset_names())):
        code, out, err = cli(command)
        assert code == 0, err
        assert max(len(x) for x in out.splitlines()) <= 100, out
        cells = {x.split("│")[1].strip() for x in out.splitlines() if x.startswith("│")}
        assert set(names) <= cells, (command, set(names) - cells)
    code, out, err = cli("rank", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4",
                         "--global-batch", "16", "--top", "3")
    assert code == 0, err
    assert max(len(x) for x in out.splitlines()) <= 100, out
    assert "mem MiB" in out and "mem GiB" not in out and "left out to fit 100 columns: GFLOP/s/GPU" in out
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = cli("rank", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4",
                         "--global-batch", "16", "--top", "3")
    assert "GFLOP/s/GPU" in out and "left out" not in out
    code, out, err = cli("rank", "--model", "gpt-20b", "--machine", "perlmutter", "--gpus", "64",
                         "--global-batch", "512", "--top", "3")
    assert "mem GiB" in out and "TFLOP/s/GPU" in out
