"""benchmarks/gemm_shape_fit.py runs as the README's benchmark table lists it, with and without --published (which
predicts the H100 published runs with XLA's table in place of the curve, through published_fidelity's rows)."""
from __future__ import annotations

from pathlib import Path

from conftest import load_benchmark


def test_runs_with_and_without_the_published_runs(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = load_benchmark("gemm_shape_fit")
    assert bench.main([]) == 0
    plain = capsys.readouterr().out
    assert "rms log error" in plain and "XLA table" not in plain
    assert bench.main(["--published"]) == 0
    out = capsys.readouterr().out
    for ds in ("llmfoundry-h100", "megatron-core-h100", "torchtitan-h100"):
        assert f"XLA table      {ds}" in out and f"profile curve  {ds}" in out
