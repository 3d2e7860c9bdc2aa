"""The pipelined trainer runs the planner's schedule: on 5D grids of 2, 4 and 8 ranks (both schedules,
checkpointing on and off, uneven splits) and on GPT-20B grids of 32 ranks, the first and the last pipeline
rank, each traced as its stage's first rank under fake tensors and the fake process group (`axoplan dryrun
--pp`), run the chunks in the order of planner/pipeline.rank_orders, send and receive what
pipeline.rank_transfers says (sends in order, each receive posted before its chunk), and issue the
collectives of stage_timing.rank_collective_rows (their virtual stages' windows and the once-per-step ones),
by layer, kind and axis, with the same bytes."""
import dataclasses

import pytest
import yaml

pytest.importorskip("torch")

from axoplan.runtime.dryrun import compare_pipeline
from axoplan.runtime.selfcheck import DEEP

# (stage grid, pp, vpp, schedule, checkpointing): pp 2, 4 and 8 over 2, 4 and 8 ranks
SMALL = [((1, 1, 1, 1), 2, 1, "1f1b", False), ((1, 1, 1, 1), 2, 3, "interleaved-1f1b", True),
         ((2, 1, 1, 1), 2, 2, "interleaved-1f1b", False), ((1, 1, 1, 1), 4, 1, "1f1b", True),
         ((1, 2, 2, 1), 2, 1, "1f1b", True), ((1, 1, 2, 1), 4, 3, "interleaved-1f1b", False),
         ((1, 1, 1, 1), 8, 2, "interleaved-1f1b", True)]


def _equal(r):
    assert len(r["stages"]) == 2
    for st in r["stages"]:
        bad = [c for c in st["collectives"]
               if (c["predicted_calls"], c["predicted_bytes"]) != (c["traced_calls"], c["traced_bytes"])]
        assert not bad, (st["stage"], bad)
        assert st["order"] == {"chunks": True, "sends": True, "receives": True}, (st["stage"], st["order"])
        # the transfers are part of what was compared
        assert {c["kind"] for c in st["collectives"] if c["axis"] == "p" and c["traced_calls"]} == {"send", "recv"}
    return r


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """deep_model(n) -> a model YAML of the equivalence proof's shapes with n blocks."""
    folder = tmp_path_factory.mktemp("models")

    def write(n_layers: int = DEEP.n_layers) -> str:
        path = folder / f"deep{n_layers}.yaml"
        path.write_text(yaml.safe_dump(dataclasses.asdict(dataclasses.replace(DEEP, n_layers=n_layers))))
        return str(path)
    return write


@pytest.mark.parametrize("grid,pp,vpp,schedule,ck", SMALL,
                         ids=[f"pp{p}v{v}-{'x'.join(map(str, g))}-{s}-{'ck' if c else 'nock'}"
                              for g, p, v, s, c in SMALL])
def test_small_pipelines_run_the_modelled_schedule(deep_model, grid, pp, vpp, schedule, ck):
    gpus = pp * grid[0] * grid[1] * grid[2] * grid[3]
    batch = 2 * pp * grid[2] * grid[3]  # more micro-batches than the warm-up: a steady state
    # one block more than the virtual stages: the first holds two (an uneven split), the trace stays short
    r = _equal(compare_pipeline(deep_model(pp * vpp + 1), "localhost-cpu", gpus, batch, grid, pp=pp, vpp=vpp, schedule=schedule,
                                micro_batch=1, checkpointing=ck))
    assert (r["config"]["schedule"], r["config"]["vpp"], r["config"]["checkpointing"]) == (schedule, vpp, ck)


@pytest.mark.parametrize("grid,pp,vpp,schedule,ck", [((2, 2, 4, 1), 2, 1, "1f1b", True),
                                                      ((2, 2, 2, 1), 4, 2, "interleaved-1f1b", False)])
def test_gpt20b_pipelines_of_32_ranks_run_the_modelled_schedule(grid, pp, vpp, schedule, ck):
    _equal(compare_pipeline("gpt-20b", "perlmutter", 32, 64, grid, pp=pp, vpp=vpp, schedule=schedule,
                            micro_batch=1, checkpointing=ck))


@pytest.mark.parametrize("order", ["xyzp", "pxyz"])
def test_a_pipeline_placed_inside_data_runs_the_modelled_schedule(deep_model, order):
    """The pipeline axis inside data (AxoNN's xyzp; innermost): each stage's first rank is where the placement puts
    it (world rank 4 or 1 of 16), and it issues the modelled schedule."""
    r = _equal(compare_pipeline(deep_model(3), "localhost-cpu", 16, 8, (2, 1, 2, 2), pp=2, order=order,
                                micro_batch=1, checkpointing=False))
    assert [st["world_rank"] for st in r["stages"]] == [0, {"xyzp": 4, "pxyz": 1}[order]]


def test_a_wrong_transfer_count_is_caught(deep_model, monkeypatch):
    """The comparison can fail: a model that forgets one transfer per chunk is reported as different."""
    import axoplan.planner.pipeline as pipeline

    real = pipeline.rank_transfers
    monkeypatch.setattr(pipeline, "rank_transfers", lambda *a: real(*a)[1:])
    r = compare_pipeline(deep_model(3), "localhost-cpu", 2, 4, (1, 1, 1, 1), pp=2, micro_batch=1, checkpointing=False)
    assert any(not all(st["order"].values()) for st in r["stages"])
    assert any(c["predicted_calls"] != c["traced_calls"] for st in r["stages"] for c in st["collectives"])
