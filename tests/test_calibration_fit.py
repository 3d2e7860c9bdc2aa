"""The fits recover known constants from synthetic measurements (no torch, no timing)."""
import random

import pytest

from axoplan.calibrate import profile_writer
from axoplan.calibrate.fit import COLLECTIVES, busbw, fit_alpha_beta, fit_dim_half, fit_line, ring_steps, ring_volume

from calib_synthetic import ALPHA, BUSBW, BW, INTER_BW, OVERHEAD, SCALE, write


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_alpha_beta_recovered_within_5_percent(collective, p):
    rng = random.Random(p)
    alpha, beta = 25e-6, 15e9
    sizes = [2**e for e in range(10, 29)]
    t = [(ring_steps(collective, p) * alpha + ring_volume(collective, p, b) / beta) * (1 + rng.uniform(-0.03, 0.03))
         for b in sizes]
    f = fit_alpha_beta(collective, p, sizes, t)
    assert f.alpha_s == pytest.approx(alpha, rel=0.05)
    assert f.beta_bps == pytest.approx(beta, rel=0.05)
    assert f.rms_rel_err < 0.03 and f.max_rel_err < 0.06


def test_fit_reports_its_error_and_never_a_negative_latency():
    # pure bandwidth data with noise: least squares could go negative, NNLS must not
    sizes = [2**e for e in range(10, 20)]
    t = [b / 1e9 * (1.1 if i % 2 else 0.9) for i, b in enumerate(sizes)]
    f = fit_alpha_beta("all_reduce", 2, [s / 2 for s in sizes], t)
    assert f.alpha_s >= 0
    assert 0.05 < f.rms_rel_err < 0.2


def test_busbw_follows_nccl_tests():
    # all-reduce of 1 GB on 4 ranks in 1 s: busbw = 2*3/4 GB/s; all-gather of 1 GB total: 3/4 GB/s
    assert busbw("all_reduce", 4, 1e9, 1.0) == pytest.approx(1.5e9)
    assert busbw("all_gather", 4, 1e9, 1.0) == pytest.approx(0.75e9)
    assert ring_steps("all_reduce", 4) == 6 and ring_steps("reduce_scatter", 4) == 3


def test_fit_line_exact():
    f = fit_line([1, 1, 1], [1, 2, 4], [3, 5, 9])
    assert (f.a, f.b) == pytest.approx((1.0, 2.0))


def test_dim_half_recovered():
    dims = [8, 32, 128, 512]
    m, n, k, tf = [], [], [], []
    for a in dims:
        for b in dims:
            for c in dims:
                m.append(a), n.append(b), k.append(c)
                tf.append(0.1 * a / (a + 40) * b / (b + 40) * c / (c + 40))
    h, err = fit_dim_half(m, n, k, tf, 0.1)
    assert h == pytest.approx(40, rel=0.01) and err < 1e-3


def test_profile_numbers_from_synthetic_run(tmp_path):
    built = profile_writer.build(write(tmp_path / "r"), "synthetic", "synthetic_gemm.csv")
    net = built.profile["network"]
    groups = {(g["size"], g["stride"]): g["busbw_gbs"] for g in net["intra_node"]["groups"]}
    assert set(groups) == set(BUSBW)
    for g, bw in BUSBW.items():
        assert groups[g] == pytest.approx(bw / 1e9, rel=0.05)
    assert net["intra_node"]["latency_us"]["value"] == pytest.approx(ALPHA * 1e6, rel=0.05)
    for c in COLLECTIVES:
        assert net["collectives"][c]["bandwidth_scale"] == pytest.approx(SCALE[c], rel=0.05)
    assert "NOT MEASURED" in net["inter_node"]["busbw_gbs"]["source"]
    assert built.summary["network_model_rms_rel_err"] < 0.05
    mem = built.profile["memory"]
    assert mem["bandwidth_gbs"] == pytest.approx(BW / 1e9, rel=1e-3)
    assert mem["elementwise_efficiency"] == pytest.approx(0.5, rel=1e-3)
    comp = built.profile["compute"]
    assert comp["kernel_overhead_us"]["value"] == pytest.approx(OVERHEAD * 1e6)
    # the parametric curve from the best measured ceiling tracks the synthetic table (true curve 0.05*d/(d+32)...)
    ceiling, h = comp["gemm"]["ceiling_tflops"]["value"], comp["gemm"]["dim_half"]["value"]
    for d in (8, 64, 512):
        true = 0.05 * (d / (d + 32)) ** 3
        assert ceiling * (d / (d + h)) ** 3 == pytest.approx(true, rel=0.2)
    assert comp["attention"]["causal_skip"] is False  # causal took as long as non-causal
    assert comp["attention"]["backward_factor"] == pytest.approx(2.5)
    assert comp["attention"]["tflops"]["value"] == pytest.approx(0.01)


