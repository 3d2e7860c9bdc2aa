"""Rank placement and process groups of the 4D grid (data x Z x Y x X) and the pipeline stages.

Placement follows the planner's contract (planner.space.layout): `order` names x, y, z innermost first and
data comes after them, so for order "xyz" world_rank = x + gx*(y + gy*(z + gz*d)). The pipeline stage p is
outermost unless the order places it: for "xyz", world_rank = p * (gx*gy*gz*gdata) + that rank; for "xyzp"
(AxoNN's), p sits between z and data. Each stage has its own 4D sub-grid, and the pipeline group ("p") joins
the ranks of equal (x, y, z, d) across the stages. Along any single axis the world rank grows with that
axis' coordinate, so the rank inside a one-axis group equals the coordinate on that axis (the flat Z shards
rely on it).
"""
from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from axoplan.planner.space import layout

AXES = ("x", "y", "z", "d")


@dataclass(frozen=True)
class Coords:
    x: int
    y: int
    z: int
    d: int
    p: int = 0  # the pipeline stage


def _sizes(gx: int, gy: int, gz: int, gdata: int, order: str, pp: int = 1) -> list[tuple[str, int]]:
    size = {"x": gx, "y": gy, "z": gz, "d": gdata, "p": pp}
    return [(a, size[a]) for a in layout(order)]


def rank_of(c: Coords, gx: int, gy: int, gz: int, gdata: int, order: str = "xyz", pp: int = 1) -> int:
    rank, stride = 0, 1
    for axis, n in _sizes(gx, gy, gz, gdata, order, pp):
        rank += getattr(c, axis) * stride
        stride *= n
    return rank


def coords_of(rank: int, gx: int, gy: int, gz: int, gdata: int, order: str = "xyz", pp: int = 1) -> Coords:
    vals = {}
    for axis, n in _sizes(gx, gy, gz, gdata, order, pp):
        vals[axis] = rank % n
        rank //= n
    return Coords(**vals)


@dataclass
class ParallelGrid:
    """This rank's coordinates and its process groups (None where a group has one member)."""

    gx: int
    gy: int
    gz: int
    gdata: int
    order: str
    rank: int
    coords: Coords
    groups: dict[str, Any] = field(default_factory=dict)  # "x", "y", "z", "d", "zd", and "p" with a pipeline
    _owned: list = field(default_factory=list)
    pp: int = 1  # pipeline stages; this rank is in stage `stage`

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (its coordinate on p)."""
        return self.coords.p

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage's 4D grid."""
        return self.gx * self.gy * self.gz * self.gdata

    @property
    def size(self) -> int:
        """Ranks of the whole job (every pipeline stage)."""
        return self.stage_size * self.pp

    def group(self, axis: str):
        return self.groups.get(axis)

    def destroy(self) -> None:
        """Release the sub-groups (tests build one grid after another in the same world)."""
        if self._owned and dist.is_initialized() and sys.exc_info()[0] is None:
            # no rank may tear a group down while a peer still has work queued on it: gloo aborts the
            # process ("terminate called without an active exception") when that happens. Not while an
            # exception unwinds: the peers may be stuck elsewhere, and failing fast matters more then.
            dist.barrier()
        for g in self._owned:
            try:
                dist.destroy_process_group(g)
            except Exception:  # already gone with the world: nothing to release
                pass
        self._owned.clear()
        self.groups.clear()


def build_grid(gx: int, gy: int, gz: int, gdata: int, order: str = "xyz", pp: int = 1) -> ParallelGrid:
    """Create every one-axis group (and the Z x D group for replicated parameters) of every pipeline stage,
    and the pipeline groups, on all ranks.

    torch requires every rank to take part in creating every group, in the same order.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    n4 = gx * gy * gz * gdata
    if n4 * pp != world:
        raise ValueError(f"grid {gx}x{gy}x{gz}x{gdata} x pp {pp} does not match world size {world}")
    me = coords_of(rank, gx, gy, gz, gdata, order, pp)
    grid = ParallelGrid(gx, gy, gz, gdata, order, rank, me, pp=pp)
    sizes = {"x": gx, "y": gy, "z": gz, "d": gdata}

    def world_rank(**c) -> int:
        return rank_of(Coords(**c), gx, gy, gz, gdata, order, pp)

    for p in range(pp):
        for name, varying in (("x", ("x",)), ("y", ("y",)), ("z", ("z",)), ("d", ("d",)), ("zd", ("z", "d"))):
            n = 1
            for a in varying:
                n *= sizes[a]
            if n == 1:
                continue
            fixed = [a for a in AXES if a not in varying]
            for fixed_vals in itertools.product(*(range(sizes[a]) for a in fixed)):
                members = []
                for var_vals in itertools.product(*(range(sizes[a]) for a in varying)):
                    members.append(world_rank(p=p, **dict(zip(fixed, fixed_vals)), **dict(zip(varying, var_vals))))
                members.sort()
                g = dist.new_group(members)
                grid._owned.append(g)
                if rank in members:
                    grid.groups[name] = g
    if pp > 1:  # the stages' ranks of one 4D coordinate, in stage order (the group rank is the stage)
        for vals in itertools.product(*(range(sizes[a]) for a in AXES)):
            members = [world_rank(p=p, **dict(zip(AXES, vals))) for p in range(pp)]
            g = dist.new_group(members)
            grid._owned.append(g)
            if rank in members:
                grid.groups["p"] = g
    return grid


def stage_first_rank(gx: int, gy: int, gz: int, gdata: int, order: str, pp: int, stage: int) -> int:
    """The world rank of a pipeline stage's first rank (its 4D coordinates all 0)."""
    return rank_of(Coords(0, 0, 0, 0, stage), gx, gy, gz, gdata, order, pp)
