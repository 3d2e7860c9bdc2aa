"""The data-parallel gradient all-reduce overlapped with the last backward (overlap.data_parallel):
the queue formula by hand, the planner's step against its own backward windows, and the trainer's
buckets and their order under fake tensors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import tiny_model

from axoplan.costmodel import batch as B
from axoplan.costmodel import comm as C
from axoplan.rank import explain
from axoplan.space import Candidates


def queue_tail(t_end, arrivals, services):
    """One call at a time, in order, each no earlier than its arrival: seconds past t_end."""
    f = 0.0
    for a, s in zip(arrivals, services):
        f = max(f, a) + s
    return max(f - t_end, 0.0)


def arrivals(t_end, t_first, t_block, n, lag):
    return ([min(t_first + lag * t_block, t_end)] + [min(t_first + (j + 1 + lag) * t_block, t_end) for j in range(n)]
            + [t_end])


def tail(*a):
    return float(B.data_parallel_tail(*(np.array([x], dtype=float) if isinstance(x, float) else x for x in a))[0])


def test_tail_by_hand():
    # backward of 10 s: LM head window 1 s, 4 blocks of 2 s, embedding 1 s. Buckets of 0.5, 1 (x4), 0.5 s.
    # lag 0: LM head at 1 -> 1.5; blocks at 3, 5, 7, 9 -> 4, 6, 8, 10; embedding at 10 -> 10.5
    assert tail(10.0, 1.0, 2.0, 4, 0.0, 0.5, 1.0, 0.5) == pytest.approx(0.5)
    # blocks of 3 s each: the D stream falls behind: 3 -> 6 -> 9 -> 12 -> 15, embedding 15 -> 15.5
    assert tail(10.0, 1.0, 2.0, 4, 0.0, 0.5, 3.0, 0.5) == pytest.approx(5.5)
    # lag of one block: LM head at 3, blocks at 5, 7, 9, 10 (capped): 3.5, 6, 8, 10, 11; embedding 11.5
    assert tail(10.0, 1.0, 2.0, 4, 1.0, 0.5, 1.0, 0.5) == pytest.approx(1.5)
    # nothing to reduce beside it: no tail
    assert tail(10.0, 1.0, 2.0, 4, 0.0, 0.0, 0.0, 0.0) == 0.0


def test_tail_equals_a_queue_simulation():
    """The closed form (an end or the kink) equals the call-by-call queue over many random cases."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        n = int(rng.integers(1, 40))
        t_first, t_block, e = rng.uniform(0, 2), rng.uniform(1e-3, 3), rng.uniform(0, 2)
        t_end = t_first + n * t_block + e
        lag = float(rng.choice([0.0, 0.5, 1.0]))
        s1, sb, s2 = rng.uniform(0, 2), rng.uniform(0, 4) * rng.choice([0.01, 1.0]), rng.uniform(0, 2)
        want = queue_tail(t_end, arrivals(t_end, t_first, t_block, n, lag), [s1] + [sb] * n + [s2])
        assert tail(t_end, t_first, t_block, n, lag, s1, sb, s2) == pytest.approx(want, abs=1e-12)


def test_bucketed_rows(pm):
    """One row per bucket, calls per step beside it, the same fp32 bytes as the single call."""
    g = C.place(pm, Candidates(*(np.array([v]) for v in (1, 2, 2, 4, 0, 1)), np.array([False])))
    one = C.data_parallel_collectives(pm, g, np.array([1000.0 * 5 + 300 + 200]), np.array([10.0]))
    bk = C.gradient_buckets(np.array([1000.0]), np.array([300.0]), np.array([200.0]), 5)
    split = C.data_parallel_collectives(pm, g, np.array([5500.0]), np.array([10.0]), bk)
    assert len(split) == len(one) + 2
    grads = split[:3]
    assert [(c.layer, c.phase, c.axis, float(c.nbytes[0]), c.calls) for c in grads] == [
        ("gradients", "bwd", "d", 1200.0, 1), ("gradients", "bwd", "d", 4000.0, 5), ("gradients", "bwd", "d", 800.0, 1)]
    assert sum(float(c.nbytes[0]) * c.calls for c in grads) == float(one[0].nbytes[0])
    assert [c.layer for c in split[3:]] == [c.layer for c in one[1:]]


