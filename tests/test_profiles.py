"""The bundled machine profiles: they load, every number has a source, and Perlmutter/Frontier carry
the AxoNN authors' measured bandwidth table faithfully through axoplan.planner.machine's group lookup."""
from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import yaml

from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile, profile_from_dict, profile_names

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ("perlmutter", "frontier", "alps", "dgx-h100", "dgx-h200", "dgx-a100")
GB = 1e9

# The AxoNN authors' bandwidth table (its source in the file's first lines), copied from the project's
# shared reference data: machine, inner_group_product_ip, group_size, bandwidth (GB/s)
TABLE_CSV = ROOT / "tests" / "data" / "axonn_perf_model_bandwidth_table.csv"


def _table_rows() -> list[tuple[str, str, str, float]]:
    with open(TABLE_CSV) as f:
        rows = list(csv.reader(line for line in f if not line.startswith("#")))
    assert rows[0][:4] == ["machine", "inner_group_product_ip", "group_size", "bandwidth"]
    return [(r[0], r[1], r[2], float(r[3])) for r in rows[1:] if r]


TABLE_ROWS = _table_rows()


def _bundled_path(name: str) -> Path:
    return ROOT / "machine_profiles" / f"{name}.yaml"


def _raw(name: str) -> dict:
    return yaml.safe_load(_bundled_path(name).read_text())


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_profile_loads_and_is_sane(name):
    p = load_profile(name)
    assert name in profile_names()
    assert p.name == name
    assert p.gpus_per_node in (4, 8)
    assert 16 * 2**30 <= p.mem_capacity <= 192 * 2**30
    assert 0 < p.mem_headroom < 0.2 * p.mem_capacity
    assert 0 < p.elementwise_efficiency <= 1
    # the measured GEMM ceiling and fused attention sit below the spec peak
    assert 0 < p.gemm_ceiling <= p.peak_flops
    assert 0 < p.attn_flops <= p.peak_flops
    assert p.attn_bwd_factor == 2.5 and p.attn_causal_skip
    assert p.gemm_half > 0
    for size, stride, bw in p.intra_groups:
        assert size * stride <= p.gpus_per_node and p.gpus_per_node % (size * stride) == 0
        assert 10 * GB <= bw <= 1000 * GB
    assert 1 * GB <= p.inter_busbw <= 1000 * GB
    assert 0 < p.intra_latency < 1e-4 and 0 < p.inter_latency < 1e-4


@pytest.mark.parametrize("name", BUNDLED)
def test_every_number_in_the_file_has_a_source(name):
    """Walk the YAML independently of the loader: each number sits in {value, source} or in a mapping
    (or a mapping enclosing it) that has a non-empty source."""
    def walk(node, sourced, path):
        if isinstance(node, dict):
            here = sourced or (bool(path) and isinstance(node.get("source"), str) and node["source"].strip() != "")
            for k, v in node.items():
                if k in ("calibration", "schema"):
                    continue
                walk(v, here, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, sourced, f"{path}[{i}]")
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            assert sourced, f"{name}: {path} has no source"

    walk(_raw(name), False, "")


@pytest.mark.parametrize("field", [
    ("compute", "peak_tflops"),
    ("network", "inter_node", "busbw_gbs"),
    ("memory", "capacity_gib"),
])
def test_a_number_without_source_is_rejected(field):
    d = copy.deepcopy(_raw("perlmutter"))
    node = d
    for k in field[:-1]:
        node = node[k]
    node[field[-1]] = 123  # a bare number where the section has no source of its own
    with pytest.raises(UserError, match="has no source"):
        profile_from_dict(d, "test profile")


def test_a_bare_number_in_a_sourced_section_is_accepted_and_top_level_source_covers_nothing():
    d = copy.deepcopy(_raw("perlmutter"))
    d["memory"] = {"source": "one datasheet for the section", "capacity_gib": 40, "headroom_gib": 3,
                   "bandwidth_gbs": 1555, "elementwise_efficiency": 0.7}
    assert profile_from_dict(d, "test profile").mem_capacity == 40 * 2**30
    d["compute"]["peak_tflops"] = 312
    d["source"] = "a whole-file source is too coarse to count"
    with pytest.raises(UserError, match="compute.peak_tflops"):
        profile_from_dict(d, "test profile")


