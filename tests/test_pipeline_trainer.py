"""The pipeline in the trainer's config and tools: LaunchConfig's pp, vpp and schedule and their one-sentence
errors (the schema's own, and the ones that need the world or the model: pp not dividing the processes, too
few micro-batches, more stages than blocks), the slice each pipeline rank holds, emit's config and scripts,
validate's candidates and refit's rows with a pipeline, and `axoplan dryrun --pp` (tables and JSON)."""
import json

import pandas as pd
import pytest

from axoplan.errors import UserError
from axoplan.loop.launch import config_from_row, pipeline_of, torchrun_script
from axoplan.runconfig import Grid, LaunchConfig, config_from_dict, load_config


def _row(**kw):
    row = {"gx": 1, "gy": 2, "gz": 1, "gdata": 1, "order": "xyz", "micro_batch": 1, "checkpointing": False,
           "pp": 4, "vpp": 2, "schedule": "interleaved-1f1b"}
    row.update(kw)
    return row


@pytest.mark.parametrize("d,needle", [
    ({"vpp": 2}, "vpp=2 needs schedule interleaved-1f1b"),
    ({"schedule": "zb-h1"}, "schedule must be one of 1f1b, interleaved-1f1b"),
    ({"pp": 0}, "pp must be a positive integer"),
    ({"vpp": "two", "schedule": "interleaved-1f1b"}, "vpp must be a positive integer"),
    ({"order": "xyzp"}, "order xyzp places the pipeline axis, which needs pp of 2 or more"),
    ({"order": "xyzpp", "pp": 2}, "order must be an order of x, y, z, innermost first, with p among them"),
])
def test_the_schema_refuses_a_bad_pipeline_in_one_sentence(d, needle):
    with pytest.raises(UserError) as e:
        config_from_dict(d, "config 'x.yaml'")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and msg.startswith("config 'x.yaml': ")


def test_the_pipeline_round_trips_through_the_yaml(tmp_path):
    cfg = LaunchConfig(grid=Grid(1, 2, 1, 1), pp=4, vpp=2, schedule="interleaved-1f1b")
    path = cfg.write(tmp_path / "config.yaml")
    back = load_config(path)
    assert (back.pp, back.vpp, back.schedule, back.world) == (4, 2, "interleaved-1f1b", 8)
    assert LaunchConfig().world == 1 and (LaunchConfig().pp, LaunchConfig().vpp) == (1, 1)


