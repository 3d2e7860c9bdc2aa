"""`axoplan train`: run the bundled 4D trainer on one LaunchConfig (under torchrun, srun, or alone
for a world of one); the common keys can be overridden on the command line. torch is imported only
inside the command."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.inputs import SafePath


def check_environment(cfg) -> None:
    """What the config asks of this machine, checked on every rank before any process group: the
    outputs can be written, and NCCL has a GPU."""
    from axoplan.atomic import check_writable

    for key, what in (("metrics", "metrics file"), ("save", "save file")):
        if getattr(cfg, key):
            check_writable(cfg.path(getattr(cfg, key)), what)
    folders = [("tensorboard", "TensorBoard folder")] + ([("checkpoint_dir", "checkpoint folder")]
                                                         if cfg.checkpoint_every else [])
    for key, what in folders:
        folder = cfg.path(getattr(cfg, key))
        if folder and Path(folder).exists() and not Path(folder).is_dir():
            raise UserError(f"{key}: {what} '{folder}' is a file; give a folder")
        if folder:
            check_writable(Path(folder) / "probe", what)  # the folder, or the first existing one above it
    if cfg.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UserError("config: backend nccl needs CUDA GPUs and none is visible here; "
                            "use backend: gloo (or auto) on CPU")


def apply_overrides(cfg, given: dict, where: str):
    """The config with the options given on the command line in place of its keys, checked again."""
    import dataclasses

    from axoplan.runconfig import Grid

    changes = {k: v for k, v in given.items() if v is not None}
    if "grid" in changes:
        from axoplan.cli.plan import parse_grid

        changes["grid"] = Grid(*parse_grid(changes["grid"]))
    return dataclasses.replace(cfg, **changes).validate(where) if changes else cfg


def example_for(gpus: int | None, given: dict):
    """The printed example for `gpus` ranks: every rank data parallel (the one grid every model divides), the
    global batch the smallest multiple of the ranks not below the default; the other options shape it too."""
    from axoplan.runconfig import Grid, LaunchConfig

    cfg, note = LaunchConfig(goldfish=None), ""
    if given.get("model") is not None:
        from axoplan.planner.specs import load_model

        load_model(given["model"])  # an unknown model is one error sentence now, not at the run
    if gpus is not None:
        cfg.grid = Grid(gdata=gpus)
        cfg.global_batch = gpus * -(-cfg.global_batch // gpus)
        note = (f"grid: {gpus} data-parallel ranks, for torchrun --nproc-per-node {gpus}; "
                "'axoplan emit' writes the planner's best grid instead")
    return apply_overrides(cfg, given, "the printed example"), note


@click.command("train")
@click.option("--config", "config_path", type=SafePath(dir_okay=False),
              help="Run config YAML (a LaunchConfig); without it, the defaults of --print-config.")
@click.option("--print-config", is_flag=True, help="Print an example config with every key and its default.")
@click.option("--model", type=inputs.TEXT, help="Override model: a preset name or a model YAML.")
@click.option("--grid", type=inputs.TEXT, help="Override grid: gx,gy,gz,gdata (their product is the ranks started).")
@click.option("--steps", type=inputs.STEPS, help="Override steps (optimizer steps of the whole run).")
@click.option("--lr", type=inputs.Number(lo=0, lo_open=True), help="Override lr (the peak learning rate).")
@click.option("--global-batch", type=inputs.GLOBAL_BATCH, help="Override global_batch (sequences per step).")
@click.option("--micro-batch", type=inputs.MICRO_BATCH, help="Override micro_batch (sequences per rank per micro-step).")
@click.option("--seq-len", type=inputs.SEQ_LEN, help="Override seq_len.")
@click.option("--out", type=SafePath(file_okay=False), help="Override out: the run folder (metrics, TensorBoard, "
              "checkpoints).")
@click.option("--log-every", type=inputs.STEPS, help="Override log_every (a readable line every N steps).")
@click.option("--checkpoint-every", type=inputs.Count(0, inputs.MAX_STEPS),
              help="Override checkpoint_every (a sharded checkpoint every N steps; 0: none).")
@click.option("--resume", is_flag=True, default=None,
              help="Continue from the newest checkpoint in checkpoint_dir (same grid); none yet: start at 0.")
@click.option("--gpus", "-g", type=inputs.GPUS, default=None,
              help="With --print-config: a grid for this many ranks (data parallel; 'axoplan emit' writes a ranked one).")
def train(config_path, print_config, gpus, **given):
    """Run the bundled 4D-parallel trainer: a readable line every log_every steps, JSON records in the
    metrics file, TensorBoard events and checkpoints under the run folder; options override the config."""
    from axoplan.runconfig import LaunchConfig, example_config_yaml, load_config

    if print_config:
        cfg, note = example_for(gpus, given)
        click.echo(example_config_yaml(cfg, note), nl=False)
        return
    if gpus is not None:
        raise UserError("--gpus shapes the printed example (with --print-config); for a run, --grid sets the ranks")
    from axoplan.runtime.dist_env import read_env

    de = read_env()
    try:
        cfg = load_config(config_path) if config_path else LaunchConfig().validate("defaults")
        cfg = apply_overrides(cfg, given, f"config '{config_path}' with the command-line options" if config_path
                              else "the command-line options")
        from axoplan.runtime.train import check_config  # imports torch: after the cheap checks

        check_config(cfg, de.world_size, de.local_world_size)
        check_environment(cfg)
        from axoplan.runtime.dist_env import export_for_env_init

        export_for_env_init(de)  # MASTER_ADDR/MASTER_PORT of torchrun or srun, before any process group
    except UserError:
        # every rank read the same config and failed the same way: one sentence from rank 0 only,
        # exit code 2 everywhere, before any process group exists (so nobody waits on anybody)
        _quiet_exit_unless_rank0(de.rank)
        raise
    if cfg.machine and de.rank == 0:  # % of peak and the plan it follows are the profile's
        from axoplan.device import mismatch, warn
        from axoplan.planner.profile_reader import load_profile

        warn(mismatch(load_profile(cfg.machine)))
    from axoplan.runtime.train import run

    try:
        run(cfg)
    except UserError:  # e.g. a non-finite loss: every rank stops at the same step, rank 0 says why
        _quiet_exit_unless_rank0(de.rank)
        raise


def _quiet_exit_unless_rank0(rank: int) -> None:
    if rank != 0:
        # torchrun stops all ranks when the first one exits: give rank 0 time to print
        time.sleep(3)
        sys.exit(2)
