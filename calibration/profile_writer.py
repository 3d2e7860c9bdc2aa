"""Raw results of a calibration run -> a machine profile (machine_profiles/README.md schema).

Every number gets a source naming the run (date, host, device, torch and backend versions, the
command) and what it was derived from. The GEMM table is written beside the profile, then the
profile, each atomically, so a failed write leaves the previous profile whole."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from axoplan.atomic import atomic_write_text

from .fit import COLLECTIVES, fit_alpha_beta, fit_dim_half, fit_line, geomean, ring_steps, ring_volume
from .results_io import ResultsDir

GIB = 2**30
SCHEMA = "axoplan-profile/1"


class CalibrationError(Exception):
    """The raw results cannot make a profile (missing or incomplete tables)."""


@dataclass
class Built:
    profile: dict
    table_rows: list[dict]  # the GEMM table written beside the profile
    fits: list[dict]  # one row per (collective, group shape), for fits.csv
    summary: dict  # headline numbers for people


def run_tag(meta: dict) -> str:
    nodes = f" on {meta['nodes']} nodes" if meta.get("nodes", 1) > 1 else ""
    return (f"axoplan calibrate {meta['date']} on host {meta['host']} ({meta['device']}), torch {meta['torch']}, "
            f"{meta['backend_version']}, {meta['world']} ranks{nodes}, {meta['dtype']}: `{meta['command']}`")


def _r(x: float, digits: int = 4) -> float:
    """Round to `digits` significant digits: a profile is read by people."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def gemm_part(rows: list[dict], tag: str, table_name: str, peak_from_ceiling: bool):
    if not rows:
        raise CalibrationError("the GEMM table is empty")
    best: dict = {}
    for r in rows:
        key = (r["m"], r["n"], r["k"])
        if key not in best or r["seconds"] < best[key]["seconds"]:
            best[key] = r
    # The ceiling is a high percentile, not the maximum, of the large shapes: one lucky timing (a
    # moment when the node was quieter) must not set the throughput every estimate scales from.
    large = [r for r in best.values() if min(r["m"], r["n"], r["k"]) >= 256] or list(best.values())
    ranked = sorted(large, key=lambda r: r["tflops"])
    top = ranked[min(len(ranked) - 1, int(0.95 * len(ranked)))]
    ceiling = top["tflops"]
    ms, ns, ks, tf = zip(*[(r["m"], r["n"], r["k"], r["tflops"]) for r in best.values()])
    dim_half, err = fit_dim_half(ms, ns, ks, tf, ceiling)
    where = f"{top['m']}x{top['n']}x{top['k']} {top['layout']}"
    how = f"95th percentile of the best-layout throughput over {len(large)} shapes with m, n, k >= 256 ({where})"
    gemm = {
        "ceiling_tflops": {"value": _r(ceiling), "source": f"{tag}; per rank, all ranks at once: {how}"},
        "dim_half": {"value": _r(dim_half, 3), "source": f"{tag}; least-squares fit of ceiling*prod(d/(d+dim_half)) "
                                                     f"to {len(best)} shapes (best layout), rms log error {err:.2f}"},
        "table": {"path": table_name, "source": f"{tag}; {len(rows)} rows, {len(best)} shapes x layouts NN/NT/TN, "
                                               "median per-rank seconds per call with all ranks computing at once"},
    }
    peak = {"value": _r(ceiling), "source": f"{tag}; "
            + (f"no spec-sheet peak for this device: the measured GEMM ceiling per rank ({how})" if peak_from_ceiling
               else f"no spec sheet read: the measured GEMM ceiling ({how}); replace with the dense peak")}
    table = [{"m": r["m"], "n": r["n"], "k": r["k"], "layout": r["layout"], "seconds": r["seconds"],
              "tflops": r["tflops"]} for r in rows]
    return gemm, peak, table, {"gemm_ceiling_tflops": ceiling, "gemm_ceiling_shape": where, "dim_half": dim_half,
                               "dim_half_rms_log_err": err}


