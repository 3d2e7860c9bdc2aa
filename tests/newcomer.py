"""A newcomer's first hour, scripted: a fresh copy of the repository and a fresh virtual environment, then
every command README.md prints, top to bottom, as printed (tests/docs_blocks.py finds them); each must exit 0.
Commands marked `# needs ...` (a Slurm cluster, a GPU) are listed and skipped. Not part of pytest: it takes
several minutes (it trains, validates, calibrates and runs the memorization study).

    python3 tests/newcomer.py [--docs] [--quick] [--keep DIR]

--docs also runs the commands of docs/*.md. --quick runs the README's whole-suite `pytest -q` as a collection
only (`--collect-only`, said in the output): the suite itself is CI's job. The venv sees the system's site
packages (--system-site-packages), so torch is the one installed here rather than a multi-GB download; the
project itself is installed into the venv by the README's own `pip install -e`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import docs_blocks as D  # noqa: E402

SUITE = "python3 -m pytest -q -n 2"


def copy_tree(dest: Path) -> None:
    """The repository's files as a clone would have them (tracked and new, not ignored), uncommitted edits included."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=D.ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for f in filter(None, files):
        src = D.ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", action="store_true", help="also the commands of docs/*.md")
    ap.add_argument("--quick", action="store_true", help="collect the test suite instead of running it")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    args = ap.parse_args(argv)

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="axoplan-newcomer-"))
    work.mkdir(parents=True, exist_ok=True)
    repo, venv = work / "axoplan", work / "venv"
    if repo.exists():
        shutil.rmtree(repo)
    repo.mkdir()
    copy_tree(repo)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    docs = {"README.md"} | ({str(p.relative_to(D.ROOT)) for p in D.documents()} if args.docs else set())
    cmds = [c for c in D.commands(repo) if c.doc in docs and c.kind in ("run", "transcript")]
    print(f"newcomer run in {work}: {len(cmds)} commands from {', '.join(sorted(docs))}", flush=True)
    failed, t_all = [], time.perf_counter()
    for c in cmds:
        if c.needs:
            print(f"skip          {c.where():22} {c.text}   (needs {c.needs})", flush=True)
            continue
        text = c.text
        if args.quick and text.rstrip().endswith(SUITE):
            text = text.rstrip() + " --collect-only"
        t0 = time.perf_counter()
        try:
            r = subprocess.run(["bash", "-o", "pipefail", "-c", text], cwd=repo, env=env, capture_output=True,
                               text=True, timeout=args.timeout)
            rc, tail = r.returncode, (r.stdout + r.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            rc, tail = "timeout", []
        dt = time.perf_counter() - t0
        mark = "ok  " if rc == 0 else "FAIL"
        print(f"{mark} {dt:7.1f} s {c.where():22} {text}" + ("   (collection only: --quick)" if text != c.text else ""),
              flush=True)
        if rc != 0:
            failed.append(c)
            for line in tail:
                print(f"        | {line}", flush=True)
    print(f"{len(cmds) - len(failed)} of {len(cmds)} commands passed or were marked, {len(failed)} failed, "
          f"{time.perf_counter() - t_all:.0f} s", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
