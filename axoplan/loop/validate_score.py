"""Scoring a validate sweep and its plot: how well the predicted times ranked the measured ones
(Kendall tau, Spearman rho, top-1/top-3, regret, error), in the manner of the AxoNN paper's Figure 2."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from axoplan import plots
from axoplan.loop.validate_files import INFRA, STATUSES


# ---- scoring -----------------------------------------------------------------------------------
def score(results: pd.DataFrame) -> dict:
    """Ranking quality of the prediction (batch_time_s) against the measurement (measured_time_s) over
    the runs that finished ok. Positions count among those runs, in predicted order."""
    from scipy import stats

    counts = {s: int((results["status"] == s).sum()) for s in STATUSES if s != INFRA or (results["status"] == s).any()}
    ok = results[(results["status"] == "ok") & results["measured_time_s"].notna()].copy()
    out: dict = {"candidates": len(results), "ok": len(ok), "status_counts": counts}
    if len(ok) == 0:
        out["note"] = "no run finished ok: nothing to score"
        return out
    ok = ok.sort_values(["batch_time_s", "rank"], kind="stable").reset_index(drop=True)
    pred = ok["batch_time_s"].to_numpy(float)
    meas = ok["measured_time_s"].to_numpy(float)
    best = int(np.argmin(meas))
    ape = np.abs(pred - meas) / meas
    out.update({
        "kendall_tau": float(stats.kendalltau(pred, meas).statistic) if len(ok) >= 2 else None,
        "spearman_rho": float(stats.spearmanr(pred, meas).statistic) if len(ok) >= 2 else None,
        "measured_best": str(ok.loc[best, "candidate"]),
        "measured_best_time_s": float(meas[best]),
        "measured_best_predicted_position": best + 1,
        "best_in_top1": bool(best < 1),
        "best_in_top3": bool(best < 3),
        "predicted_best": str(ok.loc[0, "candidate"]),
        "predicted_best_measured_time_s": float(meas[0]),
        "regret": float(meas[0] / meas[best] - 1.0),
        "mean_abs_pct_error": float(100 * ape.mean()),
        "max_abs_pct_error": float(100 * ape.max()),
        "median_pred_over_measured": float(np.median(pred / meas)),
    })
    if len(ok) >= 2 and (np.isnan(out["kendall_tau"]) or np.isnan(out["spearman_rho"])):
        out["note"] = "constant predictions or measurements: rank correlations undefined"
        out["kendall_tau"] = out["spearman_rho"] = None
    failed_first = results.sort_values("batch_time_s", kind="stable").iloc[0]
    if failed_first["status"] != "ok":
        out["note"] = (f"the predicted best overall ({failed_first['candidate']}) did not finish ok "
                       f"({failed_first['status']}): scores are over the runs that did")
    return out


def format_score(s: dict) -> str:
    if not s.get("ok"):
        return f"{s.get('candidates', 0)} candidates, none finished ok ({s.get('status_counts')})"

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    lines = [f"runs: {s['ok']} ok of {s['candidates']} ({', '.join(f'{k} {v}' for k, v in s['status_counts'].items() if v)})",
             f"Kendall tau {f(s['kendall_tau'], '.3f')}   Spearman rho {f(s['spearman_rho'], '.3f')}",
             (f"measured best {s['measured_best']} ({s['measured_best_time_s']:.4g} s) is predicted #{s['measured_best_predicted_position']}"
             f"  (top-1: {'yes' if s['best_in_top1'] else 'no'}, top-3: {'yes' if s['best_in_top3'] else 'no'})"),
             f"regret of the predicted best {s['predicted_best']}: {100 * s['regret']:.1f}%",
             (f"prediction error: mean {s['mean_abs_pct_error']:.1f}%, max {s['max_abs_pct_error']:.1f}% "
             f"(median predicted/measured {s['median_pred_over_measured']:.3g})")]
    if s.get("note"):
        lines.append("note: " + s["note"])
    return "\n".join(lines)


# ---- the plot -----------------------------------------------------------------------------------
def plot(results: pd.DataFrame, path: str | Path, title: str = "") -> Path:
    """plot_png's PNG written to path atomically."""
    from axoplan.atomic import write_output

    return write_output(path, plot_png(results, title))


def plot_png(results: pd.DataFrame, title: str = "") -> bytes:
    """Left: measured (and predicted) time per batch against predicted rank, failed runs marked on the
    axis; right: predicted against measured with the y = x line. As AxoNN's Figure 2 (SC24)."""
    plt = plots.pyplot()
    df = results.sort_values(["batch_time_s", "rank"], kind="stable").reset_index(drop=True)
    pos = np.arange(1, len(df) + 1)
    ok = (df["status"] == "ok").to_numpy() & df["measured_time_s"].notna().to_numpy()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.3))
    a.plot(pos, df["batch_time_s"], "o", mfc="none", color="tab:gray", label="predicted")
    a.plot(pos[ok], df["measured_time_s"][ok], "o-", color="tab:blue", label="measured")
    if ok.any():
        i = int(np.argmin(np.where(ok, df["measured_time_s"].fillna(np.inf), np.inf)))
        a.plot([pos[i]], [df["measured_time_s"][i]], "*", ms=16, color="tab:red", label="measured best")
    if (~ok).any():
        ymin = np.nanmin(np.concatenate([df["batch_time_s"].to_numpy(float),
                                         df["measured_time_s"].to_numpy(float)[ok]]))
        a.plot(pos[~ok], np.full((~ok).sum(), ymin), "x", color="black", label="failed / oom / timeout")
    a.set_xlabel("predicted rank")
    a.set_ylabel("time per batch (s)")
    a.set_xticks(pos if len(pos) <= 20 else pos[::max(1, len(pos) // 20)])
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    if ok.any():
        p, m = df["batch_time_s"][ok].to_numpy(float), df["measured_time_s"][ok].to_numpy(float)
        b.plot(m, p, "o", color="tab:blue")
        lo, hi = min(p.min(), m.min()) * 0.9, max(p.max(), m.max()) * 1.1
        b.plot([lo, hi], [lo, hi], "--", color="tab:gray", label="y = x")
        b.set_xlim(lo, hi)
        b.set_ylim(lo, hi)
        if hi / lo > 20:
            b.set_xscale("log")
            b.set_yscale("log")
        b.legend(fontsize=8)
    b.set_xlabel("measured time per batch (s)")
    b.set_ylabel("predicted time per batch (s)")
    b.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return plots.png_bytes(fig)
