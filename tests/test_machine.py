"""MachineProfile: placement-aware group bandwidth (AxoNN's table), intra-node fallbacks, profile
validation errors, and GEMM times from a measured table or the parametric curve."""
from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile

from conftest import profile_dict

GB = 1e9
US = 1e-6


# ---- group bandwidth -------------------------------------------------------------------------
# (size, stride) -> GB/s on the Perlmutter-like fixture; stride = ip, the product of the axes inside.
# AxoNN's Perlmutter table: ip=1: 2 -> 76, 4 -> 225, >=8 -> 80; ip=2: 2 -> 76, >=4 -> 40; ip>=4: 20.
PERLMUTTER_CASES = [
    (2, 1, 76), (4, 1, 225), (8, 1, 80), (64, 1, 80),
    (2, 2, 76), (4, 2, 40), (16, 2, 40),
    (2, 4, 20), (4, 4, 20), (2, 8, 20), (8, 16, 20), (2, 1024, 20),
    # 3 GPUs do not tile a 4-GPU node: the groups straddle nodes, and node 4-7 carries the rings of two of them,
    # {3, 4, 5} and {6, 7, 8} (machine.rings_per_node): 80 / 2
    (3, 1, 40),
]


def test_group_busbw_reproduces_axonn_perlmutter_table(write_profile):
    p = load_profile(str(write_profile(inter_latency_us=20)))
    size = np.array([c[0] for c in PERLMUTTER_CASES])
    stride = np.array([c[1] for c in PERLMUTTER_CASES])
    bw = p.group_busbw(size, stride)
    assert bw.tolist() == pytest.approx([c[2] * GB for c in PERLMUTTER_CASES])
    lat = p.group_latency(size, stride)
    inside = [(s * st <= 4) and 4 % (s * st) == 0 for s, st, _ in PERLMUTTER_CASES]
    assert lat.tolist() == pytest.approx([9 * US if i else 20 * US for i in inside])


def _rings_by_rank(size: int, stride: int, n: int) -> int:
    """The most groups whose members sit on both sides of some node's edge, counted rank by rank."""
    span, best = size * stride, 0
    for j in range(4 * span + 4):
        lo, hi = j * n, (j + 1) * n
        cut = set()
        for r in range(lo, hi):
            block, i = divmod(r, span)
            members = [block * span + i % stride + k * stride for k in range(size)]
            if any(m < lo or m >= hi for m in members):
                cut.add((block, i % stride))
        best = max(best, len(cut))
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 13), st.integers(1, 16), st.sampled_from([2, 3, 4, 6, 8, 9]))
def test_rings_per_node_counts_the_groups_a_node_cuts(size, stride, n):
    """Groups of an axis (blocks of size x stride consecutive ranks, stride groups interleaved in each) that
    cross nodes: rings_per_node is the most groups any node has members of on both sides of one of its edges,
    as counted rank by rank; where the blocks line up with the nodes, AxoNN's min(stride, GPUs per node)."""
    from axoplan.planner.machine import rings_per_node

    if size * stride <= n and n % (size * stride) == 0:
        return  # inside a node: no ring leaves it
    got = int(rings_per_node(size, stride, n))
    assert got == _rings_by_rank(size, stride, n)
    if (size * stride) % n == 0 or stride >= n:
        assert got == min(stride, n)


def test_group_busbw_size_one_is_free(pm):
    assert np.all(np.isinf(pm.group_busbw(np.array([1, 1, 1]), np.array([1, 4, 64]))))


def test_group_busbw_reproduces_axonn_frontier_table(write_profile):
    """Frontier (8 GCDs per node): ip=1: 2 -> 129, 4 -> 52, 8 -> 135, >8 -> 40; ip=2: 2 -> 50, 4 -> 72,
    other -> 20; ip=4: 2 -> 36, other -> 10; ip>=8: 5 (40 / min(ip, 8))."""
    p = load_profile(str(write_profile(
        name="frontier-test", gpus_per_node=8, inter_busbw_gbs=40,
        intra_groups=((2, 1, 129), (4, 1, 52), (8, 1, 135), (2, 2, 50), (4, 2, 72), (2, 4, 36)))))
    cases = [(2, 1, 129), (4, 1, 52), (8, 1, 135), (16, 1, 40), (2, 2, 50), (4, 2, 72), (8, 2, 20),
             (2, 4, 36), (4, 4, 10), (2, 8, 5), (4, 32, 5)]
    bw = p.group_busbw(np.array([c[0] for c in cases]), np.array([c[1] for c in cases]))
    assert bw.tolist() == pytest.approx([c[2] * GB for c in cases])