def test_inter_node_fitted_from_groups_that_cross_nodes(tmp_path):
    # 8 ranks as 2 nodes of 4: (2,4) and (8,1)... cross; the planner divides the node's bandwidth
    rd = write(tmp_path / "r", world=8, ranks_per_node=4)
    built = profile_writer.build(rd, "two-nodes", "t.csv")
    inter = built.profile["network"]["inter_node"]
    assert inter["busbw_gbs"]["value"] == pytest.approx(INTER_BW / 1e9, rel=0.05)
    assert "NOT MEASURED" not in inter["busbw_gbs"]["source"]
    assert built.profile["gpus_per_node"]["value"] == 4
    intra = {(g["size"], g["stride"]) for g in built.profile["network"]["intra_node"]["groups"]}
    assert intra == set(BUSBW)


def test_gpu_run_across_nodes_fits_nccls_protocol_model(tmp_path):
    """A GPU run on 4 nodes of 4 whose crossing groups follow NCCL's protocol model with a 120 GB/s plateau and
    latencies 1.6x NCCL's defaults (1 KiB-4 GiB): the fit recovers both and writes network.protocols, which
    the planner loads; a CPU run writes none (test_profile_numbers_from_synthetic_run)."""
    rd = write(tmp_path / "r", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6))
    built = profile_writer.build(rd, "gpu-nodes", "t.csv")
    net = built.profile["network"]
    assert net["inter_node"]["busbw_gbs"]["value"] == pytest.approx(120, rel=0.05)
    assert built.summary["protocols"]["latency_scale"] == pytest.approx(1.6, rel=0.05)
    assert built.summary["protocols"]["rms_rel_err"] < 0.03
    assert net["protocols"]["latency_scale"]["value"] == pytest.approx(1.6, rel=0.05)
    simple = net["protocols"]["ring"][2]
    assert simple["protocol"] == "Simple" and simple["net_us"] == 14.0  # NCCL's default row, unscaled
    from axoplan.planner.profile_reader import load_profile

    profile_writer.write(rd, tmp_path / "gpu.yaml")
    prof = load_profile(str(tmp_path / "gpu.yaml"))
    assert prof.physics.protocols is not None and prof.inter_busbw == pytest.approx(120e9, rel=0.05)


def test_gpu_run_whose_all_gathers_stall_writes_network_stalls(tmp_path):
    """The same GPU run, its all-gathers across nodes stalling at 400 us a ring step wherever each rank's part is
    64-256 KiB (as RCCL's on Frontier): the fit finds the band and the step and writes network.stalls, which the
    planner loads; the protocol model, fitted to the other calls, still recovers the plateau and the latency."""
    rd = write(tmp_path / "r", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6),
               stall=("all_gather", 64 * 1024, 256 * 1024, 400e-6))
    built = profile_writer.build(rd, "gpu-nodes", "t.csv")
    (row,) = built.profile["network"]["stalls"]
    assert row["collective"] == "all_gather" and row["per_rank_kib"] == [64, 256]
    assert row["step_us"] == pytest.approx(400, rel=0.03)
    assert built.summary["protocols"]["latency_scale"] == pytest.approx(1.6, rel=0.05)
    assert built.profile["network"]["inter_node"]["busbw_gbs"]["value"] == pytest.approx(120, rel=0.05)
    from axoplan.planner.profile_reader import load_profile

    profile_writer.write(rd, tmp_path / "gpu.yaml")
    (st,) = load_profile(str(tmp_path / "gpu.yaml")).physics.stalls
    assert (st.kind, st.lo, st.hi) == ("all_gather", 65536, 262144)
    # without the stall no band: the run of the test above writes none
    plain = profile_writer.build(write(tmp_path / "p", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6)), "g", "t.csv")
    assert "stalls" not in plain.profile["network"]


