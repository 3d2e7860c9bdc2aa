"""The pipeline axis: stage layout, torch's schedule orders, the walk (textbook bubble, steady-state
continuation), the space and its rules, per-stage memory, and the CLI's pipeline errors."""
from __future__ import annotations

import dataclasses

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import axoplan
from axoplan.errors import UserError
from axoplan.planner import pipeline as P
from axoplan.planner.rank import explain
from axoplan.planner.space import enumerate_space, factorizations4, pipeline_choices
from axoplan.planner.stage_timing import bound_time, rank_blocks


def test_blocks_split_evenly_the_first_stages_take_the_extra():
    assert P.stage_blocks(10, 4).tolist() == [3, 3, 2, 2]
    assert P.stage_blocks(32, 4).tolist() == [8, 8, 8, 8]
    assert P.stage_blocks(10, 2, 2).tolist() == [3, 3, 2, 2]  # virtual stages 0..3, rank v mod 2
    # the last stage (the LM head's) never takes an extra block
    for L in range(2, 40):
        for V in range(1, L + 1):
            b = P.stage_blocks(L, V)
            assert b.sum() == L and b.max() - b.min() <= 1 and b[-1] == b.min()
    # a rank's blocks: its virtual stages', by hand for L=10, pp=2, vpp=2: rank 0 holds stages 0 and 2 (3 + 2)
    assert rank_blocks(10, 2, 2, 0) == 5 and rank_blocks(10, 2, 2, 1) == 5
    assert rank_blocks(11, 2, 2, 0) == 6 and rank_blocks(11, 2, 2, 1) == 5


@pytest.mark.parametrize("schedule,pp,vpp,m", [("1f1b", 4, 1, 4), ("1f1b", 3, 1, 7), ("1f1b", 4, 1, 2),
                                                ("interleaved-1f1b", 2, 2, 4), ("interleaved-1f1b", 4, 3, 8),
                                                ("interleaved-1f1b", 3, 2, 3)])
def test_every_rank_runs_each_of_its_chunks_once_forward_before_backward(schedule, pp, vpp, m):
    orders = P.rank_orders(schedule, pp, vpp, m)
    V = pp * vpp
    for s, ops in enumerate(orders):
        mine = {v for v in range(V) if v % pp == s}
        assert sorted(ops) == sorted((k, v, i) for k in "FB" for v in mine for i in range(m))
        for v in mine:
            for i in range(m):
                assert ops.index(("F", v, i)) < ops.index(("B", v, i))
    if schedule == "1f1b":  # torch's Schedule1F1B: min(m, pp - s) forwards before the first backward
        for s, ops in enumerate(orders):
            first_b = next(k for k, op in enumerate(ops) if op[0] == "B")
            assert first_b == min(m, pp - s)


def _uniform(V, F, B):
    return np.concatenate([np.full((V, 1), F), np.full((V, 1), B)])


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 7), (4, 4), (4, 16), (8, 8), (8, 33)])
def test_textbook_bubble_falls_out_of_the_1f1b_walk(pp, m):
    F, B = 1.0, 2.0
    end = P.rank_end_times("1f1b", pp, 1, m, _uniform(pp, F, B), np.zeros((2, 1)))
    assert end.max() == pytest.approx(m * (F + B) * (1 + (pp - 1) / m), rel=1e-12)
    assert end[0, 0] == end.max()  # the first stage ends last: its backward is the step's last


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 3, 8), (4, 2, 4), (4, 4, 16), (8, 2, 8), (8, 3, 24)])
def test_textbook_bubble_falls_out_of_the_interleaved_walk(pp, vpp, m):
    F, B = 1.0 / vpp, 2.0 / vpp  # a stage's model chunk is split in vpp
    end = P.rank_end_times("interleaved-1f1b", pp, vpp, m, _uniform(pp * vpp, F, B), np.zeros((2, 1)))
    assert end.max() == pytest.approx(3.0 * m * (1 + (pp - 1) / (m * vpp)), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(2, 8), rounds=st.integers(6, 20), edge=st.floats(1.0, 1.6), send=st.floats(0.0, 0.3),
       inter=st.booleans())
def test_the_steady_state_continuation_equals_the_full_walk(pp, rounds, edge, send, inter):
    """Stages as the planner makes them (identical middles, the first and last heavier), transfers between them:
    continuing the walk's last increments past steady_cap is the walk itself."""
    vpp = 2 if inter else 1
    sched = "interleaved-1f1b" if inter else "1f1b"
    V = pp * vpp
    m = rounds * pp
    F = np.full(V, 1.0)
    F[0], F[-1] = edge * 0.5 + 0.5, edge
    sec = np.concatenate([F, 2 * F])[:, None]
    sends = np.full((2, 1), send)
    full = P._walk(P.walk_plan(sched, pp, vpp, m), sec, P.send_rows(sends, pp))
    cap, period = P.steady_cap(sched, pp)
    # exact up to the cap; past it the mean increment of a period: within the spread of one period's increments
    spread = period * 2 * send + 1e-9 * full.max()
    assert np.all(np.abs(P.rank_end_times(sched, pp, vpp, m, sec, sends) - full) <= (spread if m > cap else 1e-9 * full.max()))


