"""GPU physics chosen by profile fields (issue 15): NCCL's latency model, attention throughput by
sequence length and head size, compute slowed under overlap. Every expected number is worked by hand."""
from __future__ import annotations

import numpy as np
import pytest

from axoplan.planner import comm as C
from axoplan.planner import compute as K
from axoplan.planner.timing import overlapped
from axoplan.errors import UserError
from axoplan.planner.profile_reader import load_profile, profile_from_dict
from axoplan.planner.specs import ModelSpec
from tests.conftest import profile_dict

US = 1e-6


def gpu_profile(attention_rows=None, **network):
    """The conftest profile (4 GPUs per node, 9 us latencies) with GPU fields added."""
    d = profile_dict(intra_latency_us=3, inter_latency_us=10)
    d["network"].update(network)
    if attention_rows is not None:
        d["compute"]["attention"]["throughput"] = attention_rows
    return profile_from_dict(d, "test profile")


NCCL = {"latency_model": "nccl", "base_latency_us": {"value": 8, "source": "test"}}


# ---- NCCL latency model ------------------------------------------------------------------------
def test_nccl_ring_over_two_nodes_of_four_by_hand():
    """8 GPUs, 4 per node, stride 1: a ring pass has 7 steps, of which 1 crosses the node boundary."""
    prof = gpu_profile(**NCCL)
    ag = C.nccl_latency(prof, "all_gather", np.array([8]), np.array([1]))[0]
    # base 8 + 6 intra steps x 3 + 1 crossing x 10 = 36 us
    assert ag == pytest.approx(36 * US)
    # all-reduce: two passes 2 x (6 x 3 + 10) = 56, or the tree 2 x ((4-1) x 3 + log2(2) x 10) = 38: the tree
    ar = C.nccl_latency(prof, "all_reduce", np.array([8]), np.array([1]))[0]
    assert ar == pytest.approx((8 + 38) * US)


def test_nccl_latency_inside_a_node_and_one_member_per_node():
    prof = gpu_profile(**NCCL)
    # 4 GPUs of one node: base + 3 x 3 (all-gather), base + 2 x 3 x 3 (all-reduce: no tree inside)
    assert C.nccl_latency(prof, "all_gather", np.array([4]), 1)[0] == pytest.approx(17 * US)
    assert C.nccl_latency(prof, "all_reduce", np.array([4]), 1)[0] == pytest.approx(26 * US)
    # stride 4: one member per node, every step crosses: 8 + 3 x 10 (all-gather over 4 nodes)
    assert C.nccl_latency(prof, "reduce_scatter", np.array([4]), 4)[0] == pytest.approx(38 * US)
    # a group of one costs nothing
    assert C.nccl_latency(prof, "all_gather", np.array([1]), 1)[0] == 0


def test_nccl_model_charges_far_less_than_per_step_over_large_rings():
    """512 GPUs on 128 nodes: per-step charges 511 x 10 us; NCCL 8 + 384 x 3 + 127 x 10."""
    per_step = gpu_profile()
    nccl = gpu_profile(**NCCL)
    args = ("all_gather", 0.0, np.array([512]), np.array([np.inf]))
    t_old = C.ring_time(per_step, *args, per_step.group_latency(512, 1), False, 1)[0]
    t_new = C.ring_time(nccl, *args, nccl.group_latency(512, 1), False, 1)[0]
    assert t_old == pytest.approx(511 * 10 * US)
    assert t_new == pytest.approx((8 + 384 * 3 + 127 * 10) * US)


def test_latency_model_fields_are_checked():
    with pytest.raises(UserError, match="latency_model"):
        gpu_profile(latency_model="tree")
    with pytest.raises(UserError, match="base_latency_us"):
        gpu_profile(base_latency_us={"value": 8, "source": "test"})
    with pytest.raises(UserError, match="source"):
        gpu_profile(latency_model="nccl", base_latency_us=8)


