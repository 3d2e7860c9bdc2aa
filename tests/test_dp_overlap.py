"""The data-parallel gradient all-reduce overlapped with the last backward (overlap.data_parallel):
the queue formula by hand, the planner's step against its own backward windows, and the trainer's
buckets and their order under fake tensors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import tiny_model

from axoplan.planner import batch as B
from axoplan.planner import timing
from axoplan.planner import comm as C
from axoplan.planner.execution import Execution
from axoplan.planner.rank import explain
from axoplan.planner.space import Candidates

SERIAL_DP = Execution(overlap_grad_reduce=False)  # the D gradients reduced once, after the last backward


def queue_tail(t_end, arrivals, services):
    """One call at a time, in order, each no earlier than its arrival: seconds past t_end."""
    f = 0.0
    for a, s in zip(arrivals, services):
        f = max(f, a) + s
    return max(f - t_end, 0.0)


def arrivals(t_end, t_first, t_block, n, lag):
    """Per-unit buckets (LM head, each block, embedding): when each becomes final."""
    return ([min(t_first + lag * t_block, t_end)] + [min(t_first + (j + 1 + lag) * t_block, t_end) for j in range(n)]
            + [t_end])


def tail(t_end, t_first, t_block, lag, k0, k, mid, single, s1, sm, sl, last=1):
    a = [np.array([float(x)]) for x in (t_end, t_first, t_block, lag, k0, k, mid)]
    out = timing.data_parallel_tail(*a, np.array([single]), *(np.array([float(x)]) for x in (s1, sm, sl, last)))
    return float(out[0])


def test_tail_by_hand():
    # backward of 10 s: LM head window 1 s, 4 blocks of 2 s, embedding 1 s; buckets: the LM head alone
    # (0.5 s), each block (1 s, 4 middle buckets of 1 block), the embedding (0.5 s).
    # lag 0: LM head at 1 -> 1.5; blocks at 3, 5, 7, 9 -> 4, 6, 8, 10; embedding at 10 -> 10.5
    assert tail(10, 1, 2, 0, 0, 1, 4, False, 0.5, 1.0, 0.5) == pytest.approx(0.5)
    # blocks of 3 s each: the D stream falls behind: 3 -> 6 -> 9 -> 12 -> 15, embedding 15 -> 15.5
    assert tail(10, 1, 2, 0, 0, 1, 4, False, 0.5, 3.0, 0.5) == pytest.approx(5.5)
    # lag of one block: LM head at 3, blocks at 5, 7, 9, 10 (capped): 3.5, 6, 8, 10, 11; embedding 11.5
    assert tail(10, 1, 2, 1, 0, 1, 4, False, 0.5, 1.0, 0.5) == pytest.approx(1.5)
    # LM head + 1 block (1.5 s) at 3 -> 4.5; one bucket of 2 blocks (2 s) at 7 -> 9; the last block with the
    # embedding (1.5 s) at 10 -> 11.5
    assert tail(10, 1, 2, 0, 1, 2, 1, False, 1.5, 2.0, 1.5) == pytest.approx(1.5)
    # one bucket of everything: launched at the end, all of it exposed
    assert tail(10, 1, 2, 0, 4, 1, 0, True, 4.0, 0.0, 0.0, last=0) == pytest.approx(4.0)
    # nothing to reduce beside it: no tail
    assert tail(10, 1, 2, 0, 0, 1, 4, False, 0.0, 0.0, 0.0) == 0.0


def test_tail_equals_a_queue_simulation():
    """The closed form (an end or the kink) equals the call-by-call queue of the greedy buckets over many
    random cases."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 40))
        t_first, t_block, e = rng.uniform(0, 2), rng.uniform(1e-3, 3), rng.uniform(0, 2)
        t_end = t_first + n * t_block + e
        lag = float(rng.choice([0.0, 0.5, 1.0]))
        a, b, c = (int(x) for x in rng.integers(1, 1000, 3))
        cap = int(rng.choice([1, 500, 2000, 10**6]))
        plan = C.gradient_buckets(np.array([b]), np.array([a]), np.array([c]), n, cap_bytes=4 * cap)
        # the greedy by hand: units and when each is final, buckets closing at the cap
        sizes = [a] + [b] * n + [c]
        final = arrivals(t_end, t_first, t_block, n, lag)
        buckets, cur, when = [], 0, 0.0
        for i, (sz, t) in enumerate(zip(sizes, final)):
            cur, when = cur + sz, t
            if cur >= cap or i == len(sizes) - 1:
                buckets.append((cur, when))
                cur = 0
        rows = [(int(el[0]), int(calls[0])) for _, el, calls in plan.rows]
        assert sum(calls for _, calls in rows) == len(buckets)
        assert sorted(el for el, calls in rows for _ in range(calls)) == sorted(el for el, _ in buckets)
        per_byte = rng.uniform(1e-5, 1e-2)
        s = [el * per_byte for el, _ in rows]
        want = queue_tail(t_end, [t for _, t in buckets], [el * per_byte for el, _ in buckets])
        got = timing.data_parallel_tail(*(np.array([float(x)]) for x in (t_end, t_first, t_block, lag)), plan.first_blocks,
                                   plan.per_bucket, plan.middle, plan.single, s[0], s[1], s[2], plan.rows[2][2])
        assert float(got[0]) == pytest.approx(want, abs=1e-9)


