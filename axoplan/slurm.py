"""The one writer of Slurm batch scripts: emit's training run (loop/launch.py), validate's job array
(loop/validate.py) and calibration across nodes (calibrate/slurm.py) share the #SBATCH header, the
preamble and the final check here; each adds only its own body. Values go in through axoplan.shell."""
from __future__ import annotations

import math
from pathlib import Path

from axoplan.errors import UserError
from axoplan.shell import check_script, slug


MAX_TIME_S = 365 * 86400


def slurm_time(seconds: float) -> str:
    """--time as HH:MM:SS, rounded up to whole minutes (at least one); refused beyond a year (a
    prediction that long, or an inf from extreme inputs, is no time limit any scheduler takes)."""
    if not math.isfinite(seconds) or seconds > MAX_TIME_S:
        raise UserError(f"the Slurm time limit would be {seconds:.3g} s, more than a year: the predicted run is "
                        f"too long for a batch job (fewer --steps, or check the machine profile's numbers)")
    s = 60 * max(1, math.ceil(seconds / 60))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h:02d}:{m:02d}:{sec:02d}"


def directive_safe(s: str) -> bool:
    # #SBATCH lines are not parsed by a shell: only plain characters are safe in them
    return bool(s) and all((c.isascii() and c.isalnum()) or c in "._-/" for c in s)


def head_node(var: str) -> str:
    """The assignment of the allocation's first node's host name to var (where rendezvous is hosted)."""
    return f'{var}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'


def header(*, job_name: str, nodes: int, ntasks_per_node: int, gpus_per_node: int | None, time_s: float,
           log_dir: str | Path | None, log_name: str, about: list[str], ntasks: int | None = None,
           array: int | None = None, exclusive: bool = False, site: dict | None = None,
           cpus_per_task: int | None = None, requeue: bool = False) -> list[str]:
    """The lines every batch script starts with: the shebang, `about` (comment lines, written by the
    caller through shell.comment), the #SBATCH directives, the account/partition lines to fill in,
    then the preamble. gpus_per_node is None for a CPU job (no --gpus-per-node); array is the number
    of array tasks; the log goes to log_dir/log_name (log_name alone: the folder sbatch is called
    from), left to Slurm's default when log_dir has characters a directive cannot hold. site: the profile's
    `launch.slurm` (site_options): account, partition, qos and constraint lines, written where given and left
    as commented placeholders otherwise. requeue: Slurm signals the batch shell 120 s before it ends the job
    (preemption or time limit); requeue_lines() turns that into `scontrol requeue`."""
    lines = ["#!/bin/bash", *about, f"#SBATCH --job-name={slug(job_name)}"]
    if array is not None:
        lines.append(f"#SBATCH --array=0-{array - 1}")
    lines.append(f"#SBATCH --nodes={nodes}")
    if ntasks is not None:
        lines.append(f"#SBATCH --ntasks={ntasks}")
    lines.append(f"#SBATCH --ntasks-per-node={ntasks_per_node}")
    if gpus_per_node is not None:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task is not None:
        lines.append(f"#SBATCH --cpus-per-task={int(cpus_per_task)}")
    if exclusive:
        lines.append("#SBATCH --exclusive")
    if requeue:
        lines += ["#SBATCH --signal=B:USR1@120", "#SBATCH --requeue"]
    lines.append(f"#SBATCH --time={slurm_time(time_s)}")
    if log_dir is None:
        lines.append(f"#SBATCH --output={log_name}")
    elif directive_safe(str(log_dir)):
        lines.append(f"#SBATCH --output={log_dir}/{log_name}")
    else:
        lines += ["# (no --output directive: the folder's path has characters #SBATCH cannot quote;",
                  "#  Slurm writes its log in the folder sbatch was called from)"]
    site = site or {}
    for key in SITE_KEYS:
        if site.get(key):
            lines.append(f"#SBATCH --{key}={site[key]}")
    missing = [k for k in ("account", "partition") if not site.get(k)]
    for i, key in enumerate(missing):
        lines.append(f"##SBATCH --{key}=YOUR_{key.upper()}" + ("   (uncomment and fill in what your site requires, "
                                                                "or set launch.slurm in the machine profile)" if i == 0 else ""))
    return lines + ["set -euo pipefail"]


# the #SBATCH lines a machine profile may carry for its site (launch.slurm in machine_profiles/README.md)
SITE_KEYS = ("account", "partition", "qos", "constraint")


def site_options(profile) -> dict:
    """The profile's `launch.slurm` mapping (account, partition, qos, constraint, cpus_per_task, gpu_bind), as
    profile_reader._check_launch validated it; {} when it has none."""
    raw = getattr(profile, "raw", None) or {}
    launch = raw.get("launch") if isinstance(raw, dict) else None
    sl = launch.get("slurm") if isinstance(launch, dict) else None
    return dict(sl) if isinstance(sl, dict) else {}


def requeue_lines() -> list[str]:
    """The batch shell's handler of header(requeue=True)'s signal: put the job back in the queue, where it
    starts again from its last checkpoint. The job's main step must run in the background and be waited for
    (background_step), as bash runs a trap only between commands."""
    return ['requeue() {',
            '  echo "axoplan: Slurm signalled the end of job $SLURM_JOB_ID (preemption or time limit): requeueing it" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"',
            '}',
            "trap requeue USR1"]


def background_step(command_lines: list[str]) -> list[str]:
    """The job's main step (its last line must not end in a continuation) run in the background and waited for,
    so the requeue trap can run while it is under way."""
    return command_lines[:-1] + [command_lines[-1] + " &", 'STEP_PID=$!', 'wait "$STEP_PID"']


def script(lines: list[str], what: str) -> str:
    """The whole script from its lines, every one checked to be printable text (see shell.check_script)."""
    return check_script("\n".join(lines) + "\n", what)
