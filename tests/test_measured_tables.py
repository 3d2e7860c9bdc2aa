"""Measured tables in a profile: collectives per group shape and attention per local shape are
interpolated (or taken) as measured; everything else keeps the parametric model."""
import numpy as np
import pytest
import yaml

from axoplan.planner import comm as C
from axoplan.planner import compute as K
from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile, profile_paths
from axoplan.planner.space import Candidates
from axoplan.planner.specs import load_model

# all-reduce on 2 ranks (stride 1): a latency floor, then bandwidth
AR21 = {8: 1e-4, 1024: 2e-4, 1048576: 4e-3}


def _profile(tmp_path, coll_rows=None, attn_rows=None, **corrections):
    src = profile_paths()["dgx-h100"]
    d = yaml.safe_load(src.read_text())
    for k in ("compute", "network"):
        d[k] = yaml.safe_load(yaml.safe_dump(d[k]))
    if coll_rows is not None:
        (tmp_path / "c.csv").write_text("collective,size,stride,bytes,seconds,burst_s\n"
                                        + "".join(",".join(map(str, (*r, 0.0)[:6])) + "\n" for r in coll_rows))
        d["network"]["intra_node"]["table"] = {"path": "c.csv", "source": "test"}
    if attn_rows is not None:
        (tmp_path / "a.csv").write_text("batch,heads,seq,head_dim,causal,pass,seconds\n"
                                        + "".join(",".join(map(str, r)) + "\n" for r in attn_rows))
        d["compute"]["attention"]["table"] = {"path": "a.csv", "source": "test"}
    if corrections:
        d["corrections"] = {**corrections, "source": "test"}
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump(d))
    return load_profile(str(p))


def _one(prof, kind, axis, nbytes, gx=2, gy=1, gz=1, gd=4, order=0):
    c = Candidates(*(np.array([v]) for v in (gx, gy, gz, gd, order, 1)), np.array([False]))
    g = C.place(prof, c)
    return float(C._coll(prof, g, "t", "fwd", kind, axis, nbytes).seconds[0])


def test_measured_points_interpolation_and_ends(tmp_path):
    prof = _profile(tmp_path, [("all_reduce", 2, 1, b, t) for b, t in AR21.items()])
    for b, t in AR21.items():
        assert _one(prof, "all_reduce", "x", b) == pytest.approx(t)
    # log-log between two points
    mid = np.sqrt(1024 * 1048576)
    assert _one(prof, "all_reduce", "x", mid) == pytest.approx(np.sqrt(2e-4 * 4e-3))
    assert _one(prof, "all_reduce", "x", 1) == pytest.approx(1e-4)  # below: the latency floor
    # above: the largest point plus the ring's per-byte cost of the fitted bandwidth
    bw = prof.intra_busbw(2, 1) * prof.coll_bw_scale["all_reduce"]
    extra = 2**30
    assert _one(prof, "all_reduce", "x", 1048576 + extra) == pytest.approx(4e-3 + extra * 1.0 / bw)


def test_unmeasured_shapes_and_kinds_keep_the_alpha_beta_model(tmp_path):
    with_t = _profile(tmp_path, [("all_reduce", 2, 1, b, t) for b, t in AR21.items()])
    without = load_profile("dgx-h100")
    # an all-gather on the same group, and an all-reduce over 4 ranks, were not measured
    assert _one(with_t, "all_gather", "x", 1e6) == pytest.approx(_one(without, "all_gather", "x", 1e6))
    assert _one(with_t, "all_reduce", "d", 1e6) == pytest.approx(_one(without, "all_reduce", "d", 1e6))


def test_corrections_split_the_curve_at_its_smallest_size(tmp_path):
    rows = [("all_reduce", 2, 1, b, t) for b, t in AR21.items()]
    rows += [("all_reduce", 4, 1, b, 2 * t) for b, t in AR21.items()]
    prof = _profile(tmp_path, rows, intra_bw_scale=2.0, latency_scale=0.5, collective_overhead_s=1e-3)
    t0, t = AR21[8], AR21[1048576]
    assert _one(prof, "all_reduce", "x", 1048576) == pytest.approx(0.5 * t0 + (t - t0) / 2 + 1e-3)
    # a group of 4 waits for the last of 4: 2 (H_4 - 1) = 13/6 pairs' overheads (comm.rank_skew)
    assert _one(prof, "all_reduce", "x", 1048576, gx=4, gd=2) == pytest.approx(t0 + (t - t0) + 13 / 6 * 1e-3)


