"""Rank placement of the 4D grid (torch-free arithmetic) and the trainer's divisibility rules."""
import itertools

import pytest

from axoplan.planner.space import ORDERS
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
