"""axoplan.allocator: glibc kept from returning the planner's freed temporaries to the kernel, so their reuse
does not fault pages in again; `axoplan rank` sets it, another C library is left as it is."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

import axoplan.allocator as allocator
import axoplan.cli.plan as plan

# rounds of twenty 1 MiB temporaries, all freed before the next round (as a chunk of candidates leaves them)
PATTERN = """
import resource, sys
import numpy as np
from axoplan.allocator import keep_freed_memory
assert not (sys.argv[1] == "1") or keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    xs = [np.ones(1 << 17) for _ in range(20)]
    del xs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, "1" if tuned else "0"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_temporaries_are_reused_without_faults():
    # 30 rounds x 20 MiB is ~150k pages faulted in where each round's memory is trimmed; kept, the first round's
    default, tuned = _faults(False), _faults(True)
    assert tuned * 3 < default, (tuned, default)
    assert tuned < 30 * 20 * 256 / 4, tuned  # well under a fault per page of every round


def test_other_c_libraries_left_alone(monkeypatch):
    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert allocator.keep_freed_memory() is False


def test_rank_sets_it(monkeypatch, model_yaml, pm_path, capsys):
    calls = []
    monkeypatch.setattr(plan, "keep_freed_memory", lambda: calls.append(1))
    from axoplan.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["rank", "-m", str(model_yaml()), "-p", str(pm_path), "-g", "16", "-b", "32", "--top", "2"])
    assert e.value.code == 0, capsys.readouterr().err
    assert calls == [1]