def test_gpu_run_through_the_host_bridge_writes_no_ll128_rows(tmp_path):
    """The same run on hosts whose GPUs reach their NICs through the CPU (the worker recorded PHB): NCCL runs
    no LL128 across nodes there, the truth has none, and the written rows have none; the fit still recovers
    the plateau and the latency scale."""
    rd = write(tmp_path / "r", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6), nic_path="PHB")
    built = profile_writer.build(rd, "gpu-nodes", "t.csv")
    pr = built.profile["network"]["protocols"]
    assert [r["protocol"] for r in pr["ring"]] == ["LL", "Simple"]
    assert [r["protocol"] for r in pr["tree"]] == ["LL", "Simple"]
    assert built.summary["protocols"]["latency_scale"] == pytest.approx(1.6, rel=0.05)
    assert built.profile["network"]["inter_node"]["busbw_gbs"]["value"] == pytest.approx(120, rel=0.05)


def test_gpu_run_with_nvls_writes_nccls_nvls_tree_row(tmp_path):
    """The same run on Hopper nodes whose NVSwitch does multicast (the worker recorded nvls): the truth's
    all-reduces across nodes may take NVLSTree, the written profile has NCCL's NVLSTree row
    (gpu_physics.nvls_tree_row), and the fit through it still recovers the plateau and the latency scale. A
    run that recorded no NVLS writes none; nor does a Blackwell run, whose NVLSTree constants are not written."""
    from axoplan.planner import gpu_physics

    rd = write(tmp_path / "r", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6), nvls=True)
    built = profile_writer.build(rd, "gpu-nodes", "t.csv")
    pr = built.profile["network"]["protocols"]
    assert pr["nvls_tree"] == [gpu_physics.nvls_tree_row()]
    assert built.summary["protocols"]["latency_scale"] == pytest.approx(1.6, rel=0.05)
    assert built.profile["network"]["inter_node"]["busbw_gbs"]["value"] == pytest.approx(120, rel=0.05)
    from axoplan.planner.profile_reader import load_profile

    profile_writer.write(rd, tmp_path / "gpu.yaml")
    assert load_profile(str(tmp_path / "gpu.yaml")).physics.protocols.nvls_tree
    # without NVLS in the fit the NVLSTree truth is not explained as well
    off = write(tmp_path / "off", world=16, ranks_per_node=4, gpu_truth=(120e9, 1.6), nvls=True)
    m = off.meta()
    m["nvls"] = False
    off.write_meta(m)
    plain = profile_writer.build(off, "gpu-nodes", "t.csv")
    assert "nvls_tree" not in plain.profile["network"]["protocols"]
    assert plain.summary["protocols"]["rms_rel_err"] > built.summary["protocols"]["rms_rel_err"]
    m.update(nvls=True, cuda_capability=100)
    off.write_meta(m)
    blackwell = profile_writer.build(off, "gpu-nodes", "t.csv").profile["network"]["protocols"]
    assert "nvls_tree" not in blackwell and "Hopper only (compute capability 100)" in blackwell["source"]


@pytest.mark.parametrize("env, multicast, want", [
    (None, True, True), (None, False, False), (None, None, False), ("2", True, True),
    ("0", True, False), ("1", False, True), ("1", None, True)])
def test_nvls_follows_nccls_rule(env, multicast, want):
    """NCCL_NVLS_ENABLE 0 off, 1 on, unset or 2 (the default) where the driver reports multicast."""
    from axoplan.calibrate.worker import nvls_enabled

    assert nvls_enabled(env, multicast) is want


def test_nic_path_from_nvidia_smi_topo():
    """The nearest NIC of the rank's GPU in `nvidia-smi topo -m`, in NCCL's path names (NODE is through the CPU)."""
    from axoplan.calibrate.worker import nic_path_from_topo

    text = """
\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tPXB\tSYS\t0-31\t0
GPU1\tNV4\t X \tNODE\tSYS\t0-31\t0

Legend:
  X    = Self
"""
    assert nic_path_from_topo(text, 0) == "PXB"
    assert nic_path_from_topo(text, 1) == "PHB"
    assert nic_path_from_topo(text, 2) == ""
    assert nic_path_from_topo(text.replace("NIC0", "GPU2").replace("NIC1", "GPU3"), 0) == ""  # no NIC column
    older = "\tGPU0\tmlx5_0\tmlx5_1\nGPU0\t X \tSYS\tPIX\n"
    assert nic_path_from_topo(older, 0) == "PIX"


def test_incomplete_run_is_refused(tmp_path):
    rd = write(tmp_path / "r")
    m = rd.meta()
    m["status"] = "running"
    rd.write_meta(m)
    with pytest.raises(profile_writer.CalibrationError, match="did not finish"):
        profile_writer.build(rd, "x", "x.csv")


