"""Reading a machine profile: the YAML's schema (every key, every number sourced and bounded), its launch
settings, the measured tables beside it, and finding a profile by name (bundled, ./machine_profiles,
AXOPLAN_PROFILES). profile_from_dict and load_profile build a MachineProfile."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.planner import gpu_physics
from axoplan.planner.machine import GB, GIB, TFLOP, US, Corrections, MachineProfile
from axoplan.planner.profile_tables import (COLLECTIVES, _load_attention_table, _load_collective_table,
                                         _load_gemm_table)
from axoplan.yamlio import load_yaml

SCHEMA = "axoplan-profile/1"

# ---- the keys a profile may hold, at every level (checked by _check_keys before anything is parsed) ----
# A new field is declared in the section's table below (one place): a misspelled key anywhere, like
# memory.headroom_gb or groups[0].strde, is refused in one sentence instead of silently taking a default.
# NUM: a number, or {value: number, source: text}; TEXT, FLAG: a scalar; FREE: not checked here (provenance
# written by calibrate; launch.env, whose names _check_launch checks); a list holds one spec for each item.
NUM, TEXT, FLAG, FREE = "number", "text", "flag", "free"
TABLE_KEYS = {"path": TEXT, "source": TEXT}  # {path: FILE.csv, source: ...} beside a section
MEMORY_KEYS = {"source": TEXT, "capacity_gib": NUM, "headroom_gib": NUM, "bandwidth_gbs": NUM,
               "elementwise_efficiency": NUM}
GEMM_KEYS = {"source": TEXT, "ceiling_tflops": NUM, "sustained_fraction": NUM, "dim_half": NUM, "unaligned_tflops": NUM, "table": TABLE_KEYS,
             "waves": {"sms": FREE, "tiles": FREE, "source": TEXT}}
ATTENTION_KEYS = {"source": TEXT, "tflops": NUM, "causal_skip": FLAG, "backward_factor": NUM, "table": TABLE_KEYS,
                  "throughput": [{"seq": NUM, "head_dim": NUM, "fwd_tflops": NUM, "bwd_tflops": NUM, "source": TEXT}]}
COMPUTE_KEYS = {"source": TEXT, "peak_tflops": NUM, "kernel_overhead_us": NUM, "shared_cores": NUM, "gemm": GEMM_KEYS,
                "attention": ATTENTION_KEYS,
                "elementwise_kernels": FREE}  # refused by _no_framework_fields, with the reason
INTRA_NODE_KEYS = {"source": TEXT, "latency_us": NUM, "table": TABLE_KEYS,
                   "groups": [{"size": NUM, "stride": NUM, "busbw_gbs": NUM, "source": TEXT}],
                   "nvls_all_reduce": [{"size": NUM, "busbw_gbs": NUM, "source": TEXT}]}
INTER_NODE_KEYS = {"source": TEXT, "busbw_gbs": NUM, "latency_us": NUM, "ring_busbw_gbs": NUM}
COLLECTIVE_SCALE_KEYS = {"bandwidth_scale": NUM, "latency_scale": NUM, "source": TEXT}
COLLECTIVES_KEYS = {"source": TEXT, "all_gather": COLLECTIVE_SCALE_KEYS, "reduce_scatter": COLLECTIVE_SCALE_KEYS,
                    "all_reduce": COLLECTIVE_SCALE_KEYS}
# NCCL's protocol model across nodes: its keys are gpu_physics's (PROTOCOL_KEYS, a row's PROTOCOL_ROW_KEYS),
# the values checked where gpu_physics parses them
_ROW = [{k: FREE for k in gpu_physics.PROTOCOL_ROW_KEYS}]
PROTOCOLS_KEYS = {**{k: FREE for k in gpu_physics.PROTOCOL_KEYS}, "ring": _ROW, "tree": _ROW, "nvls_tree": _ROW}
NETWORK_KEYS = {"source": TEXT, "latency_model": TEXT, "base_latency_us": NUM, "overlap_compute_slowdown": NUM,
                "overlap_efficiency": NUM, "intra_node": INTRA_NODE_KEYS, "inter_node": INTER_NODE_KEYS,
                "collectives": COLLECTIVES_KEYS, "protocols": PROTOCOLS_KEYS,
                "stalls": [{k: FREE for k in gpu_physics.STALL_KEYS}]}
CORRECTIONS_KEYS = {"source": TEXT, **{name: NUM for name in (
    "gemm_scale", "elementwise_scale", "intra_bw_scale", "inter_bw_scale", "latency_scale", "step_overhead_s",
    "kernel_overhead_scale", "collective_overhead_s", "overlap_efficiency")}}  # = Corrections' fields (checked below)
LAUNCH_KEYS = {"env": FREE, "slurm": FREE, "source": TEXT}  # launch.slurm checked by _check_launch_slurm
# the device it was measured on: a name, or {name, count, source} as calibrate writes (checked in _device)
DEVICE_KEYS = {"name": FREE, "count": FREE, "source": FREE}
PROFILE_KEYS = {"schema": TEXT, "name": TEXT, "description": TEXT, "device": DEVICE_KEYS, "kind": TEXT, "dtype": TEXT,
                "source": TEXT, "gpus_per_node": NUM, "memory": MEMORY_KEYS, "compute": COMPUTE_KEYS,
                "network": NETWORK_KEYS, "corrections": CORRECTIONS_KEYS, "calibration": FREE, "launch": LAUNCH_KEYS}
TOP_LEVEL_KEYS = set(PROFILE_KEYS)


def _check_keys(node: Any, spec: Any, path: str, rd) -> None:
    """Refuse any key the schema (PROFILE_KEYS) does not declare at its level, naming the nearest known."""
    if spec == FREE or not isinstance(node, (dict, list)):
        return  # a scalar's type and range are checked where it is parsed
    if isinstance(spec, list):
        if isinstance(node, list):
            for i, item in enumerate(node):
                _check_keys(item, spec[0], f"{path}[{i}]", rd)
        return
    if spec in (NUM, TEXT, FLAG):
        spec = {"value": FREE, "source": TEXT}  # {value: ..., source: ...}
    if not isinstance(node, dict):
        return
    for k, v in node.items():
        p = f"{path}.{k}" if path else str(k)
        if k not in spec:
            import difflib

            near = difflib.get_close_matches(str(k), [str(x) for x in spec], n=1)
            hint = f"; did you mean '{near[0]}'?" if near else f" (known here: {', '.join(sorted(spec))})"
            rd.fail(p, f"is not a profile field{hint}")
        _check_keys(v, spec[k], p, rd)


DIM_HALF_RULE = "memory-traffic"


def _dim_half(gemm: dict, rd) -> float | None:
    """compute.gemm.dim_half: a number (measured or fitted), or 'memory-traffic' for the rule of
    MachineProfile.gemm_half."""
    v = gemm.get("dim_half")
    if isinstance(v, dict):
        v = v.get("value")
    if isinstance(v, str):
        if v != DIM_HALF_RULE:
            rd.fail("compute.gemm.dim_half", f"must be a number or {DIM_HALF_RULE!r}, got {inputs.show(v)}")
        return None
    return rd.num(gemm, "dim_half", "compute.gemm", default=0.0, allow_zero=True)


def _waves(gemm: dict, rd) -> tuple | None:
    """compute.gemm.waves: {sms: N, tiles: [[rows, cols], ...], source: ...} -> (N, ((rows, cols), ...)), or None."""
    w = gemm.get("waves")
    if w is None:
        return None
    where = "compute.gemm.waves"
    if not isinstance(w, dict) or "source" not in w:
        rd.fail(where, "must be a mapping {sms: N, tiles: [[rows, cols], ...], source: ...}")
    sms = w.get("sms")
    if isinstance(sms, bool) or not isinstance(sms, int) or not 1 <= sms <= 100_000:
        rd.fail(f"{where}.sms", f"must be the device's count of streaming multiprocessors, got {inputs.show(sms)}")
    tiles = w.get("tiles")
    ok = isinstance(tiles, list) and tiles and all(
        isinstance(t, list) and len(t) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 4096
                                                    for x in t) for t in tiles)
    if not ok:
        rd.fail(f"{where}.tiles", f"must be a list of [rows, cols] output tiles (integers 1-4096), got {inputs.show(tiles)}")
    return sms, tuple((int(a), int(b)) for a, b in tiles)


def _kind(d, rd) -> str:
    if "kind" not in d:
        rd.fail("kind", "is missing: say which device the profile describes, `kind: gpu` or `kind: cpu`")
    if d["kind"] not in KINDS:
        rd.fail("kind", f"must be one of {', '.join(KINDS)}, got {d['kind']!r}")
    return d["kind"]


KINDS = ("gpu", "cpu")


def _no_framework_fields(comp, rd) -> None:
    """Which kernels a framework runs is its execution's (planner/execution.py), not the machine's."""
    if isinstance(comp, dict) and "elementwise_kernels" in comp:
        rd.fail("compute.elementwise_kernels", "is the framework's, not the machine's: give it in an execution "
                                               "(--execution, a preset or a YAML file with elementwise_kernels)")


# ---- loading ---------------------------------------------------------------------------
def _device(dev, rd) -> tuple[str, int | None]:
    """`device: NAME` or `device: {name, count, source}` (what calibrate writes): the device it was measured on."""
    if isinstance(dev, str):
        return dev, None
    if not isinstance(dev, dict) or not isinstance(dev.get("name"), str) or not dev["name"]:
        rd.fail("device", f"must be text or a mapping with a name (and count, source), got {inputs.show(dev)}")
    unknown = set(dev) - {"name", "count", "source"}
    if unknown:
        rd.fail("device", f"has unknown key(s) {', '.join(sorted(map(str, unknown)))}: name, count, source")
    count = dev.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        rd.fail("device.count", f"must be a positive whole number, got {inputs.show(count)}")
    if count is not None and not isinstance(dev.get("source"), str):
        rd.fail("device.count", "has no source: give the device section a source")
    return dev["name"], count


def _bundled_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("AXOPLAN_PROFILES")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(Path.cwd() / "machine_profiles")
    dirs.append(Path(__file__).resolve().parents[2] / "machine_profiles")
    dirs.append(Path(sys.prefix) / "share" / "axoplan" / "machine_profiles")
    seen, out = set(), []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def profile_paths() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in _bundled_dirs():
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def profile_names() -> list[str]:
    return sorted(profile_paths())


_BUNDLED = Path(__file__).resolve().parents[2] / "machine_profiles"
_noted: set = set()


def _note_local(name: str, path: Path) -> None:
    """A name that resolves to a file outside the bundled profiles (./machine_profiles or
    AXOPLAN_PROFILES) shadows the bundled one silently otherwise: say which file is used, once."""
    real = path.resolve()
    if real.parent == _BUNDLED or real in _noted:
        return
    _noted.add(real)
    shadow = " instead of the bundled one" if (_BUNDLED / path.name).is_file() else ""
    print(f"note: machine '{name}' is the local file {path}{shadow}", file=sys.stderr)


# What a profile's launch.env may set: the communication libraries' and threading settings a network
# needs, nothing that chooses which code runs (PATH, LD_PRELOAD, PYTHONPATH, BASH_ENV, ...). Within these
# families a name that loads code or searches for it (NCCL_NET_PLUGIN, FI_PROVIDER_PATH) is refused too.
LAUNCH_ENV_PREFIXES = ("NCCL_", "RCCL_", "TORCH_NCCL_", "GLOO_", "FI_", "UCX_", "MPICH_", "CXI_", "HSA_",
                       "MIOPEN_", "TORCH_DISTRIBUTED_")
LAUNCH_ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS",
                    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_LAUNCH_ENV_CODE = ("PLUGIN", "PATH", "LIB", "PRELOAD")


def launch_env_refusal(name: str) -> str | None:
    """Why a profile may not set the environment variable `name`, or None if it may."""
    if name in LAUNCH_ENV_NAMES:
        return None
    if not name.startswith(LAUNCH_ENV_PREFIXES):
        return (f"is not a communication or threading setting a profile may set (allowed: names starting "
                f"{', '.join(LAUNCH_ENV_PREFIXES)} or one of {', '.join(LAUNCH_ENV_NAMES)})")
    if any(w in name for w in _LAUNCH_ENV_CODE):
        return "names a plugin, library or search path, which would choose the code a run loads"
    return None


def _check_launch(section, rd: _Reader, where: str) -> None:
    """`launch: {env: {NAME: value}, source: ...}` reaches the emitted scripts: names must be shell
    names a profile may set (launch_env_refusal) and every text printable (a newline in `source`
    would end a script comment)."""
    if section is None:
        return
    if not isinstance(section, dict):
        rd.fail("launch", "must be a mapping {env: {NAME: value, ...}, source: ...}")
    if "source" in section:
        inputs.text(section["source"] if isinstance(section["source"], str) else str(section["source"]),
                    f"{where}: field 'launch.source'", allow_empty=True)
    _check_launch_slurm(section.get("slurm"), rd)
    env = section.get("env")
    if env is None:
        return
    if not isinstance(env, dict):
        rd.fail("launch.env", "must be a mapping of NAME: value")
    from axoplan.shell import env_name

    for k, v in env.items():
        env_name(k)
        why = launch_env_refusal(k)
        if why:
            rd.fail(f"launch.env.{k}", why)
        if isinstance(v, (dict, list)):
            rd.fail(f"launch.env.{k}", "must be a single value")
        inputs.text("" if v is None else str(v), f"{where}: field 'launch.env.{k}'", allow_empty=True)


# the range of every nonzero number in a profile, in its own units (GB/s, TFLOP/s, GiB, us, ratios): far beyond
# any machine (a test's "free" resource is 1e12: communication-only models), and low enough that every product
# the model forms stays finite
MIN_NUMBER, MAX_NUMBER = 1e-9, 1e15


def _check_launch_slurm(sl, rd: _Reader) -> None:
    """`launch.slurm: {account, partition, qos, constraint, cpus_per_task, gpu_bind}` become #SBATCH directives
    and srun options, which no shell quotes: plain words only."""
    if sl is None:
        return
    from axoplan.slurm import SITE_KEYS, directive_safe

    known = SITE_KEYS + ("cpus_per_task", "gpu_bind")
    if not isinstance(sl, dict):
        rd.fail("launch.slurm", f"must be a mapping of {', '.join(known)}")
    for k, v in sl.items():
        if k not in known:
            rd.fail(f"launch.slurm.{k}", f"is not a Slurm option axoplan writes (known: {', '.join(known)})")
        if k == "cpus_per_task":
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 4096:
                rd.fail("launch.slurm.cpus_per_task", f"must be a whole number of CPUs from 1 to 4096, got {v!r}")
        elif not isinstance(v, str) or not directive_safe(v.replace(",", "").replace(":", "").replace("&", "")
                                                          .replace("|", "")):
            rd.fail(f"launch.slurm.{k}", f"must be a plain word (letters, digits, . _ - / , : & |), got {v!r}")


class _Reader:
    """Reads numbers with their sources, naming the file and field in every error."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, path: str, msg: str):
        raise UserError(f"{self.where}: field '{path}' {msg}")

    def section(self, d: dict, key: str, path: str = "", required: bool = True) -> dict:
        full = f"{path}.{key}" if path else key
        v = d.get(key)
        if v is None:
            if required:
                self.fail(full, "is missing")
            return {}
        if not isinstance(v, dict):
            self.fail(full, "must be a mapping")
        return v

    def num(self, d: dict, key: str, path: str = "", default: float | None = None, positive: bool = True,
            allow_zero: bool = False) -> float:
        full = f"{path}.{key}" if path else key
        if key not in d or d[key] is None:
            if default is not None:
                return default
            self.fail(full, "is missing")
        v = d[key]
        if isinstance(v, dict):
            if "value" not in v:
                self.fail(full, "must be a number or {value: ..., source: ...}")
            v = v["value"]  # sources were checked for the whole file by _check_all_numbers_sourced
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(full, f"must be a number, got {inputs.show(v)}")
        try:
            v = float(v)
        except OverflowError:  # an integer beyond float range
            self.fail(full, f"must be a finite number, got {inputs.show(v)}")
        if not np.isfinite(v) or v < 0 or (positive and not allow_zero and v == 0):
            self.fail(full, f"must be {'non-negative' if allow_zero else 'positive'}, got {v!r}")
        if v > MAX_NUMBER or (positive and not allow_zero and v < MIN_NUMBER):
            # 1e-300 GB/s (a divisor) or a dim_half of 1e308 makes every time inf or nan downstream, and
            # 1e300 TFLOP/s overflows on conversion: no machine quantity in the profile's units lies out here
            # (a quantity that may be zero, an overhead or latency, is only added: tiny is harmless)
            self.fail(full, f"must be {'between ' + format(MIN_NUMBER, 'g') + ' and' if not allow_zero else 'at most'} "
                            f"{MAX_NUMBER:g} in its units, got {v:g}")
        return v


