"""`axoplan emit --framework torchtitan|megatron|axonn`: a planned candidate written as a real framework expects it.

Each framework has a writer (emit_torchtitan, emit_megatron, emit_axonn), a pure function from the candidate
(Plan), the model, the job, the profile and the execution to its files and the command torchrun starts. This
module holds what they share: the Plan, the check of what a framework can express, the torchrun and Slurm
launchers around the command, and the run record (run.yaml) that `validate --collect` and `refit` read back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from axoplan import slurm
from axoplan.errors import UserError
from axoplan.planner.pipeline import SCHEDULES
from axoplan.loop.launch import (PROFILE_NAME, _env_lines, gpu_bind, is_cpu_profile, launch_env, nodes_for,
                                 python_default, slurm_task_lines)
from axoplan.shell import check_script, comment, quote

TORCHRUN_NAME = "launch_torchrun.sh"
SLURM_NAME = "launch_slurm.sbatch"
RECORD_NAME = "run.yaml"  # what was planned, for reading the run back
LOG_NAME = "train.log"  # the launchers append the framework's output here
README_NAME = "README.txt"


@dataclass(frozen=True)
class Plan:
    """One planned candidate: the 4D grid, its placement, micro-batch and checkpointing, and the pipeline
    (pp stages, vpp virtual stages per stage, schedule)."""

    gx: int
    gy: int
    gz: int
    gdata: int
    order: str = "xyz"
    micro_batch: int = 1
    checkpointing: bool = False
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"

    @classmethod
    def from_row(cls, row) -> Plan:
        """A ranked row (a mapping, or an object with attributes); pp, vpp and schedule default to no pipeline
        where the ranking has none."""
        get = row.get if isinstance(row, dict) else (lambda k, d=None: getattr(row, k, d))

        def num(k, d):
            v = get(k, d)
            return d if v is None or v != v else int(v)  # NaN: a column the row does not have

        return cls(int(get("gx")), int(get("gy")), int(get("gz")), int(get("gdata")), str(get("order", "xyz")),
                   int(get("micro_batch", 1)), bool(get("checkpointing", False)), num("pp", 1), num("vpp", 1),
                   str(get("schedule", "1f1b") or "1f1b"))

    @property
    def gpus(self) -> int:
        return self.pp * self.gx * self.gy * self.gz * self.gdata

    def grad_acc(self, global_batch: int) -> int:
        """Micro-batches per step on one (data, z) slot: global batch / (gdata * gz * micro-batch)."""
        return global_batch // (self.gdata * self.gz * self.micro_batch)

    def layers_per_stage(self, n_layers: int) -> int:
        """Blocks per (virtual) pipeline stage."""
        return n_layers // (self.pp * self.vpp)

    def uneven_stages(self, n_layers: int) -> list[int] | None:
        """Blocks of each (virtual) stage in layer order as the planner splits them (pipeline.stage_blocks: the first
        n_layers mod (pp x vpp) take one more) where they do not divide evenly; None where they do."""
        from axoplan.planner.pipeline import stage_blocks

        if self.pp < 2 or n_layers % (self.pp * self.vpp) == 0:
            return None
        return [int(n) for n in stage_blocks(n_layers, self.pp, self.vpp)]


def split_text(counts) -> str:
    """A pipeline's layers per (virtual) stage in words, runs collapsed: '14 stages of 8 layers, 2 of 7'."""
    runs: list = []
    for n in (int(x) for x in counts):
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    words = [f"{k} of {n} layer{'s' * (n != 1)}" for k, n in runs]
    words[0] = words[0].replace(" of ", " stage of " if runs[0][0] == 1 else " stages of ", 1)
    return ", ".join(words)


@dataclass
class Emitted:
    """A writer's result: files (name -> (text, mode)), the command after torchrun's own options (shell words,
    $RUN_DIR the run folder), exports (name, value, why), variables the user must set (name, why), and lines
    for README.txt saying what maps to what."""

    files: dict
    command: list
    env: list = field(default_factory=list)
    required: list = field(default_factory=list)
    mapping: list = field(default_factory=list)
    shell_lines: list = field(default_factory=list)  # bash lines run before the command (after `required`)