def memory_part(rows: list[dict], meta: dict, tag: str):
    bw_rows = [r for r in rows if r["kind"] == "bandwidth"]
    ew_rows = [r for r in rows if r["kind"] == "elementwise"]
    oh_rows = [r for r in rows if r["kind"] == "overhead"]
    if not bw_rows or not ew_rows or not oh_rows:
        raise CalibrationError("the memory table lacks bandwidth, element-wise or overhead rows")
    bw = max(r["bytes"] / r["seconds"] for r in bw_rows)
    best_op = max(bw_rows, key=lambda r: r["bytes"] / r["seconds"])
    overhead = statistics.median(r["seconds"] for r in oh_rows)
    # per op: t = fixed + bytes / (bandwidth * efficiency) over the activation sizes of the models
    effs, errs = {}, []
    by_op = defaultdict(list)
    for r in ew_rows:
        by_op[r["op"]].append(r)
    for op, rs in by_op.items():
        f = fit_line([1.0] * len(rs), [r["bytes"] for r in rs], [r["seconds"] for r in rs])
        if f.b > 0:
            effs[op] = (1.0 / f.b) / bw
            errs.append(f.rms_rel_err)
    if not effs:
        raise CalibrationError("element-wise times did not grow with size; cannot fit their bandwidth")
    eff = geomean(list(effs.values()))
    ops = ", ".join(f"{k} {v:.2f}" for k, v in sorted(effs.items()))
    capacity = meta["capacity_bytes"] / GIB
    headroom = meta["runtime_overhead_bytes"] / GIB
    cap_src = ("device memory reported by CUDA" if meta.get("cuda") else
               f"total RAM / {meta['ranks_per_node']} ranks per node")
    head_src = ("memory in use after CUDA context and communicator set-up, largest rank" if meta.get("cuda") else
                "resident memory of a calibration rank after torch and gloo set-up, largest rank")
    mem = {
        "source": (f"{tag}; capacity_gib: {cap_src}; headroom_gib: {head_src}; bandwidth_gbs: per rank, all ranks "
                   f"streaming at once ({best_op['op']} of {best_op['elements']} elements); elementwise_efficiency: "
                   f"geometric mean over ops of the fitted bandwidth (t = fixed + bytes/bw) at model activation sizes "
                   f"/ bandwidth_gbs ({ops}; fit rms error {max(errs):.0%} worst op)"),
        "capacity_gib": _r(capacity),
        "headroom_gib": _r(math.ceil(headroom * 100) / 100, 3),
        "bandwidth_gbs": _r(bw / 1e9),
        "elementwise_efficiency": _r(eff, 3),
    }
    ops_tiny = ", ".join(sorted({r["op"] for r in oh_rows}))
    oh = {"value": _r(overhead * 1e6, 3), "source": f"{tag}; median time per call of ops on 8 elements ({ops_tiny}), "
                                                    "all ranks at once"}
    return mem, oh, {"bandwidth_gbs": bw / 1e9, "elementwise_efficiency": eff, "kernel_overhead_us": overhead * 1e6,
                     "elementwise_by_op": effs}