def test_transfers_sit_on_the_paths_between_stages():
    sec = _uniform(4, 1.0, 2.0)

    def delay(m):
        return (P.rank_end_times("1f1b", 4, 1, m, sec, np.full((2, 1), 0.5)).max()
                - P.rank_end_times("1f1b", 4, 1, m, sec, np.zeros((2, 1))).max())

    # one micro-batch: down the pipeline and back, one transfer per boundary each way (by hand: 2 x 3 x 0.5)
    assert delay(1) == pytest.approx(3.0)
    # in the steady state a stage's backward waits for the next stage's gradient: the delay grows with m
    assert delay(1) < delay(4) < delay(8) < delay(16)


def test_in_flight_forwards_at_the_peak():
    assert [sum(r) for r in P.peak_in_flight("1f1b", 4, 1, 8)] == [4, 3, 2, 1]
    assert [sum(r) for r in P.peak_in_flight("1f1b", 4, 1, 2)] == [2, 2, 2, 1]
    # interleaved, rank s: (vpp - 1) * pp + 2 * (pp - 1 - s) warm-up forwards, then one more before the backward
    assert [sum(r) for r in P.peak_in_flight("interleaved-1f1b", 2, 2, 4)] == [5, 3]


def test_an_execution_that_splits_unevenly_also_interleaves_at_2_4_and_8():
    """126 blocks (Llama 3 405B) on 16 GPUs: no vpp splits them evenly over 4, 8 or 16 stages, so an even-split
    execution interleaves only pp 2 (vpp 3 and 7); one that splits unevenly adds vpp 2, 4 and 8 wherever
    pp x vpp <= 126, never 3, 5, 6 or 7 beyond the even ones, and rank plans them only for such an execution."""
    even = pipeline_choices(16, 126, "all")
    uneven = pipeline_choices(16, 126, "all", uneven=True)
    assert {(p, v) for p, v, s in even if s} == {(2, 3), (2, 7)}
    assert {(p, v) for p, v, s in uneven if s} == {(2, 3), (2, 7)} | {(p, v) for p in (2, 4, 8, 16) for v in (2, 4, 8) if p * v <= 126}
    assert set(even) <= set(uneven)
    kw = dict(seq_len=8192, pp=16, schedule="interleaved-1f1b", include_infeasible=True)
    assert set(axoplan.rank("llama3-405b", "dgx-h100", 16384, 2048, execution="megatron-core", **kw).vpp) == {2, 4}
    with pytest.raises(UserError, match="no pipeline configuration matches --pp 16 --schedule interleaved-1f1b"):
        axoplan.rank("llama3-405b", "dgx-h100", 16384, 2048, execution="megatron-lm", **kw)


