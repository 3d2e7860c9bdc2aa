"""benchmarks/cpu_stage_collectives.py runs as its docstring says, on a small world, and refuses bad input in one
sentence."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_stage_collectives.py"


def test_it_prints_each_conditions_times_and_their_ratios():
    out = subprocess.run([sys.executable, str(BENCH), "--ranks", "4", "--sizes", "2", "--calls", "3",
                          "--matmuls", "0", "1", "--dim", "32"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^\s+2\s+(\d+)\s+(\d)\s+(all busy|A alone)\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M)
    # two bursts x two passes x two conditions, each call timed (a positive number of ms)
    assert len(rows) == 8 and all(float(r[4]) > 0 for r in rows)
    assert {(r[0], r[2]) for r in rows} == {(m, c) for m in ("0", "1") for c in ("all busy", "A alone")}
    ratios = re.findall(r"groups of 2,\s+(\d+) products, pass (\d): (?:compute ([\d.]+), )?all-reduce ([\d.]+)",
                        out.stdout)
    assert len(ratios) == 4 and all(float(r[3]) > 0 for r in ratios)
    assert all((r[2] == "") == (r[0] == "0") for r in ratios)  # no compute ratio without a burst


def test_bad_input_is_one_sentence_and_exit_2():
    out = subprocess.run([sys.executable, str(BENCH), "--ranks", "6", "--sizes", "2"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: ") and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0