def _framework_steps(tmp_path, change, scale: float = 1.0):
    """A calibration run whose framework rows are the planner's own times of framework.CONFIGS (times `scale`)
    under the synthetic profile with `change` (MachineProfile.replace's fields) applied."""
    import numpy as np

    from axoplan.planner.batch import evaluate
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job
    from axoplan.calibrate import framework

    rd = write(tmp_path / "r")
    first = profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")
    prof = profile_writer._load(first.profile, first.files())
    made = prof.replace(**change(prof))
    one = np.ones(1, dtype=np.int64)
    for layers, acc, mb, hidden, heads, vocab, seq in framework.CONFIGS:
        model = framework.tiny_model(layers, hidden, heads, vocab, seq)
        c = Candidates(one, one, one, one, 0 * one, one * mb, np.zeros(1, dtype=bool))
        sec = scale * float(evaluate(model, made, Job(1, acc * mb, seq), c).batch_time[0])
        rd.append("framework", {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq": seq,
                                "micro_batch": mb, "grad_acc": acc, "seconds": sec})
    return profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")


def test_framework_overhead_and_elementwise_efficiency_recovered(tmp_path):
    """Trainer steps made by the planner itself with a known per-kernel cost and element-wise efficiency:
    the writer's fit must give both back."""
    built = _framework_steps(tmp_path, lambda p: {"kernel_overhead": 20e-6, "elementwise_efficiency": 0.125})
    assert built.profile["compute"]["kernel_overhead_us"]["value"] == pytest.approx(20.0, rel=0.01)
    assert built.profile["memory"]["elementwise_efficiency"] == pytest.approx(0.125, rel=0.01)
    assert "autograd" in built.profile["compute"]["kernel_overhead_us"]["source"]
    assert built.summary["bare_op_us"] == pytest.approx(OVERHEAD * 1e6)


def test_steps_faster_than_their_modelled_arithmetic_give_the_dispatch_floor_with_a_note(tmp_path):
    """A machine (or a GEMM table short of the tiny models' shapes) whose trainer steps take no longer than
    the modelled GEMMs and attention: the overhead is a bare op's dispatch, said in the source, not an error."""
    built = _framework_steps(tmp_path, lambda p: {"kernel_overhead": 0.0,
                                                  "elementwise_efficiency": p.elementwise_efficiency * 1e6}, 0.8)
    oh = built.profile["compute"]["kernel_overhead_us"]
    assert oh["value"] == pytest.approx(OVERHEAD * 1e6) and built.summary["framework_overhead_at_floor"]
    assert "6 of 6 no longer than their modelled GEMM and attention" in oh["source"]
    # element-wise work the steps need not explain: the efficiency at its cap, a profile that loads
    cap = built.summary["elementwise_efficiency_ops"] / profile_writer.MIN_ELEMENTWISE_SCALE
    assert built.summary["elementwise_efficiency"] <= cap * (1 + 1e-9)
    assert profile_writer._load(built.profile, built.files()).elementwise_efficiency <= cap * (1 + 1e-3)


def test_overlap_efficiency_is_the_median_of_the_measurements(tmp_path):
    rd = write(tmp_path / "r")
    for i, eff in enumerate((0.1, 0.3, 0.9)):
        rd.append("overlap", {"collective": "all_gather", "size": 2, "stride": 1, "bytes": 65536 * (i + 1),
                              "burst_s": 4e-3, "collective_s": 1e-3, "together_s": 5e-3 - eff * 1e-3,
                              "efficiency": eff})
    built = profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")
    ov = built.profile["network"]["overlap_efficiency"]
    assert ov["value"] == pytest.approx(0.3) and "asynchronously" in ov["source"]
    # without overlap rows (GPUs, or a core per rank) the field is absent: the planner's default 1 holds
    assert "overlap_efficiency" not in profile_writer.build(write(tmp_path / "r2"), "s", "s.csv").profile["network"]


def test_trainer_grids_cover_every_grid_and_placement_the_models_divide():
    from axoplan.planner.space import grid_problem
    from axoplan.calibrate import trainer_grids as T

    for m in T.MODELS:
        model = T.calibration_model(*m)
        g4 = T.grids(4, model)
        # 4 ranks: 13 distinct grids and placements (as validate --all measures), none a grid of one
        assert len(g4) == len(set(g4)) == 13
        for gx, gy, gz, gd, _order, mb in g4:
            assert gx * gy * gz * gd == 4 and mb == T.global_batch(4) // (gd * gz)
            assert grid_problem(model, gx, gy, gz, gd, T.global_batch(4), mb) is None
        assert len(T.grids(64, model)) == T.MAX_GRIDS  # many ranks: an even spread, not all of them
    assert T.grids(1, T.calibration_model(*T.MODELS[0])) == []


