"""The schedule (planner/schedule.py) is the step the trainer runs: hand-counted GEMM FLOP and element-wise
work read off it, and the totals the planner reports are sums over it."""
import numpy as np
import pytest
from conftest import tiny_model

from axoplan.planner import comm, schedule
from axoplan.planner.batch import evaluate
from axoplan.planner.compute import elementwise_work
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.space import Candidates
from axoplan.planner.specs import Job


def _build(m, grid, mb, ck, prof):
    c = Candidates(*(np.array([v]) for v in (*grid, 0, mb)), np.array([ck]))
    job = Job(int(np.prod(grid)), mb * grid[2] * grid[3] * 2, m.seq_len)  # two micro-batches
    return schedule.build(m, prof, job, c, c.checkpointing, True, True, comm.place(prof, c)), c, job


@pytest.mark.parametrize("grid,ck", [((1, 1, 1, 1), False), ((2, 2, 1, 1), True), ((2, 1, 2, 2), False)])
def test_gemm_flop_per_micro_batch_by_hand(grid, ck):
    """Every linear's forward, dI and dW GEMMs once per micro-batch (the forward again under recompute):
    2·T·k·n/(gx·gy) FLOP each; the LM head's three once."""
    m = tiny_model()  # hidden 64, ffn 256, vocab 256, 2 layers
    s, _, _ = _build(m, grid, 2, ck, load_profile("dgx-h100"))
    gx, gy = grid[0], grid[1]
    T = 2 * m.seq_len
    flop = 0.0
    for p in s.passes(ck):
        for w, n in p.windows(s.n_blocks):
            for op in w.compute.values():
                if op.kind == "gemm":
                    mm, nn, kk = (float(np.ravel(x)[0]) for x in op.shape)
                    flop += 2 * mm * nn * kk * n
    per_layer = sum(lin.k * lin.n for lin in m.block_linears()) / (gx * gy)
    head = m.hidden * m.padded_vocab / (gx * gy)
    assert flop == pytest.approx(2 * T * (per_layer * m.n_layers * (3 + ck) + head * 3))


def test_element_wise_work_and_launches_are_the_traced_ones():
    """The schedule's element-wise ops add up to the trainer's kernels (compute.elementwise_work, proven equal
    to the traced trainer in test_optrace.py), per pass."""
    m = tiny_model()
    grid, mb = (2, 2, 2, 1), 2
    s, c, job = _build(m, grid, mb, False, load_profile("dgx-h100"))
    w = elementwise_work(m, *grid[:3], mb, m.seq_len, 2, s.grad_acc, prefetch=True)
    phases = w.phases(m.n_layers, False)  # one micro-batch
    for p, name in ((s.forward, "forward"), (s.backward, "backward")):
        bytes_, kernels = 0.0, 0.0
        for win, n in p.windows(s.n_blocks):
            for op in win.compute.values():
                if op.kind == "element-wise":
                    bytes_ += float(np.ravel(op.bytes)[0]) * n
                    kernels += float(np.ravel(op.kernels)[0]) * n
        want = phases[name]
        assert bytes_ == pytest.approx(float(np.ravel(want.bytes)[0]))
        assert kernels == pytest.approx(float(np.ravel(want.kernels)[0]))


def test_reported_totals_are_sums_over_the_schedule():
    m = tiny_model()
    prof = load_profile("dgx-h100")
    s, c, job = _build(m, (1, 2, 2, 2), 1, True, prof)
    ev = evaluate(m, prof, job, c, explain=True)
    ga = float(np.ravel(s.grad_acc)[0])
    comp = sum(float(np.ravel(op.seconds)[0]) * n for p in s.passes(True) for w, n in p.windows(s.n_blocks)
               for op in w.compute.values())
    coll = sum(float(np.ravel(x.seconds)[0]) * n for p in s.passes(True) for w, n in p.windows(s.n_blocks)
               for x in w.collectives())
    step = sum(float(np.ravel(x.seconds)[0]) * float(np.ravel(x.calls)[0]) for x in s.step)
    assert float(ev.compute[0]) == pytest.approx(ga * comp + float(np.ravel(s.optimizer)[0]), rel=1e-12)
    assert float(ev.comm[0]) == pytest.approx(ga * coll + step, rel=1e-12)