def test_inter_node_rows_of_a_table_are_ignored(tmp_path):
    # gpus_per_node 8: a group of 4 at stride 4 spans 16 ranks, two nodes
    rows = [("all_reduce", 2, 1, b, t) for b, t in AR21.items()] + [("all_reduce", 4, 4, 8, 1.0), ("all_reduce", 4, 4, 64, 2.0)]
    prof = _profile(tmp_path, rows)
    assert prof.coll_table.covers("all_reduce", 2, 1) and not prof.coll_table.covers("all_reduce", 4, 4)


def test_attention_table_taken_where_the_local_shape_was_measured(tmp_path):
    m = load_model("gpt-tiny")  # 8 heads, head_dim 8, seq 64
    prof = _profile(tmp_path, attn_rows=[(4, 4, 64, 8, "true", "forward", 0.002),
                                         (4, 4, 64, 8, "true", "forward_backward", 0.007),
                                         (4, 4, 64, 8, "false", "forward", 0.5)])
    gy = np.array([1, 2])
    fwd, bwd = K.attention_seconds(prof, m, gy, 4, 64)
    assert fwd[1] == pytest.approx(0.002) and bwd[1] == pytest.approx(0.005)  # 8/2 = 4 heads: measured
    # 8 heads of 4 sequences: twice the (sequence, head) pairs measured, beyond the table: twice the time
    assert fwd[0] == pytest.approx(0.004) and bwd[0] == pytest.approx(0.010)
    plain = load_profile("dgx-h100")
    f0, b0 = K.attention_seconds(plain, m, gy, 4, 32)  # a sequence length never measured: the rate
    f1, b1 = K.attention_seconds(prof, m, gy, 4, 32)
    assert np.allclose(f0, f1) and np.allclose(b0, b1)


def test_attention_interpolated_over_batch_times_heads(tmp_path):
    """Between measured batch x heads counts: log-log; equal counts (4 x 2, 1 x 8) averaged geometrically."""
    rows = [(1, 2, 64, 8, "true", "forward", 1e-3), (1, 2, 64, 8, "true", "forward_backward", 4e-3),
            (4, 2, 64, 8, "true", "forward", 2e-3), (4, 2, 64, 8, "true", "forward_backward", 8e-3),
            (1, 8, 64, 8, "true", "forward", 8e-3), (1, 8, 64, 8, "true", "forward_backward", 32e-3),
            (16, 2, 64, 8, "true", "forward", 16e-3), (16, 2, 64, 8, "true", "forward_backward", 64e-3)]
    prof = _profile(tmp_path, attn_rows=rows)
    tab = prof.attn_table
    f8 = np.sqrt(2e-3 * 8e-3)  # n = 8 measured twice: 4 x 2 and 1 x 8
    assert tab.seconds(2, 4, 64, 8)[0] == pytest.approx(f8)
    assert tab.seconds(4, 2, 64, 8) == pytest.approx((2e-3, 6e-3))  # measured: as measured
    n = 16  # between n = 8 and n = 32, log-log
    assert tab.seconds(8, 2, 64, 8)[0] == pytest.approx(np.exp(np.interp(np.log(n), np.log([8, 32]), np.log([f8, 16e-3]))))
    assert tab.seconds(1, 1, 64, 8)[0] == pytest.approx(0.5e-3)  # below the table: proportional to n
    assert tab.seconds(2, 2, 32, 8) is None and tab.seconds(2, 2, 64, 16) is None


def test_gemm_scale_applies_to_measured_attention(tmp_path):
    m = load_model("gpt-tiny")
    rows = [(4, 8, 64, 8, "true", "forward", 0.002), (4, 8, 64, 8, "true", "forward_backward", 0.006)]
    prof = _profile(tmp_path, attn_rows=rows, gemm_scale=2.0)
    fwd, bwd = K.attention_seconds(prof, m, np.array([1]), 4, 64)
    assert fwd[0] == pytest.approx(0.001) and bwd[0] == pytest.approx(0.002)


@pytest.mark.parametrize("which", ["network.intra_node.table", "compute.attention.table"])
def test_a_missing_table_file_is_one_sentence(tmp_path, which):
    prof = _profile(tmp_path, [("all_reduce", 2, 1, 8, 1e-4), ("all_reduce", 2, 1, 64, 2e-4)],
                    [(1, 1, 64, 8, "true", "forward", 1e-3), (1, 1, 64, 8, "true", "forward_backward", 3e-3)])
    assert prof.coll_table is not None and prof.attn_table is not None
    (tmp_path / ("c.csv" if which.startswith("network") else "a.csv")).unlink()
    with pytest.raises(UserError, match=which.replace(".", r"\.") + r"\.path.*cannot be read"):
        load_profile(str(tmp_path / "t.yaml"))


