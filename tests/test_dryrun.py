"""The trainer traced at full scale with fake tensors and a fake process group (`axoplan dryrun`):
the planner's peak memory per GPU and every collective of the step against the trainer's own."""
import json

import pytest

pytest.importorskip("torch")

from conftest import profile_dict

from axoplan.cli.main import main
from axoplan.planner.rank import explain
from axoplan.runtime.dryrun import compare

GIB = 2**30


@pytest.fixture(params=["bf16", "fp32"])
def profile(request, write_profile):
    import yaml

    raw = profile_dict(dtype=request.param, name=f"mem-{request.param}")
    return str(write_profile(raw=yaml.safe_dump(raw), name=raw["name"]))


@pytest.mark.parametrize("grid,ck", [((2, 2, 2, 1), True), ((2, 2, 2, 1), False), ((1, 1, 8, 1), True),
                                     ((8, 1, 1, 1), False), ((1, 2, 2, 2), False), ((2, 1, 4, 1), True)])
def test_traced_equals_predicted_on_8_fake_ranks(profile, grid, ck):
    r = compare("gpt-tiny", profile, 8, 16, grid, micro_batch=16 // (grid[2] * grid[3]), checkpointing=ck)
    assert r["traced_memory_gib"] > 0
    assert r["predicted_memory_gib"] == pytest.approx(r["traced_memory_gib"], rel=0.03), r["memory_by_kind"]
    for c in r["collectives"]:
        assert (c["predicted_calls"], c["predicted_bytes"]) == (c["traced_calls"], c["traced_bytes"]), c
    kinds = {k for k, v in r["memory_by_kind"].items() if v["traced"] > 0}
    assert {"states", "activations"} <= kinds
    if grid[2] > 1:  # the reduce-scatters in flight reached the trainer's default bound, and no more
        assert r["config"]["max_inflight_reduce_scatters_traced"] == 2


def test_gpt20b_on_32_perlmutter_gpus_fits_as_it_ran():
    """The published example: GPT-20B, 1 x 1 x 32 x 1, one sequence per GPU, checkpointing, on 40 GB
    A100s was the fastest configuration measured. The model used to hold every full gradient block
    until the end of the backward (52 GiB); the trainer now bounds them, and the model follows it."""
    ex = explain("gpt-20b", "perlmutter", 32, 32, (1, 1, 32, 1), micro_batch=1, checkpointing=True)
    total = float(ex.memory.gib[ex.memory.kind == "total (peak)"].iloc[0])
    assert total < 16 and bool(ex.summary.feasible[0])
    r = compare("gpt-20b", "perlmutter", 32, 32, (1, 1, 32, 1), micro_batch=1, checkpointing=True)
    assert r["predicted_memory_gib"] == pytest.approx(r["traced_memory_gib"], rel=0.02)
    assert all(c["predicted_calls"] == c["traced_calls"] and c["predicted_bytes"] == c["traced_bytes"]
               for c in r["collectives"])


def test_the_peak_moment_is_named():
    ex = explain("gpt-tiny", "localhost-cpu", 8, 16, (2, 2, 2, 1), micro_batch=2, checkpointing=True)
    assert any(n.startswith("memory peaks at: backward") for n in ex.notes)
    assert list(ex.memory.kind[:6]) == ["states", "gathered weights", "gradient blocks", "activations", "logits",
                                        "transients"]


def test_cli_json_is_the_fixed_schema(capsys):
    with pytest.raises(SystemExit) as e:
        main(["dryrun", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "8", "--global-batch", "16",
              "--grid", "2,2,2,1", "--micro-batch", "2", "--checkpointing", "on", "--format", "json"])
    assert e.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert {"predicted_memory_gib", "traced_memory_gib", "memory_by_kind", "collectives", "fits",
            "available_gib"} <= set(out)
    assert out["fits"] is True and out["available_gib"] == pytest.approx(5.885 - 0.26)
    assert set(out["memory_by_kind"]["states"]) == {"predicted", "traced"}
    assert set(out["collectives"][0]) == {"layer", "kind", "axis", "predicted_calls", "traced_calls",
                                          "predicted_bytes", "traced_bytes"}


def test_cli_table(capsys):
    with pytest.raises(SystemExit) as e:
        main(["dryrun", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4", "--global-batch", "8",
              "--grid", "1,2,2,1"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "peak memory per GPU" in out and "every one equal in calls and bytes" in out


@pytest.mark.parametrize("grid,needle", [("2,2,1,1", "not the 8 of --gpus"), ("3,1,1,1", "--grid"),
                                         ("1,16,1,1", "attention heads"), ("128,1,1,1", "hidden")])
def test_cli_bad_grid_is_one_sentence(capsys, grid, needle):
    gpus = {"1,16,1,1": "16", "128,1,1,1": "128"}.get(grid, "8")
    with pytest.raises(SystemExit) as e:
        main(["dryrun", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", gpus, "--global-batch", "16",
              "--grid", grid])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err and needle in err


def test_a_huge_global_batch_is_traced_with_two_micro_batches(capsys):
    """16M sequences on one GPU would be 16M micro-batches: the peak and the per-micro-batch collectives are
    those of two, so two are traced and predicted (the tool stays a few seconds, and says so)."""
    r = compare("gpt-tiny", "localhost-cpu", 2, 2**24, (1, 1, 2, 1), micro_batch=1, checkpointing=True)
    assert r["config"]["global_batch"] == 2**24 and r["config"]["global_batch_traced"] == 4
    assert r["predicted_memory_gib"] == pytest.approx(r["traced_memory_gib"], rel=0.03)
    with pytest.raises(SystemExit) as e:
        main(["dryrun", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "1", "--global-batch",
              str(2**24), "--grid", "1,1,1,1", "--micro-batch", "1"])
    assert e.value.code == 0 and "traced and predicted with global batch 2" in capsys.readouterr().out


def test_blocks_padded_to_z_move_their_padding():
    """gz = 24 divides none of gpt-tiny's blocks evenly: each all-gather and reduce-scatter moves the block
    zero-padded to 24 shards, and the model counts those bytes (dryrun found it counting the bare block)."""
    r = compare("gpt-tiny", "localhost-cpu", 24, 48, (1, 1, 24, 1), micro_batch=1, checkpointing=True)
    z = [c for c in r["collectives"] if c["axis"] == "z"]
    assert z and all(c["predicted_bytes"] == c["traced_bytes"] and c["predicted_calls"] == c["traced_calls"] for c in z)


def test_a_configuration_that_does_not_fit_says_so_and_strict_exits_1(capsys, tmp_path):
    """The verdict is the traced peak against capacity less headroom: exit 0 with a clear line, 1 with --strict."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "machine_profiles"
    for f in src.glob("localhost-cpu*"):
        shutil.copy(f, tmp_path / f.name)
    prof = tmp_path / "localhost-cpu.yaml"
    text = prof.read_text()
    assert "capacity_gib: 5.885, headroom_gib: 0.26" in text
    prof.write_text(text.replace("capacity_gib: 5.885, headroom_gib: 0.26", "capacity_gib: 0.0012, headroom_gib: 0.0005"))
    args = ["dryrun", "--model", "gpt-tiny", "--machine", str(prof), "--gpus", "4", "--global-batch", "8",
            "--grid", "1,2,2,1", "--micro-batch", "1"]
    for extra, code in (([], 0), (["--strict"], 1)):
        with pytest.raises(SystemExit) as e:
            main(args + extra)
        assert e.value.code == code
        out = " ".join(capsys.readouterr().out.split())  # the verdict is the last line, however it wraps
        verdict = out[out.rindex("does NOT fit"):]
        assert verdict.startswith("does NOT fit: traced 0.00") and "over the 0.0007 GiB available" in verdict
        assert verdict.endswith("or a smaller micro-batch")  # the last thing printed
    with pytest.raises(SystemExit):
        main(args + ["--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["available_gib"] == pytest.approx(0.0007)