def cannot(framework: str, what: str):
    """The one sentence for something a framework cannot express."""
    raise UserError(f"{framework} cannot express this candidate: {what}")


def check_plan(framework: str, plan: Plan, model, job, execution) -> None:
    """Refuse, in one sentence, a plan the framework cannot run: a schedule it does not have, a grid that does not
    fill the job, or any rule rank --execution applies (batch.plan_rules: divisibility, pipeline, capability)."""
    from axoplan.planner.batch import plan_rules
    from axoplan.planner.space import PLACEMENTS, first_violation, one_candidate

    if plan.gpus != job.gpus:
        raise UserError(f"the plan uses {plan.gpus} GPUs (pp x gx x gy x gz x gdata), not the job's {job.gpus}")
    if plan.order not in PLACEMENTS:
        raise UserError(f"unknown placement order '{plan.order}'")
    if plan.schedule not in SCHEDULES:
        cannot(framework, f"no pipeline schedule '{plan.schedule}' (known: {', '.join(SCHEDULES)})")
    if plan.pp > 1 and plan.schedule not in execution.pipeline_schedules:
        cannot(framework, f"it has no {plan.schedule} pipeline schedule"
               + (" (it has no pipeline parallelism)" if not execution.pipeline_schedules else ""))
    if plan.vpp > 1 and plan.schedule != "interleaved-1f1b":
        cannot(framework, f"vpp={plan.vpp} virtual stages need the interleaved-1f1b schedule, not {plan.schedule}")
    if plan.schedule == "interleaved-1f1b" and plan.pp > 1 and plan.vpp < 2:
        cannot(framework, "the interleaved-1f1b schedule needs vpp >= 2 virtual stages per pipeline stage")
    c = one_candidate(plan.gx, plan.gy, plan.gz, plan.gdata, plan.micro_batch, PLACEMENTS.index(plan.order),
                      plan.checkpointing, plan.pp, plan.vpp, plan.schedule)
    why = first_violation(plan_rules(model, job, c, execution), c, job.global_batch)
    if why is not None:
        cannot(framework, why)


def _launcher_head(emitted: Emitted, profile) -> list[str]:
    lines = [python_default(), *_env_lines(launch_env(profile) + emitted.env)]
    for name, why in emitted.required:
        lines += [f'if [[ -z "${{{name}:-}}" ]]; then',
                  f'  echo {quote(f"error: set {name}: {why}", "an error message")} >&2',
                  "  exit 2", "fi"]
    return lines + list(emitted.shell_lines)


def torchrun_script(about: str, emitted: Emitted, profile, gpus: int) -> str:
    """One node (--standalone) or NNODES nodes with a c10d rendezvous; the folder is found from the script's own
    path, so it can be moved; output is appended to train.log beside it."""
    nodes, per = nodes_for(gpus, profile.gpus_per_node)
    cmd = " ".join(emitted.command)
    lines = ["#!/usr/bin/env bash", comment(about, "the model or machine name"),
             f"# One node:    bash {TORCHRUN_NAME}",
             f"# Many nodes:  on every node, NNODES=N MASTER_ADDR=host0 [MASTER_PORT=29500] bash {TORCHRUN_NAME}",
             "set -euo pipefail",
             'RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
             'cd "$RUN_DIR"',
             f"GPUS={gpus}",
             f'NNODES="${{NNODES:-{nodes}}}"',
             f'NPROC_PER_NODE="${{NPROC_PER_NODE:-{per}}}"',
             'if (( NNODES * NPROC_PER_NODE != GPUS )); then',
             '  echo "error: NNODES*NPROC_PER_NODE = $NNODES*$NPROC_PER_NODE must equal the plan\'s $GPUS GPUs" >&2',
             "  exit 2", "fi",
             *_launcher_head(emitted, profile),
             'if (( NNODES == 1 )); then',
             '  RDZV=(--standalone --nnodes 1)',
             'else',
             '  if [[ -z "${MASTER_ADDR:-}" ]]; then',
             '    echo "error: multi-node runs need MASTER_ADDR (the host name of node 0) on every node" >&2',
             "    exit 2", "  fi",
             '  RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-axoplan}" '
             '--rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")',
             'fi',
             f'"$PYTHON" -m torch.distributed.run "${{RDZV[@]}}" --nproc-per-node "$NPROC_PER_NODE" {cmd} 2>&1 \\',
             f'  | tee -a "$RUN_DIR/{LOG_NAME}"',
             'exit "${PIPESTATUS[0]}"']
    return check_script("\n".join(lines) + "\n")


