"""Docs that cannot drift: every command README.md and docs/*.md print (found by tests/docs_blocks.py)
either runs here as printed, is checked against the code (its options, files and modules exist) and
run by tests/newcomer.py, or carries a visible `# needs ...` marker saying why it cannot run here."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest

import docs_blocks as D

# commands no test here can run (they take minutes or need what a CI machine lacks); the newcomer
# run does them, and here their options, files and modules are checked
DEFERRED = ("pip", "pytest", "torchrun", "bash", "python", "python3")


def _options(sub: str) -> set[str] | None:
    from axoplan.cli.main import cli

    cmd = cli.get_command(click.Context(cli), sub)
    if cmd is None:
        return None
    opts = {"--help"}
    for p in cmd.params:
        opts.update(p.opts)
        opts.update(p.secondary_opts)
    return opts


def option_problems(args: list[str]) -> list[str]:
    """The options of `axoplan ARGS` that its command does not have (placeholders and [..|..] allowed)."""
    if not args:
        return ["no command"]
    opts = _options(args[0])
    if opts is None:
        return [f"no command '{args[0]}'"]
    bad = []
    for w in args[1:]:
        for tok in re.split(r"[\[\]|()]", w):
            tok = tok.split("=")[0]
            if re.match(r"^--?[A-Za-z]", tok) and tok not in opts:
                bad.append(f"'{args[0]}' has no option {tok}")
    return bad


def _env(bin_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env["PYTHONPATH"] = str(D.ROOT)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _shim(tmp: Path) -> Path:
    """`axoplan` on PATH as this interpreter running this tree (the entry point may be another install's)."""
    b = tmp / "bin"
    b.mkdir(exist_ok=True)
    (b / "axoplan").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m axoplan.cli "$@"\n')
    (b / "axoplan").chmod(0o755)
    return b


def _grid_problems(ws: list[str], args: list[str], cwd: Path) -> list[str]:
    """torchrun's process count against the grid of a config an earlier command wrote."""
    if ws[0] != "torchrun" or "--config" not in args or "--nproc-per-node" not in ws:
        return []
    path = cwd / args[args.index("--config") + 1]
    if not path.is_file():
        return []
    from axoplan.runconfig import load_config

    cfg = load_config(path)
    n, size = int(ws[ws.index("--nproc-per-node") + 1]), cfg.grid.size
    if "--grid" in args:  # the command line's grid overrides the file's
        size = int(np.prod([int(x) for x in args[args.index("--grid") + 1].split(",")]))
    size *= cfg.pp  # each pipeline stage is a grid of its own
    return [] if n == size else [f"{path.name}'s grid and pipeline have {size} rank(s), torchrun starts {n}"]


def static_problems(simple: str, cwd: Path, made: set = frozenset()) -> list[str]:
    ws = D.words(simple)
    args = D.axoplan_args(ws)
    if args is not None:
        return option_problems(args) + _grid_problems(ws, args, cwd)
    head = ws[0] if ws else ""
    if head not in DEFERRED:
        return [f"'{head}' is neither run nor checked here: mark it '# needs ...' or make it runnable"]
    rest = ws[1:]
    made_dirs = {(m,) for m in made}  # folders the document's earlier commands write (--out)
    if head in ("python", "python3") and rest[:1] == ["-m"]:
        mod = rest[1]
        if mod in ("pip", "pytest"):
            head, rest = mod, rest[2:]
        elif importlib.util.find_spec(mod) is None:
            return [f"no module {mod}"]
        else:
            return []
    if head in ("python", "python3", "bash"):
        script = rest[0] if rest else ""
        if not ((D.ROOT / script).is_file() or (cwd / script).is_file() or Path(script).parts[:1] in made_dirs):
            return [f"no file {script} (in the repository or made by the commands above it)"]
    if head == "pytest":
        takes_value = {"-n", "--numprocesses", "-k", "-m", "-p", "--durations", "--maxfail"}
        for before, w in zip([""] + rest[:-1], rest):
            if before in takes_value:  # the option's value, not a path
                continue
            if not w.startswith("-") and not (D.ROOT / w.split("::")[0]).exists():
                return [f"no test path {w}"]
    return []


def check_document(path: Path, tmp: Path, root: Path = D.ROOT) -> tuple[list[str], int]:
    """Problems of one document's commands, and how many were run. Commands run in order in `tmp`,
    so a file one makes (emit's run folder) is there for the next."""
    env = _env(_shim(tmp))
    problems, ran = [], 0
    made = set()  # what the deferred commands write (--out): a cheap command reading one is deferred too
    for c in D.commands(root):
        if c.doc != str(path.relative_to(root)):
            continue
        if c.kind == "synopsis":
            problems += [f"{c.where()}: {p}" for p in option_problems(D.words(c.text.replace("...", ""))[1:])]
            ws = D.words(c.text.replace("...", ""))
            made.update(ws[i + 1] for i, w in enumerate(ws[:-1]) if w == "--out")  # what its reader made
            continue
        if c.kind == "untagged":
            problems.append(f"{c.where()}: '{c.text}' is a command in a plain block: fence it ```bash (marking "
                            "what cannot run here '# needs ...')")
            continue
        if c.needs:
            continue
        if c.kind == "run" and re.search(r"\[-|\bDIR\b|\.\.\.", c.text):
            problems.append(f"{c.where()}: a placeholder in a command that runs as printed (a synopsis goes in a "
                            "plain block)")
            continue
        for simple in D.simple_commands(c.text):
            ws = D.words(simple)
            if D.is_cheap(simple) and not made.intersection(ws):
                r = subprocess.run(["bash", "-c", simple], cwd=tmp, env=env, capture_output=True, text=True,
                                   timeout=300)
                ran += 1
                if r.returncode != 0:
                    problems.append(f"{c.where()}: '{simple}' exited {r.returncode}: {r.stderr.strip()[-300:]}")
            else:
                problems += [f"{c.where()}: {p}" for p in static_problems(simple, tmp, made)]
                made.update(ws[i + 1] for i, w in enumerate(ws[:-1]) if w == "--out")
    return problems, ran


@pytest.mark.parametrize("doc", D.documents(), ids=lambda p: p.name)
def test_every_printed_command_runs_is_checked_or_says_why_not(doc, tmp_path):
    problems, _ = check_document(doc, tmp_path)
    assert not problems, "\n".join(problems)


def test_the_documents_commands_are_found():
    found = D.commands()
    by_doc = {}
    for c in found:
        by_doc.setdefault(c.doc, []).append(c)
    assert set(by_doc) == {str(p.relative_to(D.ROOT)) for p in D.documents()}
    readme = {c.text for c in by_doc["README.md"] if c.kind == "run"}
    assert any(c.startswith("torchrun --standalone --nproc-per-node 4 -m axoplan.cli train --config run.yaml")
               for c in readme)
    assert any(c.kind == "transcript" and c.text.startswith("axoplan scale") for c in by_doc["docs/scale.md"])
    slurm = [c for c in found if c.text.startswith(("srun", "sbatch", "export MASTER_ADDR"))]
    assert slurm and all("Slurm" in c.needs for c in slurm)


def test_a_drifted_or_unmarked_command_is_caught(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "README.md").write_text(
        "```bash\naxoplan rank --model gpt-tiny --machine localhost-cpu --gpus 2 --global-batch 4 --top 2\n"
        "axoplan rank --modle gpt-tiny\nsbatch x.sbatch\nsbatch y.sbatch   # needs a Slurm cluster\n```\n\n"
        "```\naxoplan explain --model M [--nonsense]\n```\n\n```\npytest -q tests/test_docs.py\n```\n")
    problems, ran = check_document(root / "README.md", tmp_path, root)
    assert ran == 2
    assert len(problems) == 4, problems
    assert "exited 2" in problems[0] and "'sbatch' is neither run nor checked" in problems[1]
    assert "no option --nonsense" in problems[2] and "a command in a plain block" in problems[3]