def test_a_group_row_without_source_is_rejected():
    d = copy.deepcopy(_raw("frontier"))
    del d["network"]["intra_node"]["groups"][0]["source"]
    with pytest.raises(UserError, match=r"groups\[0\]"):
        profile_from_dict(d, "test profile")


def _concrete(spec: str, listed: set[int], gpn: int) -> list[int]:
    """Concrete values for a table cell: '2', '>=8', '>8', 'any', 'other' (= sizes not listed for that ip)."""
    powers = [2, 4, 8, 16, 32, 64]
    if spec.isdigit():
        return [int(spec)]
    if spec.startswith(">="):
        return [v for v in powers + [128, 256] if v >= int(spec[2:])]
    if spec.startswith(">"):
        return [v for v in powers + [128, 256] if v > int(spec[1:])]
    if spec == "any":
        return powers
    if spec == "other":
        return [v for v in powers if v not in listed]
    raise AssertionError(f"unknown table cell {spec!r}")


@pytest.mark.parametrize("machine", ["Perlmutter", "Frontier"])
def test_group_bandwidth_reproduces_the_authors_table(machine):
    """axoplan.planner.machine's placed-group lookup (size = the table's group size, stride = ip, the product
    of the axes placed inside) gives every row of the authors' get_bw(ip, my)."""
    prof = load_profile(machine.lower())
    rows = [r for r in TABLE_ROWS if r[0] == machine]
    checked = 0
    for _, ip_spec, size_spec, bw in rows:
        for ip in _concrete(ip_spec, set(), prof.gpus_per_node):
            listed = {int(r[2]) for r in rows if r[1] == ip_spec and r[2].isdigit()}
            for size in _concrete(size_spec, listed, prof.gpus_per_node):
                got = float(prof.group_busbw(size, ip)) / GB
                assert got == pytest.approx(bw), f"{machine} ip={ip} size={size}: {got} != {bw}"
                checked += 1
    assert checked >= 3 * len(rows) // 2


def test_frontier_latencies_per_collective():
    """39 us all-gather and 29.8 us reduce-scatter per ring step, as in the authors' later model."""
    p = load_profile("frontier")
    assert p.inter_latency * p.coll_lat_scale["all_gather"] == pytest.approx(39e-6)
    assert p.inter_latency * p.coll_lat_scale["reduce_scatter"] == pytest.approx(29.8e-6, rel=1e-3)
    q = load_profile("perlmutter")
    assert all(q.inter_latency * s == pytest.approx(9e-6) for s in q.coll_lat_scale.values())


def test_gemm_dim_half_by_the_memory_traffic_rule():
    """dim_half = ceiling x bytes / (2 x elementwise_efficiency x bandwidth), by hand: Perlmutter's A100-40GB
    280e12 x 2 / (2 x 0.7 x 1555e9) = 257.23; it follows the bandwidth (a benchmark's machine override) and
    an explicit number still wins."""
    p = load_profile("perlmutter")
    assert _raw("perlmutter")["compute"]["gemm"]["dim_half"]["value"] == "memory-traffic"
    assert p.gemm_half == pytest.approx(280e12 * 2 / (2 * 0.7 * 1555e9)) == pytest.approx(257.23, abs=0.01)
    half = p.gemm_half
    t, _ = p.gemm_seconds(4096, 2048, 96, "NN")
    eff = 4096 / (4096 + half) * 2048 / (2048 + half) * 96 / (96 + half)
    # and its waves: 128x128 tiles, 32 x 16 = 512 of them in 5 waves of 108 (256x128: 256 in 3 waves, worse)
    assert float(t) == pytest.approx(2 * 4096 * 2048 * 96 / (280e12 * eff * 512 / 540) + p.launch_cost)
    assert p.replace(mem_bandwidth=2 * 1555e9).gemm_half == pytest.approx(half / 2)
    assert p.replace(gemm_dim_half=340.0).gemm_half == 340.0
    # the H100: at its burst ceiling (794.5, as XLA's table was timed) the rule lands on the least-squares fit to
    # XLA's table (340); at the ceiling it sustains under load (x 0.88) on 298
    h = load_profile("dgx-h100")
    assert h.replace(gemm_ceiling=h.gemm_ceiling / h.gemm_sustained).gemm_half == pytest.approx(340, rel=0.01)
    assert h.gemm_half == pytest.approx(794.5e12 * 0.88 * 2 / (2 * 0.7 * 3350e9)) == pytest.approx(298.1, abs=0.1)


