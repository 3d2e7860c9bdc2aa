"""Raw results of a calibration run -> a machine profile (machine_profiles/README.md schema).

Every number gets a source naming the run (date, host, device, torch and backend versions, the
command) and what it was derived from. The GEMM table is written beside the profile, then the
profile, each atomically, so a failed write leaves the previous profile whole. The collective
times themselves are written beside it too: on measured group shapes the planner interpolates them
rather than the alpha-beta fit (on a CPU node the latency is not one number per ring step)."""
from __future__ import annotations

import math
import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

from axoplan import progress
from axoplan.atomic import atomic_write_text

from axoplan.calibrate.fit import (
    COLLECTIVES,
    fit_alpha_beta,
    fit_dim_half,
    fit_line,
    geomean,
)
from axoplan.calibrate.results_io import ResultsDir, ResultsError
from axoplan.planner.comm import ring_steps, ring_volume

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
    coll_rows: list[dict] = None  # the intra-node collective times written beside the profile
    attn_rows: list[dict] = None  # the attention times written beside the profile

    def files(self) -> dict[str, str]:
        """File name -> text of everything written beside (and as) the profile; the profile last."""
        out = {self.profile["compute"]["gemm"]["table"]["path"]: table_csv(self.table_rows)}
        ctab = self.profile["network"]["intra_node"].get("table")
        if ctab:
            out[ctab["path"]] = collectives_csv(self.coll_rows)
        atab = self.profile["compute"]["attention"].get("table")
        if atab:
            out[atab["path"]] = attention_csv(self.attn_rows)
        out[f"{self.profile['name']}.yaml"] = profile_yaml(self.profile)
        return out


def run_tag(meta: dict) -> str:
    nodes = f" on {meta['nodes']} nodes" if meta.get("nodes", 1) > 1 else ""
    return (f"axoplan calibrate {meta['date']} on host {meta['host']} ({meta['device']}), torch {meta['torch']}, "
            f"{meta['backend_version']}, {meta['world']} ranks{nodes}, {meta['dtype']}: `{meta['command']}`")


def added_runs(meta: dict) -> list[dict]:
    """The runs that measured parts again on top of this one (calibrate --parts), oldest first."""
    added = meta.get("added") or []
    return [added] if isinstance(added, dict) else list(added)


def part_tag(meta: dict, part: str) -> str:
    """run_tag for one part: a part measured again later (calibrate --parts) names its own date and command."""
    date = (meta.get("part_dates") or {}).get(part, meta["date"])
    if date == meta["date"]:
        return run_tag(meta)
    run = next((a for a in reversed(added_runs(meta)) if a.get("date") == date), {})
    return run_tag({**meta, "date": date, "command": run.get("command", meta["command"])})


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


def attention_part(rows: list[dict], tag: str, table_name: str | None = None):
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
    if table_name:
        att["table"] = {"path": table_name, "source": (
            f"{tag}; causal forward and forward+backward seconds of scaled_dot_product_attention on {len(shapes)} "
            f"local shapes (batch, heads, seq, head_dim) of the calibrated models, all ranks at once; the planner "
            f"takes these where its local shape was measured, the rate above elsewhere")}
    return att, {"attention_tflops": tflops, "causal_ratio": ratio, "backward_factor": factor}


