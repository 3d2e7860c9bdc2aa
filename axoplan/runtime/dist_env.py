"""Who am I in the job: torchrun's variables, else Slurm's (srun), else a single process.
Torch-free, so a config can be checked against the world size before any process group exists."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from axoplan.errors import UserError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str  # "torchrun", "srun" or "single"


def _int(env, key: str, default: int | None = None, lo: int = 0) -> int:
    """An integer the launcher put in the environment; anything else is one sentence, not a traceback."""
    raw = env.get(key)
    if raw is None or (raw == "" and default is not None):
        return default
    s = raw.strip()
    if not re.fullmatch(r"[0-9]{1,9}", s) or int(s) < lo:
        raise UserError(f"environment variable {key} must be a whole number >= {lo}, got {raw!r} "
                        f"(set by torchrun or srun; unset it to run a single process)")
    return int(s)


def _slurm_tasks_per_node(env) -> int:
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int(env, "SLURM_NTASKS_PER_NODE", lo=1)
    m = re.match(r"(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))  # e.g. "4(x2)"
    return int(m.group(1)) if m else 1


def read_env(env=None) -> DistEnv:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        ws = _int(env, "WORLD_SIZE", lo=1)
        return _checked(DistEnv(_int(env, "RANK"), ws, _int(env, "LOCAL_RANK", 0),
                                _int(env, "LOCAL_WORLD_SIZE", ws, lo=1), "torchrun"))
    # srun sets SLURM_STEP_ID for the tasks it starts; the batch script itself has no step id,
    # so `axoplan train` run directly in an sbatch script stays a single process
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        return _checked(DistEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS", lo=1),
                                _int(env, "SLURM_LOCALID", 0), _slurm_tasks_per_node(env), "srun"))
    return DistEnv(0, 1, 0, 1, "single")


def _checked(de: DistEnv) -> DistEnv:
    if de.rank >= de.world_size:
        raise UserError(f"the environment says rank {de.rank} of a world of {de.world_size} processes; "
                        f"the rank must be below the world size")
    return de


def export_for_env_init(de: DistEnv, env=None) -> None:
    """torch's env:// rendezvous reads RANK/WORLD_SIZE/MASTER_*: fill them in under srun."""
    env = os.environ if env is None else env
    if de.launcher == "single":
        return
    # the same check for either launcher: torch's env:// reads both and fails with a traceback otherwise
    if not env.get("MASTER_ADDR", "").strip() or "MASTER_PORT" not in env:
        who = ("under srun, export MASTER_ADDR (the first node's host name) and MASTER_PORT before starting "
               "the tasks" if de.launcher == "srun" else
               "RANK and WORLD_SIZE are set (a torchrun-style launch), so MASTER_ADDR and MASTER_PORT must be "
               "too; start it with torchrun, or unset RANK and WORLD_SIZE to run one process")
        raise UserError(f"{who} (see docs/trainer.md)")
    port = env["MASTER_PORT"].strip()
    if not port.isascii() or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        raise UserError(f"environment variable MASTER_PORT must be a port number from 1 to 65535, got {port[:20]!r}")
    if de.launcher != "srun":
        return
    env.setdefault("RANK", str(de.rank))
    env.setdefault("WORLD_SIZE", str(de.world_size))
    env.setdefault("LOCAL_RANK", str(de.local_rank))


def cpu_threads(local_world_size: int, env=None) -> int | None:
    """Threads per process: cpu_count / processes on the node unless OMP_NUM_THREADS is set
    (None: leave torch's setting alone). The one rule: the trainer, `axoplan calibrate` (for the
    workers it starts) and the calibration worker all ask here."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))