@pytest.mark.parametrize("kw,world,needle", [
    ({"pp": 3}, 8, "pp=3 pipeline stages do not divide the 8 process(es) started"),
    ({"pp": 2, "grid": Grid(2, 1, 1, 1)}, 8, "gx*gy*gz*gdata*pp = 2*1*1*1*2 = 4 does not match the 8 process(es)"),
    ({"pp": 4, "global_batch": 2}, 4, "1f1b over pp=4 stages needs at least 4 micro-batches, the step has 2"),
    ({"pp": 2, "vpp": 2, "schedule": "interleaved-1f1b", "global_batch": 3}, 2,
     "interleaved-1f1b over pp=2 stages needs a multiple of 2 micro-batches, the step has 3"),
    ({"pp": 2, "vpp": 3, "schedule": "interleaved-1f1b", "global_batch": 4}, 2,
     "pp=2 x vpp=3 virtual stages are more than the model's 4 blocks"),
])
def test_the_trainer_refuses_what_the_world_or_the_model_cannot_run(kw, world, needle):
    pytest.importorskip("torch")
    from axoplan.runtime.train import check_config

    cfg = LaunchConfig(model="gpt-small", seq_len=16, **kw).validate()  # 4 blocks
    with pytest.raises(UserError) as e:
        check_config(cfg, world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_axoplan_train_says_so_in_one_line(tmp_path, capsys):
    pytest.importorskip("torch")
    from axoplan.cli.main import main

    path = LaunchConfig(model="gpt-tiny", pp=2, metrics=None).write(tmp_path / "config.yaml")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error:") and "\n" not in err and "pp=2" in err


def test_each_rank_holds_its_virtual_stages():
    pytest.importorskip("torch")
    from axoplan.runtime.pipeline_stage import rank_slice, virtual_stages

    # 10 blocks over 4 x 2 virtual stages: the first two take one more; stage v on rank v mod 4
    vs = [virtual_stages(10, 4, 2, r) for r in range(4)]
    assert [(v, list(b)) for v, b, _, _ in vs[0]] == [(0, [0, 1]), (4, [6])]
    assert [(v, list(b)) for v, b, _, _ in vs[3]] == [(3, [5]), (7, [9])]
    assert sorted(i for r in range(4) for i in rank_slice(10, 4, 2, r)["blocks"]) == list(range(10))
    assert rank_slice(10, 4, 2, 0)["embedding"] and not rank_slice(10, 4, 2, 0)["head"]
    assert rank_slice(10, 4, 2, 3)["head"] and not rank_slice(10, 4, 2, 3)["embedding"]


def test_emit_writes_the_pipeline_and_starts_every_stage(tmp_path, pm):
    cfg = config_from_row(_row(), "gpt-small", 8)
    assert (cfg.pp, cfg.vpp, cfg.schedule, cfg.world) == (4, 2, "interleaved-1f1b", 8)
    back = load_config(cfg.write(tmp_path / "config.yaml"))
    assert (back.pp, back.vpp, back.schedule) == (4, 2, "interleaved-1f1b")
    script = torchrun_script(cfg, pm)
    assert "GRID_SIZE=8" in script and "pp=4 (interleaved-1f1b, vpp=2)" in script
    # a row from before the pipeline columns (or pp 1) has none
    flat = config_from_row({k: v for k, v in _row().items() if k not in ("pp", "vpp", "schedule")}, "gpt-small", 8)
    assert (flat.pp, flat.vpp, flat.schedule) == (1, 1, "1f1b")
    assert pipeline_of({"pp": float("nan")}) == (1, 1, "1f1b")


def test_validate_measures_pipelines_as_their_own_placements():
    from axoplan.loop.validate import candidate_id, distinct_configs

    rows = pd.DataFrame([_row(pp=1, vpp=1, schedule="1f1b", gy=8), _row(), _row(pp=4, vpp=1, schedule="1f1b"),
                         _row(micro_batch=2)])
    rows["feasible"] = True
    d = distinct_configs(rows)
    assert len(d) == 3  # the micro-batch-2 twin of the interleaved row is not a new placement
    assert candidate_id(1, d.iloc[1]).startswith("c01-pp4v2-1x2x1x1-xyz")
    assert candidate_id(0, d.iloc[0]).startswith("c00-1x8x1x1")


def test_refit_reads_pipelined_runs_back():
    from axoplan.loop.refit import runs_from_results

    base = {"candidate": "c", "model": "gpt-small", "gpus": 8, "global_batch": 16, "seq_len": 64, "status": "ok",
            "measured_time_s": 1.0}
    df = pd.DataFrame([{**base, **_row()}, {**base, **_row(pp=1, vpp=1, schedule="1f1b", gy=8)}])
    runs = runs_from_results(df)
    c = runs.groups[0][2]
    assert list(c.pp) == [4, 1] and list(c.vpp) == [2, 1] and list(c.schedule) == [1, 0]
    bad = pd.DataFrame([{**base, **_row(pp=2)}])
    with pytest.raises(UserError, match=r"the grid 1x2x1x1 x pp 2 multiplies to 4, not its gpus 8"):
        runs_from_results(bad)


def test_dryrun_pp_prints_each_end_of_the_pipeline(capsys):
    pytest.importorskip("torch")
    from axoplan.cli.main import main

    args = ["dryrun", "--model", "gpt-small", "--machine", "localhost-cpu", "--gpus", "4", "--global-batch", "8",
            "--grid", "1,2,1,1", "--pp", "2", "--micro-batch", "1", "--checkpointing", "off"]
    with pytest.raises(SystemExit) as e:
        main(args)
    out = " ".join(capsys.readouterr().out.split())  # the report wraps at the terminal's width
    assert e.value.code == 0
    for stage in ("first stage (pipeline rank 0, world rank 0)", "last stage (pipeline rank 1, world rank 2)"):
        assert stage in out
    assert out.count("every one equal in calls and bytes") == 2 and "chunks in the planner's order: yes" in out
    with pytest.raises(SystemExit) as e:
        main(args + ["--format", "json"])
    r = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in r["stages"]] == ["first", "last"] and r["config"]["pp"] == 2
    with pytest.raises(SystemExit) as e:
        main(args[:-6] + ["--pp", "4"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "error: --grid 1,2,1,1 x --pp 4 has 8 GPUs, not the 4 of --gpus"


def test_emit_pp_chooses_among_the_trainers_pipelines(tmp_path, capsys):
    from axoplan.cli.main import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["emit", "-m", "gpt-small", "-p", "localhost-cpu", "-g", "4", "-b", "8", "--grid", "1,2,1,1", "--pp", "2",
              "--vpp", "2", "--out", str(out)])
    assert e.value.code == 0 and "x pp=2 (interleaved-1f1b, vpp=2)" in capsys.readouterr().out
    cfg = load_config(out / "config.yaml")
    assert (cfg.grid.gy, cfg.pp, cfg.vpp, cfg.schedule, cfg.world) == (2, 2, 2, "interleaved-1f1b", 4)
    assert "GRID_SIZE=4" in (out / "launch_torchrun.sh").read_text()
    with pytest.raises(SystemExit) as e:
        main(["emit", "-m", "gpt-small", "-p", "localhost-cpu", "-g", "4", "-b", "8", "--grid", "1,2,1,1", "--pp", "4",
              "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "error: --grid 1,2,1,1 with --pp 4 uses 8 GPUs, not --gpus 4"


def test_explain_refuses_a_placed_pipeline_without_one(capsys):
    from axoplan.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["explain", "--model", "gpt-tiny", "--machine", "localhost-cpu", "--gpus", "4", "--global-batch", "8",
              "--grid", "1,2,1,2", "--order", "yxzp"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "error: --order yxzp places the pipeline axis, which needs --pp of 2 or more"


def test_a_framework_that_fixes_its_placement_refuses_a_pipeline_inside_data():
    import axoplan

    e = axoplan.explain("gpt-20b", "dgx-a100", 64, 64, (1, 8, 1, 2), pp=4, order="yxzp", execution="torchtitan")
    s = e.summary.iloc[0]
    assert not s["feasible"] and "torchtitan places its axes yzx (innermost first, the pipeline axis outermost)" in s["reason"]
    ok = axoplan.explain("gpt-20b", "dgx-a100", 64, 64, (1, 8, 1, 2), pp=4, order="yxzp").summary.iloc[0]
    assert ok["feasible"] and ok["order"] == "yxzp"