def slurm_script(about: str, emitted: Emitted, profile, gpus: int, run_dir: Path, job_name: str,
                 time_s: float) -> str:
    """sbatch: one torchrun per node (it starts that node's GPUs), exclusive nodes, the site's lines from the
    profile, and a requeue on Slurm's warning signal (the frameworks resume from their checkpoints)."""
    nodes, per = nodes_for(gpus, profile.gpus_per_node)
    rd = str(run_dir.resolve())
    site = slurm.site_options(profile)
    lines = slurm.header(job_name=job_name, nodes=nodes, ntasks_per_node=1,
                         gpus_per_node=None if is_cpu_profile(profile) else per, time_s=time_s, log_dir=rd,
                         log_name="slurm-%j.out", about=[comment(about, "the model or machine name"),
                                                         f"# Submit with: sbatch {SLURM_NAME}"],
                         exclusive=True, site=site, cpus_per_task=site.get("cpus_per_task"), requeue=True)
    lines += ["# shellcheck disable=SC2016  # the quoted path is literal on purpose",
              f"RUN_DIR={quote(rd, 'the run folder path')}",
              'cd "$RUN_DIR"',
              *_launcher_head(emitted, profile),
              slurm.head_node("MASTER_ADDR"),
              "export MASTER_ADDR",
              'export MASTER_PORT="${MASTER_PORT:-29500}"',
              # one task per node owns the node's CPUs and GPUs; torchrun gives each GPU its rank
              *slurm_task_lines(profile, 1, per),
              *slurm.requeue_lines(),
              *slurm.background_step([
                  f'srun --ntasks={nodes} --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" '
                  f'{gpu_bind(profile, 1)}--kill-on-bad-exit=1 \\',
                  f'  "$PYTHON" -m torch.distributed.run --nnodes {nodes} --nproc-per-node {per} '
                  '--rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\',
                  f'  {" ".join(emitted.command)}'])]
    return slurm.script(lines, "an emitted script")


def execution_ref(execution) -> str:
    """How a record names an execution: its preset's name, or the JSON of its fields (refit.execution_of)."""
    import json

    from axoplan.planner.execution import PRESETS

    if PRESETS.get(execution.name) == execution:
        return execution.name
    return json.dumps(dataclasses.asdict(execution), sort_keys=True)


def record(framework: str, plan: Plan, model_ref: str, machine_ref: str, job, chosen: dict | None,
           execution=None) -> str:
    """run.yaml: the planned candidate, its job and execution, so the run's log can be read back as a measured row."""
    d = {"framework": framework, "model": model_ref, "machine": machine_ref, "gpus": job.gpus,
         "global_batch": job.global_batch, "seq_len": job.seq_len, "plan": dataclasses.asdict(plan),
         "execution": None if execution is None else execution_ref(execution)}
    if chosen:
        d["predicted"] = {k: float(chosen[k]) for k in ("batch_time_s", "memory_gib") if k in chosen}
    return ("# axoplan: what was planned for this run; `axoplan validate --collect` on this folder reads the run back\n"
            + yaml.safe_dump(d, sort_keys=False))


FRAMEWORKS = {"torchtitan": "emit_torchtitan", "megatron": "emit_megatron", "axonn": "emit_axonn"}
# the execution each framework runs (planner/execution.py), which `--framework` implies
EXECUTIONS = {"axoplan": "axoplan", "torchtitan": "torchtitan", "megatron": "megatron-core", "axonn": "axonn"}


CAPABILITY = ("grid_axes", "placement", "pipeline_inside_data", "pipeline", "micro_batch_over_tensor")


