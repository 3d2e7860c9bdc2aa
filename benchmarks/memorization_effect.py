"""Memorization effect on this CPU: standard loss memorizes repeated documents, goldfish loss does not.

Runs `axoplan memorization` in-process with the demonstration settings of docs/memorization.md
(a tiny byte-level GPT, the standard library's module docstrings as documents, each seen many
times) and prints what one run measured: exact-match rate and RougeL for both losses, the
held-out loss of each and their ratio, and where the wall time went.

    python benchmarks/memorization_effect.py [--out /tmp/memorization] [--repeats 256] [--nproc 1]

The settings were chosen as an experimental design (model, documents, repeats, learning rate);
the metric is the issue's: all 50 greedily decoded tokens equal, and RougeL over tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from axoplan.studies.memorization import StudySettings, format_table, run_study


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--out", default="/tmp/axoplan-memorization")
    ap.add_argument("--n-docs", type=int, default=64)
    ap.add_argument("--n-heldout", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=256)
    ap.add_argument("--eval-at", default="16,32,64,128")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--grid", default=None, help="gx,gy,gz,gdata (with --nproc > 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (1: robust on a busy CPU)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    grid = tuple(int(v) for v in a.grid.split(",")) if a.grid else None
    s = StudySettings(model=a.model, out=a.out, repeats=a.repeats, n_docs=a.n_docs, n_heldout=a.n_heldout,
                      lr=a.lr, global_batch=a.batch, nproc=a.nproc, grid=grid, threads=a.threads, seed=a.seed,
                      eval_at=[int(v) for v in a.eval_at.split(",")] if a.eval_at else None)
    cpu0, t0 = os.times(), time.perf_counter()
    summary = run_study(s)
    wall, cpu1 = time.perf_counter() - t0, os.times()
    print()
    print(format_table(summary))
    st, gf = summary["standard"], summary["goldfish_loss"]
    print(f"\nexact match: standard {100 * st['exact_match_rate']:.1f}%, goldfish {100 * gf['exact_match_rate']:.1f}% "
          f"of {summary['documents']} documents")
    print(f"mean RougeL: standard {st['mean_rouge_l']:.3f}, goldfish {gf['mean_rouge_l']:.3f}")
    print(f"held-out loss goldfish / standard: {gf['heldout_loss'] / st['heldout_loss']:.3f}")
    for key in ("standard", "goldfish_loss"):
        best = min(summary[key]["curve"], key=lambda p: p["heldout_loss"])
        print(f"  {key:>13}: lowest held-out loss {best['heldout_loss']:.3f} at {best['repeats']} repeats")
    train = st["train_seconds"] + gf["train_seconds"]
    evals = st["eval_seconds"] + gf["eval_seconds"]
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system) + (cpu1.children_user - cpu0.children_user) \
        + (cpu1.children_system - cpu0.children_system)
    print(f"wall {wall:.0f} s (training {train:.0f} s, decoding and evaluation {evals:.0f} s); "
          f"CPU time {cpu:.0f} s; load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"outputs in {a.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
