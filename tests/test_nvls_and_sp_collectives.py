"""NVLink SHARP inside a node and sequence parallelism's split all-reduce, against numbers worked out by hand.

A profile of 8 GPUs per node whose ring gives 300 GB/s to every group inside a node and whose 8-GPU all-reduce
reduces in the switch (network.intra_node.nvls_all_reduce) at 450 GB/s; latencies 5 us per ring step, no NCCL
protocol model (the alpha-beta line): an all-reduce of N bytes over p GPUs takes 2(p-1)/p N / busbw + 2(p-1) x
5 us, an all-gather or reduce-scatter (p-1)/p N / busbw + (p-1) x 5 us.
"""
from __future__ import annotations

import numpy as np
import pytest

from axoplan.errors import UserError
from axoplan.planner import comm as C
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.space import Candidates

GB, US, N = 1e9, 1e-6, 64 * 2**20


@pytest.fixture
def nvls_profile(write_profile):
    def make(nvls=((8, 450),), **kw):
        from conftest import profile_dict
        d = profile_dict(name="nvls-node", gpus_per_node=8, intra_latency_us=5, inter_latency_us=5,
                         intra_groups=((2, 1, 300), (4, 1, 300), (8, 1, 300), (2, 2, 300), (4, 2, 300), (2, 4, 300)),
                         **kw)
        if nvls:
            d["network"]["intra_node"]["nvls_all_reduce"] = [{"size": s, "busbw_gbs": bw, "source": "test"}
                                                             for s, bw in nvls]
        return load_profile(str(write_profile(raw=d, name="nvls-node")))
    return make


def _groups(prof, grid):
    gx, gy, gz, gd = grid
    return C.place(prof, Candidates(*(np.array([v]) for v in (gx, gy, gz, gd, 0, 1)), np.array([False])))


def ar(n, p, bw):
    return 2 * (p - 1) / p * n / bw + 2 * (p - 1) * 5 * US


def half(n, p, bw):  # an all-gather or a reduce-scatter
    return (p - 1) / p * n / bw + (p - 1) * 5 * US


def test_only_an_all_reduce_over_the_listed_size_inside_a_node_reduces_in_the_switch(nvls_profile):
    prof = nvls_profile()
    g = _groups(prof, (1, 8, 1, 1))
    assert C._coll(prof, g, "l", "fwd", "all_reduce", "y", N).seconds[0] == pytest.approx(ar(N, 8, 450 * GB))
    for kind in ("all_gather", "reduce_scatter"):  # NVLS is an all-reduce algorithm only: the ring
        assert C._coll(prof, g, "l", "fwd", kind, "y", N).seconds[0] == pytest.approx(half(N, 8, 300 * GB))
    g4 = _groups(prof, (1, 4, 1, 2))  # 4 members: not in the table, the ring
    assert C._coll(prof, g4, "l", "fwd", "all_reduce", "y", N).seconds[0] == pytest.approx(ar(N, 4, 300 * GB))
    assert g.bw("y", "all_reduce")[0] == 450 * GB and g.bw("y", "all_gather")[0] == 300 * GB


def test_a_group_across_nodes_never_takes_nvls_and_a_slower_table_row_never_slows_the_ring(nvls_profile):
    prof = nvls_profile()
    g = _groups(prof, (1, 1, 1, 16))  # D over two nodes: the network's bandwidth, whatever the table says
    assert g.bw("d", "all_reduce")[0] == g.busbw["d"][0] < 300 * GB
    slow = nvls_profile(nvls=((8, 100),))  # NCCL takes the faster of NVLS and the ring
    assert _groups(slow, (1, 8, 1, 1)).bw("y", "all_reduce")[0] == 300 * GB
    none = nvls_profile(nvls=())
    assert none.intra_nvls == () and _groups(none, (1, 8, 1, 1)).busbw_ar is None


def test_sequence_parallel_splits_the_all_reduce_into_a_reduce_scatter_and_an_all_gather(nvls_profile):
    prof = nvls_profile()
    g = _groups(prof, (1, 8, 1, 1))
    pair = C._coll(prof, g, "l", "fwd", C.SP_PAIR, "y", N)
    assert pair.kind == "reduce_scatter+all_gather" and float(pair.nbytes[0]) == N
    assert pair.seconds[0] == pytest.approx(2 * half(N, 8, 300 * GB))  # two ring calls, no NVLS
    # without NVLS the pair moves the all-reduce's ring volume in as many steps: the same time
    flat = nvls_profile(nvls=())
    gf = _groups(flat, (1, 8, 1, 1))
    assert C._coll(flat, gf, "l", "fwd", C.SP_PAIR, "y", N).seconds[0] == pytest.approx(
        C._coll(flat, gf, "l", "fwd", "all_reduce", "y", N).seconds[0])


def test_linear_and_embedding_collectives_split_only_under_sequence_parallelism(nvls_profile):
    from conftest import tiny_model

    prof = nvls_profile()
    g = _groups(prof, (1, 8, 1, 1))
    lin = tiny_model().block_linears()[0]
    plain = C.linear_collectives(prof, g, lin, 1000, 2)
    sp = C.linear_collectives(prof, g, lin, 1000, 2, sequence_parallel=True)
    assert plain["ar_bwd"].kind == "all_reduce" and sp["ar_bwd"].kind == C.SP_PAIR and "ag_input" in sp
    head = C.linear_collectives(prof, g, tiny_model().lm_head(), 1000, 2, split_all_reduce=True)
    assert head["ar_bwd"].kind == C.SP_PAIR and "ag_input" not in head
    assert C.embedding_collectives(prof, g, tiny_model(), 1000, 2, sequence_parallel=True)["ar_fwd"].kind == C.SP_PAIR
    assert C.embedding_collectives(prof, g, tiny_model(), 1000, 2)["ar_fwd"].kind == "all_reduce"


@pytest.mark.parametrize("rows, msg", [
    ([{"size": 9, "busbw_gbs": 400, "source": "t"}], "size must be an integer from 2 to gpus_per_node"),
    ([{"size": 8, "busbw_gbs": 400, "source": "t"}, {"size": 8, "busbw_gbs": 410, "source": "t"}], "repeats size 8"),
    ({"size": 8}, "must be a list"),
])
def test_bad_nvls_rows_are_one_sentence(write_profile, rows, msg):
    from conftest import profile_dict
    d = profile_dict(name="bad-nvls", gpus_per_node=8,
                     intra_groups=((2, 1, 300), (4, 1, 300), (8, 1, 300), (2, 2, 300), (4, 2, 300), (2, 4, 300)))
    d["network"]["intra_node"]["nvls_all_reduce"] = rows
    with pytest.raises(UserError, match=msg):
        load_profile(str(write_profile(raw=d, name="bad-nvls")))


def test_the_bundled_hopper_profiles_carry_the_measured_ring_and_nvls():
    for name in ("dgx-h100", "dgx-h200"):
        p = load_profile(name)
        assert dict(p.intra_nvls)[8] == 473.1 * GB and p.intra_busbw(8, 1) == 365.6 * GB
        assert p.intra_busbw(4, 1) == 363.3 * GB and 4 not in dict(p.intra_nvls)
    assert load_profile("dgx-a100").intra_nvls == ()  # no multicast in the A100's NVSwitch