def _has_source(d: dict) -> bool:
    s = d.get("source")
    return isinstance(s, str) and s.strip() != ""


def _check_all_numbers_sourced(node: Any, path: str, rd: _Reader, inherited: bool = False):
    """No number anywhere (outside `calibration`) may lack a source: a bare number is covered by the
    `source` of the mapping it sits in or of an enclosing section ({value: X, source: ...} is the
    one-number case). The file's top-level `source`, if any, covers nothing: too coarse to be useful."""
    if isinstance(node, dict):
        sourced = inherited or (bool(path) and _has_source(node))
        for k, v in node.items():
            if k in ("calibration", "schema"):
                continue
            p = f"{path}.{k}" if path else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not sourced:
                    rd.fail(p, "has no source (every number in a profile needs one)")
            else:
                _check_all_numbers_sourced(v, p, rd, sourced)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            p = f"{path}[{i}]"
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not inherited:
                rd.fail(p, "has no source (every number in a profile needs one)")
            _check_all_numbers_sourced(v, p, rd, inherited)


def _overlap_efficiency(net: dict, rd: _Reader) -> float:
    v = rd.num(net, "overlap_efficiency", "network", default=1.0, allow_zero=True)
    if v > 1:
        rd.fail("network.overlap_efficiency", f"must be between 0 and 1, got {v:g}")
    return v