def network_part(all_rows: list[dict], meta: dict, tag: str, coll_table_name: str | None = None):
    if not all_rows:
        raise CalibrationError("the collectives table is empty")
    # the alpha-beta fit describes calls back to back (burst 0), as nccl-tests times them
    rows = [r for r in all_rows if not r.get("burst_s")]
    if not rows:
        raise CalibrationError("the collectives table has no back-to-back timings")
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

    def predict(c, p, nbytes, lat, bw):
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
        rel.append(predict(r["collective"], g[0], r["bytes"], lat, bw) / r["seconds"] - 1)
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
    intra_node = {
        "latency_us": {"value": _r(latency * 1e6, 3), "source": f"{tag}; per ring step, geometric mean of the "
                       f"all-reduce alpha over {len(intra)} intra-node group shapes"},
        "groups": groups,
    }
    coll_rows = [{"collective": r["collective"], "size": r["size"], "stride": r["stride"], "bytes": r["bytes"],
                  "seconds": r["seconds"], "burst_s": r.get("burst_s") or 0.0} for r in all_rows if not r["crosses_nodes"]]
    bursts = sorted({r["burst_s"] for r in coll_rows})
    if coll_table_name and coll_rows:
        intra_node["table"] = {"path": coll_table_name, "source": (
            f"{tag}; {len(coll_rows)} rows: slowest rank's median seconds per call of each collective over "
            f"{span} on every intra-node group shape, all groups of a shape at once"
            + ("; ranks share cores, so calls were also timed after compute bursts on every rank ("
               + ", ".join(f"{b * 1e3:.2g}" for b in bursts) + " ms, column burst_s), less the burst's own time "
               "(what a call costs between compute, as in training)" if len(bursts) > 1 else "")
            + "; the planner interpolates these (log-log) on measured shapes, the fit above serves the rest")}
    stalls, in_band = _stalls_part(rows, tag) if inter else ([], set())
    # calls in a stall band follow the stall, not NCCL's protocol model: the model is fitted to the rest
    proto_rows = [r for r in rows if id(r) not in in_band]
    protocols, proto_summary = _protocols_part(proto_rows, meta, tag, inter_bw) if inter else (None, None)
    if protocols is not None:
        inter_bw = proto_summary["busbw_gbs"] * 1e9
        inter_src = (f"{tag}; the plateau of one ring leaving a node, fitted with network.protocols (NCCL's "
                     f"protocol model) to every group shape crossing nodes ({proto_summary['points']} points, rms "
                     f"error {proto_summary['rms_rel_err']:.0%}); shared by min(stride, ranks per node)")
    net = {
        **({"protocols": protocols} if protocols is not None else {}),
        **({"stalls": stalls} if stalls else {}),
        "intra_node": intra_node,
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
               "inter_node_measured": bool(inter), "scales": scales, "protocols": proto_summary,
               "stalls": stalls}
    return net, fit_rows, summary, coll_rows


def _shared_cores(meta: dict, tag: str) -> dict | None:
    """compute.shared_cores where the node's CPU ranks had more threads than cores: the rates above were
    measured with all of them busy, so a rank that waits frees cores for the others (pipeline stages)."""
    cores, ranks, threads = meta.get("cpu_count"), meta.get("ranks_per_node", 1), meta.get("threads_per_rank", 1)
    if meta.get("cuda") or not cores or ranks * threads <= cores:
        return None
    return {"value": int(cores), "source": f"{tag}; os.cpu_count() of the host: {ranks} ranks x {threads} thread(s) "
                                          f"on {cores} cores, every rate above measured with all ranks busy"}


def _device_section(meta: dict, tag: str) -> dict:
    """What the profile was measured on, which validate, train and calibrate compare with where they run."""
    if meta.get("cuda"):
        return {"name": meta["device"], "count": int(meta["ranks_per_node"]),
                "source": f"{tag}; torch.cuda.get_device_name, one GPU per rank on each node"}
    dev = {"name": meta["device"], "source": f"{tag}; /proc/cpuinfo model name and os.cpu_count() of the host"}
    if meta.get("cpu_count"):
        dev["count"] = int(meta["cpu_count"])
    return dev


def _stalls_part(rows: list[dict], tag: str) -> tuple[list[dict], set]:
    """network.stalls from the groups crossing nodes (fit.find_stalls: a band of each rank's part where calls took
    longer than larger ones, on two thirds of the group shapes that measured it) and the ids of the rows in a band."""
    from axoplan.calibrate.fit import STALL_RATIO, find_stalls

    cross = [dict(r, curve=(r["collective"], r["size"], r["stride"]), src=id(r)) for r in rows if r["crosses_nodes"]]
    out, in_band = [], set()
    for f in find_stalls(cross):
        in_band |= {cross[i]["src"] for i in f.members}
        out.append({"collective": f.collective, "per_rank_kib": [_r(f.lo / 1024, 4), _r(f.hi / 1024, 4)],
                    "step_us": _r(f.step * 1e6, 4), "source": (
                        f"{tag}; {f.stalled} of the {f.rows} calls of groups crossing nodes whose every rank's part was "
                        f"{_human(int(f.lo))}-{_human(int(f.hi))} took longer than {STALL_RATIO:g} x a larger "
                        f"message's call on {f.curves} group shapes; the median seconds per ring step of all "
                        f"{f.rows}, the least the planner lets such a call take")})
    return out, in_band


