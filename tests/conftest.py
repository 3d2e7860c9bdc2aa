"""Shared fixtures for the planner tests: machine profiles and models written to tmp_path.

The planner tests use their own profiles (not the bundled ones) so that every expected number in a
test follows from parameters set right here. The default profile is Perlmutter-like with the AxoNN
authors' bandwidth table (reference §3): 4 GPUs per node, 2-GPU groups 76 GB/s, the 4-GPU node
225 GB/s, one ring leaving a node 80 GB/s.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml

from axoplan.planner.specs import ModelSpec

PERLMUTTER_LIKE = dict(
    name="pm-test",
    gpus_per_node=4,
    capacity_gib=40,
    headroom_gib=3,
    mem_bandwidth_gbs=1555,
    elementwise_efficiency=0.7,
    peak_tflops=312,
    kernel_overhead_us=4,
    ceiling_tflops=280,
    dim_half=48,
    attn_tflops=150,
    intra_latency_us=9,
    inter_latency_us=9,
    intra_groups=((2, 1, 76), (4, 1, 225), (2, 2, 76)),
    inter_busbw_gbs=80,
    dtype="bf16",
)


def profile_dict(gemm_table: str | None = None, collectives: dict | None = None, corrections: dict | None = None,
                 **overrides) -> dict:
    """A valid profile as the YAML mapping of machine_profiles/README.md, every number sourced."""
    p = dict(PERLMUTTER_LIKE)
    unknown = set(overrides) - set(p)
    assert not unknown, f"unknown profile parameter(s) {unknown}"
    p.update(overrides)
    gemm = {"source": "test", "ceiling_tflops": p["ceiling_tflops"], "dim_half": p["dim_half"]}
    if gemm_table is not None:
        gemm["table"] = {"path": gemm_table, "source": "synthetic test table"}
    d = {
        "schema": "axoplan-profile/1",
        "name": p["name"],
        "description": "test profile",
        "device": "test-gpu",
        "kind": "cpu" if p["dtype"] == "fp32" else "gpu",
        "dtype": p["dtype"],
        "gpus_per_node": {"value": p["gpus_per_node"], "source": "test"},
        "memory": {"source": "test", "capacity_gib": p["capacity_gib"], "headroom_gib": p["headroom_gib"],
                   "bandwidth_gbs": p["mem_bandwidth_gbs"], "elementwise_efficiency": p["elementwise_efficiency"]},
        "compute": {
            "source": "test",
            "peak_tflops": p["peak_tflops"],
            "kernel_overhead_us": p["kernel_overhead_us"],
            "gemm": gemm,
            "attention": {"source": "test", "tflops": p["attn_tflops"], "causal_skip": True, "backward_factor": 2.5},
        },
        "network": {
            "intra_node": {"source": "test", "latency_us": p["intra_latency_us"],
                           "groups": [{"size": s, "stride": st, "busbw_gbs": bw} for s, st, bw in p["intra_groups"]]},
            "inter_node": {"source": "test", "busbw_gbs": p["inter_busbw_gbs"], "latency_us": p["inter_latency_us"]},
        },
    }
    if collectives is not None:
        d["network"]["collectives"] = dict(collectives, source="test")
    if corrections is not None:
        d["corrections"] = dict(corrections, source="test")
    return copy.deepcopy(d)


@pytest.fixture
def write_profile(tmp_path):
    """write_profile(**params) -> path of a profile YAML in tmp_path (params: keys of PERLMUTTER_LIKE,
    gemm_table, collectives, corrections); write_profile(raw=dict_or_text, name=...) writes as given."""

    def _write(raw=None, **kw) -> Path:
        if raw is None:
            raw = profile_dict(**kw)
            name = raw["name"]
        else:
            name = kw.get("name", "raw-profile")
        path = tmp_path / f"{name}.yaml"
        path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
        return path

    return _write


@pytest.fixture
def pm_path(write_profile) -> Path:
    return write_profile()


@pytest.fixture
def pm(pm_path):
    from axoplan.planner.profile_reader import load_profile

    return load_profile(str(pm_path))


def tiny_model(**kw) -> ModelSpec:
    """2 layers, hidden 64, 8 heads, vocabulary 256: every axis up to 8 divides it (like the gpt-tiny preset)."""
    d = dict(name="test-tiny", n_layers=2, hidden=64, n_heads=8, vocab=256, seq_len=64, vocab_multiple=64)
    d.update(kw)
    return ModelSpec(**d).validate()


@pytest.fixture
def model_yaml(tmp_path):
    """model_yaml(**fields) -> path of a model YAML (defaults: tiny_model's fields)."""

    def _write(name="test-tiny", **kw) -> Path:
        d = dict(name=name, n_layers=2, hidden=64, n_heads=8, vocab=256, seq_len=64, vocab_multiple=64)
        d.update(kw)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        return path

    return _write


def run_cli(args, capsys):
    """`axoplan ARGS` in this process: (exit code, stdout, stderr)."""
    from axoplan.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def one_sentence(code, err):
    """A user error: exit code 2 and one `error:` line, no traceback."""
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
