"""Every collective's message size and time, against numbers worked out by hand (reference §2, §3).

Grid of the hand examples: gx=2, gy=4, gz=3, gdata=2 (gx != gy, so normal and transposed layers
differ), order xyz on the Perlmutter-like fixture (4 GPUs per node) with inter-node latency set to
20 us so intra- and inter-node groups can be told apart:
  X: size 2, stride 1  -> inside a node, 76 GB/s, 9 us
  Y: size 4, stride 2  -> spans 8 GPUs, crosses nodes: 80 / min(2, 4) = 40 GB/s, 20 us
  Z: size 3, stride 8  -> crosses nodes: 80 / min(8, 4) = 20 GB/s, 20 us
  D: size 2, stride 24 -> crosses nodes: 20 GB/s, 20 us
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model

from axoplan.planner import comm as C
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import explain
from axoplan.planner.space import Candidates, factorizations4
from axoplan.planner.specs import LinearShape, ModelSpec

GB = 1e9
US = 1e-6
BW = {"x": 76 * GB, "y": 40 * GB, "z": 20 * GB, "d": 20 * GB}
LAT = {"x": 9 * US, "y": 20 * US, "z": 20 * US, "d": 20 * US}
P = {"x": 2, "y": 4, "z": 3, "d": 2}
T = 1000  # tokens per GPU per micro-batch


INSIDE = {"x": True, "y": False, "z": False, "d": False}


def ar_time(nbytes, axis):
    """Ring all-reduce; across nodes the latency takes NCCL's tree when that is fewer steps:
    Y (p=4) crossing nodes: 2*min(3, log2 4 = 2) = 4 latency steps instead of 6."""
    p = P[axis]
    steps = p - 1 if INSIDE[axis] else min(p - 1, int(np.ceil(np.log2(p))))
    return 2 * (p - 1) / p * nbytes / BW[axis] + 2 * steps * LAT[axis]


def ag_time(nbytes, axis):
    p = P[axis]
    return (p - 1) / p * nbytes / BW[axis] + (p - 1) * LAT[axis]


@pytest.fixture
def prof(write_profile):
    return load_profile(str(write_profile(inter_latency_us=20)))


@pytest.fixture
def groups(prof):
    c = Candidates(*(np.array([v]) for v in (2, 4, 3, 2, 0, 1)), np.array([False]))
    return C.place(prof, c)


def test_groups_of_the_hand_grid(groups):
    for a in "xyzd":
        assert groups.size[a][0] == P[a]
        assert groups.busbw[a][0] == pytest.approx(BW[a])
        assert groups.latency[a][0] == pytest.approx(LAT[a])
    assert [groups.stride[a][0] for a in "xyzd"] == [1, 2, 8, 24]


# layer, k, n, transposed -> (fwd AR axis, bytes), (bwd AR axis, bytes), weight block bytes
# bf16 (2 bytes); T = 1000
LINEAR_CASES = [
    # normal: in over X (2), out over Y (4). fwd AR over X of T*n/gy; bwd AR over Y of T*k/gx
    ("qkv", 96, 288, False, ("x", 1000 * 72 * 2), ("y", 1000 * 48 * 2), 48 * 72 * 2),
    ("fc1", 96, 384, False, ("x", 1000 * 96 * 2), ("y", 1000 * 48 * 2), 48 * 96 * 2),
    # transposed: in over Y (4), out over X (2). fwd AR over Y of T*n/gx; bwd AR over X of T*k/gy
    ("attn_out", 96, 96, True, ("y", 1000 * 48 * 2), ("x", 1000 * 24 * 2), 24 * 48 * 2),
    ("fc2", 384, 96, True, ("y", 1000 * 48 * 2), ("x", 1000 * 96 * 2), 96 * 48 * 2),
]


@pytest.mark.parametrize("name,k,n,tr,fwd,bwd,block", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_collectives_by_hand(prof, groups, name, k, n, tr, fwd, bwd, block):
    cols = C.linear_collectives(prof, groups, LinearShape(name, k, n, tr), np.array([float(T)]), 2)
    assert set(cols) == {"ar_fwd", "ar_bwd", "ag", "rs"}
    f, b, ag, rs = cols["ar_fwd"], cols["ar_bwd"], cols["ag"], cols["rs"]
    assert (f.kind, f.axis, f.phase) == ("all_reduce", fwd[0], "fwd")
    assert (b.kind, b.axis, b.phase) == ("all_reduce", bwd[0], "bwd")
    assert (ag.kind, ag.axis) == ("all_gather", "z")
    assert (rs.kind, rs.axis) == ("reduce_scatter", "z")
    assert f.nbytes[0] == fwd[1]
    assert b.nbytes[0] == bwd[1]
    assert ag.nbytes[0] == block and rs.nbytes[0] == block
    assert f.seconds[0] == pytest.approx(ar_time(fwd[1], fwd[0]), rel=1e-12)
    assert b.seconds[0] == pytest.approx(ar_time(bwd[1], bwd[0]), rel=1e-12)
    assert ag.seconds[0] == pytest.approx(ag_time(block, "z"), rel=1e-12)
    assert rs.seconds[0] == pytest.approx(ag_time(block, "z"), rel=1e-12)


def test_transposed_layer_is_not_the_normal_one_when_gx_ne_gy(prof, groups):
    """The authors' model passes transposed layers un-swapped; with gx != gy the sizes must differ."""
    t = C.linear_collectives(prof, groups, LinearShape("fc2", 384, 96, True), np.array([1000.0]), 2)
    n = C.linear_collectives(prof, groups, LinearShape("fc2", 384, 96, False), np.array([1000.0]), 2)
    assert t["ar_fwd"].axis == "y" and n["ar_fwd"].axis == "x"
    assert t["ar_fwd"].nbytes[0] == 1000 * 96 / 2 * 2 and n["ar_fwd"].nbytes[0] == 1000 * 96 / 4 * 2
    assert t["ar_bwd"].nbytes[0] == 1000 * 384 / 4 * 2 and n["ar_bwd"].nbytes[0] == 1000 * 384 / 2 * 2