def test_bundled_cpu_profile_predicts_with_its_tables():
    prof = load_profile("localhost-cpu")
    assert prof.coll_table is not None and prof.attn_table is not None
    # a scalar all-reduce over 4 ranks costs what calibration measured for its smallest size, after
    # some compute burst between the shortest and the longest measured
    smallest = [float(np.exp(ls[0])) for _, lb, ls in prof.coll_table.curves["all_reduce", 4, 1]]
    assert len(smallest) >= 2  # ranks share the 2 cores here: calls were timed after bursts too
    t = _one(prof, "all_reduce", "d", 8, gx=1, gd=4)
    lat = prof.corrections.latency_scale  # the corrections scale the latency-bound part and add the 4-group's wait
    t = (t - float(C.call_overhead(prof.corrections, 4))) / lat
    assert min(smallest) * (1 - 1e-9) <= t <= max(smallest) * (1 + 1e-9)


def test_burst_length_interpolated_and_clamped(tmp_path):
    rows = [("all_reduce", 2, 1, 8, 1e-3, 0.0), ("all_reduce", 2, 1, 1024, 2e-3, 0.0),
            ("all_reduce", 2, 1, 8, 3e-3, 1e-3), ("all_reduce", 2, 1, 1024, 4e-3, 1e-3)]
    prof = _profile(tmp_path, rows)
    b = np.array([0.0, 5e-4, 1e-3, 1.0])
    got = C.table_seconds(prof, "all_reduce", 2, 1, np.full(4, 8.0), b)
    assert got == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])
    got = C.table_seconds(prof, "all_reduce", 2, 1, np.full(4, 1024.0), b)
    assert got == pytest.approx([2e-3, 3e-3, 4e-3, 4e-3])


def test_strides_pooled_only_where_ranks_share_cores(tmp_path):
    """A table timed after compute bursts comes from ranks sharing cores, none pinned: groups of one
    size at strides 1 and 2 measured the same thing, so both read the geometric mean of their runs at
    each burst level (at the mean burst length). A table without bursts (GPUs, NUMA) keeps strides apart."""
    rows = []
    for st, scale, b1 in ((1, 1.0, 1e-3), (2, 4.0, 3e-3)):
        for nbytes, t in ((8, 1e-3), (1024, 2e-3)):
            rows += [("all_reduce", 2, st, nbytes, scale * t, 0.0), ("all_reduce", 2, st, nbytes, scale * 2 * t, b1)]
    prof = _profile(tmp_path, rows)
    for st in (1, 2):
        got = C.table_seconds(prof, "all_reduce", 2, st, np.array([8.0, 1024.0, 8.0]), np.array([0.0, 0.0, 2e-3]))
        assert got == pytest.approx([2e-3, 4e-3, 4e-3])  # sqrt(1 * 4) x the stride-1 times; burst level (1 + 3) / 2 ms
    flat = [r for r in rows if r[5] == 0.0]
    prof = _profile(tmp_path, flat)
    assert C.table_seconds(prof, "all_reduce", 2, 1, np.array([8.0]), np.array([0.0]))[0] == pytest.approx(1e-3)
    assert C.table_seconds(prof, "all_reduce", 2, 2, np.array([8.0]), np.array([0.0]))[0] == pytest.approx(4e-3)


def test_a_dip_in_a_measured_curve_is_pooled_as_noise(tmp_path):
    prof = _profile(tmp_path, [("all_reduce", 2, 1, 8, 1e-3), ("all_reduce", 2, 1, 64, 0.5e-3),
                               ("all_reduce", 2, 1, 512, 1.5e-3)])
    assert _one(prof, "all_reduce", "x", 8) == pytest.approx(0.75e-3)
    assert _one(prof, "all_reduce", "x", 64) == pytest.approx(0.75e-3)
    assert _one(prof, "all_reduce", "x", 512) == pytest.approx(1.5e-3)