def test_wave_quantization_by_hand():
    """NVIDIA's tile and wave quantization on an A100 (108 SMs): C[2048, 1792] (BLOOM's tp8 projection at one
    sequence) is 8 x 14 = 112 tiles of 256x128 (2 waves, 112/216 busy) or 16 x 14 = 224 of 128x128 (3 waves,
    224/324): the better is 0.691; 108 full tiles are one full wave; a batched call's products share the waves."""
    from axoplan.planner.machine import wave_efficiency
    tiles = ((256, 128), (128, 256), (128, 128))
    assert float(wave_efficiency(2048, 1792, 1, 108, tiles)) == pytest.approx(224 / 324)
    assert float(wave_efficiency(256 * 108, 128, 1, 108, tiles)) == 1.0
    # a partial tile is a whole one: 109 x 256 rows of 128 fill one wave, and 200 more rows a whole 256x128 tile
    # of the second wave, doing 200/256 of its work
    assert float(wave_efficiency(108 * 256 + 200, 128, 1, 108, ((256, 128),))) == pytest.approx(
        (108 * 256 + 200) / (2 * 108 * 256))
    # within one wave the thin-dimension curve covers the loss: nothing quantized
    assert float(wave_efficiency(200, 128, 1, 108, ((256, 128),))) == 1.0
    # 16 products of [2048, 2048] in 128x128 tiles: 16 x 256 = 4096 tiles in 38 waves (4104 slots)
    assert float(wave_efficiency(2048, 2048, 16, 108, ((128, 128),))) == pytest.approx(4096 / 4104)
    assert float(wave_efficiency(2048, 2048, 0, 108, tiles)) == 1.0  # no product, nothing quantized
    p = load_profile("dgx-a100")
    flat = p.replace(gemm_waves=None)
    t, t0 = p.gemm_seconds(2048, 1792, 14336)[0], flat.gemm_seconds(2048, 1792, 14336)[0]
    assert float(t - p.launch_cost) == pytest.approx(float(t0 - p.launch_cost) * 324 / 224)
    assert load_profile("dgx-h100").gemm_waves is None  # not modelled on Hopper (docs/profiles.md says why)


@pytest.mark.parametrize("waves, msg", [
    ({"sms": 0, "tiles": [[128, 128]], "source": "x"}, r"field 'compute.gemm.waves.sms' must be the device's count of streaming multiprocessors, got 0$"),
    ({"sms": 108, "tiles": [[128]], "source": "x"}, r"field 'compute.gemm.waves.tiles' must be a list of \[rows, cols\] output tiles \(integers 1-4096\), got \[\[128\]\]$"),
    ("yes", r"field 'compute.gemm.waves' must be a mapping \{sms: N, tiles: \[\[rows, cols\], ...\], source: ...\}$"),
])
def test_a_bad_waves_field_is_one_sentence(waves, msg):
    d = copy.deepcopy(_raw("dgx-a100"))
    d["compute"]["gemm"]["waves"] = waves
    with pytest.raises(UserError, match=msg):
        profile_from_dict(d, "test profile")


def test_a_bad_dim_half_rule_is_one_sentence():
    d = copy.deepcopy(_raw("perlmutter"))
    d["compute"]["gemm"]["dim_half"]["value"] = "memory"
    with pytest.raises(UserError, match=r"field 'compute.gemm.dim_half' must be a number or 'memory-traffic', got 'memory'$"):
        profile_from_dict(d, "test profile")
