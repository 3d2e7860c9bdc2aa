"""emit: a ranked configuration -> config.yaml (axoplan.runconfig's LaunchConfig) + launch scripts + README.
Everything here is text generation: no torch, no process start. `axoplan emit` and `axoplan validate` both
write run directories through write_run_dir(), so what validate measures is exactly what a user would launch."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from axoplan import inputs, slurm
from axoplan.errors import UserError
from axoplan.shell import check_script, comment, env_name, quote, safe_line
from axoplan.runconfig import Grid, LaunchConfig

CONFIG_NAME = "config.yaml"
PROFILE_NAME = "machine.yaml"  # the machine profile, copied in: the folder holds everything it needs
MODEL_NAME = "model.yaml"  # a model given as a YAML file, copied in (a preset stays a name)
TORCHRUN_NAME = "launch_torchrun.sh"
SLURM_NAME = "launch_slurm.sbatch"
README_NAME = "README.txt"


def portable_ref(ref: str) -> str:
    """A preset/profile name stays a name; a path becomes absolute, so a run directory works from
    any working directory (the launch scripts cd into it)."""
    s = inputs.text(str(ref), "the model or machine")
    p = Path(s)
    if s.endswith((".yaml", ".yml")) or p.exists():
        return str(p.resolve())
    return s


def python_default() -> str:
    """The launchers' `PYTHON="${PYTHON:-...}"` line: the interpreter that ran emit (its venv's, with axoplan and
    torch installed), overridable; a bare python3 outside the venv would lack them."""
    return f'PYTHON="${{PYTHON:-{quote(sys.executable or "python3", "the Python interpreter path")}}}"'


def config_from_row(row, model: str, global_batch: int, seq_len: int | None = None, machine: str | None = None,
                    steps: int = 10, timing_warmup_steps: int = 2, **overrides) -> LaunchConfig:
    """The LaunchConfig of one ranked row (a mapping with gx, gy, gz, gdata, order, micro_batch,
    checkpointing, as axoplan.planner.rank.rank() returns)."""
    cfg = LaunchConfig(
        model=portable_ref(model),
        grid=Grid(int(row["gx"]), int(row["gy"]), int(row["gz"]), int(row["gdata"])),
        order=str(row["order"]), global_batch=int(global_batch), micro_batch=int(row["micro_batch"]),
        seq_len=None if seq_len is None else int(seq_len), steps=int(steps),
        timing_warmup_steps=int(timing_warmup_steps),
        checkpointing=bool(row["checkpointing"]), machine=machine)
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise UserError(f"unknown config key '{k}'")
        setattr(cfg, k, v)
    return cfg.validate("emitted config")


def is_cpu_profile(profile) -> bool:
    """CPU profiles run gloo ranks; GPU profiles NCCL with a GPU per rank (the profile's `kind`)."""
    return profile.kind == "cpu"


# Network environment per interconnect, used when the profile has no `launch.env` section.
# Sources: the Derecho/Slingshot NCCL guide (negin513.github.io/distributed-pytorch-hpc, "NCCL Tuning
# Guide": NCCL_SOCKET_IFNAME=hsn, NCCL_CROSS_NIC=1, FI_CXI_DISABLE_HOST_REGISTER=1,
# FI_MR_CACHE_MONITOR=userfaultfd) and the aws-ofi-nccl plugin wiki; TORCH_NCCL_ASYNC_ERROR_HANDLING
# is PyTorch's switch that turns a stuck NCCL collective into an error instead of a silent hang.
_ENV_GPU = [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a stuck collective aborts the job instead of hanging it"),
            ("NCCL_DEBUG", "WARN", "NCCL prints its warnings (INFO shows the chosen transports)")]
_ENV_SLINGSHOT = [("NCCL_SOCKET_IFNAME", "hsn", "bootstrap over the Slingshot high-speed interfaces"),
                  ("NCCL_CROSS_NIC", "1", "Slingshot is not rail-optimised: let rings cross NICs"),
                  ("FI_CXI_DISABLE_HOST_REGISTER", "1", "avoids CUDA/libfabric registration deadlocks (CXI)"),
                  ("FI_MR_CACHE_MONITOR", "userfaultfd", "libfabric memory-registration cache monitor for CUDA")]
_ENV_CPU = [("GLOO_SOCKET_IFNAME", "", "leave empty for gloo's default interface; set it on multi-homed hosts")]


def launch_env(profile) -> list[tuple[str, str, str]]:
    """(name, value, why) of the environment the launch scripts export for this machine's network.

    A profile may carry its own: `launch: {env: {NAME: value, ...}, source: ...}` (proposed schema
    extension); otherwise defaults by kind: gloo on CPU, NCCL on GPU, plus the libfabric/NCCL settings
    Slingshot machines need when the profile's description names Slingshot."""
    raw = getattr(profile, "raw", None) or {}
    section = raw.get("launch") if isinstance(raw, dict) else None
    if isinstance(section, dict) and isinstance(section.get("env"), dict):
        why = str(section.get("source", "from the machine profile"))
        return [(str(k), "" if v is None else str(v), why) for k, v in section["env"].items()]
    if is_cpu_profile(profile):
        return [e for e in _ENV_CPU if e[1]]
    env = list(_ENV_GPU)
    text = f"{profile.description} {profile.device}".lower()
    if "slingshot" in text:
        env += _ENV_SLINGSHOT
    return env


def env_summary(profile) -> str | None:
    """One line naming what the launch scripts export from this profile (None if nothing): said before
    anything runs, so a profile's environment never takes effect unseen."""
    env = launch_env(profile)
    if not env:
        return None
    return (f"the launch scripts export (unless already set) from machine '{profile.name}': "
            + ", ".join(f"{k}={v}" for k, v, _ in env))


def _env_lines(env) -> list[str]:
    lines = []
    for name, value, why in env:
        env_name(name)
        lines.append(comment(why, "launch.source of the machine profile"))
        # a value the user already exported wins
        if "$" in value or "`" in value:
            lines.append("# shellcheck disable=SC2016  # a literal value")
        lines.append(f'[[ -n "${{{name}:-}}" ]] || export {name}={quote(value, f"launch.env.{name}")}')
    return lines


def check_layout(gpus: int, profile) -> tuple[int, int]:
    """(nodes, processes per node) the launch scripts start, refused in one sentence when they cannot
    start exactly `gpus` ranks: more than one node's worth that is not a whole number of nodes."""
    nodes, per = nodes_for(gpus, profile.gpus_per_node)
    if nodes * per != gpus:
        raise UserError(f"--gpus {gpus} is not a whole number of nodes of {profile.gpus_per_node} GPUs "
                        f"(machine '{profile.name}'): the launch scripts start the same number of ranks on every "
                        f"node; give at most {profile.gpus_per_node} or a multiple of {profile.gpus_per_node}")
    return nodes, per


def nodes_for(gpus: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node): full nodes of `gpus_per_node`, fewer on one node when G is smaller."""
    per = max(1, min(gpus, gpus_per_node))
    return -(-gpus // per), per


def torchrun_script(cfg: LaunchConfig, profile) -> str:
    """A bash script that trains this config with torchrun: one node (--standalone) by default, or
    NNODES nodes with a c10d rendezvous at MASTER_ADDR:MASTER_PORT (run it once per node with
    NODE_RANK set). It finds config.yaml beside itself, so the directory can be moved."""
    g = cfg.grid.size
    nodes, per = nodes_for(g, profile.gpus_per_node)
    lines = [
        "#!/usr/bin/env bash",
        comment(f"axoplan: train {cfg.model} on grid gx={cfg.grid.gx} gy={cfg.grid.gy} gz={cfg.grid.gz} "
                f"gdata={cfg.grid.gdata} (order {cfg.order}), {g} processes.", "the model path"),
        "# One node:    bash launch_torchrun.sh",
        "# Many nodes:  on every node, NNODES=N NODE_RANK=i MASTER_ADDR=host0 [MASTER_PORT=29500] bash launch_torchrun.sh",
        "# Override:    PYTHON=/path/to/python, NPROC_PER_NODE=k (with NNODES*NPROC_PER_NODE = the grid size).",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'cd "$HERE"  # metrics and relative paths of the config land beside it',
        f"GRID_SIZE={g}",
        f'NNODES="${{NNODES:-{nodes}}}"',
        f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{per}}}"',
        'NODE_RANK="${NODE_RANK:-0}"',
        python_default(),
        'if (( NNODES * NPROC_PER_NODE != GRID_SIZE )); then',
        '  echo "error: NNODES*NPROC_PER_NODE = $NNODES*$NPROC_PER_NODE must equal the grid size $GRID_SIZE" >&2',
        "  exit 2",
        "fi",
        *_env_lines(launch_env(profile)),
        'if (( NNODES == 1 )); then',
        '  exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \\',
        f'    -m axoplan.cli train --config "$HERE/{CONFIG_NAME}"',
        "fi",
        'if [[ -z "${MASTER_ADDR:-}" ]]; then',
        '  echo "error: multi-node runs need MASTER_ADDR (the host name of node 0) on every node" >&2',
        "  exit 2",
        "fi",
        'exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \\',
        '  --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-axoplan}" \\',
        '  --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \\',
        f'  -m axoplan.cli train --config "$HERE/{CONFIG_NAME}"',
    ]
    return check_script("\n".join(lines) + "\n")


def slurm_script(cfg: LaunchConfig, profile, run_dir: str | Path, time_limit_s: float = 3600.0,
                 job_name: str | None = None) -> str:
    """An sbatch script: nodes = ceil(G / gpus_per_node), one task per GPU, srun starts the ranks and
    `axoplan train` reads Slurm's variables. Slurm copies a batch script elsewhere before running it,
    so the run directory is written in (quoted), not found from the script's own path."""
    g = cfg.grid.size
    nodes, per = nodes_for(g, profile.gpus_per_node)
    rd = str(Path(run_dir).resolve())
    about = [comment(f"axoplan: {cfg.model} on grid gx={cfg.grid.gx} gy={cfg.grid.gy} gz={cfg.grid.gz} "
                     f"gdata={cfg.grid.gdata} (order {cfg.order}) on {nodes} node(s) x {per} "
                     f"{'process(es)' if is_cpu_profile(profile) else 'GPU(s)'} of {profile.name}.",
                     "the model path or the machine profile's name"),
             f"# Submit with: sbatch {SLURM_NAME}"]
    lines = slurm.header(
        job_name=job_name or f"axoplan-{Path(cfg.model).stem}-{cfg.grid.gx}x{cfg.grid.gy}x{cfg.grid.gz}x{cfg.grid.gdata}-{cfg.order}",
        nodes=nodes, ntasks=g, ntasks_per_node=per, gpus_per_node=None if is_cpu_profile(profile) else per,
        time_s=time_limit_s, log_dir=rd, log_name="slurm-%j.out", about=about, exclusive=True,
        site=slurm.site_options(profile), cpus_per_task=slurm.site_options(profile).get("cpus_per_task"),
        requeue=True)
    lines += [
        "# shellcheck disable=SC2016  # the quoted path is literal on purpose",
        f"RUN_DIR={quote(rd, 'the run folder path')}",
        'cd "$RUN_DIR"',
        python_default(),
        "# torch's env:// rendezvous: the first node of the allocation hosts the store",
        slurm.head_node("MASTER_ADDR"),
        'export MASTER_ADDR',
        'export MASTER_PORT="${MASTER_PORT:-29500}"',
        *_env_lines(launch_env(profile)),
        *slurm_task_lines(profile, per),
        *slurm.requeue_lines(),
        *slurm.background_step([
            f'srun --ntasks={g} --ntasks-per-node={per} --cpus-per-task="$CPUS_PER_TASK" {gpu_bind(profile, per)}'
            '--kill-on-bad-exit=1 \\',
            f'  "$PYTHON" -m axoplan.cli train --config "$RUN_DIR/{CONFIG_NAME}"']),
    ]
    return slurm.script(lines, "an emitted script")


def slurm_task_lines(profile, tasks_per_node: int, ranks_per_task: int = 1) -> list[str]:
    """CPUS_PER_TASK: the profile's launch.slurm.cpus_per_task, else the node's CPUs shared by its tasks (an
    exclusive job owns the node); each rank's threads are its share of them (a torchrun task starts
    ranks_per_task ranks)."""
    fixed = slurm.site_options(profile).get("cpus_per_task")
    share = (str(int(fixed)) if fixed else
             f'$(( ${{SLURM_CPUS_ON_NODE:-{tasks_per_node}}} / {tasks_per_node} > 0 ? '
             f'${{SLURM_CPUS_ON_NODE:-{tasks_per_node}}} / {tasks_per_node} : 1 ))')
    threads = ('"$CPUS_PER_TASK"' if ranks_per_task == 1 else
               f'"$(( CPUS_PER_TASK / {ranks_per_task} > 0 ? CPUS_PER_TASK / {ranks_per_task} : 1 ))"')
    return [f'CPUS_PER_TASK="${{CPUS_PER_TASK:-{share}}}"',
            f'[[ -n "${{OMP_NUM_THREADS:-}}" ]] || export OMP_NUM_THREADS={threads}']


def gpu_bind(profile, tasks_per_node: int) -> str:
    """srun's --gpu-bind option (with a trailing space), or "" on CPU: each of one-task-per-GPU ranks gets the
    GPU closest to its CPUs; one task owning a node's GPUs (torchrun) sees them all. launch.slurm.gpu_bind wins."""
    if is_cpu_profile(profile):
        return ""
    bind = slurm.site_options(profile).get("gpu_bind") or ("closest" if tasks_per_node == profile.gpus_per_node
                                                            else "none")
    return f"--gpu-bind={bind} "


def _fmt_row(r) -> str:
    return (f"grid gx={int(r['gx'])} gy={int(r['gy'])} gz={int(r['gz'])} gdata={int(r['gdata'])}, order {r['order']}, "
            f"micro-batch {int(r['micro_batch'])}, checkpointing {'on' if bool(r['checkpointing']) else 'off'}")


def readme_text(cfg: LaunchConfig, profile, chosen, runner_up=None, command: str = "",
                candidates: int | None = None, feasible: int | None = None) -> str:
    """README.txt of a run directory: what was chosen, why, and how to launch it."""
    g = cfg.grid.size
    nodes, per = nodes_for(g, profile.gpus_per_node)
    t = float(chosen["batch_time_s"])
    out = [f"axoplan run directory: {cfg.model} on {g} {'processes' if is_cpu_profile(profile) else 'GPUs'} of "
           f"{profile.name} ({nodes} node(s) x {per}), global batch {cfg.global_batch} sequences"
           + (f" x {cfg.seq_len} tokens" if cfg.seq_len else ""), ""]
    out.append("CHOSEN")
    rank = chosen.get("rank")
    out.append(f"  {_fmt_row(chosen)}" + (f"  (rank {rank}" + (f" of {feasible} feasible" if feasible else "") + ")"
                                          if rank is not None and str(rank) not in ("<NA>", "nan") else ""))
    out.append(f"  predicted time per batch : {t:.4g} s  (compute {float(chosen['compute_s']):.4g} s, "
               f"communication {float(chosen['comm_s']):.4g} s of which exposed {float(chosen['exposed_comm_s']):.4g} s)")
    out.append(f"  predicted memory per GPU : {float(chosen['memory_gib']):.3g} GiB "
               f"(capacity {profile.mem_capacity / 2**30:.3g} GiB, headroom {profile.mem_headroom / 2**30:.3g} GiB)")
    out.append(f"  predicted throughput     : {float(chosen['tflops_per_gpu']):.4g} TFLOP/s per GPU "
               f"({float(chosen['pct_of_peak']):.3g}% of peak)")
    out.append("")
    if runner_up is not None:
        tr = float(runner_up["batch_time_s"])
        out.append("RUNNER-UP (best configuration with another grid or order)")
        out.append(f"  {_fmt_row(runner_up)}")
        out.append(f"  predicted {tr:.4g} s per batch, {100 * (tr / t - 1):+.1f}% vs the chosen one; "
                   f"memory {float(runner_up['memory_gib']):.3g} GiB")
        if abs(tr / t - 1) < 0.05:
            out.append("  (within 5%: the model cannot separate them reliably; `axoplan validate` measures both)")
        out.append("")
    out += ["WHY",
            "  The planner scored " + (f"{candidates} candidate configurations ({feasible} feasible) " if candidates else
                                       "every candidate configuration ")
            + "with the profile's GEMM, network and memory numbers and picked this one;",
            "  `axoplan explain` with the same arguments and --grid/--order shows where its time and memory go.",
            ""]
    if command:
        out += ["MADE BY", f"  {command}", ""]
    out += ["FILES",
            f"  {CONFIG_NAME:<22} the run config (LaunchConfig; `axoplan train --print-config` documents every key)",
            f"  {TORCHRUN_NAME:<22} torchrun launcher (one node, or several with NNODES/NODE_RANK/MASTER_ADDR)",
            f"  {SLURM_NAME:<22} Slurm batch script ({nodes} node(s), {per} task(s) per node, srun)",
            "",
            "RUN",
            (f"  one node     : bash {TORCHRUN_NAME}" if nodes == 1 else
             f"  one node     : NNODES=1 NPROC_PER_NODE={g} bash {TORCHRUN_NAME}   (all {g} ranks on one machine)"),
            f"  {nodes} nodes{' ' * max(0, 7 - len(str(nodes)))}: on node i = 0..{nodes - 1}: NNODES={nodes} NODE_RANK=i "
            f"MASTER_ADDR=<node 0 host> bash {TORCHRUN_NAME}" if nodes > 1 else
            f"  many nodes   : on node i: NNODES=N NPROC_PER_NODE={g}/N NODE_RANK=i MASTER_ADDR=<node 0 host> "
            f"bash {TORCHRUN_NAME}",
            f"  Slurm        : sbatch {SLURM_NAME}",
            f"  Metrics are printed as JSON lines and appended to {cfg.metrics or '(stdout only)'} in this directory;",
            "  the last line has \"summary\": true and the median time per batch after warm-up.",
            ""]
    return "\n".join(safe_line(line, "a value written into README.txt") for line in out)


def portable(cfg: LaunchConfig, profile, folder: Path) -> tuple[LaunchConfig, dict]:
    """cfg naming the copies of its profile and model file that go into the folder (relative names: the folder can
    move; runconfig.load_config reads them from the config's folder), and those files."""
    from axoplan.loop.profile_copy import profile_files

    files: dict = {}
    if profile.path:
        files.update(profile_files(profile, PROFILE_NAME, folder))
        cfg = dataclasses.replace(cfg, machine=PROFILE_NAME)
    model = Path(cfg.model)
    if cfg.model.endswith((".yaml", ".yml")) and model.is_file():
        try:
            files[MODEL_NAME] = (model.read_bytes(), 0o644)
        except OSError as e:
            raise UserError(f"cannot read the model file '{model}': {(e.strerror or str(e)).lower()}") from None
        cfg = dataclasses.replace(cfg, model=MODEL_NAME)
    return cfg, files


def write_run_dir(out_dir: str | Path, cfg: LaunchConfig, profile, chosen, runner_up=None, command: str = "",
                  candidates: int | None = None, feasible: int | None = None,
                  slurm_time_s: float | None = None) -> dict[str, Path]:
    """Write config.yaml, launch_torchrun.sh, launch_slurm.sbatch and README.txt into out_dir, each
    atomically; the scripts are made executable."""
    from axoplan.atomic import write_files

    d = Path(inputs.text(str(out_dir), "the run folder path"))
    cfg, carried = portable(cfg, profile, d)
    if slurm_time_s is None:
        # the predicted run (steps x predicted batch time) with a generous margin for start-up and
        # model error, at least 10 minutes
        slurm_time_s = max(600.0, 4.0 * cfg.steps * float(chosen["batch_time_s"]) + 600.0)
    files = {
        CONFIG_NAME: (cfg.to_yaml(), 0o644),
        TORCHRUN_NAME: (torchrun_script(cfg, profile), 0o755),
        SLURM_NAME: (slurm_script(cfg, profile, d, slurm_time_s), 0o755),
        README_NAME: (readme_text(cfg, profile, chosen, runner_up, command, candidates, feasible), 0o644),
        **carried,
    }
    # all four files as one unit under the folder's lock: two emits into one folder never mix
    return write_files(d, files)