def backward_parts(ex):
    """(LM head window, one block's window, whole backward) per micro-batch from explain's windows."""
    ga = int(ex.notes[1].split("=")[1].split()[0])
    w = ex.windows[ex.windows["pass"] == "backward"]
    L = int(w.count_per_micro_batch.max())
    lm = float(w.window_s.iloc[0]) / ga
    blocks = float(w[w.count_per_micro_batch == L].window_s.sum()) / ga
    return lm, blocks / L, float(w.window_s.sum()) / ga, L


@pytest.mark.parametrize("grid,mb", [((1, 2, 1, 4), 1), ((1, 1, 1, 8), 2), ((2, 2, 1, 2), 4)])
def test_step_against_its_backward_by_hand(pm, monkeypatch, grid, mb):
    """GPU-like profile (eta 1, no slowdown), Z = 1 (a shard is final at its own window: lag 0): the step
    with the overlap is the step without it, minus the single blocking call, plus the queue's tail over
    the last backward's windows, the buckets arriving as their windows end."""
    m = tiny_model(n_layers=4, hidden=256, n_heads=8)
    on = explain(m, pm, 8, 32, grid, micro_batch=mb, checkpointing=False)
    monkeypatch.setattr(B, "OVERLAP_DP", False)
    off = explain(m, pm, 8, 32, grid, micro_batch=mb, checkpointing=False)
    g_on = on.collectives[on.collectives.layer == "gradients"]
    g_off = off.collectives[off.collectives.layer == "gradients"]
    assert list(g_on.calls_per_step) == [1, 4, 1] and list(g_off.calls_per_step) == [1]
    assert (g_on.bytes * g_on.calls_per_step).sum() == float(g_off.bytes.iloc[0])
    lm, blk, t_end, L = backward_parts(on)
    s = list(g_on.time_per_call_s)
    want = queue_tail(t_end, arrivals(t_end, lm, blk, L, 0.0), [s[0]] + [s[1]] * L + [s[2]])
    assert 0 < want < sum(s[i] * c for i, c in enumerate(g_on.calls_per_step))
    got = float(on.summary.batch_time_s.iloc[0]) - float(off.summary.batch_time_s.iloc[0])
    assert got == pytest.approx(want - float(g_off.time_per_call_s.iloc[0]), rel=1e-9, abs=1e-12)
    # the communication total counts every bucket call
    d_comm = float(on.summary.comm_s.iloc[0]) - float(off.summary.comm_s.iloc[0])
    assert d_comm == pytest.approx(float(g_on.total_s.sum()) - float(g_off.total_s.iloc[0]), rel=1e-9)


def test_shared_cores_hide_only_eta(monkeypatch):
    """On CPU ranks (localhost-cpu, eta < 1) what runs beside the backward still costs (1 - eta) of itself."""
    from axoplan.machine import load_profile
    from axoplan.specs import Job, load_model

    p = load_profile("localhost-cpu")
    assert 0 < p.overlap < 1 and not p.physics.overlap_slowdown
    c = Candidates(*(np.array([v]) for v in (1, 1, 2, 4, 0, 1)), np.array([False]))
    ev = B.evaluate(load_model("gpt-tiny"), p, Job(8, 16, 64), c, explain=True)
    d = ev.detail
    others = sum(float(s.seconds[0]) for s in d["step"][3:])
    hidden = float(d["t_dp_hidden"][0])
    tail_s = float(d["t_dp"][0]) - others - (1 - p.overlap) * hidden
    total = sum(float(s.seconds[0]) * s.calls for s in d["step"][:3])
    assert hidden > 0 and tail_s >= float(d["step"][2].seconds[0]) - 1e-15
    assert tail_s + hidden == pytest.approx(total)