def test_embedding_lm_head_loss_norms(prof, groups):
    # hidden 96, heads 12, vocab 1000 padded to 1024
    m = ModelSpec("m", n_layers=2, hidden=96, n_heads=12, vocab=1000, vocab_multiple=128).validate()
    tok = np.array([float(T)])
    emb = C.embedding_collectives(prof, groups, m, tok, 2)
    block = (1024 // 4) * (96 // 2) * 2  # [V/gy, H/gx] bf16
    assert block == 24576
    assert (emb["ag"].kind, emb["ag"].axis, emb["ag"].nbytes[0]) == ("all_gather", "z", block)
    assert (emb["rs"].kind, emb["rs"].axis, emb["rs"].nbytes[0]) == ("reduce_scatter", "z", block)
    assert (emb["ar_fwd"].kind, emb["ar_fwd"].axis, emb["ar_fwd"].nbytes[0]) == ("all_reduce", "y", 1000 * 48 * 2)
    assert emb["ar_fwd"].seconds[0] == pytest.approx(ar_time(96000, "y"))

    lm = C.linear_collectives(prof, groups, m.lm_head(), tok, 2)
    assert m.lm_head().k == 96 and m.lm_head().n == 1024 and not m.lm_head().transposed
    assert (lm["ar_fwd"].axis, lm["ar_fwd"].nbytes[0]) == ("x", 1000 * 256 * 2)  # logits [T, V/gy]
    assert (lm["ar_bwd"].axis, lm["ar_bwd"].nbytes[0]) == ("y", 1000 * 48 * 2)
    assert lm["ag"].nbytes[0] == 48 * 256 * 2

    gmax, sums = C.loss_collectives(prof, groups, tok)
    assert (gmax.kind, gmax.axis, gmax.nbytes[0]) == ("all_reduce", "y", 1000 * 1 * 4)  # per-token max
    assert (sums.kind, sums.axis, sums.nbytes[0]) == ("all_reduce", "y", 1000 * 2 * 4)  # sum of exp, target
    assert gmax.seconds[0] == pytest.approx(ar_time(4000, "y"))
    assert sums.seconds[0] == pytest.approx(ar_time(8000, "y"))

    nf, nb = C.norm_collectives(prof, groups, m, tok, "norm")
    for c in (nf, nb):
        assert (c.kind, c.axis, c.nbytes[0]) == ("all_reduce", "x", 1000 * 2 * 4)
        assert c.seconds[0] == pytest.approx(ar_time(8000, "x"))
    rms = ModelSpec("r", n_layers=2, hidden=96, n_heads=12, vocab=1000, norm="rmsnorm").validate()
    rf, rb = C.norm_collectives(prof, groups, rms, tok, "norm")
    assert rf.nbytes[0] == 1000 * 1 * 4 and rb.nbytes[0] == 4000


def test_data_parallel_collectives(prof, groups):
    dp = C.data_parallel_collectives(prof, groups, np.array([1e6]), np.array([1e3]))
    got = {(c.layer, c.axis): c for c in dp}
    g = got[("gradients", "d")]
    assert g.kind == "all_reduce" and g.nbytes[0] == 4e6  # fp32
    assert g.seconds[0] == pytest.approx(ar_time(4e6, "d"))
    # replicated parameters, token count and loss over Z and D together (6 GPUs): as slow as the slower
    # of Z and D (20 GB/s, 20 us), crossing nodes, so tree latency: 2*min(5, ceil(log2 6) = 3) steps
    zd_bw, zd_steps = 20 * GB, 3
    for layer, nbytes in (("replicated", 4e3), ("token count", 8.0), ("loss", 8.0)):
        c = got[(layer, "zd")]
        assert c.kind == "all_reduce" and c.nbytes[0] == nbytes
        assert c.seconds[0] == pytest.approx(2 * 5 / 6 * nbytes / zd_bw + 2 * zd_steps * 20 * US)
    # the gradient norm over all 48 GPUs: slowest axis 20 GB/s, latency 20 us, 2*min(47, 6) steps
    c = got[("gradient norm", "all")]
    assert c.seconds[0] == pytest.approx(2 * 47 / 48 * 8 / (20 * GB) + 2 * 6 * 20 * US)
    # the barrier closing each timed step: a 4-byte all-reduce over all 48
    c = got[("step barrier", "all")]
    assert c.seconds[0] == pytest.approx(2 * 47 / 48 * 4 / (20 * GB) + 2 * 6 * 20 * US)
    assert len(dp) == 6


def test_shard_elems_pads_to_a_multiple_of_gz():
    assert list(C.shard_elems(np.array([12, 13, 1]), 3)) == [4, 5, 1]


# ---- ring formulas -------------------------------------------------------------------
def test_ring_time_formulas(pm):
    p = np.array([1, 2, 4, 8])
    M, bw, a = 1e9, 100e9, 5e-6
    ar = C.ring_time(pm, "all_reduce", M, p, bw, a)
    ag = C.ring_time(pm, "all_gather", M, p, bw, a)
    rs = C.ring_time(pm, "reduce_scatter", M, p, bw, a)
    # p = 1 is no communication at all
    assert ar[0] == 0 and ag[0] == 0 and rs[0] == 0
    # p = 2: all-reduce 2*(1/2)*M/bw + 2*alpha = 0.01 + 1e-5
    assert ar[1] == pytest.approx(0.01 + 1e-5)
    # p = 4: all-reduce 2*(3/4)*M/bw + 6*alpha ; all-gather (3/4)*M/bw + 3*alpha
    assert ar[2] == pytest.approx(0.015 + 30e-6)
    assert ag[2] == pytest.approx(0.0075 + 15e-6)
    assert rs[2] == pytest.approx(0.0075 + 15e-6)
    # p = 8: all-gather (7/8)*0.01 + 7*alpha
    assert ag[3] == pytest.approx(0.00875 + 35e-6)
    # an infinite bandwidth (size-1 group) still gives 0, not nan
    assert C.ring_time(pm, "all_reduce", M, np.array([1]), np.inf, a)[0] == 0


def test_ring_time_uses_per_collective_scales(write_profile):
    prof = load_profile(str(write_profile(
        collectives={"all_reduce": {"bandwidth_scale": 0.5, "latency_scale": 2.0},
                     "all_gather": {"bandwidth_scale": 2.0, "latency_scale": 0.0}})))
    ar = C.ring_time(prof, "all_reduce", 1e9, np.array([4]), 100e9, 5e-6)[0]
    ag = C.ring_time(prof, "all_gather", 1e9, np.array([4]), 100e9, 5e-6)[0]
    rs = C.ring_time(prof, "reduce_scatter", 1e9, np.array([4]), 100e9, 5e-6)[0]
    assert ar == pytest.approx(1.5e9 / 50e9 + 6 * 10e-6)
    assert ag == pytest.approx(0.75e9 / 200e9)
    assert rs == pytest.approx(0.75e9 / 100e9 + 3 * 5e-6)


# ---- explain()'s collectives table ---------------------------------------------------------
def test_explain_collectives_table_by_hand(pm, monkeypatch):
    """gpt-tiny-like model (L=2, H=64, 8 heads, V=256, S=64) on grid 2x4x2x2, order xyz, global batch 8,
    micro-batch 1, no checkpointing: T = 64 tokens, grad_acc = 8/(2*2*1) = 2.
    Bandwidths: X 76 (size 2 stride 1), Y 40 (size 4 stride 2), Z 20 (size 2 stride 8), D 20 (stride 16)."""
    m = tiny_model()
    ex = explain(m, pm, 32, 8, (2, 4, 2, 2), order="xyz", micro_batch=1, checkpointing=False)
    tab = ex.collectives
    assert (tab["group_size"] > 1).all()
    # zd: Z and D together (4 GPUs, as slow as the slower member); all: the 32 GPUs
    bw = {"x": 76.0, "y": 40.0, "z": 20.0, "d": 20.0, "zd": 20.0, "all": 20.0}
    lat = {a: 9e-6 for a in bw}
    size = {"x": 2, "y": 4, "z": 2, "d": 2, "zd": 4, "all": 32}
    stride = {"x": 1, "y": 2, "z": 8, "d": 16, "zd": 8, "all": 1}
    inside = {"x": True, "y": False, "z": False, "d": False, "zd": False, "all": False}
    ga, L = 2, 2
    expect = {
        # (layer, phase, collective, axis): (bytes, calls per step)
        ("qkv", "fwd", "all_reduce", "x"): (64 * 48 * 2, ga * L),  # T * (192/gy) * 2
        ("qkv", "bwd", "all_reduce", "y"): (64 * 32 * 2, ga * L),  # T * (64/gx) * 2
        ("qkv", "fwd", "all_gather", "z"): (32 * 48 * 2, 2 * ga * L),
        ("qkv", "bwd", "reduce_scatter", "z"): (32 * 48 * 2, ga * L),
        ("attn_out", "fwd", "all_reduce", "y"): (64 * 32 * 2, ga * L),  # T * (64/gx) * 2
        ("attn_out", "bwd", "all_reduce", "x"): (64 * 16 * 2, ga * L),  # T * (64/gy) * 2
        ("attn_out", "fwd", "all_gather", "z"): (16 * 32 * 2, 2 * ga * L),
        ("fc1", "fwd", "all_reduce", "x"): (64 * 64 * 2, ga * L),
        ("fc1", "bwd", "all_reduce", "y"): (64 * 32 * 2, ga * L),
        ("fc2", "fwd", "all_reduce", "y"): (64 * 32 * 2, ga * L),
        ("fc2", "bwd", "all_reduce", "x"): (64 * 64 * 2, ga * L),  # T * (256/gy) * 2
        ("fc2", "bwd", "reduce_scatter", "z"): (64 * 32 * 2, ga * L),
        ("lm_head", "fwd", "all_reduce", "x"): (64 * 64 * 2, ga),  # T * (256/gy) * 2
        ("lm_head", "bwd", "all_reduce", "y"): (64 * 32 * 2, ga),
        ("embedding", "fwd", "all_reduce", "y"): (64 * 32 * 2, ga),
        ("lm_head", "fwd", "all_gather", "z"): (32 * 64 * 2, 2 * ga),  # [H/gx, V/gy] block
        ("lm_head", "bwd", "reduce_scatter", "z"): (32 * 64 * 2, ga),
        ("embedding", "fwd", "all_gather", "z"): (64 * 32 * 2, ga),  # [V/gy, H/gx] block
        ("embedding", "bwd", "reduce_scatter", "z"): (64 * 32 * 2, ga),
        # norms: 2 per block forward, plus the final norm
        ("norm", "fwd", "all_reduce", "x"): (64 * 2 * 4, ga * (2 * L + 1)),
        ("norm", "bwd", "all_reduce", "x"): (64 * 2 * 4, ga * (2 * L + 1)),
        # fp32 gradient shards: the trainer's buckets, all-reduced inside the last backward (checked below)
        # replicated: (2L+1) norm weights of H/gx plus S*H/gx learned positions = 160 + 2048
        ("replicated", "step", "all_reduce", "zd"): (2208 * 4, 1),
        ("token count", "step", "all_reduce", "zd"): (8, 1),
        ("loss", "step", "all_reduce", "zd"): (8, 1),
        ("gradient norm", "step", "all_reduce", "all"): (8, 1),
    }
    # the loss: two fp32 all-reduces over Y per micro-batch, the max then the sums (T x 1 and T x 2)
    loss_rows = tab[(tab.layer == "loss") & (tab.phase == "fwd")]
    assert sorted(loss_rows.bytes) == [64 * 1 * 4, 64 * 2 * 4] and (loss_rows.calls_per_step == ga).all()
    # fp32 gradient shards over D: per block (1536 + 512 + 2048 + 2048) / gz = 3072 elements, x2 layers, the
    # LM head 2048/2 and the embedding 2048/2: 8192 elements, under the 25 MiB bucket cap: one bucket, one call
    grads = tab[tab.layer == "gradients"]
    assert list(zip(grads.phase, grads.axis, grads.bytes, grads.calls_per_step)) == [("bwd", "d", 8192 * 4, 1)]
    # buckets closing at any size (a cap of 4 bytes): the LM head, each block (L calls), the embedding
    monkeypatch.setattr(C, "DP_BUCKET_BYTES", 4)
    split = explain(m, pm, 32, 8, (2, 4, 2, 2), order="xyz", micro_batch=1, checkpointing=False).collectives
    grads = split[split.layer == "gradients"]
    assert list(zip(grads.bytes, grads.calls_per_step)) == [(1024 * 4, 1), (3072 * 4, L), (1024 * 4, 1)]
    for r in grads.itertuples(index=False):
        t = 2 * (2 - 1) / 2 * r.bytes / (bw["d"] * 1e9) + 2 * 1 * lat["d"]
        assert r.time_per_call_s == pytest.approx(t, rel=1e-9) and r.total_s == pytest.approx(t * r.calls_per_step)
    rows = {(r.layer, r.phase, r.collective, r.axis): r for r in tab.itertuples(index=False)}
    for key, (nbytes, calls) in expect.items():
        assert key in rows, f"missing {key}"
        r = rows[key]
        ax = key[3]
        assert r.bytes == nbytes, key
        assert r.calls_per_step == calls, key
        assert r.group_size == size[ax] and r.stride == stride[ax], key
        assert r.busbw_gbs == pytest.approx(bw[ax]), key
        p = size[ax]
        if key[2] == "all_reduce":
            steps = p - 1 if inside[ax] else min(p - 1, int(np.ceil(np.log2(p))))  # tree across nodes
            t = 2 * (p - 1) / p * nbytes / (bw[ax] * 1e9) + 2 * steps * lat[ax]
        else:
            t = (p - 1) / p * nbytes / (bw[ax] * 1e9) + (p - 1) * lat[ax]
        assert r.time_per_call_s == pytest.approx(t, rel=1e-9), key
        assert r.total_s == pytest.approx(t * calls, rel=1e-9), key


def test_explain_agrees_with_linear_collectives(pm):
    """The table's rows for each block layer are exactly what linear_collectives computes."""
    m = tiny_model()
    ex = explain(m, pm, 32, 8, (2, 4, 2, 2), order="yzx", micro_batch=2, checkpointing=True)
    c = Candidates(*(np.array([v]) for v in (2, 4, 2, 2, 3, 2)), np.array([True]))  # ORDERS[3] == "yzx"
    g = C.place(pm, c)
    rows = {(r.layer, r.phase, r.collective): r for r in ex.collectives.itertuples(index=False)}
    for lin in m.block_linears():
        for cl in C.linear_collectives(pm, g, lin, np.array([128.0]), 2).values():
            r = rows[(lin.name, cl.phase, cl.kind)]
            assert r.axis == cl.axis and r.bytes == cl.nbytes[0]
            assert r.time_per_call_s == pytest.approx(cl.seconds[0])
    # checkpointing: the forward all-reduces run again in the recompute
    ga = 8 // (2 * 2 * 2)
    assert rows[("qkv", "fwd", "all_reduce")].calls_per_step == ga * 2 * 2


@pytest.mark.parametrize("ckpt", [False, True])
def test_explain_collectives_add_up_to_comm_s(pm, ckpt):
    """Every second of communication the rank table reports is listed, call by call, in explain."""
    m = tiny_model()
    ex = explain(m, pm, 32, 16, (2, 2, 4, 2), order="zxy", micro_batch=1, checkpointing=ckpt)
    assert ex.collectives["total_s"].sum() == pytest.approx(ex.summary["comm_s"][0], rel=1e-9)


# ---- the authors' performance model (reference §3) ---------------------------------------------
def authors_bw(ip: int, my: int) -> float:
    """AxoNN's Perlmutter table (axonn_perf_model_bandwidth_table.csv), GB/s -> bytes/s."""
    if ip == 1:
        return {2: 76, 4: 225}.get(my, 80) * GB
    if ip == 2:
        return (76 if my == 2 else 40) * GB
    return 20 * GB


def authors_layer_time(H, K, B, S, gx, gy, gz, gd):
    """Communication seconds per batch of one normal layer H -> K*H, bf16, their four terms
    (X with the recomputed forward), no latency."""
    def t(p, ip, nbytes):
        return 0.0 if p == 1 else nbytes / authors_bw(ip, p)
    d = t(gd, gx * gy * gz, 4 * (gd - 1) / gd * K * H * H / (gx * gy * gz) * 2)
    z = t(gz, gx * gy, 3 * (gz - 1) / gz * K * H * H / (gx * gy) * 2 * (B // (gd * gz)))
    y = t(gy, gx, 2 * (gy - 1) / gy * (B / (gd * gz)) * S * H / gx * 2)
    x = t(gx, 1, 4 * (gx - 1) / gx * (B / (gd * gz)) * S * K * H / gy * 2)
    return x + y + z + d


@pytest.mark.parametrize("grid", [tuple(int(v) for v in g) for g in factorizations4(32)])
@pytest.mark.parametrize("K", [3, 4])
def test_reproduces_the_authors_formula_for_normal_layers(write_profile, grid, K):
    """Order xyz, AxoNN's bandwidth table, no latency, checkpointing on, micro-batch 1, one layer."""
    gx, gy, gz, gd = grid
    H, S, B = 4096, 2048, 64
    prof = load_profile(str(write_profile(intra_latency_us=0, inter_latency_us=0)))
    c = Candidates(*(np.array([v]) for v in (gx, gy, gz, gd, 0, 1)), np.array([True]))
    g = C.place(prof, c)
    cols = C.linear_collectives(prof, g, LinearShape("fc1", H, K * H, False), np.array([float(S)]), 2)
    ga = B // (gd * gz)
    per_mb = 2 * cols["ar_fwd"].seconds + cols["ar_bwd"].seconds + 2 * cols["ag"].seconds + cols["rs"].seconds
    shard = C.shard_elems((H // gx) * (K * H // gy), gz)
    dp = C.data_parallel_collectives(prof, g, np.array([float(shard)]), np.array([0.0]))[0].seconds
    ours = float(ga * per_mb[0] + dp[0])
    assert ours == pytest.approx(authors_layer_time(H, K, B, S, gx, gy, gz, gd), rel=1e-12)


def _ours_layer_time(prof, lin, grid, H, S, B):
    gx, gy, gz, gd = grid
    c = Candidates(*(np.array([v]) for v in (gx, gy, gz, gd, 0, 1)), np.array([True]))
    g = C.place(prof, c)
    cols = C.linear_collectives(prof, g, lin, np.array([float(S)]), 2)
    per_mb = 2 * cols["ar_fwd"].seconds + cols["ar_bwd"].seconds + 2 * cols["ag"].seconds + cols["rs"].seconds
    in_g, out_g = (gy, gx) if lin.transposed else (gx, gy)
    shard = C.shard_elems((lin.k // in_g) * (lin.n // out_g), gz)
    dp = C.data_parallel_collectives(prof, g, np.array([float(shard)]), np.array([0.0]))[0].seconds
    return float(B // (gd * gz) * per_mb[0] + dp[0])


def test_transposed_layers_differ_from_the_authors_formula_when_gx_ne_gy(write_profile):
    """Their model scores the attention output (H -> H) as a normal layer; the real transposed layer
    all-reduces T*H/gx over Y forward (twice with recompute) and T*H/gy over X backward."""
    H, S, B = 4096, 2048, 64
    prof = load_profile(str(write_profile(intra_latency_us=0, inter_latency_us=0)))
    lin = LinearShape("attn_out", H, H, True)
    for grid in [(1, 4, 2, 4), (4, 1, 2, 4), (2, 8, 1, 2), (8, 2, 2, 1)]:
        ours = _ours_layer_time(prof, lin, grid, H, S, B)
        theirs = authors_layer_time(H, 1, B, S, *grid)
        assert abs(ours - theirs) > 1e-3 * theirs, grid
    a = _ours_layer_time(prof, lin, (1, 4, 2, 4), H, S, B)
    # transposed with gx=1, gy=4: forward all-reduce over Y (ip=1, 4 GPUs: 225 GB/s) of T*H bytes, twice;
    # backward over X: nothing. Z and D as for any layer of H*H/4 elements.
    T = S * B // (2 * 4)
    expect = (2 * 2 * 3 / 4 * T * H * 2 / 225e9                                   # Y, fwd + recompute
              + 3 * 1 / 2 * (H * H / 4) * 2 / 20e9 * (B // 8)                     # Z: ip = 4 -> 20 GB/s
              + 2 * 3 / 4 * (H * H / 8) * 4 / 20e9)                                # D fp32: ip = 8 -> 20 GB/s
    assert a == pytest.approx(expect, rel=1e-12)
