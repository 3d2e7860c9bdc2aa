"""Ranking fidelity on this machine: run EVERY feasible grid and order (validate --all) with the bundled
trainer, score the planner's ranking against the measurements, then refit the profile's corrections
and report the leave-one-out error. Prints the issue-5 targets with the figures measured in this run.

    python benchmarks/ranking_fidelity.py                      # gpt-tiny, 4 and 8 ranks, localhost-cpu
    python benchmarks/ranking_fidelity.py --model gpt-small --ranks 4 --out /tmp/rf --resume
    python benchmarks/ranking_fidelity.py --ranks 8 --machine P.yaml --out /tmp/pooled --pool /tmp/rf-a /tmp/rf-b

Each candidate runs --repeats times (default 3), in passes over all candidates, so drift of the
machine during a sweep reaches every candidate alike; its time is the median of its runs (three, so one
run slowed end to end by the machine is outvoted; with two the median is their mean).

8 ranks on a 2-core machine are oversubscribed (4 processes per core): that measures the trainer under
contention, which a profile calibrated with 4 ranks does not describe (benchmarks/data/profiles/
localhost-cpu-8.yaml was calibrated with 8: pass it as --machine). Beside tau it prints the tau the model's
ties allow (tie_ceiling): below it the model orders candidates wrongly; candidates it predicts alike (e.g.
placements it cannot tell apart) cost the rest. Other processes running on the machine at the same time
distort every measurement: the load average is printed before and after each sweep so a reader can judge.

--pool scores the runs of several earlier sweeps (their --out folders) as one: the same candidates, run with
the same profile, each candidate's time the median of all its runs. Where one sweep's tau moves with the
machine's state, the pooled one is the model's ranking against a measurement with less noise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from axoplan.atomic import atomic_write_text, ensure_dir  # noqa: E402
from axoplan.errors import UserError  # noqa: E402
from axoplan.loop import validate as V  # noqa: E402
from axoplan.loop.launch import pipeline_of  # noqa: E402
from axoplan.loop.validate_files import csv_line  # noqa: E402
from axoplan.planner.profile_reader import load_profile  # noqa: E402
from axoplan.planner.rank import explain  # noqa: E402
from axoplan.loop.refit import format_report, predict, refit_profile, runs_from_results  # noqa: E402

TARGETS = {"kendall_tau": 0.8, "best_in_top3": True, "regret": 0.05, "mape_before": 15.0, "mape_loo": 10.0}


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def breakdown(args, ranks, res):
    """Per run: measured vs predicted, and the model's split into compute / exposed communication / the
    data-parallel and optimizer step terms, for finding which term is off."""
    rows = []
    for row in res.to_dict("records"):
        r = SimpleNamespace(**row)
        if r.status != "ok":
            rows.append(f"  {r.candidate:26s} {r.status:8s} {r.error}")
            continue
        pp, vpp, schedule = pipeline_of(row)
        ex = explain(args.model, args.machine, ranks, args.global_batch, (int(r.gx), int(r.gy), int(r.gz), int(r.gdata)),
                     order=r.order, micro_batch=int(r.micro_batch), checkpointing=bool(r.checkpointing), pp=pp,
                     vpp=vpp, schedule=schedule)
        s = ex.summary.iloc[0]
        ncalls = int(ex.collectives["calls_per_step"].sum()) if len(ex.collectives) else 0
        rows.append(f"  {r.candidate:26s} meas {r.measured_time_s * 1e3:8.2f} ms  pred {s.batch_time_s * 1e3:8.2f} ms  "
                    f"(compute {s.compute_s * 1e3:7.2f}, exposed comm {s.exposed_comm_s * 1e3:7.2f}, "
                    f"{ncalls:4d} collective calls/step)  meas/pred {r.measured_time_s / s.batch_time_s:5.2f}")
    return "\n".join(rows)


def pool_sweeps(folders: list[str | Path], out: Path) -> int:
    """Write the runs of several sweeps of one space (each a validate folder) into out's results.csv as one
    sweep, their repeats numbered on; returns the number of runs. The sweeps must hold the same candidates
    and have run them with the same profile (each run folder's machine.yaml), else pooling mixes machines."""
    frames, profiles, cands = [], set(), None
    for f in map(Path, folders):
        res = V.read_results(f / V.RESULTS_FILE, per_run=True).drop(columns="measured_time_text")
        names = set(res["candidate"])
        if cands is not None and names != cands:
            raise UserError(f"sweep '{f}' holds other candidates than '{folders[0]}': only sweeps of one space "
                            f"pool")
        cands = names
        for c in sorted(names):
            m = f / "runs" / c / "machine.yaml"
            if m.is_file():
                profiles.add(m.read_bytes())
        if frames:  # number this sweep's repeats on from the last one's
            res["repeat"] += int(frames[-1]["repeat"].max()) + 1
        frames.append(res)
    if len(profiles) > 1:
        raise UserError("the pooled sweeps ran with different profiles (their run folders' machine.yaml differ): "
                        "only runs of one profile pool")
    runs = pd.concat(frames, ignore_index=True)
    cols = list(runs.columns)
    # validate's own record format: one record per line, so read_results reads the pool as any sweep
    atomic_write_text(ensure_dir(out) / V.RESULTS_FILE, "".join(csv_line(v) for v in [cols] + runs.values.tolist()))
    return len(runs)


def one(args, ranks: int) -> dict:
    out = Path(args.out) / f"{args.model}-{ranks}ranks"
    passes = f"{args.repeats} pass(es)"
    if args.pool:
        n = pool_sweeps([Path(d) / out.name for d in args.pool], out)
        passes = f"{n} runs pooled from {len(args.pool)} sweeps ({', '.join(args.pool)})"
    sw = V.Sweep(model=args.model, machine=args.machine, gpus=ranks, global_batch=args.global_batch, top_k=None,
                 all=True, steps=args.steps, warmup_steps=args.warmup, timeout_s=args.timeout,
                 checkpointing=args.checkpointing, repeats=args.repeats)
    # the profile was calibrated with gpus_per_node ranks on this machine's cores; more ranks than that
    # share the cores further than anything the profile measured
    prof = load_profile(args.machine)
    over = (f" (OVERSUBSCRIBED: {ranks} processes on {os.cpu_count()} cores; the profile was calibrated with "
            f"{prof.gpus_per_node})" if ranks > prof.gpus_per_node else "")
    print(f"\n=== {args.model}, {ranks} ranks{over}, global batch {args.global_batch}, profile {args.machine}, "
          f"--all, {args.steps} steps ({args.warmup} warm-up), {passes} ===")
    if args.rescore or args.pool:
        print(f"re-scoring the recorded runs in {out} with the planner as it is now (no new runs)")
    else:
        print(f"load average before: {load()}")
        t0 = time.monotonic()
        V.run_sweep(sw, out, resume=args.resume and (out / V.SWEEP_FILE).exists(), echo=print)
        wall = time.monotonic() - t0
        print(f"load average after:  {load()}   (sweep wall time {wall:.0f} s)")
    res = V.read_results(out / V.RESULTS_FILE)
    # score with the planner as it is now: the cost model may have changed since the runs were made
    ok = (res["status"] == "ok") & res["measured_time_s"].notna()
    then = res["batch_time_s"].copy()
    res.loc[ok, "batch_time_s"] = predict(prof, runs_from_results(res))
    if not np.allclose(then[ok], res.loc[ok, "batch_time_s"]):
        print("note: the planner's predictions changed since the sweep ran; scoring the current ones")
    s = V.score(res)
    spread = res.loc[ok, "measured_spread"].dropna() if "measured_spread" in res else []
    if len(spread):
        # how far one run of a candidate is from another: the noise floor of every error below
        print(f"repeat spread (max/min - 1 over a candidate's runs): median {100 * spread.median():.1f}%, "
              f"max {100 * spread.max():.1f}%")
    print("scores (current planner):")
    print(V.format_score(s))
    ceiling = tie_ceiling(res.loc[ok, "batch_time_s"].to_numpy(), res.loc[ok, "measured_time_s"].to_numpy())
    if ceiling is not None:
        # the gap below it is the model's ordering; above it, what no model making the same ties can reach
        print(f"Kendall tau with the model's ties kept and its distinct predictions ordered as measured: {ceiling:.3f}")
    print("per run (model terms from `axoplan explain`):")
    print(breakdown(args, ranks, res))
    fig = {"ranks": ranks, "oversubscribed": bool(over), "candidates": s["candidates"], "ok": s["ok"],
           "kendall_tau": s.get("kendall_tau"), "spearman_rho": s.get("spearman_rho"),
           "best_in_top3": s.get("best_in_top3"), "regret": s.get("regret"),
           "mape_before": s.get("mean_abs_pct_error"), "mape_after": None, "mape_loo": None}
    if s["ok"] >= 3:
        runs = runs_from_results(res)
        rep = refit_profile(prof, runs, "auto" if args.params == "auto" else args.params.split(","))
        print("refit (leave-one-out: each run predicted by a fit to the others):")
        print(format_report(rep))
        fig.update(mape_after=rep.mape_after, mape_loo=rep.mape_loo, refit_params=rep.params,
                   refit_corrections={k: rep.after[k] for k in rep.params})
        # the ranking the refitted profile gives, scored in-sample (how much of the order the corrections fix)
        from scipy import stats

        fig["kendall_tau_after_refit_in_sample"] = float(stats.kendalltau(rep.per_run["after_s"],
                                                                         rep.per_run["measured_s"]).statistic)
    (out / "fidelity.json").write_text(json.dumps(fig, indent=1, default=str) + "\n")
    return fig


def tie_ceiling(pred, meas) -> float | None:
    """Kendall tau when every group of candidates predicted alike (within 1e-9) is predicted as its mean
    measured time: the most a model with the same ties can reach."""
    from scipy import stats

    pred, meas = np.asarray(pred, dtype=np.float64), np.asarray(meas, dtype=np.float64)
    if len(pred) < 2:
        return None
    order = np.argsort(pred, kind="stable")
    group = np.zeros(len(pred), dtype=np.int64)
    group[order[1:]] = np.cumsum(np.diff(pred[order]) > 1e-9 * np.abs(pred[order][1:]))
    means = np.bincount(group, meas) / np.bincount(group)
    tau = stats.kendalltau(means[group], meas).statistic
    return None if np.isnan(tau) else float(tau)


def verdict(fig: dict) -> str:
    def chk(ok):
        return "ok  " if ok else "MISS"

    t = TARGETS
    lines = [f"  Kendall tau       {fig['kendall_tau']:.3f}   target >= {t['kendall_tau']}   "
             f"{chk(fig['kendall_tau'] is not None and fig['kendall_tau'] >= t['kendall_tau'])}",
             f"  best in top-3     {fig['best_in_top3']}   {chk(bool(fig['best_in_top3']))}",
             f"  regret            {100 * fig['regret']:.1f}%   target <= {100 * t['regret']:.0f}%   "
             f"{chk(fig['regret'] <= t['regret'])}",
             f"  mean abs error    {fig['mape_before']:.1f}% before refit   target <= {t['mape_before']:.0f}%   "
             f"{chk(fig['mape_before'] <= t['mape_before'])}"]
    if fig.get("mape_loo") is not None:
        lines.append(f"  mean abs error    {fig['mape_after']:.1f}% after refit in-sample, {fig['mape_loo']:.1f}% "
                     f"leave-one-out   target <= {t['mape_loo']:.0f}% (LOO)   {chk(fig['mape_loo'] <= t['mape_loo'])}")
        lines.append(f"  (Kendall tau with the refitted profile, in-sample: {fig['kendall_tau_after_refit_in_sample']:.3f}; "
                     f"fitted {', '.join(f'{k}={v:.3g}' for k, v in fig['refit_corrections'].items())})")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--machine", default="localhost-cpu")
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300.0)
    # three: the median of two is their mean and keeps an outlier run (8 ranks on 2 cores: one in 2x end to end)
    ap.add_argument("--repeats", type=int, default=3,
                    help="passes over the candidates, round robin (each candidate's time: the median of its runs)")
    ap.add_argument("--checkpointing", default="off", choices=["both", "on", "off"])
    ap.add_argument("--params", default="auto", help="corrections to refit (comma-separated) or auto")
    ap.add_argument("--out", default="out/ranking-fidelity", help="run folder (default under out/, which git ignores)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--rescore", action="store_true", help="no runs: score the recorded ones with the current planner")
    ap.add_argument("--pool", nargs="+", metavar="DIR", default=None,
                    help="no runs: score the runs of these sweeps' --out folders together (same candidates and "
                         "profile; each candidate's time the median of all its runs), written under --out")
    args = ap.parse_args()
    prof = load_profile(args.machine)
    print(f"profile {prof.name} ({prof.path}): {prof.description}")
    print(f"this machine: {os.cpu_count()} cores; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    try:
        figs = [one(args, r) for r in args.ranks]
    except UserError as e:
        sys.exit(f"error: {e}")
    print("\n=== figures (issue 5 targets) ===")
    for f in figs:
        print(f"{args.model}, {f['ranks']} ranks{' (oversubscribed)' if f['oversubscribed'] else ''}: "
              f"{f['ok']} of {f['candidates']} runs ok")
        if f["ok"] >= 2:
            print(verdict(f))


if __name__ == "__main__":
    main()