def test_trainer_launches_each_bucket_inside_the_last_backward():
    """gpt-tiny on 1 x 1 x 2 x 2 fake ranks, two micro-batches: the D all-reduces are issued between
    the last micro-batch's reduce-scatters, one per bucket (LM head, each block, embedding) in the
    order their shards become final, tiling the gradient buffer; with the flag off, one call after them."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from axoplan.launch import Grid, LaunchConfig, Overlap
    from axoplan.runtime.dryrun import _fake_world
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Resolved, Trainer

    def trace(dp):
        cfg = LaunchConfig(model="gpt-tiny", grid=Grid(1, 1, 2, 2), global_batch=8, micro_batch=1,
                           overlap=Overlap(data_parallel=dp), metrics=None)
        _fake_world(4)
        try:
            res = Resolved(torch.device("cpu"), "fake", torch.float32, torch.float32, blas_tuning=False)
            with FakeTensorMode(allow_non_fake_inputs=True):
                tr = Trainer(cfg, build_grid(1, 1, 2, 2, "xyz"), res)
                tr.rt.calls = []
                tr.train_step(0)
            return tr, tr.rt.calls
        finally:
            dist.destroy_process_group()

    tr, calls = trace(True)
    L = tr.spec.n_layers
    idx = [i for i, c in enumerate(calls) if c.layer == "gradients"]
    rs = [i for i, c in enumerate(calls) if c.kind == "reduce_scatter"]
    assert tr.grad_acc == 2 and len(idx) == L + 2 and all(calls[i].axis == "d" for i in idx)
    assert rs[len(rs) // 2] < idx[0] < rs[-1]  # launched in the last micro-batch, before its backward ends
    assert calls[idx[-1]].nbytes == tr.model.weights["tok_emb"].shard_len * 4  # the embedding's, finished last
    buckets = tr.model.grad_buckets()
    assert sorted(calls[i].nbytes for i in idx) == sorted(t.numel() * 4 for _, t in buckets)
    assert [t.storage_offset() for _, t in itertools.islice(buckets, 1, None)] == [
        t.storage_offset() + t.numel() for _, t in buckets[:-1]]  # adjacent views: they tile the buffer
    assert sum(t.numel() for _, t in buckets) == tr.model.grad_buffer.numel()
    assert tr.rt.dp_overlapped == L + 2
    tr, calls = trace(False)
    idx = [i for i, c in enumerate(calls) if c.layer == "gradients"]
    rs = [i for i, c in enumerate(calls) if c.kind == "reduce_scatter"]
    assert len(idx) == 1 and idx[0] > rs[-1] and calls[idx[0]].nbytes == tr.model.grad_buffer.numel() * 4
    assert tr.rt.dp_overlapped == 0


@pytest.mark.parametrize("machine", ["dgx-h100", "localhost-cpu"])
def test_overlap_costs_at_most_the_extra_calls(machine, monkeypatch):
    """Over a whole space: the buckets hide what the last backward covers and never cost more than the
    fixed cost of their extra calls (n_layers + 1 more than the single one), eta 0 to 1 alike."""
    from axoplan.machine import load_profile
    from axoplan.space import enumerate_space
    from axoplan.specs import Job, load_model

    m = load_model("gpt-tiny")
    c = enumerate_space(8, 16, checkpointing="both")
    job = Job(8, 16, m.seq_len)
    for eta in (0.0, 0.5, 1.0):
        p = load_profile(machine).replace(overlap_efficiency=eta)
        on = B.evaluate(m, p, job, c).batch_time
        monkeypatch.setattr(B, "OVERLAP_DP", False)
        off = B.evaluate(m, p, job, c).batch_time
        monkeypatch.setattr(B, "OVERLAP_DP", True)
        g = C.place(p, c)
        # a call's fixed cost: its time at zero bytes (measured tables: the smallest message's, or more)
        fixed = C._coll(p, g, "gradients", "bwd", "all_reduce", "d", np.zeros(len(c))).seconds
        split = c.gdata > 1
        np.testing.assert_allclose(on[~split], off[~split], rtol=1e-12)  # no D group: the same step
        assert np.all(on[split] <= off[split] + (m.n_layers + 1) * fixed[split] * (1 + 1e-9) + 1e-12)