def _protocols_part(rows: list[dict], meta: dict, tag: str, busbw0: float):
    """network.protocols for a GPU run across nodes: NCCL's default rows for the GPU generation, host CPU and
    GPU-to-NIC path the worker recorded (no LL128 rows beyond PXB; NVLSTree where it found NVLS), their latencies scaled and the plateau fitted to the groups that cross nodes (the
    size x node-count curves). None where NCCL's defaults for the device are not written in axoplan (no
    CUDA, before Ampere, an unknown host CPU)."""
    from axoplan.calibrate.fit import fit_protocols
    from axoplan.planner import gpu_physics
    from axoplan.planner.profile_reader import _Reader

    if not meta.get("cuda"):
        return None, None
    path = str(meta.get("nic_path") or "PXB")  # an older run, or no nvidia-smi: NCCL's rows as on DGX/HGX boards
    cap = int(meta.get("cuda_capability") or 0)
    # NVLSTree needs 2 or more GPUs of a node in the group (nvls.cc); its constants are written for Hopper only
    nvls = bool(meta.get("nvls")) and meta["ranks_per_node"] >= 2
    d = gpu_physics.nccl_protocols(cap, str(meta.get("cpu_vendor") or ""),
                                   path if path in gpu_physics.NIC_PATHS else "PXB", nvls and 90 <= cap < 100)
    cross = [r for r in rows if r["crosses_nodes"]]
    if d is None or len(cross) < 2:
        return None, None
    if nvls and not 90 <= cap < 100:
        d["source"] += (f"; the worker found NVLS multicast, but NVLSTree's constants are written here for Hopper "
                        f"only (compute capability {cap}): no nvls_tree row, the fit takes the ring and tree alone")
    pr = gpu_physics.parse({"network": {"protocols": d}}, _Reader("NCCL's default protocols")).protocols
    f = fit_protocols(pr, cross, meta["ranks_per_node"], busbw0)
    d["latency_scale"] = {"value": _r(f.latency_scale, 4), "source": (
        f"{tag}; every latency of NCCL's default rows below x this, fitted with the plateau inter_node.busbw_gbs to "
        f"{f.points} measurements of groups crossing nodes (least squares in log time), rms error "
        f"{f.rms_rel_err:.0%} (max {f.max_rel_err:.0%})")}
    return d, {"busbw_gbs": f.busbw / 1e9, "latency_scale": f.latency_scale, "rms_rel_err": f.rms_rel_err,
               "max_rel_err": f.max_rel_err, "points": f.points}


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# the fitted element-wise time is at least 1/1000 of the isolated ops' (efficiency at most 1000x theirs): steps
# whose element-wise work the fit need not explain would otherwise give an unbounded efficiency
MIN_ELEMENTWISE_SCALE = 1e-3