def _trainer_rows(prof, world, true):
    """Trainer steps made by the planner itself with known corrections."""
    import numpy as np

    from axoplan.planner.batch import evaluate
    from axoplan.planner.space import ORDERS
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job
    from axoplan.calibrate import trainer_grids as T

    p = prof.with_corrections(**true)
    rows = []
    for m in T.MODELS:
        model = T.calibration_model(*m)
        gb = T.global_batch(world)
        for gx, gy, gz, gd, order, mb in T.grids(world, model):
            c = Candidates(*(np.array([v]) for v in (gx, gy, gz, gd)), np.array([ORDERS.index(order)], dtype=np.int8),
                           np.array([mb]), np.array([False]))
            sec = float(evaluate(model, p, Job(world, gb, model.seq_len), c).batch_time[0])
            rows.append(dict(zip(("layers", "hidden", "heads", "vocab", "seq"), m), global_batch=gb, micro_batch=mb,
                             gx=gx, gy=gy, gz=gz, gdata=gd, order=order, seconds=sec))
    return rows


def test_trainer_steps_give_the_profile_known_corrections(tmp_path):
    """Steps on every grid of 4 ranks, made with a per-call cost of 1 ms and overlap 0.6 the microbenchmarks
    do not see: the writer fits both back into the profile's corrections (and nothing it need not)."""
    rd = write(tmp_path / "r")
    first = profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")
    prof = profile_writer._load(first.profile, first.files())
    true = {"collective_overhead_s": 1e-3, "overlap_efficiency": 0.6}
    rng = random.Random(1)
    for row in _trainer_rows(prof, 4, true):
        rd.append("trainer", dict(row, seconds=row["seconds"] * (1 + rng.uniform(-0.02, 0.02))))  # timing noise
    built = profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")
    corr = built.profile["corrections"]
    assert corr["collective_overhead_s"] == pytest.approx(1e-3, rel=0.1)
    assert corr["overlap_efficiency"] == pytest.approx(0.6, abs=0.08)
    # both found; timing noise may buy the criterion others (here the per-kernel cost and the latency scale, which
    # the per-call cost now resembles: both grow with the group), each within a fifth of changing nothing
    chosen = built.summary["trainer_params"]
    assert set(true) <= set(chosen)
    assert all(abs(v - 1) < 0.2 for k, v in chosen.items() if k not in true), chosen
    assert "39 grids and placements" in corr["source"] and built.summary["trainer_mape_after"] < 2.0
    assert built.summary["trainer_mape_before"] > 10.0  # the microbenchmarks alone miss what the steps show
    loaded = profile_writer._load(built.profile, built.files())
    assert loaded.corrections.collective_overhead_s == pytest.approx(corr["collective_overhead_s"])
    # without trainer rows the corrections stay the identity
    assert "collective_overhead_s" not in first.profile["corrections"]


def test_attention_timed_above_the_gemm_ceiling_raises_the_measured_peak(tmp_path):
    """A loaded machine or a small GEMM sweep can time attention faster than the GEMM ceiling (a 2-rank CI run:
    19.6 against 18.9 GFLOP/s): the profile's measured peak is raised to it, so the profile loads, instead of a
    finished calibration ending on the reader's 'no kernel runs faster than the peak'."""
    import csv

    rd = write(tmp_path / "r")
    path = rd.csv_path("attention")
    rows = list(csv.DictReader(path.open()))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(dict(r, seconds=float(r["seconds"]) / 10) for r in rows)  # 0.1 TFLOP/s against a 0.05 ceiling
    built = profile_writer.build(rd, "synthetic", "synthetic_gemm.csv")
    comp = built.profile["compute"]
    assert comp["attention"]["tflops"]["value"] == pytest.approx(0.1)
    assert comp["gemm"]["ceiling_tflops"]["value"] < comp["peak_tflops"]["value"] == comp["attention"]["tflops"]["value"]
    assert "raised to the attention rate" in comp["peak_tflops"]["source"]
    assert profile_writer._load(built.profile, built.files()).name == "synthetic"  # the reader takes it