def test_collective_calls_per_micro_batch_counted_by_hand():
    from axoplan.planner import schedule
    from axoplan.planner.specs import Job

    m = load_model("gpt-tiny")  # 2 blocks of qkv, attn_out (transposed), fc1, fc2 (transposed); head normal
    prof = load_profile("dgx-h100")

    def calls(gx, gy, gz, ck=False):
        c = Candidates(*(np.array([v]) for v in (gx, gy, gz, 8 // (gx * gy * gz), 0, 1)), np.array([ck]))
        s = schedule.build(m, prof, Job(8, 8, m.seq_len), c, c.checkpointing, True, True, C.place(prof, c))
        return float(s.calls_per_micro_batch(ck)[0])

    # X only: every linear all-reduces once over X (in-features of normal, out-features of transposed
    # ones): 9; norm statistics forward and backward for 5 norms: 10
    assert calls(2, 1, 1) == 19
    # Y only: every linear once over Y: 9; embedding all-reduce 1; the loss's max and sums 2
    assert calls(1, 2, 1) == 12
    # Z only: per linear the weight all-gathered in the forward and again in the backward, its gradient
    # reduce-scattered (9 x 3); the embedding's all-gather and reduce-scatter (its backward needs no weight): 29
    assert calls(1, 1, 2) == 29
    # recompute: the block's forward collectives again, the backward's all-gathers kept from it: 29; over X
    # the forward all-reduces of the normal block linears (qkv, fc1: 4) and the block norms (4) again
    assert calls(1, 1, 2, ck=True) == 29
    assert calls(2, 1, 1, ck=True) == 19 + 4 + 4
    assert calls(1, 1, 1) == 0


def test_refit_keeps_tables_valid_from_another_folder(tmp_path):
    from axoplan.loop.refit import Report, new_profile_dict

    base = tmp_path / "src"
    base.mkdir()
    prof = _profile(base, [("all_reduce", 2, 1, 8, 1e-4), ("all_reduce", 2, 1, 64, 2e-4)],
                    [(1, 1, 64, 8, "true", "forward", 1e-3), (1, 1, 64, 8, "true", "forward_backward", 3e-3)])
    out = tmp_path / "elsewhere" / "new.yaml"
    out.parent.mkdir()
    from axoplan.loop.refit import PARAMS

    ident = {k: (0.0 if k.endswith("_s") else 1.0) for k in PARAMS}
    rep = Report([], ident, ident, 1, 1.0, 1.0, 1.0, 1.0, None, None, None, None)
    from pathlib import Path

    from axoplan.loop.profile_copy import with_tables

    d = new_profile_dict(prof, rep, out, "r.csv")
    # as refit writes it: the tables copied beside the new profile, so it stands without the old folder
    d, tables = with_tables(d, Path(prof.path), out.parent, prefix="new_")
    for name, (data, _) in tables.items():
        (out.parent / name).write_bytes(data)
    out.write_text(yaml.safe_dump(d))
    import shutil

    shutil.rmtree(base)
    again = load_profile(str(out))
    assert again.coll_table is not None and again.attn_table is not None


def test_no_overlap_efficiency_means_no_overlap(tmp_path):
    """eta 0: a background collective hides nothing, so the overlapped schedule costs what the serial
    one does; eta 1 is the plain max; anything between lies between."""
    from axoplan.planner.execution import Execution
    from axoplan.planner.batch import evaluate
    from axoplan.planner.space import enumerate_space
    from axoplan.planner.specs import Job

    m = load_model("gpt-tiny")
    c = enumerate_space(8, 16, checkpointing="both")
    job = Job(8, 16, m.seq_len)
    base = load_profile("dgx-h100")
    serial = evaluate(m, base, job, c, overlap=False).batch_time
    serial_dp = Execution(overlap_grad_reduce=False)  # one D call as in the serial run: the buckets add calls
    t = {eta: evaluate(m, base.replace(overlap_efficiency=eta), job, c, execution=serial_dp).batch_time
         for eta in (0.0, 0.5, 1.0)}
    assert np.allclose(t[0.0], serial, rtol=1e-12)
    assert np.all(t[1.0] <= t[0.5] + 1e-15) and np.all(t[0.5] <= t[0.0] + 1e-15)
    assert np.any(t[1.0] < t[0.0])


def test_overlap_efficiency_read_and_checked(tmp_path):
    d = yaml.safe_load(profile_paths()["dgx-h100"].read_text())
    d["network"]["overlap_efficiency"] = {"value": 0.25, "source": "test"}
    p = tmp_path / "o.yaml"
    p.write_text(yaml.safe_dump(d))
    assert load_profile(str(p)).overlap_efficiency == 0.25
    assert load_profile("dgx-h100").overlap_efficiency == 1.0
    d["network"]["overlap_efficiency"]["value"] = 1.5
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(UserError, match="overlap_efficiency' must be between 0 and 1"):
        load_profile(str(p))