def framework_part(rows: list[dict], profile: dict, files: dict[str, str], tag: str, bare: dict):
    """Per kernel the trainer dispatches, and per element-wise byte: each measured step less what the
    planner models for its GEMMs and attention, split by bounded least squares into
    kernels x overhead + element-wise time x s. The kernel and element-wise terms are the planner's own,
    found by evaluating it with a launch cost of 0 and 1 us and with element-wise bandwidth 1x and
    1e6x, so the counts never drift from the cost model. s rescales the element-wise efficiency.

    The overhead is bounded below by a bare op's dispatch (every kernel the trainer issues pays at least
    that), so steps no longer than their modelled arithmetic (a GEMM table that stops short of their
    shapes models them slow) give the floor with a note instead of no profile."""

    import numpy as np
    from scipy.optimize import lsq_linear

    from axoplan.planner.batch import evaluate
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job

    from axoplan.calibrate.framework import tiny_model

    prof = _load(profile, files)
    one = np.ones(1, dtype=np.int64)
    A, base, sec, details = [], [], [], []
    for r in rows:
        model = tiny_model(r["layers"], r["hidden"], r["heads"], r["vocab"], r["seq"])
        job = Job(1, r["grad_acc"] * r["micro_batch"], r["seq"])
        c = Candidates(one, one, one, one, 0 * one, one * r["micro_batch"], np.zeros(1, dtype=bool))

        def t(oh, ew, model=model, job=job, c=c):  # bound now: called only in this iteration anyway
            p = prof.replace(kernel_overhead=oh, elementwise_efficiency=prof.elementwise_efficiency * ew)
            return float(evaluate(model, p, job, c).batch_time[0])

        b = t(0.0, 1e6)
        A.append([(t(1e-6, 1e6) - b) / 1e-6, t(0.0, 1.0) - b])
        base.append(b)
        sec.append(r["seconds"])
        details.append(f"{r['layers']} layer(s), hidden {r['hidden']}, {r['grad_acc']} x {r['micro_batch']} x "
                       f"{r['seq']} tokens: {r['seconds'] * 1e3:.2f} ms")
    A, base, sec = np.array(A), np.array(base), np.array(sec)
    floor = bare["us"] * 1e-6
    # relative error of each whole step: every model counts alike, and a step faster than its modelled
    # arithmetic (negative remainder) still weighs as itself
    fit = lsq_linear(A / sec[:, None], (sec - base) / sec, bounds=([floor, MIN_ELEMENTWISE_SCALE], [np.inf, np.inf]))
    oh, s = (float(v) for v in fit.x)
    pred = base + A @ np.array([oh, s])
    err = float(np.sqrt(np.mean((pred / sec - 1) ** 2)))
    eff = prof.elementwise_efficiency / s
    fast = int(np.sum(sec <= base))
    at_floor = oh <= floor * (1 + 1e-6)
    note = ""
    if at_floor:
        note = (f"; the steps' time is explained without a cost above a bare op's dispatch ({fast} of {len(rows)} "
                f"no longer than their modelled GEMM and attention, which a GEMM table short of their shapes "
                f"overestimates), so the overhead is that floor")
    how = (f"{tag}; the bundled trainer's whole optimizer steps on {len(rows)} small GPT models (grid of one, all "
           f"ranks at once: {'; '.join(details)}) less the modelled GEMM and attention time, fitted as kernels x "
           f"overhead + element-wise bytes / (bandwidth x efficiency) with the planner's counts, the overhead at "
           f"least a bare op's dispatch (rms error {err:.0%}){note}")
    oh_entry = {"value": _r(oh * 1e6, 3), "source": f"{how}. The dispatch of a bare op on 8 elements "
                f"({bare['ops']}) is {bare['us']:.3g} us: the rest is autograd and Python"}
    return oh_entry, _r(eff, 3), how, {"kernel_overhead_us": oh * 1e6, "bare_op_us": bare["us"],
                                        "framework_rms_rel_err": err, "elementwise_efficiency": eff,
                                        "elementwise_efficiency_ops": prof.elementwise_efficiency,
                                        "framework_overhead_at_floor": at_floor}


# what the trainer's steps on parallel grids decide; GEMM and element-wise rates are measured directly
TRAINER_PARAMS = ("collective_overhead_s", "latency_scale", "intra_bw_scale", "inter_bw_scale", "overlap_efficiency",
                  "kernel_overhead_scale", "step_overhead_s")


def _load(profile: dict, files: dict[str, str]):
    from axoplan.planner.profile_reader import load_profile

    with tempfile.TemporaryDirectory() as d:
        for fname, text in files.items():
            (Path(d) / fname).write_text(text)
        return load_profile(str(Path(d) / f"{profile['name']}.yaml"))