# ---- attention throughput table --------------------------------------------------------------
ROWS = [{"seq": 512, "head_dim": 128, "fwd_tflops": 100, "bwd_tflops": 50, "source": "test"},
        {"seq": 8192, "head_dim": 128, "fwd_tflops": 200, "bwd_tflops": 150, "source": "test"},
        {"seq": 512, "head_dim": 64, "fwd_tflops": 80, "bwd_tflops": 40, "source": "test"}]


def test_attention_rates_interpolate_in_log_seq_and_head_dim():
    ph = gpu_profile(ROWS).physics
    # seq 2048 is half way from 512 to 8192 in log2: 150 / 100 TFLOP/s at head dim 128
    assert ph.attention_rates(2048, 128) == pytest.approx((150e12, 100e12))
    # clamped at both ends of the sequences
    assert ph.attention_rates(128, 128) == pytest.approx((100e12, 50e12))
    assert ph.attention_rates(65536, 128) == pytest.approx((200e12, 150e12))
    # head dim 64 has only seq 512 (constant); head dim 90.5 = 2^6.5 is half way in log2 at seq 512
    assert ph.attention_rates(4096, 64) == pytest.approx((80e12, 40e12))
    assert ph.attention_rates(512, 2 ** 6.5) == pytest.approx((90e12, 45e12))


def test_attention_seconds_take_the_table_rates():
    prof = gpu_profile(ROWS)
    model = ModelSpec(name="t", n_layers=2, hidden=1024, n_heads=8, vocab=256, seq_len=2048)  # head dim 128
    fwd, bwd = K.attention_seconds(prof, model, np.array([2]), 1, 2048)
    flop = 4.0 * 2048 * 2048 * 128 * 4 / 2  # 4 heads per GPU, causal half
    assert float(fwd[0]) == pytest.approx(flop / 150e12)
    assert float(bwd[0]) == pytest.approx(2.5 * flop / 100e12)


def test_attention_table_rows_are_checked():
    with pytest.raises(UserError, match="repeats seq"):
        gpu_profile(ROWS + [ROWS[0]])
    with pytest.raises(UserError, match="throughput"):
        gpu_profile([])


# ---- compute slowed under overlap -----------------------------------------------------------
def test_overlap_slowdown_by_hand():
    # compute 10 beside a collective 4, compute 25% slower meanwhile: 4 s of comm cover 3.2 s of
    # compute, 6.8 s remain: 10.8 = 10 + 4 x 0.25 / 1.25
    assert overlapped(10.0, 4.0, 1.0, 0.25) == pytest.approx(10.8)
    # a collective longer than the slowed compute hides it: 20 > 10 x 1.25
    assert overlapped(10.0, 20.0, 1.0, 0.25) == pytest.approx(20.0)
    # no slowdown is the old max / eta formula exactly
    assert overlapped(10.0, 4.0, 1.0, 0.0) == 10.0
    assert overlapped(10.0, 4.0, 0.5, 0.0) == 12.0
    with pytest.raises(UserError, match="overlap_compute_slowdown"):
        gpu_profile(overlap_compute_slowdown={"value": 1.2, "source": "test"})


# ---- bundled profiles ---------------------------------------------------------------------------
def test_cpu_profile_selects_no_gpu_physics():
    p = load_profile("localhost-cpu")
    assert p.physics.latency_model == "per_step" and p.physics.overlap_slowdown == 0
    assert p.physics.attention_rates(2048, 64) is None


@pytest.mark.parametrize("name", ["perlmutter", "frontier", "alps", "dgx-a100", "dgx-h100", "dgx-h200"])
def test_gpu_profiles_select_their_physics(name):
    p = load_profile(name)
    assert p.physics.overlap_slowdown == pytest.approx(0.189)
    if name.startswith("dgx-"):
        assert p.physics.latency_model == "nccl" and p.physics.base_latency == pytest.approx(8.4e-6)
    if name != "frontier":
        f, b = p.physics.attention_rates(2048, 128)
        assert 0 < f < p.peak_flops and 0 < b < p.peak_flops
