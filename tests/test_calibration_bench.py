"""Each microbenchmark really runs: unit checks in-process, then one tiny 2-rank axoplan.calibrate."""
import json
import subprocess
import sys

import pytest
import yaml

torch = pytest.importorskip("torch")

from axoplan.calibrate import gemm, memory  # noqa: E402
from axoplan.calibrate.collectives import crosses_nodes, group_shapes, groups_of  # noqa: E402
from axoplan.calibrate.timing import settle_clock, time_call  # noqa: E402


@pytest.mark.parametrize("layout", gemm.LAYOUTS)
def test_layouts_compute_the_same_product(layout):
    a, b = gemm.operands(5, 7, 3, layout, torch.float32, torch.device("cpu"))
    ref_a, ref_b = gemm.operands(5, 7, 3, "NN", torch.float32, torch.device("cpu"))
    assert a.shape == (5, 3) and b.shape == (3, 7)
    # the trainer's naming: first letter A, second B; T = the transpose of a contiguous tensor
    assert a.is_contiguous() == (layout[0] == "N") and a.t().is_contiguous() == (layout[0] == "T")
    assert b.is_contiguous() == (layout[1] == "N") and b.t().is_contiguous() == (layout[1] == "T")
    assert torch.allclose(a @ b, (a.contiguous() @ b.contiguous()))


