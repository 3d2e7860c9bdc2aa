"""Collectives across nodes by NCCL's protocol model (issue 24): protocol and algorithm choice by size,
NIC sharing among groups that leave a node at once, point-to-point sends. Every expected number is
worked by hand from the test profile's fields below."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from axoplan.errors import UserError
from axoplan.planner import comm as C
from axoplan.planner.profile_reader import load_profile, profile_from_dict
from axoplan.planner.space import Candidates
from tests.conftest import profile_dict

US = 1e-6
GB = 1e9

# 4 GPUs per node, one ring leaving a node 80 GB/s (conftest); LL capped at 20 GB/s on 2 nodes, 10 on more
PROTOCOLS = {
    "source": "test", "channels": 4, "ring_plateau": 1.5, "two_node_tree_factor": 2.0, "ll_max_busbw_gbs": [20, 10],
    "ring": [{"protocol": "LL", "base_us": 6, "intra_us": 1, "net_us": 3, "bw_factor": 0.5},
             {"protocol": "Simple", "base_us": 8, "intra_us": 4, "net_us": 10, "bw_factor": 1.0}],
    "tree": [{"protocol": "Simple", "base_us": 8, "intra_us": 4, "net_us": 10, "bw_factor": 1.0}],
}


def prof(protocols=PROTOCOLS):
    d = profile_dict()
    if protocols is not None:
        d["network"]["protocols"] = protocols
    return profile_from_dict(d, "test profile")


def across(p, kind, nbytes, size, stride=1):
    size, stride = np.array([size]), np.array([stride])
    m, n = C.group_nodes(p, size, stride)
    return float(C.protocol_seconds(p, kind, nbytes, size, m, n, p.group_busbw(size, stride))[0])


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 13), st.integers(1, 19), st.sampled_from([2, 3, 4, 6, 8, 9]))
def test_group_nodes_counts_the_nodes_a_group_spans(size, stride, n):
    """Across nodes, group_nodes gives the most nodes any group of the axis spans (blocks of size x stride
    consecutive ranks, stride groups interleaved in each), as counted rank by rank, and NCCL's members per node,
    size // nodes; where the stride divides a node and the blocks line up, n / stride members on each."""
    if size * stride <= n and n % (size * stride) == 0:
        return  # inside a node
    p = prof().replace(gpus_per_node=n)
    per_node, nodes = (float(x[0]) for x in C.group_nodes(p, np.array([size]), np.array([stride])))
    span, most = size * stride, 0
    for block in range(4 * n + 4):
        for i in range(stride):
            most = max(most, len({(block * span + i + k * stride) // n for k in range(size)}))
    assert nodes == most and per_node == max(size // most, 1)
    if stride < n and n % stride == 0 and span % n == 0:
        assert per_node == n // stride


def test_small_messages_take_ll_large_ones_simple():
    """All-gather over 8 GPUs on 2 nodes: 7 steps, 1 across. LL: 6 + 6 x 1 + 3 = 15 us at min(0.5 x 80, 20)
    = 20 GB/s; Simple: 8 + 6 x 4 + 10 = 42 us at 80 GB/s. Ring volume 7/8 of the buffer."""
    p = prof()
    assert across(p, "all_gather", 8e5, 8) == pytest.approx((15 + 7e5 / 20e9 / US) * US)  # LL: 50 us
    assert across(p, "all_gather", 8e6, 8) == pytest.approx((42 + 7e6 / 80e9 / US) * US)  # Simple: 129.5 us


def test_all_reduce_takes_the_tree_with_its_correction():
    """All-reduce over 8 GPUs on 2 nodes. Ring Simple: (8 + 12 x 4 + 2 x 10) x 1.5 = 114 us at 80 GB/s over
    14/8 of the buffer; tree Simple: 8 + 2 x (3 x 4 + 1 x 10) = 52 us, over half of 2 x 80 GB/s (2 nodes),
    slowed to 0.8 at 64 MiB (NCCL's treeCorrectionFactor[Simple][20]), 1.0 beyond 256 MiB."""
    p = prof()
    nb = 2.0**26
    assert across(p, "all_reduce", nb, 8) == pytest.approx((52 + nb / (0.5 * 160e9 * 0.8) / US) * US)
    nb = 2.0**32
    assert across(p, "all_reduce", nb, 8) == pytest.approx((52 + nb / 80e9 / US) * US)
    # without a tree the ring: 114 us + 14/8 x 2^32 / 80 GB/s
    no_tree = prof(dict(PROTOCOLS, tree=[]))
    assert across(no_tree, "all_reduce", nb, 8) == pytest.approx((114 + 1.75 * nb / 80e9 / US) * US)


def test_tree_depth_is_nccls_log2i_of_the_nodes():
    """NCCL's tree latency counts log2i(nNodes) network hops, the floor: 12 GPUs on 3 nodes pay 1 hop, as 2
    nodes do (ceil would give 2), 20 on 5 nodes 2. Tree Simple on 3 nodes: 8 + 2 x (3 x 4 + 1 x 10) = 52 us,
    on 5 nodes 8 + 2 x (3 x 4 + 2 x 10) = 72 us, each over half of 80 GB/s (more than 2 nodes) at 4 GiB,
    where the tree correction is 1 (the ring's network steps made slow, so that the tree is taken)."""
    p = prof(dict(PROTOCOLS, ring=[dict(PROTOCOLS["ring"][1], net_us=1e6)]))
    nb = 2.0**32
    assert across(p, "all_reduce", nb, 12) == pytest.approx((52 + nb / 40e9 / US) * US)
    assert across(p, "all_reduce", nb, 20) == pytest.approx((72 + nb / 40e9 / US) * US)


NVLS = {"protocol": "Simple", "base_us": 0, "intra_us": 25, "net_us": 20.9, "per_channel_gbs": [57.7, 45.5]}


def test_all_reduce_takes_nvls_tree_where_the_profile_has_it():
    """NVLSTree over 8 GPUs on 2 nodes (4 members per node, 4 heads): 25 + 2 x 1 x 20.9 = 66.8 us, the ring's
    14/8 of the buffer over min(2 x 80, 4 x 57.7) = 160 GB/s (x NCCL's tree correction 0.8 at 64 MiB), faster
    than the tree's 52 us + the buffer over 80 GB/s. With one member per node (2 GPUs 4 apart) no NVLSTree."""
    p = prof(dict(PROTOCOLS, nvls_tree=[NVLS]))
    nb = 2.0**32
    assert across(p, "all_reduce", nb, 8) == pytest.approx((66.8 + 1.75 * nb / 160e9 / US) * US)
    nb = 2.0**26
    assert across(p, "all_reduce", nb, 8) == pytest.approx((66.8 + 1.75 * nb / (160e9 * 0.8) / US) * US)
    # all-gathers and single members per node are as without it
    for kind, size, stride in (("all_gather", 8, 1), ("all_reduce", 2, 4)):
        assert across(p, kind, nb, size, stride) == across(prof(), kind, nb, size, stride)
    # on 4 nodes the head's cap is 45.5 and the NIC is not doubled: min(80, 4 x 45.5) = 80 GB/s, 25 + 4 x 20.9 us
    t4 = (108.6 + 1.875 * 2.0**32 / 80e9 / US) * US
    assert across(p, "all_reduce", 2.0**32, 16) == pytest.approx(t4)


def test_a_plugins_net_latency_is_added_to_every_network_step():
    """net_latency_us 5 (what aws-ofi-nccl reports on EFA, NCCL adds to each network step, twice for Simple):
    the all-gather of test_small_messages_take_ll_large_ones_simple pays LL 6 + 6 x 1 + (3 + 5) = 20 us and
    Simple 8 + 6 x 4 + (10 + 2 x 5) = 52 us."""
    p = prof(dict(PROTOCOLS, net_latency_us=5))
    assert across(p, "all_gather", 8e5, 8) == pytest.approx((20 + 7e5 / 20e9 / US) * US)
    assert across(p, "all_gather", 8e6, 8) == pytest.approx((52 + 7e6 / 80e9 / US) * US)


def test_nvls_tree_fields_are_checked():
    for bad in ([dict(NVLS, protocol="LL")], [NVLS, NVLS]):
        with pytest.raises(UserError, match="nvls_tree"):
            prof(dict(PROTOCOLS, nvls_tree=bad))
    from axoplan.planner import gpu_physics
    with pytest.raises(ValueError, match="Hopper"):
        gpu_physics.nccl_protocols(80, "amd", nvls=True)
    assert "nvls_tree" not in gpu_physics.nccl_protocols(90, "intel")


def test_groups_leaving_a_node_at_once_share_its_nics():
    """AxoNN's table (80, 40, 20 GB/s as 1, 2, 4 rings leave a node): all-gathers over 8 GPUs at stride 1,
    2 and 4 on 4-GPU nodes; at 800 MB the bandwidth term dominates and the times go 1 : 2 : 4 less the
    latency: Simple 8 + 6 x 4 + 10, 8 + 4 x 4 + 3 x 10, 8 + 7 x 10 us."""
    p = prof()
    nb = 8e8
    t = [across(p, "all_gather", nb, 8, s) for s in (1, 2, 4)]
    assert t == pytest.approx([(lat + 7e8 / bw / US) * US for lat, bw in ((42, 80e9), (54, 40e9), (78, 20e9))])


def test_one_ring_is_capped_at_ring_busbw():
    """inter_node.ring_busbw_gbs (Jean Zay's NCCL: one NIC per direction per ring): 30 GB/s caps a ring that
    would get the node's 80 or 40 GB/s (1 or 2 rings leaving), not one already below it (4 rings: 20); the
    same cap on a lone point-to-point send (Simple 8 + 10 us); without the key the share alone."""
    d = profile_dict()
    d["network"]["protocols"] = PROTOCOLS
    d["network"]["inter_node"]["ring_busbw_gbs"] = 30
    p = profile_from_dict(d, "test profile")
    assert p.group_busbw(np.array([8, 8, 8]), np.array([1, 2, 4])) == pytest.approx([30e9, 30e9, 20e9])
    assert p.group_busbw(np.array([4]), np.array([1]))[0] == prof().group_busbw(np.array([4]), np.array([1]))[0]
    assert C.p2p_seconds(p, 1e6, True) == pytest.approx((18 + 1e6 / 30e9 / US) * US)
    assert prof().inter_ring_busbw == float("inf")


def test_place_uses_the_protocol_model_only_across_nodes():
    p = prof()
    flat = prof(None)

    def one(q, gx, gd, nbytes):
        c = Candidates(*(np.array([v]) for v in (gx, 1, 1, gd, 0, 1)), np.array([False]))
        return float(C._coll(q, C.place(q, c), "t", "fwd", "all_gather", "x", nbytes).seconds[0])

    # X of 4 inside a node: the same time with and without network.protocols
    assert one(p, 4, 2, 8e6) == one(flat, 4, 2, 8e6)
    # X of 8 across 2 nodes: the protocol model's Simple ring
    assert one(p, 8, 1, 8e6) == pytest.approx(across(p, "all_gather", 8e6, 8))
    assert one(p, 8, 1, 8e6) != pytest.approx(one(flat, 8, 1, 8e6))


def test_p2p_inside_and_across_nodes():
    """Inside: 9 us (intra latency, per-step model) + bytes at the 2-GPU group's 76 GB/s. Across, alone:
    Simple 8 + 10 us at 80 GB/s or LL 6 + 3 us at min(40, 20); four pairs leaving at once share 80 GB/s."""
    p = prof()
    nb = 1e6
    t = C.p2p_seconds(p, np.array([nb, nb, nb]), np.array([False, True, True]), np.array([1, 1, 4]))
    assert t == pytest.approx([(9 + 1e6 / 76e9 / US) * US, (18 + 1e6 / 80e9 / US) * US, (18 + 1e6 / 20e9 / US) * US])
    # a small message takes LL: 9 us + 1 kB / 20 GB/s
    assert C.p2p_seconds(p, 1e3, True) == pytest.approx((9 + 1e3 / 20e9 / US) * US)
    # without network.protocols: the profile's inter-node latency and bandwidth
    assert C.p2p_seconds(prof(None), nb, True) == pytest.approx((9 + 1e6 / 80e9 / US) * US)


def test_protocol_fields_are_checked():
    with pytest.raises(UserError, match="network.protocols.rings"):
        prof(dict(PROTOCOLS, rings=[]))
    with pytest.raises(UserError, match=r"ring\[0\].protocol"):
        prof(dict(PROTOCOLS, ring=[dict(PROTOCOLS["ring"][0], protocol="LL64")]))
    with pytest.raises(UserError, match="bw_factor"):
        prof(dict(PROTOCOLS, ring=[dict(PROTOCOLS["ring"][0], bw_factor=1.5)]))
    with pytest.raises(UserError, match="source"):
        prof({k: v for k, v in PROTOCOLS.items() if k != "source"})
    with pytest.raises(UserError, match="ll_max_busbw_gbs"):
        prof(dict(PROTOCOLS, ll_max_busbw_gbs=[20]))


def test_bundled_dgx_a100_across_two_and_sixty_four_nodes():
    """dgx-a100: 1 GB all-reduced over 2 nodes is bandwidth-bound near the 192 GB/s plateau; 1 MB over 64 nodes
    pays latency (LL on a ring or a tree), far below it."""
    p = load_profile("dgx-a100")
    assert p.physics.protocols is not None
    busbw = 2 * 15 / 16 * 1e9 / across(p, "all_reduce", 1e9, 16) / GB
    assert 150 < busbw <= 192 * 1.001
    small = 2 * 511 / 512 * 1e6 / across(p, "all_reduce", 1e6, 512) / GB
    assert small < 30


def test_bundled_dgx_protocol_rows_are_nccls_defaults():
    """The DGX profiles serialise gpu_physics.nccl_protocols (the one definition, which calibration also
    writes): same rows for their GPU generation and host CPU (NVLSTree on the Hopper boards, whose NVSwitch
    does multicast), plus their measured latency_scale."""
    from axoplan.planner import gpu_physics
    from axoplan.planner.profile_reader import _Reader

    for name, cap, cpu in (("dgx-a100", 80, "amd"), ("dgx-h100", 90, "intel"), ("dgx-h200", 90, "intel")):
        want = gpu_physics.parse({"network": {"protocols": gpu_physics.nccl_protocols(cap, cpu, nvls=cap == 90)}},
                                 _Reader("t")).protocols
        got = load_profile(name).physics.protocols
        assert got.ring == want.ring and got.tree == want.tree and got.ll_max == want.ll_max
        assert got.nvls_tree == want.nvls_tree and bool(got.nvls_tree) == (cap == 90)
        assert got.latency_scale == 1.93 and want.latency_scale == 1.0


def test_dgx_latency_scale_is_the_fit_to_every_published_ndr_sweep():
    """The DGX profiles' network.protocols.latency_scale is what `collective_fidelity.py --fit-latency
    "InfiniBand NDR"` gives over every published NDR sweep (its source says so), to its two decimals."""
    cf = _collective_fidelity()
    rows = [r for r in cf.judged(cf.load_rows()) if cf.NETWORK[r["machine"]] == "InfiniBand NDR"]
    assert len({r["machine"] for r in rows}) >= 4
    fitted = round(cf.fit_latency(rows), 2)
    for name in ("dgx-a100", "dgx-h100", "dgx-h200"):
        assert load_profile(name).physics.protocols.latency_scale == fitted, name


def test_alps_protocols_are_nccls_for_grace_hopper_fitted_to_slingshot():
    """The alps profile serialises gpu_physics.nccl_protocols for Hopper on Grace (Arm) hosts with the P2C path
    (no NVLSTree: its 4 GH200 have no NVSwitch), and its latency_scale is what `collective_fidelity.py
    --fit-latency Slingshot-11 --share 0.8` gives over the NCCL sweeps on Slingshot-11 (Alps and Perlmutter) at
    the plateau it carries, 80 GB/s = 0.8 x its 4 x 25 GB/s of NICs, to its two decimals."""
    from axoplan.planner import gpu_physics
    from axoplan.planner.profile_reader import _Reader

    got = load_profile("alps")
    want = gpu_physics.parse({"network": {"protocols": gpu_physics.nccl_protocols(90, "arm", "P2C")}},
                             _Reader("t")).protocols
    pr = got.physics.protocols
    assert pr.ring == want.ring and pr.tree == want.tree and pr.ll_max == want.ll_max and not pr.nvls_tree
    assert got.inter_busbw == pytest.approx(0.8 * 4 * 25e9)
    cf = _collective_fidelity()
    rows = [r for r in cf.judged(cf.load_rows()) if cf.NETWORK[r["machine"]] == "Slingshot-11"
            and cf.LIBRARY[r["machine"]] == "NCCL"]
    assert {r["machine"] for r in rows} == {"alps-gh200", "perlmutter-a100"}
    assert pr.latency_scale == round(cf.fit_latency(rows, 0.8), 2)


def test_latency_scale_multiplies_every_latency_and_no_bandwidth():
    p, q = prof(), prof(dict(PROTOCOLS, latency_scale=2.0))
    # 8 kB all-gather over 8 GPUs on 2 nodes: LL, 15 us + 7 kB / 20 GB/s; twice the latency with the scale
    assert across(q, "all_gather", 8e3, 8) == pytest.approx((30 + 7e3 / 20e9 / US) * US)
    assert across(p, "all_gather", 8e3, 8) == pytest.approx((15 + 7e3 / 20e9 / US) * US)


def test_every_published_sweep_row_names_a_described_machine():
    """benchmarks/collective_fidelity.py: each row of the sweeps in benchmarks/data has its machine's NIC
    figure, network and library (else the benchmark could not predict it), or is a single-node sweep of a
    described board, and each file carries its source."""
    cf = _collective_fidelity()
    rows = cf.load_rows()
    across = {r["machine"] for r in rows if r["machine"] not in cf.NODE_MACHINES}
    assert across <= set(cf.MACHINES) == set(cf.NETWORK) == set(cf.LIBRARY)
    assert all(int(r["nodes"]) == 1 for r in rows if r["machine"] in cf.NODE_MACHINES)
    assert len(cf.node_rows(rows)) >= 20
    assert len(cf.judged(rows)) > 150
    for f in {r["file"] for r in rows}:
        assert (cf.DATA / f).read_text().startswith("# ")


def _collective_fidelity():
    from conftest import load_benchmark

    return load_benchmark("collective_fidelity")


def test_collective_fidelity_fits_recover_the_numbers_that_made_the_rows():
    """Rows made by the protocol model itself at a latency scale and plateau share on the fit's grid
    (Perlmutter all-gathers, 1 MiB-1 GiB on 4 and 32 nodes): the joint fit finds both, the plateau fit
    (rows of 256 MiB and more, NCCL's latency) the share within 0.03 where the latency is near NCCL's (at
    8x it the latency of 256 MiB on 32 nodes is read as a lower plateau); leave-one-machine-out uses only
    the other machines' rows (a machine alone on its network gets NCCL's defaults)."""
    cf = _collective_fidelity()
    def made(scale, share):
        return [dict(r, time_us=cf.predict(r, "protocols", scale, share) * 1e6) for r in rows]

    rows = []
    for nodes in (4, 32):
        for k in range(20, 31):
            r = {"machine": "perlmutter-a100", "collective": "all_gather", "nodes": nodes, "gpus_per_node": 4,
                 "bytes": 2.0**k, "curve": f"{nodes}n"}
            rows.append(r)
    high, near = float(cf.SCALES[40]), float(cf.SCALES[20])  # 8.5 and 1.46
    assert cf.fit_network(made(high, 0.7)) == (round(high, 2), 0.7)
    assert cf.fit_share(made(near, 0.7)) == pytest.approx(0.7, abs=0.03)
    assert cf.fit_share(made(high, 0.7)) < 0.65
    rows = made(near, 0.7)
    assert cf.leave_one_out(rows, "perlmutter-a100") == (1.0, cf.RING_EFFICIENCY)
    other = [dict(r, machine="frontier-mi250x") for r in rows]  # same network, another library
    # on Slingshot both libraries reach the network through one transport: both fitted on the other's rows
    assert "Slingshot-11" in cf.SHARED_TRANSPORT
    assert cf.leave_one_out(other + rows, "perlmutter-a100") == cf.fit_network(other)
    # and a machine of its own library there is evidence alike, not before the other library's
    alps = [dict(r, machine="alps-gh200", time_us=r["time_us"] * 1.5) for r in rows]
    assert cf.leave_one_out(other + alps + rows, "perlmutter-a100") == cf.fit_network(other + alps)
    assert cf.fit_network(other + alps) != cf.fit_network(alps)
    # elsewhere another library's rows give the plateau share alone, the latency NCCL's own
    shared, cf.SHARED_TRANSPORT = cf.SHARED_TRANSPORT, set()
    try:
        assert cf.leave_one_out(other + rows, "perlmutter-a100") == (1.0, cf.fit_share(other))
    finally:
        cf.SHARED_TRANSPORT = shared
    # a network no other sweep ran on: the median of the latency scales the library's other machines fit
    # to their own rows (three machines made at 1.46, 1.46 and 8.5), NCCL's plateau share
    elsewhere = []
    for m, sc in (("p5-h100", near), ("vm-h100-ndr", near), ("xe9680-h100-ndr", high)):
        mine = [dict(r, machine=m, gpus_per_node=8) for r in rows]
        elsewhere += [dict(r, time_us=cf.predict(r, "protocols", sc, 0.7) * 1e6) for r in mine]
    assert cf.NETWORK["oci-gpu4-a100"] not in {cf.NETWORK[m] for m in ("p5-h100", "vm-h100-ndr", "xe9680-h100-ndr")}
    assert cf.leave_one_out(elsewhere + [dict(r, machine="oci-gpu4-a100") for r in rows], "oci-gpu4-a100") == (
        round(near, 2), cf.RING_EFFICIENCY)
    # a peer on its network and library whose rows are all bandwidth-bound (p4dn's 1 GiB sweep) gives the plateau
    # share but no latency: the latency as on a network of its own, that median
    assert cf.NETWORK["p4dn-a100"] == cf.NETWORK["p4de-a100"] and cf.LIBRARY["p4dn-a100"] == cf.LIBRARY["p4de-a100"]
    big = [dict(r, machine="p4dn-a100", gpus_per_node=8) for r in rows if r["bytes"] >= cf.PLATEAU_BYTES]
    big = [dict(r, time_us=cf.predict(r, "protocols", 1.0, 0.6) * 1e6) for r in big]
    mine = [dict(r, machine="p4de-a100", gpus_per_node=8) for r in rows]
    assert cf.leave_one_out(elsewhere + big + mine, "p4de-a100") == (round(near, 2), cf.fit_share(big))
    assert cf.fit_share(big) == pytest.approx(0.6, abs=0.02)


def test_step_times_divide_each_call_by_its_ring_steps_at_one_share_per_rank():
    """collective_fidelity --scale: an all-gather of 4 GPUs per node, 1 MiB per rank, on 2, 4, 8 and 16 nodes
    takes (p - 1) steps; calls made at 30 us a step give 30 us at every node count; a sweep over 3 node counts
    is not listed, and a stall (a call slower than a larger message's) is not counted."""
    cf = _collective_fidelity()
    rows = []
    for nodes in (2, 4, 8, 16):
        p = 4 * nodes
        for share, us in ((2**20, 30.0), (2**21, 40.0)):
            rows.append({"machine": "perlmutter-a100", "collective": "all_gather", "nodes": nodes, "gpus_per_node": 4,
                         "bytes": share * p, "time_us": us * (p - 1), "curve": f"{nodes}n"})
    got = cf.step_times(rows)[("perlmutter-a100", "all_gather")]
    assert got[2**20] == pytest.approx({n: 30e-6 for n in (2, 4, 8, 16)})
    assert got[2**21] == pytest.approx({n: 40e-6 for n in (2, 4, 8, 16)})
    slow = [dict(r, time_us=r["time_us"] * 3) if r["nodes"] == 8 and r["bytes"] == 2**20 * 32 else r for r in rows]
    assert 8 not in cf.step_times(slow)[("perlmutter-a100", "all_gather")][2**20]
    assert cf.step_times([r for r in rows if r["nodes"] != 16]) == {}


def test_no_ll128_across_nodes_beyond_pxb():
    """NCCL enables LL128 across nodes only where the GPU reaches its NIC by PXB or nearer (Hopper also by PXN):
    the default rows for a host-bridge path (Perlmutter) have LL and Simple only, rings and trees alike."""
    from axoplan.planner import gpu_physics

    names = lambda d, k: [r["protocol"] for r in d[k]]  # noqa: E731
    phb = gpu_physics.nccl_protocols(80, "amd", "PHB")
    assert names(phb, "ring") == ["LL", "Simple"] and names(phb, "tree") == ["LL", "Simple"]
    assert "no LL128 across nodes" in phb["source"]
    for cap, path, kept in ((80, "PIX", True), (80, "PXB", True), (80, "P2C", False), (80, "PXN", False),
                            (90, "P2C", True), (90, "PXN", True), (90, "PHB", False), (90, "SYS", False)):
        assert ("LL128" in names(gpu_physics.nccl_protocols(cap, "intel", path), "ring")) is kept, (cap, path)
    assert gpu_physics.nccl_protocols(80, "amd") == gpu_physics.nccl_protocols(80, "amd", "PXB")
    with pytest.raises(ValueError, match="GPU-to-NIC path"):
        gpu_physics.nccl_protocols(80, "amd", "NVL")


def test_an_arm_host_gets_an_intel_hosts_constants():
    """NCCL's getNetOverhead is 2 us for AMD x86 hosts alone, and its llMaxBws row for multi-node jobs is AMD's for
    AMD hosts alone: a Grace (Arm) host's rows are an Intel host's, only the source says which host it is."""
    from axoplan.planner import gpu_physics

    arm, intel = gpu_physics.nccl_protocols(90, "arm", "P2C"), gpu_physics.nccl_protocols(90, "intel", "P2C")
    assert "Arm host CPUs (Grace)" in arm.pop("source") and "Intel x86 host CPUs" in intel.pop("source")
    assert arm == intel
    assert gpu_physics.nccl_protocols(90, "power", "PXB") is None


def test_the_worker_names_an_arm_host(monkeypatch):
    from axoplan.calibrate import worker

    monkeypatch.setattr(worker.platform, "machine", lambda: "aarch64")
    assert worker._cpu_vendor() == "arm"


def test_a_rows_size_correction_slows_medium_messages_across_nodes():
    """Simple ring with RCCL's kind of table: bandwidth x 0.25 at log2(bytes / 64) = 14 (1 MiB), the last
    factor (1.0) beyond the table. All-gather over 8 GPUs on 2 nodes: 42 us + 7/8 of the buffer at 80 GB/s."""
    simple = {"protocol": "Simple", "base_us": 8, "intra_us": 4, "net_us": 10, "bw_factor": 1.0,
              "size_correction": [0.5] * 14 + [0.25, 1.0]}
    p = prof(dict(PROTOCOLS, ring=[simple], tree=[]))
    assert across(p, "all_gather", 2.0**20, 8) == pytest.approx((42 + 7 / 8 * 2.0**20 / (0.25 * 80e9) / US) * US)
    assert across(p, "all_gather", 2.0**30, 8) == pytest.approx((42 + 7 / 8 * 2.0**30 / 80e9 / US) * US)
    bad = dict(PROTOCOLS, ring=[dict(simple, size_correction=[1.5])])
    with pytest.raises(UserError, match="size_correction"):
        prof(bad)


def test_rccl_rows_are_its_tuning_model_3():
    """gpu_physics.rccl_protocols: Frontier's RCCL rows parse as a profile's and carry its ring correction
    (Simple at 1-4 MiB: 0.2 of the plateau; 64 MiB on: 1.0); another tuning model is refused."""
    from axoplan.planner import gpu_physics

    p = prof(gpu_physics.rccl_protocols(3))
    simple = {r.name: r for r in p.physics.protocols.ring}["Simple"]
    assert simple.size_correction[14:17] == (0.2, 0.2, 0.2) and simple.size_correction[20:] == (1.0,) * 7
    assert {r.name for r in p.physics.protocols.ring} == {"LL", "Simple"}
    tree = {r.name: r for r in p.physics.protocols.tree}["Simple"]
    assert tree.size_correction[21] == 0.8 and p.physics.protocols.two_node_tree_factor == pytest.approx(1.75 / 0.96,
                                                                                                        abs=1e-4)
    with pytest.raises(ValueError, match="tuning model 5"):
        gpu_physics.rccl_protocols(5)



def test_a_tree_rows_size_correction_replaces_nccls_tree_table():
    """As test_all_reduce_takes_the_tree_with_its_correction, with the tree row's own table: 0.9 at 64 MiB
    (log2(2^26 / 64) = 20) where NCCL's gives 0.8 (the tree, 984 us, still beats the ring's 1582 us)."""
    tree = dict(PROTOCOLS["tree"][0], size_correction=[1.0] * 20 + [0.9, 1.0])
    p = prof(dict(PROTOCOLS, tree=[tree]))
    nb = 2.0**26
    assert across(p, "all_reduce", nb, 8) == pytest.approx((52 + nb / (0.5 * 160e9 * 0.9) / US) * US)


def _crossing_by_ranks(n, sizes, order, pp):
    """Per boundary (stages b, b + 1; pp - 1: the last back to the first): some pair of ranks on two nodes."""
    import itertools

    from axoplan.planner.space import PLACEMENTS, strides
    gx, gy, gz, gd = sizes
    st = [int(x[0]) for x in strides(np.array([gx]), gy, gz, gd, PLACEMENTS.index(order), pp)]
    out = [False] * pp
    for x, y, z, d in itertools.product(range(gx), range(gy), range(gz), range(gd)):
        base = x * st[0] + y * st[1] + z * st[2] + d * st[3]
        for b in range(pp):
            r1, r2 = base + b * st[4], base + ((b + 1) % pp) * st[4]
            out[b] |= r1 // n != r2 // n
    return out, st[4]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_boundary_crosses_equals_the_ranks(n):
    """boundary_crosses against every pair of ranks, over small grids, pipelines and all 30 placements."""
    from axoplan.planner.space import PLACEMENTS
    for sizes in [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 3), (3, 1, 1, 1), (2, 1, 2, 1), (1, 1, 1, 4), (2, 2, 1, 2)]:
        for pp in (2, 3, 4, 6):
            for order in PLACEMENTS:
                want, s = _crossing_by_ranks(n, sizes, order, pp)
                got = C.boundary_crosses(n, np.array([s]), pp, np.array([int(np.prod(sizes)) * pp]))[:, 0]
                assert got.tolist() == want, (n, sizes, order, pp)


def test_boundary_crosses_by_hand():
    # 16 stages one GPU apart on 8-GPU nodes: only 7 -> 8 and the wrap 15 -> 0 leave a node
    assert np.flatnonzero(C.boundary_crosses(8, np.array([1]), 16, np.array([16]))[:, 0]).tolist() == [7, 15]
    # 4 stages 4 apart (ranks 0-3, 4-7, 8-11, 12-15): 1 -> 2 and the wrap
    assert C.boundary_crosses(8, np.array([4]), 4, np.array([16]))[:, 0].tolist() == [False, True, False, True]
    # the whole pipeline in one node; stages a node or more apart: every boundary
    assert not C.boundary_crosses(8, np.array([2]), 4, np.array([8])).any()
    assert C.boundary_crosses(8, np.array([8]), 2, np.array([16])).all()


def test_pipeline_pays_across_nodes_only_where_its_boundaries_cross():
    """GPT-20B, 16 stages one GPU apart (pxyz): with 16 GPUs per node no boundary crosses, with 8 one does
    (and the wrap), with 4 three, with 1 all; the step grows in that order (before per-boundary transfers, 16,
    8 and 4 were priced alike)."""
    from axoplan.planner.machine import GB
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.rank import explain
    from axoplan.planner.specs import load_model

    m = load_model("gpt-20b")
    base = load_profile("dgx-a100").replace(inter_busbw=5 * GB)  # a slow network: each crossing visible
    for schedule, vpp in (("1f1b", None), ("interleaved-1f1b", 2)):
        t = [float(explain(m, base.replace(gpus_per_node=n), 16, 64, grid=(1, 1, 1, 1), order="pxyz", pp=16, vpp=vpp,
                           schedule=schedule, seq_len=2048, micro_batch=1, checkpointing=True).summary.iloc[0].batch_time_s)
             for n in (16, 8, 4, 1)]
        assert t[0] < t[1] < t[2] < t[3], (schedule, t)
    e = explain(m, base, 16, 64, grid=(1, 1, 1, 1), order="pxyz", pp=16, seq_len=2048, micro_batch=1, checkpointing=True)
    assert any("neighbouring stages 1 rank apart; 1 of its 15 stage boundaries crosses nodes" in n for n in e.notes)


@pytest.mark.parametrize("vpp", [1, 2])
def test_explain_transfers_add_up_where_only_some_boundaries_cross(vpp):
    """pxyz pp16 on 8-GPU nodes: the listed rank's send/recv row is its mean transfer over its boundaries
    (between a transfer inside a node and one across), and explain's rows still sum to comm_s."""
    from axoplan.planner.rank import explain

    e = explain("gpt-20b", "dgx-a100", 16, 64, grid=(1, 1, 1, 1), order="pxyz", pp=16, vpp=vpp,
                schedule="interleaved-1f1b" if vpp > 1 else "1f1b", seq_len=2048, micro_batch=1, checkpointing=True)
    sched, colls = e.detail["schedule"], e.collectives
    assert colls["total_s"].sum() == pytest.approx(float(e.summary.iloc[0].comm_s), rel=1e-9)
    row = colls[colls["collective"] == "send/recv"].iloc[0]
    assert float(np.ravel(sched.p2p_near)[0]) <= row["time_per_call_s"] <= float(np.ravel(sched.p2p_far)[0])
    # its bandwidth as nccl-tests reports a sendrecv's: bytes over time per call
    assert row["busbw_gbs"] == pytest.approx(row["bytes"] / row["time_per_call_s"] / 1e9, rel=1e-12)


# the same profile with groups inside a node by NCCL's single-node rows (test numbers, worked by hand below)
INSIDE = {"source": "test", "latency_scale": 2.0, "ll_max_busbw_gbs": 40,
          "ring": [{"protocol": "LL", "base_us": 6.6, "intra_us": 0.6, "bw_factor": 0.5},
                   {"protocol": "Simple", "base_us": 8.4, "intra_us": 3.4, "bw_factor": 1.0}]}


def test_inside_one_node_ncccls_fastest_single_node_row_by_hand():
    """An all-reduce over 4 GPUs of one node at a 100 GB/s plateau, latencies x 2: LL costs (6.6 + 6 x 0.6) x 2 =
    20.4 us plus 2 x 3/4 of the buffer over min(50, 40) GB/s; Simple (8.4 + 6 x 3.4) x 2 = 57.6 us plus it over
    100 GB/s. 8 kB takes LL (20.7 us), 8 MB Simple (177.6 us); an all-gather has 3 steps and 3/4 of the buffer."""
    p = prof(dict(PROTOCOLS, inside_node=INSIDE))
    t = C.node_protocol_time(p.physics.protocols, "all_reduce", np.array([8e3, 8e6]), 4, 100e9)
    assert t == pytest.approx([(20.4 + 12e3 / 40e9 / US) * US, (57.6 + 12e6 / 100e9 / US) * US])
    ag = C.node_protocol_time(p.physics.protocols, "all_gather", 8e6, 4, 100e9)
    assert ag == pytest.approx((2 * (8.4 + 3 * 3.4) + 6e6 / 100e9 / US) * US)
    # a row's size_correction applies as across nodes: Simple at half its bandwidth from 64 B x 2^2 = 256 B on
    sc = dict(INSIDE, ring=[INSIDE["ring"][0], dict(INSIDE["ring"][1], size_correction=[1.0, 1.0, 0.5])])
    q = prof(dict(PROTOCOLS, inside_node=sc))
    assert C.node_protocol_time(q.physics.protocols, "all_reduce", 8e6, 4, 100e9) == pytest.approx(
        (57.6 + 12e6 / 50e9 / US) * US)


def test_place_uses_the_single_node_rows_only_inside_a_node():
    """With inside_node, X of 4 inside a node takes node_protocol_seconds on its intra-node plateau; X of 8
    across 2 nodes keeps the cross-node protocol model; without inside_node X of 4 keeps the alpha-beta line."""
    p, plain = prof(dict(PROTOCOLS, inside_node=INSIDE)), prof()

    def one(q, gx, gd, nbytes):
        c = Candidates(*(np.array([v]) for v in (gx, 1, 1, gd, 0, 1)), np.array([False]))
        return float(C._coll(q, C.place(q, c), "t", "fwd", "all_gather", "x", nbytes).seconds[0])

    bw = p.group_busbw(np.array([4]), np.array([1]))[0]
    assert one(p, 4, 2, 8e6) == pytest.approx(float(C.node_protocol_seconds(p, "all_gather", 8e6, 4, bw)))
    assert one(p, 4, 2, 8e6) != pytest.approx(one(plain, 4, 2, 8e6))
    assert one(p, 8, 1, 8e6) == pytest.approx(one(plain, 8, 1, 8e6))


def test_single_node_protocol_fields_are_checked():
    with pytest.raises(UserError, match="inside_node.rings"):
        prof(dict(PROTOCOLS, inside_node=dict(INSIDE, rings=[])))
    with pytest.raises(UserError, match=r"inside_node.ring\[0\].protocol"):
        prof(dict(PROTOCOLS, inside_node=dict(INSIDE, ring=[dict(INSIDE["ring"][0], protocol="LL64")])))
    with pytest.raises(UserError, match="inside_node"):
        prof(dict(PROTOCOLS, inside_node=[1]))


def test_bundled_dgx_single_node_rows_are_nccls_and_their_scale_the_published_sweeps_fit():
    """dgx-h100 and -h200 carry gpu_physics.nccl_node_protocols for Hopper and an inside_node.latency_scale that
    is `collective_fidelity.py --fit-node-latency h200-node` to two decimals (the H100 board takes the H200
    node's: same NVLink4 NVSwitch); dgx-a100 carries none, and its comment's 3.46 is the A100 sweep's fit."""
    from axoplan.planner import gpu_physics
    from axoplan.planner.profile_reader import _Reader

    cf = _collective_fidelity()
    rows = cf.node_rows(cf.load_rows())
    fit = {m: round(cf.fit_node_latency([r for r in rows if r["machine"] == m]), 2) for m in cf.NODE_MACHINES}
    for name in ("dgx-h100", "dgx-h200"):
        d = dict(gpu_physics.nccl_protocols(90, "intel"), inside_node=gpu_physics.nccl_node_protocols(90))
        want = gpu_physics.parse({"network": {"protocols": d}}, _Reader("t")).protocols.inside_node
        got = load_profile(name).physics.protocols.inside_node
        assert got.ring == want.ring and got.tree == want.tree and got.ll_max == want.ll_max
        assert got.latency_scale == fit["h200-node"], name
    assert load_profile("dgx-a100").physics.protocols.inside_node is None
    assert fit["a100-sxm4-node"] == 3.46
    # both sweeps favour the single-node rows at their own scale over the alpha-beta line
    for m in cf.NODE_MACHINES:
        mine = [r for r in rows if r["machine"] == m]
        assert cf.node_errors(mine, "protocols", fit[m]).mean() < cf.node_errors(mine, "before").mean()


STALL = {"collective": "all_gather", "per_rank_kib": [64, 256], "step_us": 400, "source": "test"}


def stalled(rows=(STALL,), protocols=PROTOCOLS):
    d = profile_dict()
    if protocols is not None:
        d["network"]["protocols"] = protocols
    d["network"]["stalls"] = [dict(r) for r in rows]
    return profile_from_dict(d, "test profile")


def test_stall_seconds_by_hand():
    """network.stalls: an all-gather across nodes whose every rank's part (bytes / p) is 64-256 KiB takes at least
    p - 1 ring steps of 400 us; a part of 32 or 512 KiB, a group inside one node, another collective: nothing."""
    s = stalled().physics.stalls
    kib = 1024.0
    nb = np.array([32, 64, 128, 256, 512]) * kib * 8
    got = C.stall_seconds(s, "all_gather", nb, 8, 2)
    assert got == pytest.approx([0, 7 * 400 * US, 7 * 400 * US, 7 * 400 * US, 0])
    assert np.all(C.stall_seconds(s, "all_gather", nb, 8, 1) == 0)
    assert np.all(C.stall_seconds(s, "reduce_scatter", nb, 8, 2) == 0)


def test_a_stall_is_the_least_a_collective_across_nodes_takes():
    """In the planner: an all-gather of 16 members on 4 nodes (the Z axis, 4 GPUs per node), 128 KiB each, takes
    15 x 400 us under the stall instead of the protocol model's (Simple: 8 + 12 x 4 + 3 x 10 = 86 us plus 15/16
    of 2 MiB at 80 GB/s, 110.6 us); 1 MiB each is out of the band and keeps the protocol model's time; inside a
    node (4 members) the same part is not stalled."""
    c16 = Candidates(*(np.array([v]) for v in (1, 1, 16, 1, 0, 1)), np.array([False]))
    for p, want in ((stalled(), 15 * 400 * US), (prof(), None)):
        g = C.place(p, c16)
        t = float(C._coll(p, g, "w", "fwd", "all_gather", "z", 16 * 128 * 1024.0).seconds[0])
        plain = across(prof(), "all_gather", 16 * 128 * 1024.0, 16)
        assert plain == pytest.approx((86 + 15 / 16 * 2 * 2**20 / 80e9 / US) * US)
        assert t == pytest.approx(want if want is not None else plain)
        big = float(C._coll(p, g, "w", "fwd", "all_gather", "z", 16 * 1024 * 1024.0).seconds[0])
        assert big == pytest.approx(across(prof(), "all_gather", 16 * 1024 * 1024.0, 16))
    c4 = Candidates(*(np.array([v]) for v in (1, 1, 4, 4, 0, 1)), np.array([False]))
    p = stalled()
    t4 = float(C._coll(p, C.place(p, c4), "w", "fwd", "all_gather", "z", 4 * 128 * 1024.0).seconds[0])
    assert t4 < 15 * 400 * US / 10
    # a profile without network.protocols (the alpha-beta line) takes its stalls too
    flat = stalled(protocols=None)
    g = C.place(flat, c16)
    assert float(C._coll(flat, g, "w", "fwd", "all_gather", "z", 16 * 128 * 1024.0).seconds[0]) == pytest.approx(
        15 * 400 * US)


@pytest.mark.parametrize("row,field,msg", [
    ({"collective": "alltoall"}, "collective", "must be one of all_gather, reduce_scatter, all_reduce, got 'alltoall'"),
    ({"per_rank_kib": [256, 64]}, "per_rank_kib", "must be [lo, hi] with lo <= hi, got [256, 64]"),
    ({"per_rank_kib": 64}, "per_rank_kib", "must be [lo, hi], each rank's part of the buffer in KiB"),
    ({"step_us": 0}, "step_us", "must be positive, got 0.0"),
    ({"source": ""}, "per_rank_kib[0]", "has no source (every number in a profile needs one)"),
    ({"bytes": 1}, "bytes", "is not a profile field (known here: collective, per_rank_kib, source, step_us)"),
])
def test_stall_rows_are_checked(row, field, msg):
    with pytest.raises(UserError) as err:
        stalled([dict(STALL, **row)])
    assert f"field 'network.stalls[0].{field}' {msg}" in str(err.value)


def test_frontier_carries_rccls_all_gather_stall_and_the_benchmark_checks_it(capsys):
    """The frontier profile's stall is the median time per ring step of the sweep's rows in its band (0.38 ms of
    the AxoNN authors' RCCL logs), which `collective_fidelity.py --stalls` checks leaving out one node count."""
    (s,) = load_profile("frontier").physics.stalls
    assert (s.kind, s.lo, s.hi, s.step) == ("all_gather", 64 * 1024, 256 * 1024, pytest.approx(380 * US))
    cf = _collective_fidelity()
    band = [r for r in cf.load_rows() if r["machine"] == "frontier-mi250x" and r["collective"] == "all_gather"
            and int(r["nodes"]) > 1 and s.lo <= float(r["bytes"]) / (8 * int(r["nodes"])) <= s.hi]
    steps = [float(r["time_us"]) / (8 * int(r["nodes"]) - 1) for r in band]
    assert len(band) == 21 and round(float(np.median(steps)) / 10) * 10 == 380
    # calibrate's stall fit finds the same band and step in the logs, and nothing on any other machine
    from axoplan.calibrate.fit import find_stalls

    found = {m: find_stalls(cf.stall_rows(cf.load_rows(), m)) for m in cf.MACHINES}
    (f,) = found.pop("frontier-mi250x")
    assert (f.collective, f.lo, f.hi, f.stalled, f.rows) == ("all_gather", s.lo, s.hi, 19, 21)
    assert f.step == pytest.approx(s.step, rel=0.01) and not any(found.values())
    assert cf.main(["--stalls"]) == 0
    out = capsys.readouterr().out
    assert "frontier-mi250x all_gather: each rank's part 64-256 KiB" in out and "mean error over the 21 rows" in out
    # only the machine's own profile carries it into the benchmark's 'own' column, never into 'lomo'
    r = dict(band[0])
    assert cf.predict(r, "own", 1.0, 0.96) > 10 * cf.predict(r, "protocols", 1.0, 0.96)
