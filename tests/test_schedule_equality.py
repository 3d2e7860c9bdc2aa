"""The model is the trainer: on every grid of 1, 2, 4 and 8 ranks, and on GPT-20B grids of 32, the bundled
trainer run as rank 0 under fake tensors and a fake process group (`axoplan dryrun`) records every
collective it issues, and the planner's schedule (planner/schedule.py, which the batch time, the totals and
explain's tables are computed from) holds the same calls with the same bytes, by layer, kind and axis."""
import pytest

pytest.importorskip("torch")

from axoplan.planner.space import factorizations4
from axoplan.runtime.dryrun import compare

GRIDS = [tuple(int(v) for v in g) for n in (1, 2, 4, 8) for g in factorizations4(n)]


def _equal(r):
    bad = [c for c in r["collectives"]
           if (c["predicted_calls"], c["predicted_bytes"]) != (c["traced_calls"], c["traced_bytes"])]
    assert not bad, bad
    return r


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{a}x{b}x{c}x{d}" for a, b, c, d in GRIDS])
def test_every_small_grid_issues_the_modelled_collectives(grid):
    gpus = grid[0] * grid[1] * grid[2] * grid[3]
    batch = 2 * grid[2] * grid[3]  # two micro-batches of one sequence: gradient accumulation included
    ck = sum(grid) % 2 == 0  # both backward schedules, spread over the grids
    r = _equal(compare("gpt-tiny", "localhost-cpu", gpus, batch, grid, micro_batch=1, checkpointing=ck))
    assert r["config"]["checkpointing"] == ck
    # every axis of more than one rank shows up in what was recorded
    axes = {c["axis"] for c in r["collectives"] if c["traced_calls"]}
    assert {a for a, g in zip("xyz", grid) if g > 1} <= {a for ax in axes for a in ax}


@pytest.mark.parametrize("grid,mb,ck", [((2, 2, 4, 2), 1, True), ((1, 8, 4, 1), 2, False), ((4, 1, 8, 1), 1, True)])
def test_gpt20b_on_32_ranks_issues_the_modelled_collectives(grid, mb, ck):
    _equal(compare("gpt-20b", "perlmutter", 32, 64, grid, micro_batch=mb, checkpointing=ck))