def test_group_busbw_corrections_scale_intra_and_inter_separately(pm):
    q = pm.with_corrections(intra_bw_scale=2.0, inter_bw_scale=0.5)
    bw = q.group_busbw(np.array([2, 4, 4, 2]), np.array([1, 1, 2, 4]))
    assert bw.tolist() == pytest.approx([152 * GB, 450 * GB, 20 * GB, 10 * GB])
    assert pm.group_busbw(np.array([2]), np.array([1]))[0] == pytest.approx(76 * GB)  # original untouched


def test_group_busbw_broadcasts(pm):
    bw = pm.group_busbw(np.array([[2], [4]]), np.array([1, 2]))
    assert bw.shape == (2, 2)
    np.testing.assert_allclose(bw, [[76 * GB, 76 * GB], [225 * GB, 40 * GB]], rtol=1e-12)


def test_intra_fallbacks(write_profile):
    p = load_profile(str(write_profile(gpus_per_node=16, intra_groups=((2, 1, 100), (8, 1, 400), (2, 8, 50)))))
    # exact rows
    assert p.intra_busbw(2, 8) == pytest.approx(50 * GB)
    # same size, nearest stride in log2: stride 2 is 1 from stride 1 and 2 from stride 8
    assert p.intra_busbw(2, 2) == pytest.approx(100 * GB)
    assert p.intra_busbw(2, 4) == pytest.approx(50 * GB)  # 2 from 1, 1 from 8
    # unknown size: log-log interpolation over the stride-1 sizes (2 -> 100, 8 -> 400): 4 -> 200
    assert p.intra_busbw(4, 1) == pytest.approx(200 * GB)
    assert p.intra_busbw(4, 2) == pytest.approx(200 * GB)
    # clamped at the ends
    assert p.intra_busbw(16, 1) == pytest.approx(400 * GB)
    # group_busbw uses the same fallback inside the node
    assert p.group_busbw(np.array([4, 2]), np.array([2, 2])).tolist() == pytest.approx([200 * GB, 100 * GB])


# ---- validation ----------------------------------------------------------------------------------
def _err(path) -> str:
    with pytest.raises(UserError) as e:
        load_profile(str(path))
    msg = str(e.value)
    assert str(path) in msg, msg  # every error names the file
    assert "\n" not in msg
    return msg


def test_fixture_profile_loads_in_si_units(pm, pm_path):
    assert pm.name == "pm-test" and pm.path == str(pm_path)
    assert pm.gpus_per_node == 4
    assert pm.mem_capacity == 40 * 2**30 and pm.mem_headroom == 3 * 2**30
    assert pm.mem_bandwidth == 1555e9 and pm.peak_flops == 312e12 and pm.gemm_ceiling == 280e12
    assert pm.kernel_overhead == pytest.approx(4e-6) and pm.intra_latency == pytest.approx(9e-6)
    assert pm.intra_groups == ((2, 1, 76e9), (4, 1, 225e9), (2, 2, 76e9))
    assert pm.dtype_bytes == 2 and pm.blas_tuning


def test_missing_field(write_profile):
    d = profile_dict()
    del d["memory"]["capacity_gib"]
    msg = _err(write_profile(raw=d))
    assert "'memory.capacity_gib'" in msg and "missing" in msg
    d = profile_dict()
    del d["network"]["inter_node"]
    msg = _err(write_profile(raw=d))
    assert "'network.inter_node'" in msg and "missing" in msg


def test_number_without_source(write_profile):
    d = profile_dict()
    d["gpus_per_node"] = 4
    msg = _err(write_profile(raw=d))
    assert "'gpus_per_node'" in msg and "source" in msg
    d = profile_dict()
    del d["network"]["inter_node"]["source"]
    msg = _err(write_profile(raw=d))
    assert "network.inter_node." in msg and "source" in msg
    # the file's top-level source covers nothing
    d = profile_dict()
    d["source"] = "everything"
    d["gpus_per_node"] = 4
    assert "'gpus_per_node'" in _err(write_profile(raw=d))