def _table_path(d: dict, key: str, base_dir: Path | None, rd: _Reader) -> Path | None:
    tab = d.get("table")
    if not tab:
        return None
    if not isinstance(tab, dict) or not isinstance(tab.get("path"), str):
        rd.fail(key, "must be {path: FILE.csv, source: ...}")
    if not _has_source(tab):
        rd.fail(key, "has no source (name the calibration run)")
    p = Path(tab["path"])
    return p if p.is_absolute() else (base_dir or Path.cwd()) / p


def _mapping_rows(rd, rows, where: str, fields: str, required: bool = True):
    """(path, mapping) of each row of a profile's list of mappings `rows` at `where`; one sentence where it is not
    a list of mappings (required: nor empty)."""
    if rows is None and not required:
        return
    if not isinstance(rows, list) or (required and not rows):
        rd.fail(where, f"must be a {'non-empty ' if required else ''}list of {fields}")
    for i, g in enumerate(rows):
        if not isinstance(g, dict):
            rd.fail(f"{where}[{i}]", f"must be a mapping {fields}")
        yield f"{where}[{i}]", g


def profile_from_dict(d: Any, where: str, base_dir: Path | None = None) -> MachineProfile:
    rd = _Reader(where)
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a mapping at the top level")
    schema = d.get("schema", SCHEMA)
    if schema != SCHEMA:
        rd.fail("schema", f"must be '{SCHEMA}', got {inputs.show(schema)}")
    for key in ("name",):
        if not isinstance(d.get(key), str) or not d.get(key):
            rd.fail(key, "must be a non-empty string")
    for key in ("name", "description"):
        if key in d and not isinstance(d[key], str):
            rd.fail(key, f"must be text, got {inputs.show(d[key])}")
    device_name, device_count = _device(d.get("device", ""), rd)
    # the name reaches launch scripts and one-line records; a description may span lines
    inputs.text(d["name"], f"{where}: field 'name'")
    _check_launch(d.get("launch"), rd, where)
    dtype = d.get("dtype", "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        rd.fail("dtype", f"must be bf16, fp16 or fp32, got {inputs.show(dtype)}")
    unknown = sorted(str(k) for k in set(d) - TOP_LEVEL_KEYS)
    if unknown:
        rd.fail(unknown[0], f"is not a profile field (known: {', '.join(sorted(TOP_LEVEL_KEYS))})")
    _no_framework_fields(d.get("compute"), rd)
    _check_keys(d, PROFILE_KEYS, "", rd)
    _check_all_numbers_sourced(d, "", rd)

    gpn = rd.num(d, "gpus_per_node")
    if gpn != int(gpn):
        rd.fail("gpus_per_node", "must be an integer")
    if gpn > inputs.MAX_GPUS_PER_NODE:
        rd.fail("gpus_per_node", f"must be at most {inputs.MAX_GPUS_PER_NODE}, got {gpn:g}")
    mem = rd.section(d, "memory")
    comp = rd.section(d, "compute")
    _no_framework_fields(comp, rd)
    gemm = rd.section(comp, "gemm", "compute")
    attn = rd.section(comp, "attention", "compute")
    net = rd.section(d, "network")
    intra = rd.section(net, "intra_node", "network")
    inter = rd.section(net, "inter_node", "network")
    colls = rd.section(net, "collectives", "network", required=False)
    corr = rd.section(d, "corrections", required=False)
    known_corr = {f.name for f in dataclasses.fields(Corrections)} | {"source"}
    bad_corr = sorted(str(k) for k in set(corr) - known_corr)
    if bad_corr:
        rd.fail(f"corrections.{bad_corr[0]}", f"is not a correction (known: {', '.join(sorted(known_corr - {'source'}))})")

    parsed_groups = []
    for p, g in _mapping_rows(rd, intra.get("groups"), "network.intra_node.groups", "{size, stride, busbw_gbs, source}"):
        size, stride = rd.num(g, "size", p), rd.num(g, "stride", p, default=1.0)
        if size != int(size) or stride != int(stride) or size < 2:
            rd.fail(p, "size and stride must be integers, size >= 2")
        if size * stride > gpn:
            rd.fail(p, f"spans {size:g} x {stride:g} GPUs, more than gpus_per_node ({gpn:g})")
        parsed_groups.append((int(size), int(stride), rd.num(g, "busbw_gbs", p) * GB))
    parsed_nvls = []
    for p, g in _mapping_rows(rd, intra.get("nvls_all_reduce"), "network.intra_node.nvls_all_reduce",
                              "{size, busbw_gbs, source}", required=False):
        size = rd.num(g, "size", p)
        if size != int(size) or size < 2 or size > gpn:
            rd.fail(p, f"size must be an integer from 2 to gpus_per_node ({gpn:g})")
        if int(size) in dict(parsed_nvls):
            rd.fail(p, f"repeats size {size:g}")
        parsed_nvls.append((int(size), rd.num(g, "busbw_gbs", p) * GB))

    bw_scale, lat_scale = {}, {}
    for c in COLLECTIVES:
        cd = colls.get(c) or {}
        if cd and not isinstance(cd, dict):
            rd.fail(f"network.collectives.{c}", "must be a mapping {bandwidth_scale, latency_scale}")
        bw_scale[c] = rd.num(cd, "bandwidth_scale", f"network.collectives.{c}", default=1.0)
        lat_scale[c] = rd.num(cd, "latency_scale", f"network.collectives.{c}", default=1.0, allow_zero=True)

    # scales must stay positive (a zero bandwidth or throughput scale means infinite time); only the
    # latency scale and the fixed per-step overhead may be zero
    corrections = Corrections(**{
        f.name: rd.num(corr, f.name, "corrections", default=f.default,
                       allow_zero=f.name in ("latency_scale", "step_overhead_s", "kernel_overhead_scale",
                                              "collective_overhead_s"))
        for f in dataclasses.fields(Corrections) if f.name != "overlap_efficiency"
    }) if corr else Corrections()
    if corr.get("overlap_efficiency") is not None:
        eta = rd.num(corr, "overlap_efficiency", "corrections", allow_zero=True)
        if eta > 1:
            rd.fail("corrections.overlap_efficiency", f"must be between 0 and 1, got {eta:g}")
        corrections = dataclasses.replace(corrections, overlap_efficiency=eta)

    table = None
    tab = gemm.get("table")
    if tab:
        if not isinstance(tab, dict) or not isinstance(tab.get("path"), str):
            rd.fail("compute.gemm.table", "must be {path: FILE.csv, source: ...}")
        if not _has_source(tab):
            rd.fail("compute.gemm.table", "has no source (name the calibration run)")
        tp = Path(tab["path"])
        if not tp.is_absolute():
            tp = (base_dir or Path.cwd()) / tp
        table = _load_gemm_table(tp, rd)

    cp = _table_path(intra, "network.intra_node.table", base_dir, rd)
    coll_table = _load_collective_table(cp, rd, int(gpn)) if cp else None
    ap = _table_path(attn, "compute.attention.table", base_dir, rd)
    attn_table = _load_attention_table(ap, rd) if ap else None

    causal = attn.get("causal_skip", True)
    if not isinstance(causal, bool):
        rd.fail("compute.attention.causal_skip", "must be true or false")

    peak = rd.num(comp, "peak_tflops", "compute")
    sustained = rd.num(gemm, "sustained_fraction", "compute.gemm", default=1.0)
    if sustained > 1.0:
        rd.fail("compute.gemm.sustained_fraction", f"must be at most 1 (a share of ceiling_tflops), got {sustained:g}")
    unaligned = rd.num(gemm, "unaligned_tflops", "compute.gemm") if gemm.get("unaligned_tflops") is not None else None
    ceiling = rd.num(gemm, "ceiling_tflops", "compute.gemm")
    for sec, key, val in (("compute.gemm", "ceiling_tflops", ceiling),
                          ("compute.gemm", "unaligned_tflops", unaligned or 0.0),
                          ("compute.attention", "tflops", rd.num(attn, "tflops", "compute.attention"))):
        if val > peak * (1 + 1e-9):
            # a measured ceiling above the peak is a unit or copy mistake; it would show > 100 % of peak
            rd.fail(f"{sec}.{key}", f"({val:g} TFLOP/s) is above compute.peak_tflops ({peak:g}); "
                                    f"no kernel runs faster than the peak")

    capacity = rd.num(mem, "capacity_gib", "memory")
    headroom = rd.num(mem, "headroom_gib", "memory", default=0.0, allow_zero=True)
    if headroom >= capacity:
        rd.fail("memory.headroom_gib", f"({headroom:g}) must be smaller than memory.capacity_gib ({capacity:g})")

    return MachineProfile(
        name=d["name"],
        description=str(d.get("description", "")),
        device=device_name,
        device_count=device_count,
        kind=_kind(d, rd),
        dtype=dtype,
        gpus_per_node=int(gpn),
        mem_capacity=capacity * GIB,
        mem_headroom=headroom * GIB,
        mem_bandwidth=rd.num(mem, "bandwidth_gbs", "memory") * GB,
        elementwise_efficiency=rd.num(mem, "elementwise_efficiency", "memory", default=1.0),
        peak_flops=peak * TFLOP,
        kernel_overhead=rd.num(comp, "kernel_overhead_us", "compute", default=0.0, allow_zero=True) * US,
        shared_cores=_shared_cores(comp, rd, _kind(d, rd)),
        gemm_ceiling=ceiling * sustained * TFLOP,
        gemm_sustained=sustained,
        gemm_dim_half=_dim_half(gemm, rd),
        gemm_waves=_waves(gemm, rd),
        gemm_unaligned=unaligned * TFLOP if unaligned is not None else None,
        attn_flops=rd.num(attn, "tflops", "compute.attention") * TFLOP,
        attn_causal_skip=causal,
        attn_bwd_factor=rd.num(attn, "backward_factor", "compute.attention", default=2.5),
        intra_latency=rd.num(intra, "latency_us", "network.intra_node", allow_zero=True) * US,
        intra_groups=tuple(parsed_groups),
        inter_busbw=rd.num(inter, "busbw_gbs", "network.inter_node") * GB,
        inter_latency=rd.num(inter, "latency_us", "network.inter_node", allow_zero=True) * US,
        inter_ring_busbw=rd.num(inter, "ring_busbw_gbs", "network.inter_node", default=float("inf")) * GB,
        intra_nvls=tuple(sorted(parsed_nvls)),
        coll_bw_scale=bw_scale,
        coll_lat_scale=lat_scale,
        corrections=corrections,
        gemm_table=table,
        coll_table=coll_table,
        attn_table=attn_table,
        overlap_efficiency=_overlap_efficiency(net, rd),
        physics=gpu_physics.parse(d, rd),
        path=None,
        raw=d,
    )


def _shared_cores(comp: dict, rd, kind: str) -> int | None:
    """compute.shared_cores: only a cpu profile's ranks share cores (a GPU is its own rank's)."""
    if "shared_cores" not in comp:
        return None
    if kind != "cpu":
        rd.fail("compute.shared_cores", "is a cpu profile's field (ranks sharing cores); this profile's kind is "
                f"{kind}")
    v = rd.num(comp, "shared_cores", "compute")
    if v != int(v):
        rd.fail("compute.shared_cores", f"must be a whole number of cores, got {v:g}")
    return int(v)


def load_profile(name_or_path: str | MachineProfile) -> MachineProfile:
    """A bundled profile name (see `axoplan profiles`) or a path to a profile YAML."""
    if isinstance(name_or_path, MachineProfile):
        return name_or_path
    s = inputs.text(str(name_or_path), "--machine")
    p = Path(s)
    if not (s.endswith((".yaml", ".yml")) or p.exists()):
        paths = profile_paths()
        if s not in paths:
            raise UserError(f"unknown machine '{s}'; known profiles: {', '.join(sorted(paths)) or 'none'} "
                            f"(or give a YAML path)")
        p = paths[s]
        _note_local(s, p)
    where = f"machine profile '{p}'"
    if not p.is_file():
        raise UserError(f"machine profile '{s}' {'is not a file' if p.exists() else 'does not exist'}")
    d = load_yaml(p, where)
    prof = profile_from_dict(d, where, base_dir=p.parent)
    return dataclasses.replace(prof, path=str(p))
