"""Rank placement of the 4D grid (torch-free arithmetic) and the trainer's divisibility rules."""
import itertools

import pytest

from axoplan.planner.space import ORDERS, PLACEMENTS
from axoplan.planner.space import grid_problem
from axoplan.runtime.grid import Coords, coords_of, rank_of
from axoplan.planner.specs import load_model


def test_xyz_and_yxz_formulas():
    gx, gy, gz, gd = 2, 3, 4, 2
    for x, y, z, d in itertools.product(range(gx), range(gy), range(gz), range(gd)):
        c = Coords(x, y, z, d)
        assert rank_of(c, gx, gy, gz, gd, "xyz") == x + gx * (y + gy * z) + gx * gy * gz * d
        assert rank_of(c, gx, gy, gz, gd, "yxz") == y + gy * (x + gx * z) + gx * gy * gz * d


@pytest.mark.parametrize("order", ORDERS)
def test_placement_is_a_bijection_and_monotonic_per_axis(order):
    gx, gy, gz, gd = 2, 3, 2, 2
    ranks = {rank_of(coords_of(r, gx, gy, gz, gd, order), gx, gy, gz, gd, order) for r in range(gx * gy * gz * gd)}
    assert ranks == set(range(gx * gy * gz * gd))
    # inside a one-axis group the rank grows with the coordinate (flat Z shards rely on it)
    for z in range(gz - 1):
        assert rank_of(Coords(1, 2, z, 1), gx, gy, gz, gd, order) < rank_of(Coords(1, 2, z + 1, 1), gx, gy, gz, gd, order)


def test_divisibility_rules():
    tiny = load_model("gpt-tiny")  # hidden 64, 8 heads, ffn 256, padded vocab 256, seq 64
    assert grid_problem(tiny, 2, 2, 2, 1, 8, 1, 64) is None
    assert "hidden" in grid_problem(tiny, 3, 1, 1, 1, 8, 1, 64)
    assert "attention heads" in grid_problem(tiny, 1, 16, 1, 1, 8, 1, 64)
    assert "micro-batch 4 does not divide" in grid_problem(tiny, 1, 1, 2, 2, 8, 4, 64)
    assert "global batch 8 is not divisible" in grid_problem(tiny, 1, 1, 4, 4, 8, 1, 64)
    assert "seq_len" in grid_problem(tiny, 1, 1, 1, 1, 8, 1, 128)
    llama = load_model("llama3-8b")  # 8 kv heads
    assert "KV heads" in grid_problem(llama, 1, 16, 1, 1, 16, 1, 128)


@pytest.mark.parametrize("order", PLACEMENTS)
def test_pipelined_placement_is_the_planners(order):
    """The trainer's world rank of (x, y, z, d, stage) moves by the planner's stride along each axis
    (planner.space.strides: one definition of where the pipeline sits), and covers every rank once."""
    import numpy as np

    from axoplan.planner.space import strides

    gx, gy, gz, gd, pp = 2, 1, 3, 2, 2
    n = gx * gy * gz * gd * pp
    assert {rank_of(coords_of(r, gx, gy, gz, gd, order, pp), gx, gy, gz, gd, order, pp) for r in range(n)} == set(range(n))
    want = [int(s[0]) for s in strides(np.array([gx]), gy, gz, gd, np.array([PLACEMENTS.index(order)]), pp)]
    base = Coords(1, 0, 1, 0, 0)
    for axis, s in zip("xyzdp", want):
        moved = Coords(**{**base.__dict__, axis: getattr(base, axis) + 1})
        if getattr(moved, axis) < {"x": gx, "y": gy, "z": gz, "d": gd, "p": pp}[axis]:
            assert rank_of(moved, gx, gy, gz, gd, order, pp) - rank_of(base, gx, gy, gz, gd, order, pp) == s, axis


@pytest.mark.parametrize("order", ["yxz", "pyxz", "ypxz", "yxzp"])
def test_the_trainers_groups_follow_the_placement(order):
    """build_grid on one rank of 16 (torch's fake process group): its stage, its pipeline group and its Y and D
    groups are the ranks the placement's strides name."""
    import numpy as np
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from axoplan.planner.space import strides
    from axoplan.runtime.grid import build_grid

    gx, gy, gz, gd, pp = 1, 2, 1, 4, 2
    sx, sy, sz, sd, sp = (int(s[0]) for s in strides(np.array([gx]), gy, gz, gd, np.array([PLACEMENTS.index(order)]), pp))
    for rank in (0, 5, 11):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
        try:
            grid = build_grid(gx, gy, gz, gd, order, pp=pp)
            c = grid.coords
            assert rank_of(c, gx, gy, gz, gd, order, pp) == rank and grid.stage == c.p
            first = rank - c.p * sp
            assert dist.get_process_group_ranks(grid.groups["p"]) == [first + s * sp for s in range(pp)]
            assert dist.get_process_group_ranks(grid.groups["y"]) == [rank - c.y * sy + i * sy for i in range(gy)]
            assert dist.get_process_group_ranks(grid.groups["d"]) == [rank - c.d * sd + i * sd for i in range(gd)]
        finally:
            dist.destroy_process_group()