def framework_execution(framework: str, execution=None):
    """The execution to plan with: the given one (name, file or Execution), default the framework's own, with
    what the framework can express (its preset's capability fields) in any case."""
    from axoplan.planner.execution import load_execution

    own = load_execution(EXECUTIONS[framework])
    ex = own if execution is None else load_execution(execution)
    if framework == "axoplan":
        if not ex.bundled:
            raise UserError(f"the bundled trainer (--framework axoplan) runs only the 'axoplan' execution, not "
                            f"'{ex.name}'; choose the framework that runs it with --framework")
        return ex
    # a writer that cannot place an uneven split cuts the model into equal (virtual) stages (torchtitan's
    # layers_per_stage); Megatron's places the planner's split (emit_megatron: --pipeline-model-parallel-layout)
    even = not getattr(writer(framework), "UNEVEN_STAGES", False)
    return dataclasses.replace(ex, **{k: getattr(own, k) for k in CAPABILITY}, pipeline_even_split=even)


def writer(framework: str):
    import importlib

    return importlib.import_module(f"axoplan.loop.{FRAMEWORKS[framework]}")


def write_framework_dir(out_dir: str | Path, framework: str, plan: Plan, model, job, profile, execution,
                        model_ref: str, chosen: dict | None = None, command: str = "", steps: int = 10,
                        slurm_time_s: float | None = None) -> dict[str, Path]:
    """Everything for one framework run in out_dir, written as one unit: the writer's files, the two
    launchers, the profile's copy, run.yaml and README.txt."""
    from axoplan.atomic import write_files
    from axoplan.loop.profile_copy import profile_files

    d = Path(out_dir)
    mod = writer(framework)
    check_plan(mod.NAME, plan, model, job, execution)
    em = mod.write(plan, model, job, profile, execution, steps=steps)
    about = (f"axoplan: {model.name} on {plan.gpus} GPUs of {profile.name} for {mod.NAME} ({mod.VERSION}): "
             f"pp={plan.pp} gx={plan.gx} gy={plan.gy} gz={plan.gz} gdata={plan.gdata}, micro-batch {plan.micro_batch}.")
    if slurm_time_s is None:
        t = float(chosen["batch_time_s"]) if chosen and "batch_time_s" in chosen else 1.0
        slurm_time_s = max(1800.0, 4.0 * steps * t + 1200.0)  # start-up of a real framework takes minutes
    name = f"{framework}-{model.name}-{plan.pp}x{plan.gx}x{plan.gy}x{plan.gz}x{plan.gdata}"
    files = dict(em.files)
    machine_ref = profile.name
    if profile.path:
        files.update(profile_files(profile, PROFILE_NAME, d))
        machine_ref = PROFILE_NAME
    files[TORCHRUN_NAME] = (torchrun_script(about, em, profile, plan.gpus), 0o755)
    files[SLURM_NAME] = (slurm_script(about, em, profile, plan.gpus, d, name, slurm_time_s), 0o755)
    files[RECORD_NAME] = (record(framework, plan, model_ref, machine_ref, job, chosen, execution), 0o644)
    files[README_NAME] = (readme(mod, about, em, plan, command, chosen), 0o644)
    return write_files(d, files)


def readme(mod, about: str, em: Emitted, plan: Plan, command: str, chosen: dict | None) -> str:
    from axoplan.shell import safe_line

    out = [about, ""]
    if chosen and "batch_time_s" in chosen:
        out += [f"predicted time per batch: {float(chosen['batch_time_s']):.4g} s"
                + (f", memory per GPU {float(chosen['memory_gib']):.3g} GiB" if "memory_gib" in chosen else ""), ""]
    out += ["WHAT MAPS TO WHAT", *(f"  {m}" for m in em.mapping), ""]
    if em.required:
        out += ["SET BEFORE RUNNING", *(f"  {n}: {why}" for n, why in em.required), ""]
    out += ["RUN",
            f"  one node     : bash {TORCHRUN_NAME}",
            f"  many nodes   : on every node, NNODES=N MASTER_ADDR=<node 0 host> bash {TORCHRUN_NAME}",
            f"  Slurm        : sbatch {SLURM_NAME}   (exclusive nodes; requeued on preemption)",
            f"  Output goes to {LOG_NAME} (and slurm-<job>.out); then `axoplan validate --collect .` in this folder",
            "  writes results.csv, which `axoplan refit --results` reads.", ""]
    if command:
        out += ["MADE BY", f"  {command}", ""]
    return "\n".join(safe_line(line, "a line of README.txt") for line in out)