def attention_part(rows: list[dict], tag: str):
    if not rows:
        raise CalibrationError("the attention table is empty")
    t = {}
    for r in rows:
        t[(r["batch"], r["heads"], r["seq"], r["head_dim"], r["causal"], r["pass"])] = r["seconds"]
    shapes = sorted({k[:4] for k in t})
    ratios, bwd, full_flop = [], [], {}
    for s in shapes:
        try:
            nc, c, cfb = t[s + (False, "forward")], t[s + (True, "forward")], t[s + (True, "forward_backward")]
        except KeyError:
            continue
        ratios.append(c / nc)
        bwd.append((cfb - c) / c)
        b, h, sq, d = s
        full_flop[s] = (4.0 * b * h * sq * sq * d, c)
    if not ratios:
        raise CalibrationError("the attention table lacks causal/non-causal pairs")
    ratio = statistics.median(ratios)
    skip = ratio < 0.75  # a kernel that skips the masked half takes about half the time
    counted = 0.5 if skip else 1.0
    tflops = statistics.median(counted * f / c / 1e12 for f, c in full_flop.values())
    factor = max(statistics.median(bwd), 0.0)
    att = {
        "tflops": {"value": _r(tflops), "source": f"{tag}; median over {len(full_flop)} model-like shapes of causal "
                   f"forward FLOP ({'half' if skip else 'all'} of 4*b*h*s^2*d, as causal_skip says) / measured causal "
                   "forward time of scaled_dot_product_attention"},
        "causal_skip": skip,
        "backward_factor": _r(factor, 3),
        "source": f"{tag}; causal_skip: causal/non-causal forward time median {ratio:.2f} (true only below 0.75); "
                  f"backward_factor: measured backward time / forward time (causal), median",
    }
    return att, {"attention_tflops": tflops, "causal_ratio": ratio, "backward_factor": factor}


