"""The golden rankings: a few hundred candidates across every bundled preset x profile, their predicted
time, communication and memory, so that a refactor of the model can prove it changed nothing.

    python tests/golden_rankings.py          # rewrite tests/data/golden_rankings.csv (a deliberate model change)

tests/test_golden_rankings.py re-ranks the same jobs and compares every stored value within 1e-9.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_rankings.csv"
KEY = ["model", "profile", "gx", "gy", "gz", "gdata", "order", "micro_batch", "checkpointing", "pp", "vpp",
       "schedule"]
VALUES = ["batch_time_s", "compute_s", "comm_s", "exposed_comm_s", "memory_gib", "feasible"]


def jobs():
    """(model, profile, gpus, global batch) for every preset x profile, sized so that most fit."""
    from axoplan.planner.profile_reader import profile_names
    from axoplan.planner.specs import load_model, preset_names

    for name in preset_names():
        params = load_model(name).n_params
        gpus = 8 if params < 2e9 else 64 if params < 3e10 else 512 if params < 1.2e11 else 4096
        for prof in profile_names():
            yield name, prof, gpus, 8 * gpus


def compute() -> pd.DataFrame:
    import axoplan

    out = []
    for name, prof, gpus, batch in jobs():
        # 5D up to 512 GPUs; the 4096-GPU jobs keep the 4D space (their 5D spaces would be 90% of this test's time)
        df = axoplan.rank(name, prof, gpus, batch, include_infeasible=True, pp="all" if gpus <= 512 else 1)
        n = len(df)
        # the best, the second, and three spread over the rest (infeasible ones included)
        rows = df.iloc[sorted({0, min(1, n - 1), n // 4, n // 2, (3 * n) // 4})]
        out.append(rows.assign(model=name, profile=prof, gpus=gpus, global_batch=batch))
    return pd.concat(out, ignore_index=True)[KEY + ["gpus", "global_batch"] + VALUES]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    table = compute()
    tmp = GOLDEN.with_suffix(".tmp")
    table.to_csv(tmp, index=False, float_format="%.17g")
    tmp.replace(GOLDEN)
    print(f"{len(table)} candidates written to {GOLDEN}")