def test_bucketed_rows(pm):
    """One row per kind of bucket, calls per step beside it, the same fp32 bytes as the single call."""
    g = C.place(pm, Candidates(*(np.array([v]) for v in (1, 2, 2, 4, 0, 1)), np.array([False])))
    one = C.data_parallel_collectives(pm, g, np.array([1000.0 * 5 + 300 + 200]), np.array([10.0]))
    # cap 2000 elements: LM head + 2 blocks (2300), one middle bucket of 2 blocks, the last block + embedding
    plan = C.gradient_buckets(np.array([1000]), np.array([300]), np.array([200]), 5, cap_bytes=8000)
    assert (plan.first_blocks[0], plan.per_bucket[0], plan.middle[0], bool(plan.single[0])) == (2, 2, 1, False)
    split = C.data_parallel_collectives(pm, g, np.array([5500.0]), np.array([10.0]), plan.rows)
    assert len(split) == len(one) + 2
    grads = split[:3]
    assert [(c.layer, c.phase, c.axis, float(c.nbytes[0]), int(c.calls[0])) for c in grads] == [
        ("gradients", "bwd", "d", 2300 * 4.0, 1), ("gradients", "bwd", "d", 2000 * 4.0, 1),
        ("gradients", "bwd", "d", 1200 * 4.0, 1)]
    assert sum(float(c.nbytes[0]) * int(c.calls[0]) for c in grads) == float(one[0].nbytes[0])
    assert [c.layer for c in split[3:]] == [c.layer for c in one[1:]]
    # under the cap: one bucket of everything; the LM head alone over it
    plan = C.gradient_buckets(np.array([1000]), np.array([300]), np.array([200]), 5, cap_bytes=10**6)
    assert bool(plan.single[0]) and [int(r[2][0]) for r in plan.rows] == [1, 0, 0] and plan.rows[0][1][0] == 5500
    plan = C.gradient_buckets(np.array([1000]), np.array([300]), np.array([200]), 5, cap_bytes=1200)
    assert [(r[1][0], int(r[2][0])) for r in plan.rows] == [(300, 1), (1000, 5), (200, 1)]


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
    monkeypatch.setattr(C, "DP_BUCKET_BYTES", 4)  # every unit its own bucket: the LM head, each block, the embedding
    m = tiny_model(n_layers=4, hidden=256, n_heads=8)
    on = explain(m, pm, 8, 32, grid, micro_batch=mb, checkpointing=False)
    off = explain(m, pm, 8, 32, grid, micro_batch=mb, checkpointing=False, execution=SERIAL_DP)
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
    monkeypatch.setattr(C, "DP_BUCKET_BYTES", 4)  # every unit its own bucket
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import Job, load_model

    p = load_profile("localhost-cpu")
    assert 0 < p.overlap < 1 and not p.physics.overlap_slowdown
    c = Candidates(*(np.array([v]) for v in (1, 1, 2, 4, 0, 1)), np.array([False]))
    ev = B.evaluate(load_model("gpt-tiny"), p, Job(8, 16, 64), c, explain=True)
    step, st = ev.detail["schedule"].step, ev.detail["time"]
    others = sum(float(s.seconds[0]) for s in step[3:])
    hidden = float(st.data_parallel_hidden[0])
    tail_s = float(st.data_parallel[0]) - others - (1 - p.overlap) * hidden
    total = sum(float(s.seconds[0]) * int(s.calls[0]) for s in step[:3])
    assert hidden > 0 and tail_s >= float(step[2].seconds[0]) - 1e-15
    assert tail_s + hidden == pytest.approx(total)