def network_part(rows: list[dict], meta: dict, tag: str):
    if not rows:
        raise CalibrationError("the collectives table is empty")
    by = defaultdict(list)
    for r in rows:
        by[(r["collective"], r["size"], r["stride"], r["crosses_nodes"])].append(r)
    fits, fit_rows = {}, []
    for (c, p, s, cross), rs in sorted(by.items()):
        if len(rs) < 2:
            continue
        f = fit_alpha_beta(c, p, [r["bytes"] for r in rs], [r["seconds"] for r in rs])
        if not math.isfinite(f.beta_bps):  # no bandwidth term showed: take the best measured busbw
            f = type(f)(f.alpha_s, max(r["busbw_gbs"] for r in rs) * 1e9, f.rms_rel_err, f.max_rel_err, f.points)
        fits[(c, p, s)] = (f, cross)
        fit_rows.append({"collective": c, "size": p, "stride": s, "crosses_nodes": cross,
                         "alpha_us": f.alpha_s * 1e6, "busbw_gbs": f.beta_bps / 1e9,
                         "rms_rel_err": f.rms_rel_err, "max_rel_err": f.max_rel_err, "points": f.points,
                         "bytes_min": min(r["bytes"] for r in rs), "bytes_max": max(r["bytes"] for r in rs)})
    shapes = sorted({(p, s, cross) for (c, p, s), (f, cross) in fits.items() if c == "all_reduce"})
    intra = [(p, s) for p, s, cross in shapes if not cross]
    inter = [(p, s) for p, s, cross in shapes if cross]
    if not intra:
        raise CalibrationError("no intra-node all-reduce was measured")
    ar = {(p, s): fits[("all_reduce", p, s)][0] for p, s, _ in shapes}
    lat_vals = [ar[g].alpha_s for g in intra if ar[g].alpha_s > 0]
    latency = geomean(lat_vals) if lat_vals else 0.0

    scales = {}
    for c in COLLECTIVES:
        bs = [fits[(c, p, s)][0].beta_bps / ar[(p, s)].beta_bps for p, s, _ in shapes if (c, p, s) in fits]
        ls = [fits[(c, p, s)][0].alpha_s / ar[(p, s)].alpha_s for p, s, _ in shapes
              if (c, p, s) in fits and ar[(p, s)].alpha_s > 0 and fits[(c, p, s)][0].alpha_s > 0]
        scales[c] = {"bandwidth_scale": _r(geomean(bs), 3) if bs else 1.0,
                     "latency_scale": _r(geomean(ls), 3) if ls else 1.0}

    gpn = meta["ranks_per_node"]
    if inter:
        inter_bw = geomean([ar[g].beta_bps * min(g[1], gpn) for g in inter])
        inter_lat_vals = [ar[g].alpha_s for g in inter if ar[g].alpha_s > 0]
        inter_lat = geomean(inter_lat_vals) if inter_lat_vals else latency
        inter_src = (f"{tag}; all-reduce busbw of groups crossing nodes x min(stride, ranks per node) (the planner "
                     f"divides by the rings sharing a node), geometric mean over {len(inter)} group shapes")
        inter_lat_src = (f"{tag}; per ring step, geometric mean of the all-reduce alpha over {len(inter)} group "
                         "shapes crossing nodes")
    else:
        slow = min(intra, key=lambda g: ar[g].beta_bps)
        inter_bw = ar[slow].beta_bps
        inter_lat = max(ar[g].alpha_s for g in intra)
        inter_src = (f"{tag}; NOT MEASURED (one node): the slowest intra-node group (size {slow[0]}, stride "
                     f"{slow[1]}) and the largest intra-node latency stand in; run `axoplan calibrate --emit-slurm "
                     f"NODES` to measure across nodes")
        inter_lat_src = inter_src

    def predict(c, p, s, nbytes, lat, bw):
        sc = scales[c]
        return (ring_steps(c, p) * lat * sc["latency_scale"]
                + ring_volume(c, p, nbytes) / (bw * sc["bandwidth_scale"]))

    # the profile's own model (one latency, busbw per group, per-collective scales) against every point
    rel = []
    for r in rows:
        g = (r["size"], r["stride"])
        if g not in ar:
            continue
        if r["crosses_nodes"]:
            lat, bw = inter_lat, inter_bw / min(g[1], gpn)
        else:
            lat, bw = latency, ar[g].beta_bps
        rel.append(predict(r["collective"], g[0], g[1], r["bytes"], lat, bw) / r["seconds"] - 1)
    model_rms = math.sqrt(sum(x * x for x in rel) / len(rel))
    model_max = max(abs(x) for x in rel)
    lo = min(r["bytes"] for r in rows)
    hi = max(r["bytes"] for r in rows)
    span = f"{_human(lo)}-{_human(hi)}"
    groups = []
    for p, s in intra:
        f = ar[(p, s)]
        groups.append({"size": p, "stride": s, "busbw_gbs": _r(f.beta_bps / 1e9),
                       "source": f"{tag}; all-reduce fit t = 2(p-1)*alpha + 2(p-1)/p*bytes/busbw over {span}, all "
                                 f"{meta['world'] // p} groups at once, fit rms error {f.rms_rel_err:.0%} "
                                 f"(max {f.max_rel_err:.0%})"})
    net = {
        "intra_node": {
            "latency_us": {"value": _r(latency * 1e6, 3), "source": f"{tag}; per ring step, geometric mean of the "
                           f"all-reduce alpha over {len(intra)} intra-node group shapes"},
            "groups": groups,
        },
        "inter_node": {
            "busbw_gbs": {"value": _r(inter_bw / 1e9), "source": inter_src},
            "latency_us": {"value": _r(inter_lat * 1e6, 3), "source": inter_lat_src},
        },
        "collectives": {**scales, "source": f"{tag}; per-collective alpha and busbw relative to all-reduce on the same "
                        f"group, geometric mean over group shapes; the whole network model (these scales, one latency, "
                        f"busbw per group) fits all {len(rel)} measurements with rms error {model_rms:.0%} "
                        f"(max {model_max:.0%})"},
    }
    summary = {"latency_us": latency * 1e6, "busbw_gbs": {f"{p}x{s}": ar[(p, s)].beta_bps / 1e9 for p, s in intra},
               "network_model_rms_rel_err": model_rms, "network_model_max_rel_err": model_max,
               "inter_node_measured": bool(inter), "scales": scales}
    return net, fit_rows, summary


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def build(results: ResultsDir, name: str, table_name: str) -> Built:
    try:
        meta = results.meta()
    except (OSError, ValueError):
        raise CalibrationError(f"{results.path} holds no readable meta.json (not a calibration results folder)")
    if meta.get("status") != "complete":
        raise CalibrationError(f"the calibration run in {results.path} did not finish")
    tag = run_tag(meta)
    gemm, peak, table, s1 = gemm_part(results.rows("gemm"), tag, table_name, peak_from_ceiling=not meta.get("cuda"))
    mem, overhead, s2 = memory_part(results.rows("memory"), meta, tag)
    att, s3 = attention_part(results.rows("attention"), tag)
    net, fit_rows, s4 = network_part(results.rows("collectives"), meta, tag)
    nodes = meta.get("nodes", 1)
    profile = {
        "schema": SCHEMA,
        "name": name,
        "description": (f"{meta['device']}: {meta['ranks_per_node']} ranks per node"
                        + (f" x {nodes} nodes" if nodes > 1 else "")
                        + (f", {meta['threads_per_rank']} thread(s) each on {meta['cpu_count']} cores"
                           if not meta.get("cuda") else "")
                        + f", {meta['dtype']}; measured by axoplan calibrate {meta['date']}"),
        "device": meta["device"],
        "dtype": meta["dtype"],
        "gpus_per_node": {"value": meta["ranks_per_node"],
                          "source": f"{tag}; ranks per node in the calibration run"},
        "memory": mem,
        "compute": {"peak_tflops": peak, "kernel_overhead_us": overhead, "gemm": gemm, "attention": att},
        "network": net,
        "corrections": {"gemm_scale": 1.0, "elementwise_scale": 1.0, "intra_bw_scale": 1.0, "inter_bw_scale": 1.0,
                        "latency_scale": 1.0, "step_overhead_s": 0.0,
                        "source": "identity: a fresh calibration; `axoplan refit` fits these to measured runs"},
        "calibration": {
            "date": meta["date"], "host": meta["host"], "device": meta["device"], "torch": meta["torch"],
            "backend": meta["backend_version"], "python": meta.get("python", ""), "command": meta["command"],
            "ranks": meta["world"], "nodes": nodes, "threads_per_rank": meta["threads_per_rank"],
            "quick": meta["quick"], "elapsed_s": meta.get("elapsed_s"), "results": str(results.path),
            "loadavg_start": meta.get("loadavg_start"), "loadavg_end": meta.get("loadavg_end"),
            "source": "this calibration run",
        },
    }
    summary = {**s1, **s2, **s3, **s4, "elapsed_s": meta.get("elapsed_s"), "peak_tflops": peak["value"]}
    return Built(profile, table, fit_rows, summary)


