"""The trainer computes the reference GPT: every grid of 1, 2, 4 and 8 gloo ranks (all ordered
factorizations, several placement orders at 8), overlap flags on and off, checkpointing on and
off, a Llama-style variant, goldfish loss and BLAS tuning; two optimizer steps each, compared
with the single-process reference (losses, gradient norms, every shard of every rank, and the
gathered full parameters). One process world per world size runs all of its cases, the pipelined ones
too: every 5D grid of 2, 4 and 8 ranks with pp > 1 (pp stages of a 4D grid each), both schedules and
checkpointing on and off spread over them, on pp*vpp + 1 blocks (every split uneven)."""
import pytest

pytest.importorskip("torch")

from axoplan.runtime import selfcheck as sc


@pytest.fixture(scope="module")
def refs():
    cases = [c for w in (1, 2, 4, 8) for c in sc.world_cases(w)]
    return sc.reference_runs(cases)


def test_cases_cover_every_grid_and_flag():
    for world in (1, 2, 4, 8):
        cases = sc.default_cases(world)
        assert {c.grid for c in cases} == set(sc.factorizations(world))
        for attr in ("oar", "ors", "oag", "ckpt", "dp"):
            assert {getattr(c, attr) for c in cases} == {True, False}
    assert len({c.order for c in sc.default_cases(8)}) >= 2


def test_pipeline_cases_cover_every_5d_grid_schedule_and_checkpointing():
    for world in (2, 4, 8):
        cases = sc.pipeline_cases(world)
        grids = {(p, g) for p in range(2, world + 1) if world % p == 0 for g in sc.factorizations(world // p)}
        assert {(c.pp, c.grid) for c in cases} == grids
        assert {(c.schedule, c.ckpt) for c in cases} == {(s, k) for s in ("1f1b", "interleaved-1f1b")
                                                          for k in (True, False)}
    assert {(c.pp, c.schedule) for w in (2, 4, 8) for c in sc.pipeline_cases(w)} == {
        (p, s) for p in (2, 4, 8) for s in ("1f1b", "interleaved-1f1b")}
    assert {c.vpp for c in sc.pipeline_cases(8)} >= {1, 2, 3}


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_parallel_equals_reference(world, refs):
    results = sc.run_world(world, refs=refs, timeout=600)
    assert len(results) == len(sc.world_cases(world))
    bad = [r for r in results if not sc.passed(r)]
    assert not bad, "\n".join(f"{r['case']}: {r}" for r in bad)
    # ORS keeps at most its bound of reduce-scatters in flight, and reaches it (counted on every rank)
    off = [r for r in results if r["inflight"] != r["inflight_expected"]]
    assert not off, "\n".join(f"{r['case']}: {r['inflight']} in flight, expected {r['inflight_expected']}" for r in off)
    # overlap.data_parallel: every bucket's D all-reduce was launched inside the last backward, none without it
    dp = [r for r in results if r["dp_overlapped"] != r["dp_expected"]]
    assert not dp, "\n".join(f"{r['case']}: {r['dp_overlapped']} bucket calls, expected {r['dp_expected']}" for r in dp)


def test_a_wrong_reference_is_caught(refs, tmp_path):
    """The comparison can fail: against a reference trained with another learning rate, the same
    case (run here in a world of one) is reported as different."""
    import dataclasses

    import torch.distributed as dist
    import yaml

    case = sc.Case((1, 1, 1, 1))
    key = (case.model, case.goldfish)
    orig_lr = sc.LR
    try:
        sc.LR = orig_lr * 1.5
        wrong = sc.reference_run(*key)
    finally:
        sc.LR = orig_lr
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(sc.MODELS["tiny"])))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        good = sc.run_case(case, refs[key], str(path))
        bad = sc.run_case(case, wrong, str(path))
    finally:
        dist.destroy_process_group()
    good["seconds"] = bad["seconds"] = 0.0
    assert sc.passed(good)
    assert not sc.passed(bad) and bad["param"] > 100 * sc.TOL