def test_grid_and_model_shapes():
    vals = gemm.pow2_values(8, 2048)
    assert vals == [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert gemm.pow2_values(8, 2048, step=2) == [8, 32, 128, 512, 2048]
    grid = set(gemm.cartesian_grid(vals))
    assert len(grid) == 9**3 and all((n, m, k) in grid for (m, n, k) in grid)  # both forms of every shape
    from axoplan.planner.specs import load_model

    small = load_model("gpt-small")
    shapes = gemm.model_shapes([small], 4, (1, 16))
    # fc1 forward on Gx=1, Gy=4 with 16 sequences of 128: T=2048, n=1024/4, k=256
    assert (2048, 256, 256) in shapes and (256, 2048, 256) in shapes
    # qkv dW on Gx=2, Gy=2: m = 256/2, n = 768/2, k = T = 128
    assert (128, 384, 128) in shapes


def test_group_shapes_cover_the_planner_axes():
    assert group_shapes(4) == [(2, 1), (4, 1), (2, 2)]
    assert set(group_shapes(8)) == {(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4)}
    assert groups_of(8, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(sum(groups_of(12, 3, 2), [])) == list(range(12))
    assert not crosses_nodes(2, 2, 4) and crosses_nodes(4, 2, 4) and crosses_nodes(3, 1, 4)


def test_time_call_and_memory_ops_run():
    t = time_call(lambda: torch.ones(4).add_(1), repeats=3, min_batch_s=1e-4)
    assert 0 < t.seconds < 1e-2 and t.calls_per_batch >= 1 and t.batches == 3
    got = []
    memory.run(torch.float32, torch.device("cpu"), [4096], [(16, 32)], lambda xs: xs, got.append, repeats=2)
    assert {(r.kind, r.op) for r in got} >= {("bandwidth", "copy"), ("elementwise", "gelu"), ("overhead", "add")}
    att = []
    memory.run_attention([(1, 2, 16, 8)], torch.float32, torch.device("cpu"), lambda xs: xs, att.append, repeats=2)
    assert len(att) == 4 and all(r.seconds > 0 for r in att)


def test_settle_clock_runs_until_the_rate_stops_falling_by_hand():
    """A device that runs 1 call/ms cold and loses 5% of its rate every 100 calls until the 400th (its loaded clock):
    after the 1-call probe, 0.1 s windows of 100 calls run at about 1000, 950, 900, 850, then 800 twice, and it stops
    there; one whose rate keeps falling stops when max_s has passed."""
    done = [0]

    def batch(fn, calls):  # simulated seconds: each call at the rate of the calls run before it
        t = 0.0
        for _ in range(calls):
            t += 1e-3 / (1.0 - 0.05 * min(done[0] // 100, 4))
            done[0] += 1
        return t

    rates = settle_clock(lambda: None, window_s=0.1, max_s=20.0, tol=0.01, batch=batch)
    assert rates == pytest.approx([1000, 950, 900, 850, 800, 800], rel=2e-3)
    windows = []

    def slowing(fn, calls):  # every window 10% longer than the one before
        windows.append(calls)
        return 1e-3 * calls * 1.1 ** len(windows)

    # the probe (1.1 ms) sets 90 calls a window; windows of 0.109, 0.120, 0.132 s: past 0.35 s after the third
    assert len(settle_clock(lambda: None, window_s=0.1, max_s=0.35, tol=0.0, batch=slowing)) == 3


def test_tiny_two_rank_calibration_writes_a_profile(tmp_path):
    out = tmp_path / "tiny.yaml"
    res = tmp_path / "results"
    cmd = [sys.executable, "-m", "axoplan.cli", "calibrate", "--nproc", "2", "--quick", "--out", str(out),
           "--results", str(res), "--models", "gpt-tiny", "--worker-arg=--gemm-max=32",  # grid 8, 32
           "--worker-arg=--coll-max=16384", "--worker-arg=--bw-elements=65536"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:] + ((res / "worker.log").read_text()[-3000:] if (res / "worker.log").exists() else "")
    prof = yaml.safe_load(out.read_text())
    groups = prof["network"]["intra_node"]["groups"]
    assert [(g["size"], g["stride"]) for g in groups] == [(2, 1)] and groups[0]["busbw_gbs"] > 0
    assert prof["compute"]["gemm"]["ceiling_tflops"]["value"] > 0
    assert prof["memory"]["bandwidth_gbs"] > 0 and prof["compute"]["kernel_overhead_us"]["value"] > 0
    for table, rows in (("gemm", 3 * 2**3), ("collectives", 3 * 5), ("attention", None), ("memory", None),
                        ("framework", None), ("trainer", 12)):  # 3 models x every grid of 2 ranks
        lines = (res / f"{table}.csv").read_text().splitlines()
        assert len(lines) > 1 and (rows is None or len(lines) == 1 + rows), table
    assert "wrote" in p.stdout and "busbw" in p.stdout
    # scalars as the trainer all-reduces them (8 bytes, not rounded up to a chunk per rank), and the
    # measured tables beside the profile, which the planner loads
    sizes = [line.split(",")[4] for line in (res / "collectives.csv").read_text().splitlines()[1:]
             if line.startswith("all_reduce")]
    assert sizes[0] == "8"
    for tab in (prof["network"]["intra_node"]["table"], prof["compute"]["attention"]["table"]):
        assert (out.parent / tab["path"]).exists()
    assert "autograd" in prof["compute"]["kernel_overhead_us"]["source"]
    assert "trainer's optimizer steps on 12 grids" in prof["corrections"]["source"]

    # one part measured again on top of that run: the others are kept, the part keeps its own date
    before = {t: (res / f"{t}.csv").read_text() for t in ("gemm", "collectives", "trainer")}
    p = subprocess.run([sys.executable, "-m", "axoplan.cli", "calibrate", "--quick", "--out", str(out), "--results",
                        str(res), "--models", "gpt-tiny", "--parts", "trainer"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:] + (res / "worker.log").read_text()[-3000:]
    assert (res / "gemm.csv").read_text() == before["gemm"]
    assert (res / "collectives.csv").read_text() == before["collectives"]
    assert (res / "trainer.csv").read_text() != before["trainer"]
    assert len((res / "trainer.csv").read_text().splitlines()) == 1 + 12
    meta = json.loads((res / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["added"][-1]["parts"] == ["trainer"]
    assert set(meta["part_dates"]) >= {"gemm", "collectives", "trainer"}
    prof = yaml.safe_load(out.read_text())
    assert "--parts trainer" in prof["corrections"]["source"] and "--parts" not in prof["compute"]["gemm"]["dim_half"]["source"]
    assert prof["calibration"]["parts"]["trainer"] == meta["part_dates"]["trainer"] != meta["date"]


def test_interleaved_collective_is_timed_less_its_compute_burst(monkeypatch):
    """A fake clock: the burst takes 3 ms and the collective 1 ms. Back to back the call costs 1 ms; after
    each burst, less the burst's own time, it costs 1 ms too, never the 4 ms of burst plus call."""
    from axoplan.calibrate import collectives

    clock = [0.0]
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: clock[0])

    class FakeDist:
        @staticmethod
        def all_reduce(buf, group=None):
            clock[0] += 1e-3

    def burst():
        clock[0] += 3e-3

    args = (FakeDist, "all_reduce", None, 2, 64, torch.float32, torch.device("cpu"), lambda x: x, lambda x: [x], 3, 0.01)
    nbytes, alone, _ = collectives.measure(*args)
    _, interleaved, _ = collectives.measure(*args, burst=burst, burst_s=3e-3)
    assert nbytes == 64 and alone == pytest.approx(1e-3) and interleaved == pytest.approx(1e-3)
    _, scalar, _ = collectives.measure(FakeDist, "all_reduce", None, 4, 4, torch.float32, torch.device("cpu"),
                                       lambda x: x, lambda x: [x], 3, 0.01)
    assert scalar == pytest.approx(1e-3)
    assert collectives.measure(FakeDist, "all_reduce", None, 4, 4, torch.float32, torch.device("cpu"),
                               lambda x: x, lambda x: [x], 3, 0.01)[0] == 4  # one element, not one per rank


def test_overlap_measured_as_the_whole_of_call_and_burst_beside_it(monkeypatch):
    """Fake clock: a 1 ms collective started asynchronously completes while a 3 ms burst runs beside
    it, so call + burst together take 3 ms (full overlap); run serially they take 4 ms."""
    from axoplan.calibrate import collectives

    clock = [0.0]
    monkeypatch.setattr(collectives.time, "perf_counter", lambda: clock[0])

    class Work:
        def __init__(self):
            self.done_at = clock[0] + 1e-3

        def wait(self):
            clock[0] = max(clock[0], self.done_at)

    class FakeDist:
        @staticmethod
        def all_gather_into_tensor(out, inp, group=None, async_op=False):
            w = Work()
            if not async_op:
                w.wait()
            return w

    def burst():
        clock[0] += 3e-3

    args = (FakeDist, "all_gather", None, 2, 1024, torch.float32, torch.device("cpu"), lambda x: x, lambda x: [x], 3, 0.01)
    _, together, _ = collectives.measure(*args, beside=burst)
    _, serial, _ = collectives.measure(*args, burst=burst, burst_s=0.0)
    assert together == pytest.approx(3e-3) and serial == pytest.approx(4e-3)