def table_csv(rows: list[dict]) -> str:
    lines = ["m,n,k,layout,seconds,tflops"]
    lines += [f"{r['m']},{r['n']},{r['k']},{r['layout']},{r['seconds']:.6g},{r['tflops']:.6g}" for r in rows]
    return "\n".join(lines) + "\n"


def fits_csv(rows: list[dict]) -> str:
    cols = ["collective", "size", "stride", "crosses_nodes", "alpha_us", "busbw_gbs", "rms_rel_err", "max_rel_err",
            "points", "bytes_min", "bytes_max"]
    out = [",".join(cols)]
    for r in rows:
        out.append(",".join(f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]).lower() if isinstance(r[c], bool)
                            else str(r[c]) for c in cols))
    return "\n".join(out) + "\n"


def profile_yaml(profile: dict) -> str:
    head = "# Machine profile written by `axoplan calibrate` (schema: machine_profiles/README.md)\n"
    return head + yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=10_000)


def write(results: ResultsDir, out: str | Path) -> Built:
    """Fit the raw results and write the profile at `out`, its GEMM table beside it (`<stem>_gemm.csv`)
    and the fit details to the results folder."""
    out = Path(out)
    name = out.stem
    table_name = f"{name}_gemm.csv"
    built = build(results, name, table_name)
    atomic_write_text(results.path / "fits.csv", fits_csv(built.fits))
    atomic_write_text(out.parent / table_name, table_csv(built.table_rows))
    atomic_write_text(out, profile_yaml(built.profile))
    return built