def test_malformed_yaml(write_profile):
    msg = _err(write_profile(raw="name: pm\nmemory: {capacity_gib: [40\ncompute: 3\n"))
    assert "malformed YAML" in msg and "line" in msg


@pytest.mark.parametrize("edit,field,words", [
    (lambda d: d["memory"].update(capacity_gib="lots"), "memory.capacity_gib", "number"),
    (lambda d: d["memory"].update(bandwidth_gbs=-5), "memory.bandwidth_gbs", "positive"),
    (lambda d: d["compute"]["gemm"].update(ceiling_tflops=0), "compute.gemm.ceiling_tflops", "positive"),
    (lambda d: d["network"]["intra_node"].update(groups=[]), "network.intra_node.groups", "non-empty"),
    (lambda d: d["network"]["intra_node"]["groups"].append({"size": 1, "stride": 1, "busbw_gbs": 5}),
     "network.intra_node.groups[3]", "size"),
    (lambda d: d.update(schema="axoplan-profile/0"), "schema", "axoplan-profile/1"),
    (lambda d: d.update(dtype="int8"), "dtype", "bf16"),
    (lambda d: d.update(gpus_per_node={"value": 4.5, "source": "x"}), "gpus_per_node", "integer"),
    (lambda d: d["compute"]["attention"].update(causal_skip="yes"), "compute.attention.causal_skip", "true or false"),
    (lambda d: d["compute"]["gemm"].update(table={"path": "nope.csv", "source": "x"}), "compute.gemm.table.path",
     "nope.csv"),
])
def test_bad_field_names_file_and_field(write_profile, edit, field, words):
    d = profile_dict()
    edit(d)
    msg = _err(write_profile(raw=d))
    assert f"'{field}'" in msg and words in msg, msg


def test_unknown_machine_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="unknown machine 'no-such-machine-xyz'"):
        load_profile("no-such-machine-xyz")
    with pytest.raises(UserError, match="does not exist"):
        load_profile(str(tmp_path / "absent.yaml"))


def test_profile_found_by_name_through_env(monkeypatch, write_profile):
    path = write_profile(name="env-found-test")
    monkeypatch.setenv("AXOPLAN_PROFILES", str(path.parent))
    assert load_profile("env-found-test").path == str(path)


# ---- GEMM time -----------------------------------------------------------------------------------
GRID = (256, 1024, 4096)
LAYOUT_FACTOR = {"NN": 1.0, "NT": 2.0, "TN": 0.5}


def power_tput(m, n, k):
    """A throughput whose log is linear in log m, log n, log k: log-space interpolation is exact for it."""
    return 1e12 * (m / 4096) ** 0.5 * (n / 4096) ** 0.25 * (k / 4096) ** 0.125


def saturating_tput(m, n, k):
    return 1e12 * m / (m + 500) * n / (n + 500) * k / (k + 500)


def write_table(dirpath, tput, extra=()):
    path = dirpath / "gemm.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["m", "n", "k", "layout", "seconds"])
        for m, n, k in itertools.product(GRID, GRID, GRID):
            for lay, fac in LAYOUT_FACTOR.items():
                w.writerow([m, n, k, lay, 2 * m * n * k / (fac * tput(m, n, k))])
        for row in extra:
            w.writerow(row)
    return path


@pytest.fixture
def table_profile(tmp_path, write_profile):
    def _make(tput, extra=(), **kw):
        write_table(tmp_path, tput, extra)
        return load_profile(str(write_profile(gemm_table="gemm.csv", **kw)))

    return _make


def test_table_exact_at_grid_points(table_profile):
    p = table_profile(saturating_tput)
    assert p.gemm_table is not None and p.gemm_table.swappable
    assert p.gemm_table.m.tolist() == list(GRID)
    for m, n, k in [(256, 256, 256), (1024, 4096, 256), (4096, 1024, 4096)]:
        for lay, fac in LAYOUT_FACTOR.items():
            t, ext = p.gemm_seconds(m, n, k, lay)
            assert float(t) == pytest.approx(2 * m * n * k / (fac * saturating_tput(m, n, k)), rel=1e-9)
            assert not bool(ext)