def trainer_part(rows: list[dict], profile: dict, files: dict[str, str], tag: str, world: int):
    """The profile's corrections, fitted to the trainer's steps on every grid of the calibration world:
    least squares on log time, the corrections chosen by the information criterion among those the
    steps decide (refit.select_params), with the leave-one-out error reported. What `axoplan refit`
    does with a user's runs, done here on calibration models, so a fresh profile already describes the
    trainer's collectives and overlap; a refit on real runs starts from these."""
    import numpy as np

    from axoplan.planner.execution import AXOPLAN
    from axoplan.planner.space import ORDERS
    from axoplan.loop.refit import RunSet, refit_profile
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job

    from axoplan.calibrate.trainer_grids import calibration_model

    prof = _load(profile, files)
    groups, measured, labels = [], [], []
    by_model: dict = defaultdict(list)
    for r in rows:
        by_model[(r["layers"], r["hidden"], r["heads"], r["vocab"], r["seq"], r["global_batch"])].append(r)
    for (layers, hidden, heads, vocab, seq, gb), rs in by_model.items():
        model = calibration_model(layers, hidden, heads, vocab, seq)
        def col(k, dt=np.int64, rs=rs):
            return np.array([r[k] for r in rs], dtype=dt)

        c = Candidates(col("gx"), col("gy"), col("gz"), col("gdata"),
                       np.array([ORDERS.index(r["order"]) for r in rs], dtype=np.int8), col("micro_batch"),
                       np.zeros(len(rs), dtype=bool))
        idx = np.arange(len(measured), len(measured) + len(rs))
        groups.append((model, Job(world, gb, seq).validate(), c, idx, AXOPLAN))  # the bundled trainer's steps
        measured += [r["seconds"] for r in rs]
        labels += [f"{model.name} {r['gx']}x{r['gy']}x{r['gz']}x{r['gdata']} {r['order']}" for r in rs]
    runs = RunSet(groups, np.array(measured, dtype=float), labels)
    rep = refit_profile(prof, runs, "auto", loo=True, candidates=TRAINER_PARAMS)
    fitted = {k: _r(rep.after[k], 4) for k in rep.params}
    models = sorted({lab.split(" ")[0] for lab in labels})
    loo = f"{rep.mape_loo:.1f}%" if rep.mape_loo is not None else "n/a"
    how = (f"{tag}; fitted to the bundled trainer's optimizer steps on {len(runs)} grids and placements of all "
           f"{world} ranks ({len(models)} calibration models: {', '.join(models)}; median after warm-up, as the "
           f"trainer reports), least squares on log time, corrections chosen by the information criterion among "
           f"{', '.join(TRAINER_PARAMS)}: {', '.join(rep.params) or 'none'}; mean abs error {rep.mape_before:.1f}% "
           f"before, {rep.mape_after:.1f}% after, {loo} leave-one-out. `axoplan refit` refines these from real runs")
    return fitted, how, {"trainer_runs": len(runs), "trainer_params": fitted, "trainer_mape_before": rep.mape_before,
                         "trainer_mape_after": rep.mape_after, "trainer_mape_loo": rep.mape_loo}


def build(results: ResultsDir, name: str, table_name: str) -> Built:
    """The profile from a complete run's results; every file or fit that cannot make one is a
    CalibrationError (one sentence), never a traceback."""
    try:
        return _build(results, name, table_name)
    except ResultsError as e:
        raise CalibrationError(str(e)) from None
    except (ValueError, ZeroDivisionError, KeyError, TypeError) as e:  # numbers no fit can take
        raise CalibrationError(f"the measurements in {results.path} cannot be fitted ({type(e).__name__}: {e})") from None