def test_parts_measured_later_keep_their_own_date(tmp_path):
    from axoplan.calibrate.worker import merge_meta

    rd = write(tmp_path / "r")
    old = rd.meta()
    new = dict(old, date="2026-02-02T00:00:00Z", command="axoplan calibrate --parts trainer", loadavg_start=[1, 1, 1])
    m = merge_meta(old, new, {"trainer"})
    assert m["date"] == old["date"] and m["part_dates"]["trainer"] == "2026-02-02T00:00:00Z"
    assert m["part_dates"]["gemm"] == old["date"] and "trainer" in m["measured"]
    with pytest.raises(SystemExit, match="world"):
        merge_meta(old, dict(new, world=8), {"trainer"})
    with pytest.raises(SystemExit, match="no complete"):
        merge_meta(dict(old, status="running"), new, {"trainer"})
    m["status"] = "complete"
    rd.write_meta(m)
    built = profile_writer.build(rd, "s", "s_gemm.csv")
    assert built.profile["calibration"]["parts"]["trainer"] == "2026-02-02T00:00:00Z"
    assert built.profile["calibration"]["added"][-1]["parts"] == ["trainer"]
    assert profile_writer._load(built.profile, built.files()).name == "s"  # the schema takes it
    # a part measured later names its own run in its sources
    assert "2026-02-02" in profile_writer.part_tag(m, "trainer") and "--parts" in profile_writer.part_tag(m, "trainer")
    assert "2026-02-02" not in profile_writer.part_tag(m, "gemm")
    # a second part added later: each added part still names its own run
    m2 = merge_meta(m, dict(new, date="2026-03-03T00:00:00Z", command="axoplan calibrate --parts attention"),
                    {"attention"})
    assert [a["parts"] for a in m2["added"]] == [["trainer"], ["attention"]]
    assert "2026-02-02" in profile_writer.part_tag(m2, "trainer") and "--parts trainer" in profile_writer.part_tag(m2, "trainer")
    assert "--parts attention" in profile_writer.part_tag(m2, "attention")
    m2["status"] = "complete"
    rd.write_meta(m2)
    prof = profile_writer.build(rd, "s", "s_gemm.csv").profile
    assert "--parts attention" in prof["compute"]["attention"]["source"]
    assert "--parts" not in prof["compute"]["gemm"]["dim_half"]["source"]


def test_the_fitting_stage_reports_its_progress(tmp_path):
    """calibrate's fitting stage is not silent: each part says when it starts (to the command's stderr)."""
    import io

    from axoplan import progress

    buf = io.StringIO()
    with progress.on_stderr("fitting the profile", stream=buf):
        profile_writer.build(write(tmp_path / "r"), "synthetic", "synthetic_gemm.csv")
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("fitting the profile: GEMM, memory and attention (")
    assert any("collectives: latency and bandwidth" in x for x in lines)
    assert profile_writer.build(write(tmp_path / "r2"), "s", "s.csv")  # no reporter opened: silent, same result


def test_find_stalls_by_hand():
    """Curves of 8 members, parts 1 KiB-1 MiB per rank, each call 10 us + 1 us per KiB of part. Parts of 64 and
    128 KiB stall (7 ms) on curves a and b, 4 KiB on a alone: the band is 64-128 KiB, its step the median seconds
    per ring step of its rows; a third curve without the stall leaves 2 of 3 (a band), a fourth 2 of 4 (none)."""
    from axoplan.calibrate.fit import find_stalls, stalled

    assert stalled([(1, 3.0), (2, 1.0), (4, 2.0)]) == [True, False, False]

    def curve(name, stall_parts):
        return [{"collective": "all_gather", "size": 8, "curve": name, "bytes": 8 * 1024 * kib,
                 "seconds": 7e-3 if kib in stall_parts else (10 + kib) * 1e-6}
                for kib in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)]

    rows = curve("a", {4, 64, 128}) + curve("b", {64, 128})
    (f,) = find_stalls(rows)
    assert (f.collective, f.lo, f.hi, f.stalled, f.rows, f.curves) == ("all_gather", 65536, 131072, 4, 4, 2)
    assert f.step == pytest.approx(7e-3 / 7)
    (f3,) = find_stalls(rows + curve("c", set()))
    assert (f3.stalled, f3.rows) == (4, 6) and f3.step == pytest.approx(7e-3 / 7)  # median of 4 stalled, 2 not
    assert find_stalls(rows + curve("c", set()) + curve("d", set())) == []
