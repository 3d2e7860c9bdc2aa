"""The `axoplan` command group. Each command lives in its own module and is imported only when
called, so `axoplan rank` never pays for torch or matplotlib."""
from __future__ import annotations

import errno
import importlib
import sys

import click

from axoplan.errors import UserError
from axoplan.inputs import check_argv, printable

# what a file system says when it refuses a write (full, too large for a ulimit, read-only, quota, I/O)
_FS_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EIO}

# command name -> (module, attribute, one-line help shown by `axoplan --help`)
COMMANDS = {
    "models": ("axoplan.cli.plan", "models", "List the bundled model presets."),
    "profiles": ("axoplan.cli.plan", "profiles", "List the bundled machine profiles."),
    "rank": ("axoplan.cli.plan", "rank", "Rank every configuration (pipeline x data x 3D tensor) for a model, machine and GPU count."),
    "explain": ("axoplan.cli.plan", "explain", "Show where the time and memory of one configuration go."),
    "dryrun": ("axoplan.cli.dryrun", "dryrun", "Trace one training step at full scale on this CPU: memory and collectives "
               "against the plan."),
    "train": ("axoplan.cli.train", "train", "Run the bundled trainer (4D grids, pipeline stages on top; under torchrun or srun)."),
    "calibrate": ("axoplan.cli.calibrate", "calibrate", "Measure this machine and write its profile."),
    "emit": ("axoplan.cli.loop", "emit", "Write a launch config and torchrun/Slurm scripts for a configuration."),
    "validate": ("axoplan.cli.loop", "validate", "Run the top-k candidates and score the ranking."),
    "refit": ("axoplan.cli.loop", "refit", "Fit profile corrections to measured runs."),
    "memorization": ("axoplan.cli.memorization", "memorization", "Measure memorization with standard vs goldfish loss."),
    "scale": ("axoplan.cli.scale", "scale", "Predict weak/strong scaling and time to solution."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        mod, attr, _ = COMMANDS[name]
        try:
            return getattr(importlib.import_module(mod), attr)
        except ImportError as e:
            missing = getattr(e, "name", None) or str(e)
            msg = f"'axoplan {name}' needs {missing}, which is not installed"
            if missing and missing.split(".")[0] == "torch":
                msg += " (pip install torch, or the 'runtime' extra: pip install 'axoplan[runtime]')"

            @click.command(name, help=COMMANDS[name][2], context_settings={"ignore_unknown_options": True})
            @click.argument("args", nargs=-1, type=click.UNPROCESSED)
            def _missing(args):
                raise UserError(msg)

            return _missing

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="axoplan")
def cli():
    """axoplan: plan, validate and launch GPT training: data x 3D tensor parallelism (AxoNN), with pipeline stages."""


def main(argv=None):
    try:
        check_argv(sys.argv[1:] if argv is None else list(argv))
        rv = cli.main(args=argv, prog_name="axoplan", standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {printable(str(e))}", err=True)  # a message quoting a file never moves the terminal
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # usage errors: one sentence, exit code 2
        msg = e.format_message()
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"error: {msg}{hint}", err=True)
        sys.exit(2)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:
        # the last net under the one output writer: a file system refusal a command did not word itself
        if e.filename is None and e.errno not in _FS_ERRNOS:
            raise
        where = f"use '{printable(str(e.filename))}'" if e.filename is not None else "write an output"
        click.echo(f"error: cannot {where}: {(e.strerror or str(e)).lower()}", err=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