def _build(results: ResultsDir, name: str, table_name: str) -> Built:
    try:
        meta = results.meta()
    except FileNotFoundError:
        raise CalibrationError(f"{results.path} holds no readable meta.json (not a calibration results folder)") from None
    except ResultsError as e:
        if "cannot read" in str(e):
            raise CalibrationError(f"{results.path} holds no readable meta.json (not a calibration results folder)") from None
        raise
    if meta.get("status") != "complete":
        raise CalibrationError(f"the calibration run in {results.path} did not finish")
    tag = run_tag(meta)
    progress.step("GEMM, memory and attention")
    gemm, peak, table, s1 = gemm_part(results.rows("gemm"), part_tag(meta, "gemm"), table_name,
                                      peak_from_ceiling=not meta.get("cuda"))
    mem, overhead, s2 = memory_part(results.rows("memory"), meta, part_tag(meta, "memory"))
    attn_rows = results.rows("attention")
    att, s3 = attention_part(attn_rows, part_tag(meta, "attention"), f"{name}_attention.csv")
    if att["tflops"]["value"] > peak["value"]:
        # the peak is a measured rate too: a loaded machine or a small GEMM sweep can time attention faster than
        # the GEMM ceiling, and no kernel runs faster than the peak (the profile reader holds every rate to it)
        peak = {"value": att["tflops"]["value"], "source": peak["source"] + "; raised to the attention rate "
                f"measured in the same run ({att['tflops']['value']:g} TFLOP/s), which is above that ceiling"}
    progress.step("collectives: latency and bandwidth per group shape")
    net, fit_rows, s4, coll_rows = network_part(results.rows("collectives"), meta, part_tag(meta, "collectives"),
                                                f"{name}_collectives.csv")
    nodes = meta.get("nodes", 1)
    profile = {
        "schema": SCHEMA,
        "name": name,
        "description": (f"{meta['device']}: {meta['ranks_per_node']} ranks per node"
                        + (f" x {nodes} nodes" if nodes > 1 else "")
                        + (f", {meta['threads_per_rank']} thread(s) each on {meta['cpu_count']} cores"
                           if not meta.get("cuda") else "")
                        + f", {meta['dtype']}; measured by axoplan calibrate {meta['date']}"),
        "device": _device_section(meta, tag),
        "kind": "gpu" if meta.get("cuda") else "cpu",
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
    shared = _shared_cores(meta, tag)
    if shared:
        profile["compute"]["shared_cores"] = shared
    summary = {**s1, **s2, **s3, **s4, "elapsed_s": meta.get("elapsed_s"), "peak_tflops": peak["value"]}
    built = Built(profile, table, fit_rows, summary, coll_rows, attn_rows)
    # a call timed at the floor means its burst reference was an outlier (a burst slowed by something
    # else): that row says nothing about overlap
    ov_rows = [r for r in results.rows("overlap") if r["collective_s"] > 1e-6]
    if ov_rows:
        eff = statistics.median(r["efficiency"] for r in ov_rows)
        kinds = sorted({r["collective"] for r in ov_rows})
        net["overlap_efficiency"] = {"value": _r(eff, 3), "source": (
            f"{part_tag(meta, 'overlap')}; median over {len(ov_rows)} measurements ({', '.join(kinds)}, every group shape, "
            f"{', '.join(_human(b) for b in sorted({r['bytes'] for r in ov_rows}))}) of (burst + collective - "
            f"together) / min(burst, collective): a collective started asynchronously, a compute burst of "
            f"{statistics.median(r['burst_s'] for r in ov_rows) * 1e3:.2g} ms run beside it, all ranks at once "
            f"(ranks share cores: the collective's copies and reductions need the same cores)")}
        summary["overlap_efficiency"] = eff
    fw_rows = results.rows("framework")
    if fw_rows:
        bare = {"us": overhead["value"], "ops": overhead["source"].split("(")[-1].split(")")[0]}
        progress.step("the trainer's kernel overhead")
        oh, eff, how, s5 = framework_part(fw_rows, profile, built.files(), part_tag(meta, "framework"), bare)
        profile["compute"]["kernel_overhead_us"] = oh
        mem = profile["memory"]
        mem["source"] += (f"; elementwise_efficiency {eff:g} replaces the isolated ops' {mem['elementwise_efficiency']:g}: "
                          f"fitted to the trainer's own element-wise work (see compute.kernel_overhead_us)")
        mem["elementwise_efficiency"] = eff
        summary.update(s5)
    tr_rows = results.rows("trainer")
    if tr_rows:
        progress.step("the trainer's corrections")
        fitted, how, s6 = trainer_part(tr_rows, profile, built.files(), part_tag(meta, "trainer"), meta["world"])
        profile["corrections"] = {**profile["corrections"], **fitted, "source": how}
        summary.update(s6)
    parts = meta.get("part_dates")
    if parts and len(set(parts.values())) > 1:
        profile["calibration"]["parts"] = dict(sorted(parts.items()))
        keys = ("date", "parts", "command", "loadavg_start", "loadavg_end", "elapsed_s")
        profile["calibration"]["added"] = [{k: a[k] for k in keys if k in a} for a in added_runs(meta)]
    return built


def table_csv(rows: list[dict]) -> str:
    lines = ["m,n,k,layout,seconds,tflops"]
    lines += [f"{r['m']},{r['n']},{r['k']},{r['layout']},{r['seconds']:.6g},{r['tflops']:.6g}" for r in rows]
    return "\n".join(lines) + "\n"


def collectives_csv(rows: list[dict]) -> str:
    lines = ["collective,size,stride,bytes,seconds,burst_s"]
    lines += [f"{r['collective']},{r['size']},{r['stride']},{r['bytes']},{r['seconds']:.6g},{r['burst_s']:.6g}"
              for r in rows]
    return "\n".join(lines) + "\n"


def attention_csv(rows: list[dict]) -> str:
    cols = ["batch", "heads", "seq", "head_dim", "causal", "pass", "seconds"]
    lines = [",".join(cols)]
    lines += [",".join(str(r[c]).lower() if isinstance(r[c], bool) else f"{r[c]:.6g}" if isinstance(r[c], float)
                       else str(r[c]) for c in cols) for r in rows]
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
    built = build(results, name, f"{name}_gemm.csv")
    atomic_write_text(results.path / "fits.csv", fits_csv(built.fits))
    for fname, text in built.files().items():
        atomic_write_text(out if fname == f"{name}.yaml" else out.parent / fname, text)
    return built