def test_trainer_launches_each_bucket_inside_the_last_backward(monkeypatch):
    """gpt-tiny on 1 x 1 x 2 x 2 fake ranks, two micro-batches: the D all-reduces are issued between
    the last micro-batch's reduce-scatters, one per bucket (LM head, each block, embedding) in the
    order their shards become final, tiling the gradient buffer; with the flag off, one call after them."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from axoplan.runconfig import Grid, LaunchConfig, Overlap
    from axoplan.runtime.dryrun import _fake_world
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.train import Resolved, Trainer

    def trace(dp, cap):
        monkeypatch.setattr(C, "DP_BUCKET_BYTES", cap)
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

    default = C.DP_BUCKET_BYTES
    tr, calls = trace(True, 4)  # every unit its own bucket
    L = tr.spec.n_layers
    idx = [i for i, c in enumerate(calls) if c.layer == "gradients"]
    rs = [i for i, c in enumerate(calls) if c.kind == "reduce_scatter"]
    assert tr.grad_acc == 2 and len(idx) == L + 2 and all(calls[i].axis == "d" for i in idx)
    assert rs[len(rs) // 2] < idx[0] < rs[-1]  # launched in the last micro-batch, before its backward ends
    assert calls[idx[-1]].nbytes == tr.model.weights["tok_emb"].shard_len * 4  # the embedding's, finished last
    buckets = tr.model.grad_buckets()
    assert sorted(calls[i].nbytes for i in idx) == sorted(t.numel() * 4 for _, t in buckets)
    # adjacent views in backward order (the buffer holds the weights in forward order): they tile it
    assert [t.storage_offset() + t.numel() for _, t in itertools.islice(buckets, 1, None)] == [
        t.storage_offset() for _, t in buckets[:-1]]
    assert sum(t.numel() for _, t in buckets) == tr.model.grad_buffer.numel()
    assert tr.rt.dp_overlapped == L + 2
    tr, calls = trace(True, default)  # gpt-tiny's 8 MiB of gradients: one bucket at the end
    assert [(c.layer, c.nbytes) for c in calls if c.axis == "d"] == [("gradients", tr.model.grad_buffer.numel() * 4)]
    assert tr.rt.dp_overlapped == 1
    tr, calls = trace(False, 4)
    idx = [i for i, c in enumerate(calls) if c.layer == "gradients"]
    rs = [i for i, c in enumerate(calls) if c.kind == "reduce_scatter"]
    assert len(idx) == 1 and idx[0] > rs[-1] and calls[idx[0]].nbytes == tr.model.grad_buffer.numel() * 4
    assert tr.rt.dp_overlapped == 0


@pytest.mark.parametrize("cap", [4, 2**16, None])
@pytest.mark.parametrize("machine", ["dgx-h100", "localhost-cpu"])
def test_overlap_costs_at_most_the_extra_calls(machine, cap, monkeypatch):
    """Over a whole space: the buckets hide what the last backward covers and never cost more than the
    fixed cost of their extra calls (n_layers + 1 more than the single one), eta 0 to 1 alike."""
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.space import enumerate_space
    from axoplan.planner.specs import Job, load_model

    if cap:
        monkeypatch.setattr(C, "DP_BUCKET_BYTES", cap)
    m = load_model("gpt-tiny")
    c = enumerate_space(8, 16, checkpointing="both")
    job = Job(8, 16, m.seq_len)
    for eta in (0.0, 0.5, 1.0):
        p = load_profile(machine).replace(overlap_efficiency=eta)
        on = B.evaluate(m, p, job, c).batch_time
        off = B.evaluate(m, p, job, c, execution=SERIAL_DP).batch_time
        g = C.place(p, c)
        # a call's fixed cost: its time at zero bytes (measured tables: the smallest message's, or more)
        fixed = C._coll(p, g, "gradients", "bwd", "all_reduce", "d", np.zeros(len(c))).seconds
        split = c.gdata > 1
        np.testing.assert_allclose(on[~split], off[~split], rtol=1e-12)  # no D group: the same step
        assert np.all(on[split] <= off[split] + (m.n_layers + 1) * fixed[split] * (1 + 1e-9) + 1e-12)


@pytest.mark.parametrize("blocks_per_cap,calls", [(0.0, 9), (1.5, 4), (2.2, 3), (9.0, 1)])
def test_dryrun_buckets_equal_the_plan(monkeypatch, model_yaml, blocks_per_cap, calls):
    """The trainer traced (fake ranks) issues exactly the planned calls and bytes over D, whatever the cap.
    7 layers, hidden 64, vocabulary 256 on 1 x 2 x 2 x 2: a block's shard (12288 + 4096 + 16384 + 16384) / 4
    = 12288 elements, the LM head's and the embedding's 16384 / 4 = 4096. Caps of 1.5 and 2.2 blocks:
    LM head + 2 blocks | 2 | 2 | 1 + embedding, and LM head + 2 | 3 | 2 + embedding; 9 blocks: one bucket."""
    pytest.importorskip("torch")
    from axoplan.runtime.dryrun import compare

    path = str(model_yaml(n_layers=7))
    monkeypatch.setattr(C, "DP_BUCKET_BYTES", max(4, int(blocks_per_cap * 12288 * 4)))
    r = compare(path, "localhost-cpu", 8, 16, (1, 2, 2, 2), micro_batch=2, checkpointing=False)
    grads = [c for c in r["collectives"] if c["layer"] == "gradients"]
    assert len(grads) == 1 and grads[0]["traced_calls"] == calls
    assert grads[0]["traced_bytes"] == (7 * 12288 + 2 * 4096) * 4
    for c in r["collectives"]:
        assert (c["predicted_calls"], c["predicted_bytes"]) == (c["traced_calls"], c["traced_bytes"]), c