def test_table_interpolates_between_neighbours(table_profile):
    p = table_profile(saturating_tput)
    m, n, k = 512, 1024, 2000  # m between 256 and 1024, k between 1024 and 4096
    t, ext = p.gemm_seconds(m, n, k, "NN")
    tput = 2 * m * n * k / float(t)
    corners = [saturating_tput(a, n, c) for a in (256, 1024) for c in (1024, 4096)]
    assert min(corners) < tput < max(corners)
    assert not bool(ext)
    # log-space interpolation: at the log2 midpoint of m (k on the grid) the log throughput is the mean
    t_mid, _ = p.gemm_seconds(512, 1024, 1024, "NN")
    expect = np.sqrt(saturating_tput(256, 1024, 1024) * saturating_tput(1024, 1024, 1024))
    assert 2 * 512 * 1024 * 1024 / float(t_mid) == pytest.approx(expect, rel=1e-9)


def test_table_interpolation_is_exact_for_a_power_law(table_profile):
    p = table_profile(power_tput)
    m = np.array([300.0, 700, 2000, 3000])
    n = np.array([3000.0, 512, 1500, 257])
    k = np.array([999.0, 4000, 260, 2048])
    t, ext = p.gemm_seconds(m, n, k, "NN")
    assert t == pytest.approx(2 * m * n * k / power_tput(m, n, k), rel=1e-9)
    assert not ext.any()


def test_table_extrapolation_is_flagged_and_clamped(table_profile):
    p = table_profile(power_tput)
    t, ext = p.gemm_seconds(np.array([8192.0, 1024, 128]), np.array([1024.0, 1024, 1024]),
                            np.array([1024.0, 1024, 1024]), "NN")
    assert ext.tolist() == [True, False, True]
    # outside the grid the throughput of the nearest edge is used
    assert float(t[0]) == pytest.approx(2 * 8192 * 1024 * 1024 / power_tput(4096, 1024, 1024), rel=1e-9)
    assert float(t[2]) == pytest.approx(2 * 128 * 1024 * 1024 / power_tput(256, 1024, 1024), rel=1e-9)


def test_best_layout_and_transposed_form(table_profile):
    p = table_profile(power_tput)
    # m > n: the direct form is faster (m weighs more); the best layout is NT (twice NN)
    m, n, k = 1024.0, 256.0, 4096.0
    t, _ = p.gemm_seconds(m, n, k)
    assert float(t) == pytest.approx(2 * m * n * k / (2 * power_tput(m, n, k)), rel=1e-9)
    # m < n: C^T = B^T A^T computes the [n, m] product, which the table rates higher
    m, n = 256.0, 1024.0
    t, _ = p.gemm_seconds(m, n, k)
    assert power_tput(n, m, k) > power_tput(m, n, k)
    assert float(t) == pytest.approx(2 * m * n * k / (2 * power_tput(n, m, k)), rel=1e-9)
    # a fixed layout is the direct form only
    t_nn, _ = p.gemm_seconds(m, n, k, "NN")
    assert float(t_nn) == pytest.approx(2 * m * n * k / power_tput(m, n, k), rel=1e-9)
    t_tn, _ = p.gemm_seconds(m, n, k, "TN")
    assert float(t_tn) == pytest.approx(2 * m * n * k / (0.5 * power_tput(m, n, k)), rel=1e-9)


def test_table_extra_shapes_are_exact_and_scaled(table_profile):
    p = table_profile(power_tput, extra=[(300, 256, 256, "NN", 1e-3)])
    t, ext = p.gemm_seconds(300, 256, 256, "NN")
    assert float(t) == pytest.approx(1e-3) and not bool(ext)
    q = p.with_corrections(gemm_scale=2.0)
    assert float(q.gemm_seconds(300, 256, 256, "NN")[0]) == pytest.approx(5e-4)
    t_grid = float(p.gemm_seconds(1024, 1024, 1024, "NN")[0])
    assert float(q.gemm_seconds(1024, 1024, 1024, "NN")[0]) == pytest.approx(t_grid / 2)