def test_space_adds_pipelines_and_keeps_the_4d_space_for_pp_1():
    choices = pipeline_choices(16, 8, "all")
    assert {p for p, _, _ in choices} == {1, 2, 4, 8}
    assert (2, 2, 1) in choices and (2, 4, 1) in choices and (8, 1, 0) in choices and (8, 2, 1) not in choices
    c = enumerate_space(16, 32, pipelines=choices)
    one = enumerate_space(16, 32)
    assert int((c.pp == 1).sum()) == len(one)
    for p in (2, 4, 8):
        sel = (c.pp == p) & (c.schedule == 0)
        assert np.all(c.gx[sel] * c.gy[sel] * c.gz[sel] * c.gdata[sel] * p == 16)
        assert len({tuple(g) for g in np.stack([c.gx[sel], c.gy[sel], c.gz[sel], c.gdata[sel]], 1)}) == \
            len(factorizations4(16 // p))
    assert np.all(c.checkpointing[: len(c) // 2] == 0) and np.all(c.checkpointing[len(c) // 2:])


def test_pipeline_rules_are_reasons():
    model = axoplan.planner.specs.load_model("gpt-20b")  # 32 blocks
    df = axoplan.rank(model, "dgx-a100", 64, 16, pp=8, execution="megatron-core", include_infeasible=True,
                      checkpointing="on")
    n = df.gdata * df.gz * df.micro_batch
    few = df[(df.pp == 8) & (df.schedule == "1f1b") & (n > 2) & (16 % n == 0)]
    assert len(few) and (~few.feasible).all()
    assert few.reason.str.contains("1f1b over pp=8 stages needs at least 8 micro-batches").all()
    inter = df[(df.schedule == "interleaved-1f1b") & (16 % n == 0) & (16 // n % 8 != 0)]
    assert len(inter) and inter.reason.str.contains("needs a multiple of 8 micro-batches").all()


def test_a_pipelined_batch_splits_into_compute_exposed_communication_and_bubble():
    df = axoplan.rank("gpt-20b", "dgx-a100", 64, 256, pp=4, execution="megatron-core", top=20)
    assert (df.pp == 4).all() and (df.bubble_s > 0).all()
    p = axoplan.planner.profile_reader.load_profile("dgx-a100")
    total = df.compute_s + df.exposed_comm_s + df.bubble_s + p.corrections.step_overhead_s
    assert np.allclose(total, df.batch_time_s, rtol=1e-9)


def test_first_stage_memory_holds_its_forwards_in_flight():
    """1F1B's first stage saves pp micro-batches of its L/pp blocks when its first backward starts (L blocks
    whatever pp); interleaved, (vpp - 1) pp + 2 (pp - 1) + 1 chunks of L/(pp vpp) blocks (Narayanan et al.)."""
    kw = dict(grid=(1, 8, 1, 1), micro_batch=1, checkpointing=True, execution="megatron-core")
    mem = {}
    for key, gpus, pp, vpp in (("1f1b 4", 32, 4, None), ("1f1b 2", 16, 2, None), ("int 4x2", 32, 4, 2)):
        e = explain("gpt-20b", "dgx-a100", gpus, 8, pp=pp, vpp=vpp, **kw)
        mem[key] = float(e.memory.set_index("kind").loc["activations", "gib"])
        assert e.notes[0].startswith("memory peaks at: first pipeline stage: backward last block")
    # a checkpointed block keeps its [S, H] input per micro-batch (sequence parallel: split over gy = 8), bf16
    per_block = 2048 * 7168 * 2 / 8 / 2**30
    assert mem["1f1b 4"] == pytest.approx(mem["1f1b 2"], rel=1e-9)
    # interleaved 4 x 2: 11 chunks of 4 blocks = 44 blocks' inputs against 1F1B's 32
    assert mem["int 4x2"] - mem["1f1b 4"] == pytest.approx((11 * 4 - 32) * per_block, rel=1e-6)


def test_pp_1_is_the_4d_model_bit_for_bit():
    """--pp 1 ranks exactly what the bundled trainer's execution without a pipeline ranks."""
    import dataclasses

    from axoplan.planner.execution import AXOPLAN

    a = axoplan.rank("gpt-20b", "perlmutter", 64, 512, top=30, execution=dataclasses.replace(AXOPLAN, pipeline="none"))
    b = axoplan.rank("gpt-20b", "perlmutter", 64, 512, top=30, pp=1)
    assert a.equals(b) and (b["pp"] == 1).all()
    assert (axoplan.rank("gpt-20b", "perlmutter", 64, 512, top=30)["pp"] > 1).any()  # the default ranks 5D


@pytest.mark.parametrize("args,msg", [
    (["--pp", "3"], "--pp 3 does not divide --gpus 64"),
    (["--pp", "4", "--vpp", "2", "--schedule", "1f1b"], "needs --schedule interleaved-1f1b"),
    (["--pp", "64"], "more pipeline stages than the model's 32 blocks"),
    (["--pp", "4", "--execution", "llm-foundry"], "execution 'llm-foundry' runs no pipeline"),
    (["--pp", "two"], "--pp"),
])
def test_rank_pipeline_mistakes_are_one_sentence(args, msg):
    p = subprocess.run([sys.executable, "-m", "axoplan.cli", "rank", "--model", "gpt-20b", "--machine", "dgx-a100",
                        "--gpus", "64", "--global-batch", "64", "--execution", "megatron-core", *args],
                       capture_output=True, text=True)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1


def test_explain_refuses_too_few_micro_batches():
    with pytest.raises(UserError, match="needs at least 8 micro-batches"):
        explain("gpt-20b", "dgx-a100", 64, 4, grid=(1, 8, 1, 1), pp=8, micro_batch=1, execution="megatron-core")


@pytest.mark.parametrize("kw,msg", [
    # micro-batch unset: 1 and 2 break the 1f1b rule, 4 fails to divide the 2 sequences per GPU first
    ({"global_batch": 4, "pp": 4}, "--pp 4: 1f1b over pp=4 stages needs at least 4 micro-batches, the step has 2"),
    ({"global_batch": 64, "pp": 4, "vpp": 64, "schedule": "interleaved-1f1b"},
     "--pp 4: pp=4 x vpp=64 virtual stages are more than the model's 32 blocks"),
])
def test_explain_refuses_a_pipeline_rule_every_micro_batch_breaks(kw, msg):
    with pytest.raises(UserError) as err:
        explain("gpt-20b", "dgx-a100", 64, grid=(1, 8, 1, 2), **kw)
    assert str(err.value) == msg
    # one micro-batch that keeps the rules is a configuration to explain, not a mistake
    assert explain("gpt-20b", "dgx-a100", 64, 64, grid=(1, 8, 1, 2), pp=4).summary.iloc[0]["pp"] == 4


def test_explain_gives_a_micro_batch_that_does_not_divide_as_the_rows_reason():
    """A micro-batch larger than a GPU's share of the batch is its own mistake, shown as the row's reason as
    without a pipeline, not a pipeline rule on a remainder ('the step has 0 micro-batches')."""
    for pp in (1, 4):
        e = explain("gpt-20b", "dgx-a100", 64, 64, grid=(1, 8, 1, 8 // pp), pp=pp, micro_batch=64)
        row = e.summary.iloc[0]
        assert not row["feasible"] and "micro-batch 64 does not divide" in row["reason"], (pp, row["reason"])


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 6), vpp=st.integers(1, 3), rounds=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_bound_never_exceeds_the_walk(pp, vpp, rounds, seed):
    rng = np.random.default_rng(seed)
    sched = "1f1b" if vpp == 1 else "interleaved-1f1b"
    V, m = pp * vpp, rounds * pp
    sec = rng.uniform(0.2, 2.0, (2 * V, 3))
    send = rng.uniform(0.0, 0.3, (1, 3))
    walk = P.rank_end_times(sched, pp, vpp, m, sec, np.repeat(send, 2, axis=0))
    work = m * (sec[:V] + sec[V:]).reshape(vpp, pp, -1).sum(axis=0)
    bound = bound_time(sec[:pp], sec[V:V + pp], send[0], work)
    assert np.all(bound <= walk * (1 + 1e-12))


def test_the_bound_is_the_walk_for_identical_stages():
    sec = _uniform(4, 1.0, 2.0)
    work = 8 * (sec[:4] + sec[4:])
    assert bound_time(sec[:4], sec[4:], np.zeros(1), work).max() == pytest.approx(
        P.rank_end_times("1f1b", 4, 1, 8, sec, np.zeros((2, 1))).max())


@pytest.mark.parametrize("split", [False, True])
def test_ranking_walks_every_candidate_that_can_be_among_the_best(split):
    """rank's top rows, walked only where their bound can be among them, are those of walking every candidate;
    also where each received transfer is gathered again on the receiving stage (split transfers)."""
    from axoplan.planner.batch import evaluate
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import Job, load_model
    from axoplan.planner.execution import PRESETS

    model, prof = load_model("gpt-20b"), load_profile("dgx-a100")
    job = Job(64, 512, model.seq_len)
    c = enumerate_space(64, 512, pipelines=pipeline_choices(64, model.n_layers, "all"))
    ex = PRESETS["megatron-core"] if not split else dataclasses.replace(
        PRESETS["megatron-lm"], sequence_parallel=False, recompute="full", pipeline_p2p_split=True)
    full = evaluate(model, prof, job, c, execution=ex)
    some = evaluate(model, prof, job, c, execution=ex, top=10)
    # a candidate a rule excludes is not timed in either; every other is walked, or bounded below
    timed = np.isfinite(full.batch_time)
    assert np.array_equal(timed, np.isfinite(some.batch_time)) and timed[full.feasible].all()
    assert full.exact[timed].all() and not full.exact[~timed].any() and not some.exact[timed].all()
    best = lambda ev: np.argsort(np.where(ev.feasible, ev.batch_time, np.inf), kind="stable")[:10]  # noqa: E731
    assert np.array_equal(best(full), best(some))
    assert np.allclose(full.batch_time[some.exact], some.batch_time[some.exact], rtol=1e-12)
    bounded = ~some.exact & timed
    assert bounded.any() and np.all(some.batch_time[bounded] <= full.batch_time[bounded] * (1 + 1e-12))


def test_chunks_and_unbounded_infeasible_keep_the_best(monkeypatch):
    """Evaluated in chunks (each pruned by the best before it) and with the infeasible ones left untimed, the
    top rows, every exact time, the memory and the reasons are those of one evaluation of all."""
    from axoplan.planner import batch
    from axoplan.planner.execution import PRESETS
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import Job, load_model

    model, prof = load_model("gpt-20b"), load_profile("dgx-a100")
    job = Job(64, 512, model.seq_len)
    c = enumerate_space(64, 512, pipelines=pipeline_choices(64, model.n_layers, "all"))
    ex = PRESETS["megatron-core"]
    whole = batch.evaluate(model, prof, job, c, execution=ex, top=10)
    monkeypatch.setattr(batch, "CHUNK", 97)
    assert len(batch._chunks(c.take(np.nonzero(c.pp > 1)[0]), False)) > 10
    chunked = batch.evaluate(model, prof, job, c, execution=ex, top=10)
    lean = batch.evaluate(model, prof, job, c, execution=ex, top=10, bound_infeasible=False)
    best = lambda ev: np.argsort(np.where(ev.feasible, ev.batch_time, np.inf), kind="stable")[:10]  # noqa: E731
    for ev in (chunked, lean):
        assert np.array_equal(best(whole), best(ev))
        assert np.array_equal(ev.feasible, whole.feasible) and np.array_equal(ev.reason_code, whole.reason_code)
        assert np.array_equal(ev.memory.total, whole.memory.total, equal_nan=True)
        both = ev.exact & whole.exact
        assert both[ev.feasible].sum() >= 10
        assert np.array_equal(ev.batch_time[both], whole.batch_time[both])
    untimed = (c.pp > 1) & ~whole.feasible
    assert untimed.any() and np.isnan(lean.batch_time[untimed]).all()
    assert np.isfinite(lean.batch_time[lean.feasible]).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n_layers=st.integers(8, 40), blocking=st.booleans())
def test_the_closed_form_bound_is_the_path_bound_of_every_rank(seed, n_layers, blocking):
    """stage_timing.bounds_of_terms (all candidates at once) equals bound_time over each candidate's own stages."""
    from axoplan.planner.stage_timing import KINDS, bounds_of_terms, linear_terms

    rng = np.random.default_rng(seed)
    n = 40
    pp = rng.choice([2, 3, 4, 5, 8], n)
    vpp = np.where(rng.random(n) < 0.5, 1, rng.integers(2, 4, n))
    vpp = np.where(pp * vpp > n_layers, 1, vpp)
    m = pp * rng.integers(1, 4, n)
    ck = rng.random(n) < 0.5
    send = rng.uniform(0, 0.2, n)
    # per kind and pass: prefix, block, last, suffix window seconds; one fixed and one block's compute, collectives
    full = {(k, p): [rng.uniform(0.05, 1.0, n) for _ in range(8)]
            for k in KINDS for p in ("forward", "backward", "backward_recompute")}
    after = {k: (rng.uniform(0, 0.5, n), rng.uniform(0, 0.5, n)) for k in KINDS}
    got = bounds_of_terms(linear_terms(full, ck), after, pp, vpp, m, send, n_layers, blocking)
    for i in range(n):
        p_, v_ = int(pp[i]), int(vpp[i])
        V = p_ * v_
        blocks = P.stage_blocks(n_layers, p_, v_)

        def stage(v, name, what, i=i, V=V, blocks=blocks):  # seconds (0), compute (1) or collectives (2), of v
            kind = "first" if v == 0 else ("last" if v == V - 1 else "middle")
            key = (kind, "backward_recompute" if name == "backward" and ck[i] else name)
            x = [a[i] for a in full[key]]
            one = (x[0] + x[2] + x[3], x[4], x[6])[what]
            per_block = (x[1], x[5], x[7])[what]
            return one + per_block * (blocks[v] - 1)

        sec = np.array([[stage(v, name, 0) for v in range(V)] for name in ("forward", "backward")])
        if blocking:  # the sender busy for its transfer (Execution.pipeline_blocking_p2p)
            sec += send[i] * np.array([np.arange(V) < V - 1, np.arange(V) > 0])
        work = (sec[0] + sec[1]).reshape(v_, p_).sum(axis=0)
        ends = bound_time(sec[0, :p_, None], sec[1, :p_, None], np.array([send[i]]), m[i] * work[:, None])[:, 0]
        kinds = ["first"] + ["middle"] * (p_ - 2) + ["last"]
        finish = ends + np.array([sum(a[i] for a in after[k]) for k in kinds])
        r = int(np.argmax(finish))
        comp = sum(stage(v, nm, 1) for v in range(r, V, p_) for nm in ("forward", "backward"))
        colls = sum(stage(v, nm, 2) for v in range(r, V, p_) for nm in ("forward", "backward"))
        assert got["batch"][i] == pytest.approx(finish[r], rel=1e-12)
        assert int(got["crit"][i]) == r
        assert got["bubble"][i] == pytest.approx(max(ends[r] - m[i] * work[r], 0.0), rel=1e-9, abs=1e-12)
        assert got["comp"][i] == pytest.approx(m[i] * comp + after[kinds[r]][1][i], rel=1e-12)
        assert got["colls"][i] == pytest.approx(m[i] * colls + after[kinds[r]][0][i] + 2 * m[i] * v_ * send[i],
                                                rel=1e-12)


@pytest.mark.parametrize("vpp", [1, 2])
def test_explain_lists_the_slowest_ranks_collectives_and_they_add_up_to_its_comm(vpp):
    """With a pipeline, explain's collectives are its slowest rank's (the batch time's): its stages' windows,
    its once-per-step reduction and its transfers, summing to the summary's comm_s."""
    ex = axoplan.explain("gpt-20b", "dgx-a100", 64, 256, (1, 8, 1, 2), pp=4, vpp=vpp,
                         execution="megatron-core")
    colls, s = ex.collectives, ex.summary
    assert colls["total_s"].sum() == pytest.approx(s["comm_s"][0], rel=1e-9)
    p2p = colls[colls["collective"] == "send/recv"]
    m = 256 // (2 * int(s["micro_batch"][0]))
    assert len(p2p) == 1 and int(p2p["calls_per_step"].iloc[0]) == 2 * m * vpp
    assert (colls["phase"] == "step").any() and (colls["layer"] == "qkv").any()
    crit = ex.detail["time"].critical_rank
    assert any(f"collectives listed: pipeline rank {int(np.ravel(crit)[0])}'s" in n for n in ex.notes)


def test_ranks_sharing_cores_run_faster_while_others_wait_by_hand():
    """Two pipeline ranks on one core (rates measured with both busy): alone a rank runs at twice the rate.
    1F1B, m = 2, forward 1 s and backward 2 s as measured: s0 F0 alone 0-0.5; s0 F1 and s1 F0 together
    0.5-1.5; s1 B0 alone 1.5-2.5; s0 B0 with s1 F1 2.5-3.5, with s1 B1 3.5-4.5; s1 B1's last half alone
    4.5-5; s0 B1 alone 5-6."""
    sec, send = np.array([[1.0], [1.0], [2.0], [2.0]]), np.zeros((2, 1))
    f = P.sharing_factors(2, 2, 1)
    assert f.tolist() == [0.5, 0.5, 1.0]
    ends, ran = P.shared_rank_end_times("1f1b", 2, 1, 2, sec, send, f)
    assert ends.ravel().tolist() == pytest.approx([6.0, 5.0]) and ran.ravel().tolist() == pytest.approx([4.5, 4.5])
    assert P.rank_end_times("1f1b", 2, 1, 2, sec, send).ravel().tolist() == [9.0, 7.0]  # not sharing


def test_waiting_seconds_do_not_speed_up_while_others_wait_by_hand():
    """As above, but half of each forward (0.5 s) is waiting that runs at the wall's pace: a forward alone takes
    0.25 + 0.5 = 0.75 s. s0 F0 alone 0-0.75; s0 F1 and s1 F0 together 0.75-1.75; s1 B0 alone 1.75-2.75; s0 B0
    with s1 F1 2.75-3.75 (half done), with s1 B1 3.75-4.75; s1 B1's last half alone 4.75-5.25; s0 B1 alone
    5.25-6.25."""
    sec, send = np.array([[1.0], [1.0], [2.0], [2.0]]), np.zeros((2, 1))
    waiting = np.array([[0.5], [0.5], [0.0], [0.0]])
    f = P.sharing_factors(2, 2, 1)
    ends, ran = P.shared_rank_end_times("1f1b", 2, 1, 2, sec, send, f, waiting)
    assert ends.ravel().tolist() == pytest.approx([6.25, 5.25]) and ran.ravel().tolist() == pytest.approx([4.75, 4.5])
    # no waiting: the walk above, to the bit
    assert np.array_equal(P.shared_rank_end_times("1f1b", 2, 1, 2, sec, send, f, np.zeros_like(sec))[0],
                          P.shared_rank_end_times("1f1b", 2, 1, 2, sec, send, f)[0])


def test_a_collective_over_more_ranks_than_cores_keeps_its_back_to_back_time_in_a_pipeline(monkeypatch):
    """Where a stage's groups have more ranks than the node's cores (ranks sharing cores), their collectives'
    back-to-back time (the calibration's burst 0) does not shrink while the other stage waits, and compute beside
    a Z all-gather or reduce-scatter does not hide it: such pipelined candidates, and unpipelined ones with a
    Z group, take longer than if it did; groups that fit the cores, and unpipelined candidates without a Z
    group (whose collectives all block), are untouched."""
    import dataclasses

    from axoplan.planner import comm, timing
    from axoplan.planner.profile_reader import load_profile

    prof = load_profile("localhost-cpu")  # 4 ranks on 2 cores
    one_core = dataclasses.replace(prof, shared_cores=1)  # pairs no longer fit
    idx = ["gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "pp", "vpp", "schedule"]

    def ranked(p):
        return axoplan.rank("gpt-tiny", p, 4, 16, top=None).set_index(idx)["batch_time_s"]

    with_it = {c: ranked(p) for c, p in (("2 cores", prof), ("1 core", one_core))}
    monkeypatch.setattr(timing, "switching_seconds", lambda *a: 0.0)
    without = {c: ranked(p).loc[with_it[c].index] for c, p in (("2 cores", prof), ("1 core", one_core))}
    # on 2 cores only a Z group of all 4 ranks is wider than the cores (a pp 2 stage has 2 ranks)
    a, b = with_it["2 cores"], without["2 cores"]
    wide_z = a.index.get_level_values("gz") > 2
    assert wide_z.any() and (a[wide_z] > b[wide_z] * (1 + 1e-9)).all()
    assert np.array_equal(a[~wide_z].to_numpy(), b[~wide_z].to_numpy())
    a, b = with_it["1 core"], without["1 core"]
    piped = a.index.get_level_values("pp") > 1
    paired = piped & ((a.index.get_level_values("gx") > 1) | (a.index.get_level_values("gy") > 1)
                      | (a.index.get_level_values("gz") > 1))
    assert paired.any() and (a[paired] > b[paired] * (1 + 1e-9)).all()
    z = a.index.get_level_values("gz") > 1
    assert (~piped & z).any() and (a[~piped & z] > b[~piped & z] * (1 + 1e-9)).all()
    assert np.array_equal(a[~piped & ~z].to_numpy(), b[~piped & ~z].to_numpy())
    monkeypatch.undo()
    # each such call's switching seconds are its time called back to back
    ex = axoplan.explain("gpt-tiny", one_core, 4, 16, grid=(1, 2, 1, 1), pp=2, micro_batch=2, checkpointing=False)
    sched = ex.detail["schedule"]
    calls = [c for w in sched.forward.block for c in w.collectives() if c.axis == "y"]
    assert calls
    for c in calls:
        assert float(np.ravel(c.switching)[0]) == pytest.approx(
            min(float(np.ravel(comm.collective_seconds(one_core, sched.groups, c, 0.0))[0]),
                float(np.ravel(c.seconds)[0])))
    # what counts is the members on one node: a rank per node leaves every group's core to itself
    apart = dataclasses.replace(one_core, gpus_per_node=1)
    ex = axoplan.explain("gpt-tiny", apart, 4, 16, grid=(1, 2, 1, 1), pp=2, micro_batch=2, checkpointing=False)
    assert all(float(np.ravel(c.switching)[0]) == 0.0 for w in ex.detail["schedule"].forward.block
               for c in w.collectives())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), pp=st.integers(2, 4), vpp=st.integers(1, 2), rounds=st.integers(1, 3))
def test_sharing_nothing_is_the_walk(seed, pp, vpp, rounds):
    """With every factor 1 (each rank its own device) the processor-sharing walk is the level walk."""
    rng = np.random.default_rng(seed)
    sched = "1f1b" if vpp == 1 else "interleaved-1f1b"
    m, n = pp * rounds, 3
    sec, send = rng.random((2 * pp * vpp, n)), 0.1 * rng.random((2, n))
    ends, ran = P.shared_rank_end_times(sched, pp, vpp, m, sec, send, np.ones(pp + 1))
    assert np.allclose(ends, P.rank_end_times(sched, pp, vpp, m, sec, send), rtol=1e-12, atol=1e-12)
    per_rank = (sec[:pp * vpp] + sec[pp * vpp:]).reshape(vpp, pp, n).sum(axis=0) * m
    assert np.allclose(ran, per_rank, rtol=1e-12)


def test_a_cpu_profile_sharing_cores_ranks_pipelines_with_it(tmp_path):
    """compute.shared_cores (cpu only) makes a pipelined candidate faster; one without a pipeline only slower, where
    compute beside its Z group (of all 4 ranks, wider than the 2 cores) no longer hides the switching seconds; a gpu
    profile with it is refused in one sentence."""
    import dataclasses

    import yaml

    from axoplan.errors import UserError
    from axoplan.planner.profile_reader import load_profile

    prof = load_profile("localhost-cpu")
    assert prof.shared_cores == 2
    alone = dataclasses.replace(prof, shared_cores=None)
    a = axoplan.rank("gpt-tiny", prof, 4, 16, top=None).set_index(["gx", "gy", "gz", "gdata", "order", "micro_batch",
                                                                    "checkpointing", "pp", "vpp", "schedule"])
    b = axoplan.rank("gpt-tiny", alone, 4, 16, top=None).set_index(a.index.names)
    b = b.loc[a.index]
    piped = a.index.get_level_values("pp") > 1
    assert (a["batch_time_s"][piped] < b["batch_time_s"][piped]).all()
    wide_z = ~piped & (a.index.get_level_values("gz") > 2)
    assert wide_z.any() and (a["batch_time_s"][wide_z] > b["batch_time_s"][wide_z]).all()
    rest = ~piped & ~wide_z
    assert np.array_equal(a["batch_time_s"][rest].to_numpy(), b["batch_time_s"][rest].to_numpy())
    raw = yaml.safe_load(open("machine_profiles/dgx-a100.yaml"))
    raw["compute"]["shared_cores"] = {"value": 8, "source": "test"}
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="shared_cores' is a cpu profile's field"):
        load_profile(str(tmp_path / "g.yaml"))


@pytest.mark.parametrize("model_name,machine,gpus,batch,checkpointing",
                         [("gpt-20b", "dgx-a100", 64, 512, "both"), ("gpt-20b", "dgx-a100", 64, 512, "on"),
                          ("gpt-small", "localhost-cpu", 8, 32, "both")])
def test_a_schedule_built_once_for_the_vpp_and_schedule_variants_times_each_as_its_own(model_name, machine, gpus,
                                                                                       batch, checkpointing):
    """evaluate() builds one schedule for the candidates that differ only in vpp and pipeline schedule: every
    time, memory and reason equals that of each (pp, vpp, schedule) evaluated alone (no two of its candidates
    share a schedule there), bounded and walked alike."""
    from axoplan.planner import batch as B
    from axoplan.planner.profile_reader import load_profile
    from axoplan.planner.specs import Job, load_model

    model, prof = load_model(model_name), load_profile(machine)
    job = Job(gpus, batch, model.seq_len)
    choices = [p for p in pipeline_choices(gpus, model.n_layers, "all") if p[0] > 1]
    assert len({p[0] for p in choices}) < len(choices)  # some pp with several (vpp, schedule): shared schedules
    fields = ("batch_time", "compute", "comm", "exposed_comm", "bubble", "memory_rank", "exact", "feasible",
              "reason_code", "micro_batches")
    for top, bound_all in ((None, True), (10, True), (10, False)):
        whole = B.evaluate(model, prof, job, enumerate_space(gpus, batch, checkpointing=checkpointing,
                                                             pipelines=choices), top=top, bound_infeasible=bound_all)
        alone = [B.evaluate(model, prof, job, enumerate_space(gpus, batch, checkpointing=checkpointing,
                                                              pipelines=[p]), top=None) for p in choices]
        # enumerate_space lists the pipelines' blocks in order within each checkpointing half
        halves = 2 if checkpointing == "both" else 1
        for f in fields + ("memory",):
            get = (lambda ev: ev.memory.total) if f == "memory" else (lambda ev, f=f: np.broadcast_to(
                getattr(ev, f), len(ev.feasible)))
            parts = [np.split(get(ev), halves) for ev in alone]
            expect = np.concatenate([p[h] for h in range(halves) for p in parts])
            got = get(whole)
            if top is None or f in ("memory", "feasible", "reason_code", "micro_batches"):
                assert np.array_equal(got, expect, equal_nan=True), f
        if top is not None:  # the walked ones exactly; the rest bounded below, or untimed where out of memory
            ex = whole.exact
            t_alone = np.concatenate([np.split(ev.batch_time, halves)[h] for h in range(halves) for ev in alone])
            assert ex.sum() >= 10 and np.array_equal(whole.batch_time[ex], t_alone[ex])
            ok = np.isfinite(whole.batch_time)
            assert np.all(whole.batch_time[ok] <= t_alone[ok] * (1 + 1e-12))


def test_walk_transfers_per_boundary():
    """send [2, pp, n] per boundary: alike everywhere, the walk of [2, n]; 1f1b never crosses the wrap
    (last rank back to the first), interleaved does; and by hand, pp 2, one micro-batch, F = B = 1."""
    sec = np.ones((4, 1))
    x = 0.25
    ends = P.rank_end_times("1f1b", 2, 1, 1, sec, np.full((2, 2, 1), [[[x], [9.0]], [[x], [9.0]]]))
    # F0 [0, 1], transfer, F1 [1 + x, 2 + x], B1 [2 + x, 3 + x], transfer, B0 [3 + 2x, 4 + 2x]
    assert ends.ravel().tolist() == [4 + 2 * x, 3 + x]
    for sched, pp, vpp, m in (("1f1b", 4, 1, 8), ("interleaved-1f1b", 4, 2, 8)):
        sec = _uniform(pp * vpp, 1.0, 2.0)
        uniform = P.rank_end_times(sched, pp, vpp, m, sec, np.full((2, 1), 0.5))
        assert np.array_equal(P.rank_end_times(sched, pp, vpp, m, sec, np.full((2, pp, 1), 0.5)), uniform)
        slow_wrap = np.full((2, pp, 1), 0.5)
        slow_wrap[:, pp - 1] = 5.0
        walked_ = P.rank_end_times(sched, pp, vpp, m, sec, slow_wrap)
        assert (np.array_equal(walked_, uniform) if vpp == 1 else walked_.max() > uniform.max() + 4.0)
        # a slow boundary somewhere costs at least its delay, at most that of every boundary slow
        one = np.full((2, pp, 1), 0.5)
        one[:, 1] = 3.0
        t1 = P.rank_end_times(sched, pp, vpp, m, sec, one).max()
        assert uniform.max() + 2.5 <= t1 <= P.rank_end_times(sched, pp, vpp, m, sec, np.full((2, 1), 3.0)).max()
    # the processor-sharing walk reads the same rows
    sec = _uniform(4, 1.0, 2.0)
    one = np.full((2, 4, 1), 0.5)
    one[:, 2] = 3.0
    ends, _ = P.shared_rank_end_times("1f1b", 4, 1, 8, sec, one, np.ones(5))
    assert np.allclose(ends, P.rank_end_times("1f1b", 4, 1, 8, sec, one), rtol=1e-12)


def test_megatron_cores_data_parallel_reduction_beside_the_pipeline_by_hand():
    """stage_timing.data_parallel_exposed with compute slowed 20% beside a collective (a collective b beside
    compute a takes max(b, a + b/6)). Without interleaving (pp 2; forward 1 s, backward 2 s a micro-batch;
    reduction 3 s, all-gather 0.5 s): the first rank reduces beside its last backward, max(3, 2 + 0.5) - 2 = 1 s
    past it, and the others after theirs, 3 s; each gathers beside its first forward, max(0.5, 1 + 0.5/6) - 1 =
    1/12 s. Interleaved (vpp 2): half the reduction beside the 2 backwards of the chunk below (4 s): 4 + 2/6 - 4,
    and the lowest chunk's half after the last backward: 2 s."""
    from axoplan.planner.stage_timing import data_parallel_exposed
    from axoplan.planner.timing import overlapped

    def beside(a, b):
        return overlapped(a, b, 1.0, 0.2)

    one = data_parallel_exposed(np.full((2, 1), 3.0), np.full((2, 1), 0.5), np.ones((2, 1)), np.full((2, 1), 2.0),
                                2, 1, beside)
    assert one[:, 0] == pytest.approx([1 + 1 / 12, 3 + 1 / 12])
    two = data_parallel_exposed(np.full((2, 1), 4.0), np.zeros((2, 1)), np.ones((4, 1)), np.full((4, 1), 2.0),
                                2, 2, beside)
    assert two[:, 0] == pytest.approx([2 / 6 + 2, 2 / 6 + 2])


def test_megatron_cores_pipelined_ranking_is_its_walk_and_hides_at_most_its_reduction():
    """The bound that prunes the walk stays below the walk with the reduction beside the pipeline (the best 3 of a
    pruned ranking are those of the whole walk); each pipelined candidate gains at most its reduction and
    all-gather over the blocking execution, never loses."""
    import dataclasses

    import axoplan
    from axoplan.planner.execution import PRESETS

    core = PRESETS["megatron-core"]
    job = dict(model="gpt-20b", machine="dgx-h100", gpus=64, global_batch=128, pp=4, execution=core)
    pruned = axoplan.rank(top=3, **job)
    whole = axoplan.rank(include_infeasible=True, **job)
    best = whole[whole.feasible].sort_values("batch_time_s").head(3)
    assert list(pruned.batch_time_s) == pytest.approx(list(best.batch_time_s), rel=1e-12)
    blocking = axoplan.rank(include_infeasible=True, **dict(job, execution=dataclasses.replace(
        core, pipeline_dp_overlap=False)))
    key = ["gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "vpp", "schedule"]
    both = whole.merge(blocking, on=key, suffixes=("", "_blocking")).dropna(subset=["batch_time_s"])
    assert len(both) > 10
    gain = both.batch_time_s_blocking - both.batch_time_s
    assert (gain >= -1e-12).all() and (gain <= both.comm_s_blocking + 1e-12).all() and gain.max() > 0
