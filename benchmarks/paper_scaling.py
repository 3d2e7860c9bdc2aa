"""Predictions for the AxoNN paper's own scaling settings beside its published numbers, as ratios.

A check, not a fit: nothing here is tuned to the published numbers. Settings (reference §5): GPT
models from 5B upward (layers/hidden/heads of the paper), sequence 2048, global batch 8192 sequences
(16.8M tokens), on the bundled perlmutter, frontier and alps profiles, the paper's 4D space (no pipeline).

Published peaks (Singh et al., "Democratizing AI", SC24, arXiv 2502.08145, abstract and §I):
620.1 PFLOP/s on 4,096 A100s (Perlmutter), 1.381 EFLOP/s on 32,768 MI250X GCDs (Frontier),
1.423 EFLOP/s on 6,144 GH200s (Alps). The paper's abstract does not name the model of each peak and
the stored sources available to this project did not either, so this benchmark prints every
reference model at the headline GPU count and marks as the ASSUMED comparison the largest one that is
feasible there (the peaks come from the top of the paper's weak-scaling runs, which use its largest
models). Read the other rows as the sensitivity to that assumption.

FLOP are counted as the paper does (96·B·S·L·H²·(1 + S/(6H) + V/(16·L·H)), full recompute counted;
reference §4), whatever the planner chose for checkpointing, so the ratio compares like with like.

Run: python benchmarks/paper_scaling.py [--weak] [--execution megatron-axonn] [--checkpointing on]
(--weak adds a weak-scaling series per machine; --execution and --checkpointing as the paper's runs)
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from axoplan.errors import UserError
from axoplan.planner.execution import load_execution
from axoplan.planner.rank import rank
from axoplan.studies.scale import weak_scaling
from axoplan.planner.specs import load_model

BATCH = 8192  # sequences of 2048 tokens: 16.8M tokens per batch (reference §5)
PP = 1  # the paper's runs are 4D (data x 3D tensor), no pipeline: its grids only, like with like
MODELS = ["gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b", "gpt-60b", "gpt-80b", "gpt-160b", "gpt-175b"]
PUBLISHED = [  # machine, GPUs, published PFLOP/s (arXiv 2502.08145 abstract)
    ("perlmutter", 4096, 620.1),
    ("frontier", 32768, 1381.0),
    ("alps", 6144, 1423.0),
]
WEAK = {  # model doubling with GPUs, ending at the headline count; illustrative series, not the paper's table
    "perlmutter": [("gpt-5b", 256), ("gpt-10b", 512), ("gpt-20b", 1024), ("gpt-40b", 2048), ("gpt-80b", 4096)],
    "frontier": [("gpt-5b", 2048), ("gpt-10b", 4096), ("gpt-20b", 8192), ("gpt-40b", 16384), ("gpt-80b", 32768)],
    "alps": [("gpt-5b", 384), ("gpt-10b", 768), ("gpt-20b", 1536), ("gpt-40b", 3072), ("gpt-80b", 6144)],
}


def paper_pflops(model: str, batch_time_s: float) -> float:
    """PFLOP/s as the paper counts them (full recompute)."""
    m = load_model(model)
    flop = m.flops_per_token(m.seq_len, recompute=True) * BATCH * m.seq_len
    return flop / batch_time_s / 1e15


def on_machine(execution: str, machine: str):
    """The execution as it ran on this machine: Megatron-AxoNN's Frontier script passes --use-amd, which loads
    none of Megatron's fused kernels (docs/scale.md: branch update-amd-script of axonn-ai/Megatron-AxoNN)."""
    ex = load_execution(execution)
    if ex.name == "megatron-axonn" and machine == "frontier":
        return dataclasses.replace(ex, name="megatron-axonn (--use-amd)", elementwise_kernels="eager")
    return ex


def headline(execution: str, checkpointing: str) -> None:
    print(f"{'machine':<11} {'GPUs':>6} {'model':<9} {'grid x,y,z,d':>14} {'mb':>3} {'ckpt':>4} {'s/batch':>8} "
          f"{'pred PF/s':>10} {'published':>9} {'ratio':>6}  note")
    for machine, gpus, published in PUBLISHED:
        rows = []
        for name in MODELS:
            try:
                df = rank(name, machine, gpus, BATCH, top=1, execution=on_machine(execution, machine),
                          checkpointing=checkpointing, pp=PP)
            except UserError as e:
                rows.append((name, None, str(e)))
                continue
            rows.append((name, df.iloc[0], ""))
        feasible = [r for r in rows if r[1] is not None]
        assumed = feasible[-1][0] if feasible else None
        for name, best, why in rows:
            if best is None:
                print(f"{machine:<11} {gpus:>6} {name:<9} {'-':>14} {'-':>3} {'-':>4} {'-':>8} {'-':>10} "
                      f"{published:>9.1f} {'-':>6}  infeasible: {why[:70]}")
                continue
            pred = paper_pflops(name, float(best['batch_time_s']))
            grid = f"{best['gx']},{best['gy']},{best['gz']},{best['gdata']}"
            note = "ASSUMED comparison (largest feasible reference model)" if name == assumed else ""
            print(f"{machine:<11} {gpus:>6} {name:<9} {grid:>14} {int(best['micro_batch']):>3} "
                  f"{'yes' if best['checkpointing'] else 'no':>4} {best['batch_time_s']:>8.3g} {pred:>10.1f} "
                  f"{published:>9.1f} {pred / published:>6.3f}  {note}")
        print()


def weak(execution: str, checkpointing: str) -> None:
    for machine, pairs in WEAK.items():
        df = weak_scaling(pairs, machine, BATCH, execution=on_machine(execution, machine), checkpointing=checkpointing,
                          pp=PP)
        print(f"weak scaling on {machine} (batch {BATCH} x 2048 tokens), efficiency vs {df.attrs['baseline_gpus']} GPUs")
        for _, r in df.iterrows():
            if not r["feasible"]:
                print(f"  {r['model']:<9} {r['gpus']:>6}  infeasible: {r['reason'][:80]}")
                continue
            print(f"  {r['model']:<9} {int(r['gpus']):>6}  {r['batch_time_s']:>7.3g} s/batch  "
                  f"{paper_pflops(r['model'], r['batch_time_s']):>8.1f} PF/s (paper accounting)  "
                  f"{r['pct_of_peak']:>5.1f}% of peak  efficiency {r['efficiency']:.3f}")
        print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weak", action="store_true", help="also print a weak-scaling series per machine")
    ap.add_argument("--execution", default="axoplan",
                    help="framework execution (axoplan/planner/execution.py); the paper's runs: megatron-axonn")
    ap.add_argument("--checkpointing", choices=["both", "on", "off"], default="both",
                    help="'on' as the paper's runs (full activation checkpointing)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print(f"execution {args.execution}, checkpointing {args.checkpointing}")
    headline(args.execution, args.checkpointing)
    if args.weak:
        weak(args.execution, args.checkpointing)
    print(f"(planned in {time.perf_counter() - t0:.1f} s; ratio = predicted / published, nothing fitted to them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
