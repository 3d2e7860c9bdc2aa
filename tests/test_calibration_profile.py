"""Profiles written by calibration: schema round-trip, sources on every number, atomic writes."""
import os

import pytest
import yaml

from axoplan.calibrate import profile_writer

from calib_synthetic import write


def _numbers_without_source(node, path="", covered=False):
    """Every number must be {value, source} or sit in a mapping that has its own source."""
    bad = []
    if isinstance(node, dict):
        here = covered or "source" in node
        for k, v in node.items():
            bad += _numbers_without_source(v, f"{path}.{k}", here)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            bad += _numbers_without_source(v, f"{path}[{i}]", covered)
    elif isinstance(node, (int, float)) and not isinstance(node, bool) and not covered:
        bad.append(path)
    return bad


def test_written_profile_round_trips(tmp_path):
    rd = write(tmp_path / "r")
    out = tmp_path / "profiles" / "synth.yaml"
    built = profile_writer.write(rd, out)
    loaded = yaml.safe_load(out.read_text())
    assert loaded == built.profile
    assert loaded["schema"] == "axoplan-profile/1" and loaded["name"] == "synth"
    assert _numbers_without_source(loaded) == []
    table = (out.parent / loaded["compute"]["gemm"]["table"]["path"]).read_text().splitlines()
    assert table[0] == "m,n,k,layout,seconds,tflops" and len(table) == 1 + 27 * 3
    coll = (out.parent / loaded["network"]["intra_node"]["table"]["path"]).read_text().splitlines()
    assert coll[0] == "collective,size,stride,bytes,seconds,burst_s" and len(coll) == 1 + 3 * 3 * 9  # intra shapes only
    attn = (out.parent / loaded["compute"]["attention"]["table"]["path"]).read_text().splitlines()
    assert attn[0] == "batch,heads,seq,head_dim,causal,pass,seconds" and len(attn) == 1 + 8
    assert (rd.path / "fits.csv").exists()
    for src in (loaded["compute"]["peak_tflops"]["source"], loaded["memory"]["source"]):
        assert "2026-01-01" in src and "testhost" in src and "axoplan calibrate --test" in src


def test_written_profile_loads_with_the_planner(tmp_path):
    machine = pytest.importorskip("axoplan.planner.profile_reader")
    out = tmp_path / "synth.yaml"
    profile_writer.write(write(tmp_path / "r"), out)
    prof = machine.load_profile(str(out))
    assert prof is not None


def test_failed_write_leaves_the_old_profile_intact(tmp_path, monkeypatch):
    rd = write(tmp_path / "r")
    out = tmp_path / "synth.yaml"
    profile_writer.write(rd, out)
    before = out.read_bytes()

    rd2 = write(tmp_path / "r2", seed=1)
    import axoplan.atomic

    calls = []

    def boom(fd):
        # fits.csv and the measured tables (GEMM, collectives, attention) are written first; the profile
        # itself fails mid-write
        calls.append(fd)
        if len(calls) == 5:
            raise OSError("disk full")
        return real_fsync(fd)

    real_fsync = axoplan.atomic.os.fsync

    monkeypatch.setattr(axoplan.atomic.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        profile_writer.write(rd2, out)
    monkeypatch.undo()
    assert out.read_bytes() == before
    assert len(calls) == 5
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