def test_table_incomplete_axis_value_is_dropped_from_the_grid(table_profile):
    extra = [(8192, 256, 256, lay, 2 * 8192 * 256 * 256 / (fac * power_tput(8192, 256, 256)))
             for lay, fac in LAYOUT_FACTOR.items()]
    p = table_profile(power_tput, extra=extra)
    assert p.gemm_table.m.tolist() == list(GRID)
    assert (8192, 256, 256) in p.gemm_table.exact


def test_table_csv_errors(tmp_path, write_profile):
    (tmp_path / "gemm.csv").write_text("m,n,k,seconds\n1,2,3,0.1\n")
    msg = _err(write_profile(gemm_table="gemm.csv"))
    assert "'compute.gemm.table.path'" in msg and "layout" in msg


def test_parametric_curve_by_hand(pm):
    launch = pm.kernel_overhead  # the curve's call time includes one kernel launch
    assert launch == pytest.approx(4e-6)
    # compute-bound: 2*4096^3 / (280 TFLOP/s * (4096/4144)^3)
    t, ext = pm.gemm_seconds(4096, 4096, 4096)
    assert float(t) == pytest.approx(2 * 4096**3 / (280e12 * (4096 / 4144) ** 3) + launch, rel=1e-12)
    assert not bool(ext)
    # memory-bound: one row times a 4096x4096 matrix reads the matrix: (4096 + 4096^2 + 4096) * 2 B / 1555 GB/s
    t, _ = pm.gemm_seconds(1, 4096, 4096)
    assert float(t) == pytest.approx((4096 + 4096**2 + 4096) * 2 / 1555e9 + launch, rel=1e-12)
    # gemm_scale multiplies throughput, not the launch
    t2, _ = pm.with_corrections(gemm_scale=4.0).gemm_seconds(4096, 4096, 4096)
    assert float(t2) == pytest.approx(2 * 4096**3 / (4 * 280e12 * (4096 / 4144) ** 3) + launch, rel=1e-12)


@pytest.mark.parametrize("field", ["gemm_scale", "elementwise_scale", "intra_bw_scale", "inter_bw_scale"])
def test_zero_throughput_correction_is_rejected(write_profile, field):
    msg = _err(write_profile(corrections={field: 0}))
    assert f"'corrections.{field}'" in msg


def test_headroom_must_leave_memory(write_profile):
    msg = _err(write_profile(capacity_gib=40, headroom_gib=50))
    assert "'memory.headroom_gib'" in msg


def test_unknown_top_level_field_is_named(write_profile, tmp_path):

    path = write_profile()
    d = yaml.safe_load(open(path))
    d["netwrok"] = {"source": "typo"}
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump(d))
    msg = _err(bad)
    assert "'netwrok'" in msg and "is not a profile field" in msg


def test_unknown_correction_is_named(write_profile):
    msg = _err(write_profile(corrections={"gemm_scal": 2.0}))
    assert "'corrections.gemm_scal'" in msg


def test_the_kind_of_device_is_said_not_guessed(write_profile, tmp_path):
    """CPU vs GPU comes from the profile's `kind`, not from its dtype: an fp32 GPU profile is still a GPU
    profile (its Slurm script asks for GPUs, it tunes BLAS, its AdamW is fused); a profile without a kind
    is refused in one sentence."""
    import yaml

    from axoplan.errors import UserError
    from axoplan.loop.launch import is_cpu_profile, slurm_script
    from axoplan.runconfig import LaunchConfig
    from conftest import profile_dict

    raw = profile_dict(name="gpu-fp32", dtype="fp32")
    raw["kind"] = "gpu"
    p = load_profile(str(write_profile(raw=yaml.safe_dump(raw), name="gpu-fp32")))
    assert p.kind == "gpu" and p.blas_tuning and not is_cpu_profile(p)
    assert "--gpus-per-node=" in slurm_script(LaunchConfig(), p, tmp_path)
    del raw["kind"]
    with pytest.raises(UserError, match="'kind' is missing"):
        load_profile(str(write_profile(raw=yaml.safe_dump(raw), name="no-kind")))
    raw["kind"] = "tpu"
    with pytest.raises(UserError, match="must be one of gpu, cpu"):
        load_profile(str(write_profile(raw=yaml.safe_dump(raw), name="bad-kind")))
