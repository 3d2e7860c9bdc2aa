"""Issue 16 §4: every input mistake is one sentence and exit 2, never a traceback, a hang or a wrong
answer. Counts are bounded to what the planner can enumerate; files are bounded and text; tables and
configs are checked field by field."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import one_sentence, profile_dict, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.runconfig import config_from_dict
from axoplan.planner.profile_reader import load_profile
from axoplan.runtime.dist_env import read_env
from axoplan.planner.specs import load_model

ROOT = Path(__file__).resolve().parent.parent
TINY = (ROOT / "axoplan/presets/gpt-tiny.yaml").read_text()
JOB = ["--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "2", "--global-batch", "4"]



def _set(argv, opt, value):
    argv = list(argv)
    if opt in argv:
        argv[argv.index(opt) + 1] = value
    else:
        argv += [opt, value]
    return argv


# ---- numbers ------------------------------------------------------------------------------------------
@given(st.one_of(st.integers(), st.text(max_size=30), st.floats(allow_nan=True), st.booleans(), st.none()))
def test_count_is_in_range_or_a_user_error(v):
    try:
        n = inputs.count(v, "--n", 1, 1000)
    except UserError as e:
        assert "--n" in str(e) and len(str(e)) < 200
    else:
        assert isinstance(n, int) and 1 <= n <= 1000


@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.integers()))
def test_number_is_finite_or_a_user_error(v):
    try:
        x = inputs.number(v, "--lr", lo=0, lo_open=True)
    except UserError:
        return
    assert math.isfinite(x) and x > 0


BAD_COUNTS = ["1e20", str(2**63), str(2**70), "10" + "0" * 20, "²", "٤", "-1", "0", "1.5", "2^63", "", "0x10"]


@pytest.mark.parametrize("opt", ["--gpus", "--global-batch", "--seq-len", "--micro-batch"])
@pytest.mark.parametrize("value", BAD_COUNTS)
def test_rank_refuses_every_bad_count_in_one_sentence(capsys, opt, value):
    one_sentence(*run_cli(_set(["rank"] + JOB, opt, value), capsys)[::2])


@pytest.mark.parametrize("cmd", [["emit", "--out", "x"], ["explain", "--grid", "1,1,1,2"], ["validate", "--slurm"]])
@pytest.mark.parametrize("value", ["1e20", str(2**63), "²", "0"])
def test_every_command_bounds_its_counts_the_same_way(tmp_path, capsys, monkeypatch, cmd, value):
    monkeypatch.chdir(tmp_path)
    one_sentence(*run_cli(_set([cmd[0]] + JOB + cmd[1:], "--gpus", value), capsys)[::2])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("spec", ["²", "1..²", "2,1e20", str(2**63), "1..1048577"])
def test_scale_refuses_bad_gpu_counts(capsys, spec):
    code, _, err = run_cli(["scale", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", spec,
                            "--global-batch", "8"], capsys)
    one_sentence(code, err)


def test_a_gpu_count_with_too_many_factorizations_is_refused_quickly(capsys):
    code, _, err = run_cli(["rank", "--model", "gpt-1t", "--machine", "frontier", "--gpus", "997920",
                            "--global-batch", "16216200"], capsys)
    one_sentence(code, err)
    assert "candidate configurations" in err


def test_seq_len_zero_is_refused_not_replaced_by_the_models(capsys):
    one_sentence(*run_cli(["rank"] + JOB + ["--seq-len", "0"], capsys)[::2])
    from axoplan.planner.rank import rank

    with pytest.raises(UserError, match="--seq-len"):
        rank("gpt-tiny", "localhost-cpu", 2, 4, seq_len=0)


def test_emit_rank_zero_is_refused(tmp_path, capsys):
    one_sentence(*run_cli(["emit"] + JOB + ["--rank", "0", "--out", str(tmp_path / "r")], capsys)[::2])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv", [["--seed", "-1"], ["--seed", "1.5"], ["--weight-decay", "nan"],
                                  ["--weight-decay", "-1"], ["--lr", "inf"], ["--lr", "0"], ["--repeats", "1e9"]])
def test_memorization_refuses_bad_numbers(capsys, argv):
    one_sentence(*run_cli(["memorization", "--model", "gpt-tiny"] + argv, capsys)[::2])


# ---- model and YAML files -----------------------------------------------------------------------------
def _files(tmp_path) -> dict:
    big_int = TINY.replace("n_layers: 2", "n_layers: 1" + "0" * 5000)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    files = {
        "binary.yaml": b"\x89PNG\r\n\x1a\n\x00\x00\x00",
        "utf16.yaml": TINY.encode("utf-16"),
        "latin1.yaml": "name: caf\xe9\n".encode("latin-1"),
        "deep.yaml": b"[" * 100_000,
        "deepmap.yaml": ("a:\n" + "".join("  " * i + "a:\n" for i in range(1, 200))).encode(),
        "bigint.yaml": big_int.encode(),
        "hugeint.yaml": TINY.replace("n_layers: 2", "n_layers: " + "9" * 400).encode(),
        "laughs.yaml": laughs.encode(),
        "large.yaml": b"# " + b"x" * (5 * 2**20) + b"\n",
        "many_values.yaml": b"a:\n" + b"- 1\n" * 200_000,
        "name_null.yaml": TINY.replace("name: gpt-tiny", "name: null").encode(),
        "name_list.yaml": TINY.replace("name: gpt-tiny", "name: [a, b]").encode(),
        "name_newline.yaml": TINY.replace("name: gpt-tiny", 'name: "a\\nb"').encode(),
        "float_layers.yaml": TINY.replace("n_layers: 2", "n_layers: 2.5").encode(),
        "list.yaml": b"- 1\n- 2\n",
        "intkeys.yaml": b"1: 2\nname: x\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return files


def test_tiny_preset_has_the_fields_the_file_tests_edit():
    assert "n_layers: 2" in TINY and "name: gpt-tiny" in TINY


def test_every_bad_model_file_is_one_sentence_and_fast(tmp_path, capsys):
    import time

    for name in _files(tmp_path):
        t0 = time.perf_counter()
        code, _, err = run_cli(["rank", "--model", str(tmp_path / name), "--machine", "localhost-cpu", "--gpus", "2",
                                "--global-batch", "4"], capsys)
        one_sentence(code, err)
        assert time.perf_counter() - t0 < 10, name


def test_every_bad_file_as_a_profile_or_a_train_config_is_a_user_error(tmp_path):
    from axoplan.runconfig import load_config

    for name in _files(tmp_path):
        for load in (load_profile, load_config):
            with pytest.raises(UserError):
                load(str(tmp_path / name))


def test_load_model_refuses_name_types():
    with pytest.raises(UserError, match="name"):
        load_model("does\nnot-exist")


# ---- machine profiles ---------------------------------------------------------------------------------
def _write(tmp_path, d, name="p.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return str(p)


def test_a_gemm_ceiling_above_the_peak_is_refused(tmp_path):
    with pytest.raises(UserError, match="ceiling_tflops.*above compute.peak_tflops"):
        load_profile(_write(tmp_path, profile_dict(ceiling_tflops=627, peak_tflops=312)))
    with pytest.raises(UserError, match="attention.tflops"):
        load_profile(_write(tmp_path, profile_dict(attn_tflops=400, peak_tflops=312)))


def test_a_huge_gpus_per_node_is_refused_without_hanging(tmp_path):
    with pytest.raises(UserError, match="gpus_per_node"):
        load_profile(_write(tmp_path, profile_dict(gpus_per_node=100000)))


def test_many_gpus_per_node_plan_without_a_per_node_table(tmp_path):
    # a big node (allowed) must not build a gpus_per_node^2 table in Python
    import time

    p = load_profile(_write(tmp_path, profile_dict(gpus_per_node=4096)))
    t0 = time.perf_counter()
    bw = p.group_busbw(np.array([2, 4, 4096]), np.array([1, 2, 1]))
    assert np.all(bw > 0) and time.perf_counter() - t0 < 1


@pytest.mark.parametrize("row", ["1,1,1,NN,inf", "1,1,NN,1e-3", "1,1,1,NN,nan", "1,1,1,NN,-1", "a,1,1,NN,1"])
def test_a_bad_gemm_table_row_is_refused(tmp_path, row):
    (tmp_path / "g.csv").write_text("m,n,k,layout,seconds\n1,1,1,NN,1e-6\n" + row + "\n")
    with pytest.raises(UserError, match="compute.gemm.table.path"):
        load_profile(_write(tmp_path, profile_dict(gemm_table="g.csv")))


@pytest.mark.parametrize("row", ["1,1,64,8,true,forward,inf", "1,1,64,8,true,forward", "1,1,64,8,true,forward,1,2"])
def test_a_bad_attention_table_row_is_refused(tmp_path, row):
    (tmp_path / "a.csv").write_text("batch,heads,seq,head_dim,causal,pass,seconds\n" + row + "\n")
    d = profile_dict()
    d["compute"]["attention"]["table"] = {"path": "a.csv", "source": "t"}
    with pytest.raises(UserError, match="attention.table.path"):
        load_profile(_write(tmp_path, d))


@pytest.mark.parametrize("content", [b"\x00\x01binary", "m,n\n".encode("utf-16")])
def test_a_binary_table_is_refused(tmp_path, content):
    (tmp_path / "g.csv").write_bytes(content)
    with pytest.raises(UserError, match="compute.gemm.table.path"):
        load_profile(_write(tmp_path, profile_dict(gemm_table="g.csv")))


BAD_VALUES = [None, "x", -1, 0, float("nan"), float("inf"), [], {}, [1, 2], 10**400, True, "a\nb"]


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


PROFILE_PATHS = list(_paths(profile_dict()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PROFILE_PATHS), value=st.sampled_from(BAD_VALUES))
def test_any_field_of_a_profile_set_to_nonsense_loads_or_is_a_user_error(tmp_path, path, value):
    d = profile_dict()
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    p = tmp_path / "fuzz.yaml"
    p.write_text(yaml.safe_dump(d))
    try:
        load_profile(str(p))
    except UserError as e:
        assert "\n" not in str(e)


def test_profiles_lists_a_broken_profile_as_invalid(tmp_path, capsys, monkeypatch):
    d = tmp_path / "profiles"
    d.mkdir()
    (d / "broken.yaml").write_text("bad: [\n")
    (d / "binary.yaml").write_bytes(b"\x00\xff")
    _write(d, profile_dict(name="good"), "good.yaml")
    monkeypatch.setenv("AXOPLAN_PROFILES", str(d))
    code, out, err = run_cli(["profiles"], capsys)
    assert code == 0, err
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "invalid" in rows["broken"] and "invalid" in rows["binary"] and "invalid" not in rows["good"]


def test_a_local_profile_shadowing_a_bundled_one_is_named_on_stderr(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "machine_profiles").mkdir()
    (tmp_path / "machine_profiles/localhost-cpu.yaml").write_text((ROOT / "machine_profiles/perlmutter.yaml").read_text())
    code, _, err = run_cli(["rank"] + JOB + ["--top", "1"], capsys)
    assert code == 0
    assert "note: machine 'localhost-cpu' is the local file" in err and "instead of the bundled one" in err


# ---- trainer config and environment -------------------------------------------------------------------
BAD_CONFIG = [("lr", "abc"), ("lr", -1), ("lr", float("nan")), ("lr", float("inf")), ("lr", 0), ("grad_clip", -1),
              ("grad_clip", "x"), ("weight_decay", [1]), ("weight_decay", float("nan")), ("seed", -1), ("seed", "a"),
              ("seed", 1.5), ("seed", 2**40), ("data", 5), ("data", None), ("metrics", 5), ("model", None),
              ("model", "a\nb"), ("steps", 10**12), ("global_batch", 2**40), ("checkpointing", "yes"),
              ("overlap", {"all_reduce": "no"}), ("grid", {"gx": 2**21}), ("save", [])]


@pytest.mark.parametrize("key,value", BAD_CONFIG)
def test_a_bad_trainer_config_value_is_one_sentence(key, value):
    with pytest.raises(UserError, match=key):
        config_from_dict({key: value})


def test_a_metrics_folder_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError, match="metrics 'm' is a folder"):
        config_from_dict({"metrics": "m"})


def test_backend_nccl_without_cuda_is_one_sentence():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    from axoplan.cli.train import check_environment

    with pytest.raises(UserError, match="nccl needs CUDA"):
        check_environment(config_from_dict({"backend": "nccl", "metrics": None}))


@pytest.mark.parametrize("env", [{"RANK": "a", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "0"},
                                 {"RANK": "-1", "WORLD_SIZE": "2"}, {"RANK": "3", "WORLD_SIZE": "2"},
                                 {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"},
                                 {"SLURM_PROCID": "a", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}])
def test_a_bad_launcher_environment_is_one_sentence(env):
    with pytest.raises(UserError, match="environment|rank"):
        read_env(env)


def test_train_with_rank_a_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "a")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "c.yaml").write_text("model: gpt-tiny\n")
    one_sentence(*run_cli(["train", "--config", str(tmp_path / "c.yaml")], capsys)[::2])


# ---- refit's results --------------------------------------------------------------------------------
def results_csv(tmp_path: Path, edit=None, drop: str | None = None) -> Path:
    """A results.csv as validate writes it (two ok runs of gpt-tiny on 2 ranks), optionally edited."""
    from axoplan.planner.rank import rank
    from axoplan.loop.validate import RESULT_COLUMNS

    df = rank("gpt-tiny", "localhost-cpu", 2, 4, top=2)
    df = df.assign(candidate=["c0", "c1"], model="gpt-tiny", machine="localhost-cpu", gpus=2, global_batch=4,
                   seq_len="", status="ok", error="", steps=10, warmup_steps=3, wall_s=1.0, repeat=0,
                   measured_time_s=df["batch_time_s"] * 1.1)
    df = df.astype(object)
    for c in RESULT_COLUMNS:
        if c not in df:
            df[c] = ""
    if edit:
        edit(df)
    cols = [c for c in RESULT_COLUMNS if c != drop]
    p = tmp_path / "results.csv"
    df[cols].to_csv(p, index=False)
    return p


REFIT_BAD = {
    "grid does not multiply to gpus": lambda df: df.__setitem__("gx", [2, 2]),
    "micro-batch 1.5": lambda df: df.__setitem__("micro_batch", [1.5, 2]),
    "measured inf": lambda df: df.__setitem__("measured_time_s", [float("inf"), 1.0]),
    "gx 0": lambda df: df.__setitem__("gx", [0, 1]),
    "gx empty": lambda df: df.__setitem__("gx", ["", 1]),
    "gpus empty": lambda df: df.__setitem__("gpus", ["", 2]),
    "gpus huge": lambda df: df.__setitem__("gpus", [2**70, 2]),
    "unknown order": lambda df: df.__setitem__("order", ["abc", "xyz"]),
}


@pytest.mark.parametrize("case", list(REFIT_BAD))
def test_refit_refuses_rows_it_cannot_fit(tmp_path, capsys, case):
    res = results_csv(tmp_path, REFIT_BAD[case])
    out = tmp_path / "n.yaml"
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", "localhost-cpu", "--out", str(out),
                            "--no-loo"], capsys)
    one_sentence(code, err)
    assert not out.exists()


@pytest.mark.parametrize("case", ["binary", "utf16", "no wall_s"])
def test_refit_refuses_unreadable_results(tmp_path, capsys, case):
    res = results_csv(tmp_path, drop="wall_s" if case == "no wall_s" else None)
    if case == "binary":
        res.write_bytes(b"\x00\x9f\x92\x96" * 100)
    elif case == "utf16":
        res.write_bytes(res.read_text().encode("utf-16"))
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", "localhost-cpu", "--out",
                            str(tmp_path / "n.yaml")], capsys)
    one_sentence(code, err)


def test_refit_accepts_the_good_results(tmp_path, capsys):
    res = results_csv(tmp_path)
    code, _, err = run_cli(["refit", "--results", str(res), "--machine", "localhost-cpu", "--out",
                            str(tmp_path / "n.yaml"), "--no-loo", "--params", "step_overhead_s"], capsys)
    assert code == 0, err
    assert os.path.exists(tmp_path / "n.yaml") and not pd.isna(load_profile(str(tmp_path / "n.yaml")).peak_flops)


def test_a_fifo_or_device_as_an_input_file_is_refused_without_blocking(tmp_path):
    from axoplan.yamlio import read_text

    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    for p in (fifo, Path(os.devnull), tmp_path):
        with pytest.raises(UserError, match="not a regular file"):
            read_text(p, "f")
    with pytest.raises(UserError, match="is not a file"):
        load_model(str(fifo))


def test_a_bad_master_port_under_srun_is_one_sentence():
    from axoplan.runtime.dist_env import export_for_env_init

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"}
    with pytest.raises(UserError, match="MASTER_PORT"):
        export_for_env_init(read_env(env), env)


MODEL_FIELDS = list(yaml.safe_load(TINY)) + ["n_kv_heads", "ffn_hidden", "mlp", "norm", "position", "vocab_multiple"]
CONFIG_KEYS = list(config_from_dict({}).to_dict())


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(MODEL_FIELDS), value=st.sampled_from(BAD_VALUES + [2**80, -(2**80), 1.5, "", "gelu"]))
def test_any_model_field_set_to_nonsense_is_a_model_or_a_user_error(field, value):
    from axoplan.planner.specs import model_from_dict

    d = yaml.safe_load(TINY)
    d[field] = value
    try:
        m = model_from_dict(d, "model")
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
    else:
        assert m.n_params > 0


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(CONFIG_KEYS), value=st.sampled_from(BAD_VALUES + [2**80, 1.5, "", "auto", {"k": 1}]))
def test_any_config_key_set_to_nonsense_is_a_config_or_a_user_error(key, value):
    try:
        config_from_dict({key: value})
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 400


PIPE_OPTS = st.lists(st.sampled_from(
    [("--pp", v) for v in ("1", "2", "3", "4", "8", "all", "0", "-1", "x")] + [("--vpp", v) for v in ("1", "2", "3", "0")]
    + [("--schedule", v) for v in ("1f1b", "interleaved-1f1b")] + [("--micro-batch", v) for v in ("1", "2", "3", "0")]
    + [("--order", v) for v in ("xyz", "zyx", "pxyz", "xyzp", "every", "abc")]
    + [("--seq-len", v) for v in ("7", "1000", "131072")] + [("--execution", v) for v in ("megatron-core", "torchtitan",
                                                                                      "axonn", "megatron-deepspeed")]),
    max_size=4, unique_by=lambda kv: kv[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.sampled_from(["rank", "explain"]), model=st.sampled_from(["gpt-tiny", "gpt-small", "gpt-20b", "llama3-8b"]),
       machine=st.sampled_from(["dgx-a100", "dgx-h100", "frontier", "localhost-cpu"]),
       gpus=st.sampled_from([1, 2, 6, 8, 16, 64, 256]), batch=st.sampled_from([1, 3, 8, 64, 512]),
       grid=st.tuples(st.sampled_from([1, 2]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4])), opts=PIPE_OPTS)
def test_rank_and_explain_over_any_pipeline_options_answer_or_say_one_sentence(capsys, cmd, model, machine, gpus, batch,
                                                                              grid, opts):
    """Whatever the pipeline, grid and placement options, valid or not: an answer (exit 0) or one error sentence."""
    args = [cmd, "-m", model, "-p", machine, "-g", str(gpus), "-b", str(batch)]
    if cmd == "explain":
        pp = next((int(v) for k, v in opts if k == "--pp" and v.isdigit() and int(v) > 0), 1)
        args += ["--grid", ",".join(map(str, grid)) + f",{max(1, gpus // (grid[0] * grid[1] * grid[2] * pp))}"]
    else:
        args += ["--top", "2"]
    for k, v in opts:
        args += [k, v]
    code, out, err = run_cli(args, capsys)
    if code != 0:
        one_sentence(code, err)
