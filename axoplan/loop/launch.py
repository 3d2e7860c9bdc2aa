"""LaunchConfig: the one schema for a training run. `emit` writes it, `axoplan train` reads it,
`validate` produces it. Torch-free, so the planner can write configs on a login node."""
from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from axoplan import inputs, slurm
from axoplan.errors import UserError
from axoplan.shell import check_script, comment, env_name, quote, safe_line
from axoplan.planner.space import ORDERS
from axoplan.yamlio import load_yaml


@dataclass
class Grid:
    gx: int = 1
    gy: int = 1
    gz: int = 1
    gdata: int = 1

    @property
    def size(self) -> int:
        return self.gx * self.gy * self.gz * self.gdata


@dataclass
class Overlap:
    all_reduce: bool = True  # OAR: dI all-reduce under the dW GEMM
    reduce_scatter: bool = True  # ORS: dW reduce-scatters issued non-blocking, behind the backward compute
    all_gather: bool = True  # OAG: next layer's weight all-gather prefetched one layer ahead
    max_inflight_reduce_scatters: int = 2  # ORS: at most this many in flight; the oldest is waited for first
    data_parallel: bool = True  # gradient D all-reduces launched per layer in the last backward, waited before clipping


@dataclass
class Goldfish:
    k: int = 4
    h: int = 13


