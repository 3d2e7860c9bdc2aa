"""Who am I in the job: torchrun's variables, else Slurm's (srun), else a single process.
Torch-free, so a config can be checked against the world size before any process group exists."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "srun" or "single"


def _slurm_tasks_per_node(env) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    m = re.match(r"(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))  # e.g. "4(x2)"
    return int(m.group(1)) if m else 1


def read_env(env=None) -> DistEnv:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        ws = int(env["WORLD_SIZE"])
        return DistEnv(int(env["RANK"]), ws, int(env.get("LOCAL_RANK", 0)),
                       int(env.get("LOCAL_WORLD_SIZE", ws)), "torchrun")
    # srun sets SLURM_STEP_ID for the tasks it starts; the batch script itself has no step id,
    # so `axoplan train` run directly in an sbatch script stays a single process
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       _slurm_tasks_per_node(env), "srun")
    return DistEnv(0, 1, 0, 1, "single")


def export_for_env_init(de: DistEnv, env=None) -> None:
    """torch's env:// rendezvous reads RANK/WORLD_SIZE/MASTER_*: fill them in under srun."""
    env = os.environ if env is None else env
    if de.launcher != "srun":
        return
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise UserError("under srun, export MASTER_ADDR (the first node's host name) and MASTER_PORT "
                        "before starting the tasks (see docs/trainer.md)")
    env.setdefault("RANK", str(de.rank))
    env.setdefault("WORLD_SIZE", str(de.world_size))
    env.setdefault("LOCAL_RANK", str(de.local_rank))


def cpu_threads(local_world_size: int, env=None) -> int | None:
    """Threads per process: cpu_count / processes on the node unless OMP_NUM_THREADS is set
    (None: leave torch's setting alone). Calibration uses the same rule."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
