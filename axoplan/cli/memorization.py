"""`axoplan memorization`: standard loss against goldfish loss on repeated documents. torch is
imported only when the command runs (the training side of axoplan.studies.memorization)."""
from __future__ import annotations

import click

from axoplan import inputs
from axoplan.errors import UserError


def _grid(value: str | None):
    if value is None:
        return None
    from axoplan.cli.plan import parse_grid  # the one --grid syntax of explain and emit

    return parse_grid(value)


def _eval_at(value: str | None):
    if value is None:
        return None
    try:
        pts = [inputs.count(p, "--eval-at", 1, 10**6) for p in value.split(",") if p.strip()]
    except UserError:
        pts = []
    if not pts or min(pts) < 1:
        raise UserError(f"--eval-at takes positive repeat counts separated by commas (e.g. 1,4,16), got '{value}'")
    return pts


@click.command("memorization")
@click.option("--model", required=True, type=inputs.TEXT, help="Model preset name or path to a model YAML (vocabulary >= 256).")
@click.option("--docs", type=inputs.SafePath(exists=False), default=None,
              help="A text file or folder of text files, cut into documents. Default: the module docstrings "
                   "of Python's standard library.")
@click.option("--repeats", type=inputs.Count(1, 10**6), default=256, show_default=True, help="Times each document is seen in training.")
@click.option("--goldfish-k", type=inputs.Count(2, 10**6), default=4, show_default=True, help="Goldfish: drop about 1/k of the targets.")
@click.option("--goldfish-h", type=inputs.Count(1, 10**6), default=13, show_default=True, help="Goldfish: hash context width.")
@click.option("--nproc", type=inputs.Count(1, 4096), default=1, show_default=True,
              help="Processes; above 1 the study runs under torchrun on --grid.")
@click.option("--grid", type=str, default=None, help="gx,gy,gz,gdata for --nproc > 1 (default: data parallel 1,1,1,N).")
@click.option("--out", type=inputs.SafePath(dir_okay=True, file_okay=False), default="memorization-out", show_default=True, help="Output folder.")
@click.option("--n-docs", type=inputs.Count(1, 10**6), default=64, show_default=True, help="Training documents.")
@click.option("--n-heldout", type=inputs.Count(1, 10**6), default=16, show_default=True, help="Held-out documents (never trained on).")
@click.option("--seq-len", type=inputs.SEQ_LEN, default=None, help="Training sequence length (default: the model's); a document "
                                                        "is seq-len + 1 tokens, the last 50 of them are decoded.")
@click.option("--batch", "global_batch", type=inputs.GLOBAL_BATCH, default=8, show_default=True, help="Documents per optimizer step.")
@click.option("--lr", type=inputs.Number(0, inputs.MAX_LR, lo_open=True), default=3e-3, show_default=True,
              help="AdamW learning rate (constant; 3e-3 suits the tiny CPU models, larger models want less).")
@click.option("--weight-decay", type=inputs.Number(0), default=0.0, show_default=True, help="AdamW weight decay.")
@click.option("--seed", type=inputs.SEED, default=0, show_default=True, help="Initialization, document choice and order.")
@click.option("--eval-at", type=str, default=None,
              help="Repeat counts to measure at, comma-separated (default: R/8, R/4, R/2 and R).")
@click.option("--threads", type=inputs.Count(1, 4096), default=None,
              help="torch threads per process (default: cores / processes; 1 is best for tiny models on a busy CPU).")
def memorization(model, docs, repeats, goldfish_k, goldfish_h, nproc, grid, out, n_docs, n_heldout, seq_len,
                 global_batch, lr, weight_decay, seed, eval_at, threads):
    """Train a model twice on the same repeated documents (standard loss, then goldfish loss) and measure
    how many it reproduces: exact match and RougeL of the last 50 tokens, plus held-out loss."""
    from axoplan.studies.memorization import StudySettings, format_table, run_study

    settings = StudySettings(model=model, out=out, docs=docs, repeats=repeats, goldfish_k=goldfish_k,
                             goldfish_h=goldfish_h, nproc=nproc, grid=_grid(grid), n_docs=n_docs,
                             n_heldout=n_heldout, seq_len=seq_len, global_batch=global_batch, lr=lr,
                             weight_decay=weight_decay, seed=seed, eval_at=_eval_at(eval_at), threads=threads)
    summary = run_study(settings, echo=click.echo)
    click.echo("")
    click.echo(format_table(summary))
    click.echo(f"wrote {out}/summary.json, per_document.csv, generations.jsonl, memorization.png "
               f"({summary['wall_seconds']:.0f} s)")