@dataclass
class LaunchConfig:
    model: str = "gpt-tiny"  # preset name or path to a model YAML
    grid: Grid = field(default_factory=Grid)
    order: str = "xyz"  # placement of x, y, z, innermost first; data is always outermost
    global_batch: int = 8  # sequences per optimizer step, over all GPUs
    micro_batch: int = 1  # sequences per GPU per micro-step; grad_acc = global_batch / (gdata*gz*micro_batch)
    seq_len: int | None = None  # None: the model's seq_len
    steps: int = 10
    warmup_steps: int = 2  # steps left out of the summary's median
    lr: float = 3e-4
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    overlap: Overlap = field(default_factory=Overlap)
    checkpointing: bool = False  # full activation checkpointing per block
    goldfish: Goldfish | None = None  # null: standard loss
    data: str = "synthetic"  # 'synthetic' or a path to a text file or a folder of text files
    seed: int = 0
    metrics: str | None = "metrics.jsonl"  # JSON-lines file (rank 0 writes); null: stdout only
    machine: str | None = None  # profile name or path, for % of peak in metrics; null: no %
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; or fp32, bf16
    collective_dtype: str = "auto"  # auto: the compute dtype; or fp32, bf16
    blas_tuning: str = "auto"  # auto: on with CUDA, off on CPU; or on, off
    backend: str = "auto"  # auto: nccl with CUDA, gloo otherwise; or nccl, gloo
    save: str | None = None  # path to write the final parameters (a torch file), or null

    def validate(self, where: str = "config") -> LaunchConfig:
        def bad(msg):
            raise UserError(f"{where}: {msg}")

        for name in ("gx", "gy", "gz", "gdata"):
            v = getattr(self.grid, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"grid.{name} must be a positive integer, got {inputs.show(v)}")
        if self.order not in ORDERS:
            bad(f"order must be one of {', '.join(ORDERS)}, got {inputs.show(self.order)}")
        for name, hi in (("global_batch", inputs.MAX_GLOBAL_BATCH), ("micro_batch", inputs.MAX_GLOBAL_BATCH),
                         ("steps", inputs.MAX_STEPS)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive integer, got {inputs.show(v)}")
            if v > hi:
                bad(f"{name} must be at most {hi:,}, got {inputs._short(v)}")
        if self.grid.size > inputs.MAX_GPUS:
            bad(f"the grid has {self.grid.size:,} ranks; at most {inputs.MAX_GPUS:,} are supported")
        if (not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0
                or self.warmup_steps > inputs.MAX_STEPS):
            bad(f"warmup_steps must be a non-negative integer, got {inputs.show(self.warmup_steps)}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool)
                                         or not 0 < self.seq_len <= inputs.MAX_SEQ_LEN):
            bad(f"seq_len must be a positive integer (at most {inputs.MAX_SEQ_LEN:,}) or null, got {inputs.show(self.seq_len)}")
        self._validate_training(bad)
        self._validate_text(bad, where)
        for name, allowed in (("dtype", ("auto", "fp32", "bf16")), ("collective_dtype", ("auto", "fp32", "bf16")),
                              ("blas_tuning", ("auto", "on", "off")), ("backend", ("auto", "nccl", "gloo"))):
            if getattr(self, name) not in allowed:
                bad(f"{name} must be one of {', '.join(allowed)}, got {inputs.show(getattr(self, name))}")
        mif = self.overlap.max_inflight_reduce_scatters
        if not isinstance(mif, int) or isinstance(mif, bool) or mif < 1:
            bad(f"overlap.max_inflight_reduce_scatters must be a positive integer, got {inputs.show(mif)}")
        if self.goldfish is not None:
            if not isinstance(self.goldfish.k, int) or isinstance(self.goldfish.k, bool) or self.goldfish.k < 2:
                bad(f"goldfish.k must be an integer >= 2, got {inputs.show(self.goldfish.k)}")
            if not isinstance(self.goldfish.h, int) or isinstance(self.goldfish.h, bool) or self.goldfish.h < 1:
                bad(f"goldfish.h must be a positive integer, got {inputs.show(self.goldfish.h)}")
        return self

    def _validate_training(self, bad) -> None:
        """Optimizer numbers and switches: a string, nan or inf here would train to NaN or crash mid-run."""
        def num(name, v, lo_open):
            ok = not isinstance(v, (bool, str))
            try:
                ok = ok and inputs.number(v, name, lo=0, lo_open=lo_open) is not None
            except UserError:
                ok = False
            if not ok:
                bad(f"{name} must be a finite number {'> 0' if lo_open else '>= 0'}, got {inputs.show(v)}")

        num("lr", self.lr, True)
        num("weight_decay", self.weight_decay, False)
        num("grad_clip", self.grad_clip, False)  # 0 turns clipping off
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= inputs.MAX_SEED:
            bad(f"seed must be an integer from 0 to {inputs.MAX_SEED}, got {inputs.show(self.seed)}")
        for name in ("all_reduce", "reduce_scatter", "all_gather", "data_parallel"):
            if not isinstance(getattr(self.overlap, name), bool):
                bad(f"overlap.{name} must be true or false, got {inputs.show(getattr(self.overlap, name))}")
        if not isinstance(self.checkpointing, bool):
            bad(f"checkpointing must be true or false, got {inputs.show(self.checkpointing)}")

    def _validate_text(self, bad, where: str) -> None:
        """Names and paths: text without control characters (they reach scripts and one-line records)."""
        for name, optional in (("model", False), ("data", False), ("metrics", True), ("machine", True),
                               ("save", True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if not isinstance(v, str) or not v:
                bad(f"{name} must be {'a path or null' if optional else 'a name or path'}, got {inputs.show(v)}")
            inputs.text(v, f"{where}: {name}")
        for name in ("metrics", "save"):
            v = getattr(self, name)
            if v is not None and (v.endswith("/") or Path(v).is_dir()):
                bad(f"{name} '{v}' is a folder; give a file name")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def write(self, path: str | Path) -> Path:
        from axoplan.atomic import atomic_write_text

        return atomic_write_text(path, self.to_yaml())


_NESTED = {"grid": Grid, "overlap": Overlap, "goldfish": Goldfish}


def _build(cls, d: Any, where: str, prefix: str = ""):
    if not isinstance(d, dict):
        raise UserError(f"{where}: '{prefix.rstrip('.') or 'top level'}' must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(d) - names)
    if unknown:
        raise UserError(f"{where}: unknown key '{prefix}{unknown[0]}' (known: {', '.join(sorted(names))})")
    kw = {}
    for k, v in d.items():
        if k in _NESTED and cls is LaunchConfig:
            kw[k] = None if v is None and k == "goldfish" else _build(_NESTED[k], v, where, f"{k}.")
        else:
            kw[k] = v
    return cls(**kw)


def config_from_dict(d: Any, where: str = "config") -> LaunchConfig:
    return _build(LaunchConfig, d, where).validate(where)


def load_config(path: str | Path) -> LaunchConfig:
    p = Path(inputs.text(str(path), "--config"))
    where = f"config '{p}'"
    d = load_yaml(p, where)
    return config_from_dict(d if d is not None else {}, where)


def example_config_yaml() -> str:
    """A complete example with every key at its default, commented for people."""
    buf = io.StringIO()
    buf.write("# axoplan train config: every key with its default (axoplan train --print-config)\n")
    buf.write(LaunchConfig(goldfish=None).to_yaml())
    buf.write("# goldfish loss instead of the standard loss:\n# goldfish: {k: 4, h: 13}\n")
    return buf.getvalue()


# ---- emit: a ranked configuration -> config.yaml + launch scripts + README ----------------------
# Everything below is text generation: no torch, no process start. `axoplan emit` and `axoplan
# validate` both write run directories through write_run_dir(), so what validate measures is
# exactly what a user would launch.

CONFIG_NAME = "config.yaml"
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


def config_from_row(row, model: str, global_batch: int, seq_len: int | None = None, machine: str | None = None,
                    steps: int = 10, warmup_steps: int = 2, **overrides) -> LaunchConfig:
    """The LaunchConfig of one ranked row (a mapping with gx, gy, gz, gdata, order, micro_batch,
    checkpointing, as axoplan.planner.rank.rank() returns)."""
    cfg = LaunchConfig(
        model=portable_ref(model),
        grid=Grid(int(row["gx"]), int(row["gy"]), int(row["gz"]), int(row["gdata"])),
        order=str(row["order"]), global_batch=int(global_batch), micro_batch=int(row["micro_batch"]),
        seq_len=None if seq_len is None else int(seq_len), steps=int(steps), warmup_steps=int(warmup_steps),
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
        'PYTHON="${PYTHON:-python3}"',
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
        time_s=time_limit_s, log_dir=rd, log_name="slurm-%j.out", about=about)
    lines += [
        "# shellcheck disable=SC2016  # the quoted path is literal on purpose",
        f"RUN_DIR={quote(rd, 'the run folder path')}",
        'cd "$RUN_DIR"',
        'PYTHON="${PYTHON:-python3}"',
        "# torch's env:// rendezvous: the first node of the allocation hosts the store",
        slurm.head_node("MASTER_ADDR"),
        'export MASTER_ADDR',
        'export MASTER_PORT="${MASTER_PORT:-29500}"',
        *_env_lines(launch_env(profile)),
        f'srun --ntasks={g} --ntasks-per-node={per} --kill-on-bad-exit=1 \\',
        f'  "$PYTHON" -m axoplan.cli train --config "$RUN_DIR/{CONFIG_NAME}"',
    ]
    return slurm.script(lines, "an emitted script")


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


def write_run_dir(out_dir: str | Path, cfg: LaunchConfig, profile, chosen, runner_up=None, command: str = "",
                  candidates: int | None = None, feasible: int | None = None,
                  slurm_time_s: float | None = None) -> dict[str, Path]:
    """Write config.yaml, launch_torchrun.sh, launch_slurm.sbatch and README.txt into out_dir, each
    atomically; the scripts are made executable."""
    from axoplan.atomic import write_files

    d = Path(inputs.text(str(out_dir), "the run folder path"))
    if slurm_time_s is None:
        # the predicted run (steps x predicted batch time) with a generous margin for start-up and
        # model error, at least 10 minutes
        slurm_time_s = max(600.0, 4.0 * cfg.steps * float(chosen["batch_time_s"]) + 600.0)
    files = {
        CONFIG_NAME: (cfg.to_yaml(), 0o644),
        TORCHRUN_NAME: (torchrun_script(cfg, profile), 0o755),
        SLURM_NAME: (slurm_script(cfg, profile, d, slurm_time_s), 0o755),
        README_NAME: (readme_text(cfg, profile, chosen, runner_up, command, candidates, feasible), 0o644),
    }
    # all four files as one unit under the folder's lock: two emits into one folder never mix
    return write_files(d, files)
