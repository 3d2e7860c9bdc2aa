"""`axoplan train`: run the bundled 4D trainer on one LaunchConfig (under torchrun, srun, or alone
for a world of one). torch is imported only inside the command."""
from __future__ import annotations

import sys
import time

import click

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.inputs import SafePath


def check_environment(cfg) -> None:
    """What the config asks of this machine, checked on every rank before any process group: the
    metrics file can be written, and NCCL has a GPU."""
    from axoplan.atomic import check_writable

    if cfg.metrics:
        check_writable(cfg.metrics, "metrics file")
    if cfg.save:
        check_writable(cfg.save, "save file")
    if cfg.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UserError("config: backend nccl needs CUDA GPUs and none is visible here; "
                            "use backend: gloo (or auto) on CPU")


def example_for(gpus: int | None, model: str | None):
    """The printed example for `gpus` ranks of `model`: every rank data parallel (the one grid every model
    divides), the global batch the smallest multiple of the ranks not below the default."""
    from axoplan.runconfig import Grid, LaunchConfig

    cfg = LaunchConfig(goldfish=None)
    if model is not None:
        from axoplan.planner.specs import load_model

        load_model(model)  # an unknown model is one error sentence now, not at the run
        cfg.model = model
    if gpus is None:
        return cfg, ""
    cfg.grid = Grid(gdata=gpus)
    cfg.global_batch = gpus * -(-cfg.global_batch // gpus)
    return cfg, (f"grid: {gpus} data-parallel ranks, for torchrun --nproc-per-node {gpus}; "
                 "'axoplan emit' writes the planner's best grid instead")


@click.command("train")
@click.option("--config", "config_path", type=SafePath(dir_okay=False), help="Run config YAML (a LaunchConfig).")
@click.option("--print-config", is_flag=True, help="Print an example config with every key and its default.")
@click.option("--gpus", "-g", type=inputs.GPUS, default=None,
              help="With --print-config: a grid for this many ranks (data parallel; 'axoplan emit' writes a ranked one).")
@click.option("--model", "-m", type=inputs.TEXT, default=None, help="With --print-config: the model (preset or YAML).")
def train(config_path, print_config, gpus, model):
    """Run the bundled 4D-parallel trainer; metrics as JSON lines on stdout and in the config's file."""
    from axoplan.runconfig import example_config_yaml, load_config

    if print_config:
        cfg, note = example_for(gpus, model)
        click.echo(example_config_yaml(cfg, note), nl=False)
        return
    if gpus is not None or model is not None:
        raise UserError("--gpus and --model shape the printed example: use them with --print-config, "
                        "and set the grid and model in the config file for a run")
    if not config_path:
        raise UserError("give a run config with --config run.yaml (see 'axoplan train --print-config')")
    from axoplan.runtime.dist_env import read_env

    de = read_env()
    try:
        cfg = load_config(config_path)
        from axoplan.runtime.train import check_config  # imports torch: after the cheap checks

        check_config(cfg, de.world_size, de.local_world_size)
        check_environment(cfg)
        from axoplan.runtime.dist_env import export_for_env_init

        export_for_env_init(de)  # MASTER_ADDR/MASTER_PORT of torchrun or srun, before any process group
    except UserError:
        # every rank read the same config and failed the same way: one sentence from rank 0 only,
        # exit code 2 everywhere, before any process group exists (so nobody waits on anybody)
        if de.rank != 0:
            # torchrun stops all ranks when the first one exits: give rank 0 time to print
            time.sleep(3)
            sys.exit(2)
        raise
    if cfg.machine and de.rank == 0:  # % of peak and the plan it follows are the profile's
        from axoplan.device import mismatch, warn
        from axoplan.planner.machine import load_profile

        warn(mismatch(load_profile(cfg.machine)))
    from axoplan.runtime.train import run

    run(cfg)
