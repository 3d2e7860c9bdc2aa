"""How sure a time prediction is: its expected relative error in its regime, from evidence, never a guess.

GPU profiles: the leave-one-dataset-out errors of benchmarks/published_fidelity.py against published runs,
stored in planner/data/time_uncertainty.json by `published_fidelity.py --write-uncertainty` with the commit
that produced them; a regime is the execution's family (how the framework shards: megatron's tensor
parallelism, or FSDP's) and the scale (GPUs). The bundled trainer has no published run: its GPU regime is
the pooled one of every framework at that scale, and says so. CPU profiles: the leave-one-out error their
own calibration (or refit) reported for the trainer's steps, read from the corrections' source.

Where runs held outside the repository show a larger error for a regime (planner/data/held_out_errors.json,
aggregates of shared/reference/gpu-gaps.md), that error is the regime's: the model is judged on runs it never
saw, and there it misses more than on the runs it was shown. The bundled trainer's pooled regime takes the
mean of every held-out set at its scale.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "time_uncertainty.json"
HELD_OUT = Path(__file__).resolve().parent / "data" / "held_out_errors.json"
FAMILIES = {"megatron-core": "megatron", "megatron-lm": "megatron", "megatron-axonn": "megatron",
            "megatron-deepspeed": "megatron",
            "llm-foundry": "fsdp", "llm-foundry-shard-grad-op": "fsdp", "torchtitan": "fsdp"}
SCALES = ((64, "<=64"), (512, "65-512"))


def family(execution_name: str) -> str:
    return FAMILIES.get(execution_name, execution_name)


def scale(gpus: int) -> str:
    for top, name in SCALES:
        if gpus <= top:
            return name
    return ">512"


@dataclass(frozen=True)
class Uncertainty:
    expected_error: float | None  # relative, e.g. 0.18; None: no evidence for this regime
    regime: str  # what the evidence is, for people

    def show(self) -> str:
        if self.expected_error is None:
            return f"expected error of these times: unknown ({self.regime})"
        return f"expected error of these times: +/-{100 * self.expected_error:.0f}% ({self.regime})"


@lru_cache(maxsize=1)
def _regimes() -> tuple[dict, dict]:
    try:
        doc = json.loads(DATA.read_text())
    except (OSError, ValueError):
        return {}, {}
    return {(r["family"], r["scale"]): r for r in doc.get("regimes", [])}, doc


@lru_cache(maxsize=1)
def _held_out() -> list:
    try:
        return json.loads(HELD_OUT.read_text()).get("sets", [])
    except (OSError, ValueError):
        return []


def held_out(fam: str, sc: str) -> tuple[float | None, str]:
    """(the mean error of the held-out sets of this family and scale, or of every family at that scale for the
    pooled regime; what they are)."""
    sets = [x for x in _held_out() if x["scale"] == sc and (fam == "all" or x["family"] == fam)]
    if not sets:
        return None, ""
    err = sum(x["expected_error"] for x in sets) / len(sets)
    return err, "; ".join(x["what"] for x in sets)


_LOO = re.compile(r"([0-9.]+)% leave-one-out")


def expected_error(profile, execution_name: str, gpus: int) -> Uncertainty:
    if profile.kind == "cpu":
        src = (profile.raw.get("corrections") or {}).get("source", "") if isinstance(profile.raw, dict) else ""
        m = _LOO.search(src if isinstance(src, str) else "")
        if not m:
            return Uncertainty(None, f"profile '{profile.name}' states no leave-one-out error of its trainer steps")
        return Uncertainty(float(m.group(1)) / 100, f"the leave-one-out error of profile '{profile.name}''s fit to "
                                                     "the trainer's steps")
    cells, doc = _regimes()
    fam, sc = family(execution_name), scale(gpus)
    own = cells.get((fam, sc))
    at = (f"; {sc} GPUs: {len(own['datasets'])} dataset, too few to leave one out" if own
          else f"; none published on {sc} GPUs")
    for key, what in (((fam, sc), f"{fam} executions on {sc} GPUs"), ((fam, "all"), f"{fam} executions{at}"),
                      (("all", sc), f"published runs on {sc} GPUs of every framework"),
                      (("all", "all"), f"published runs of every framework{at}")):
        r = cells.get(key)
        if r and len(r["datasets"]) >= 2:  # one dataset left out leaves nothing to hold it against
            n = len(r["datasets"])
            u = Uncertainty(float(r["expected_error"]),
                            f"{what}: {r['rows']} runs of {n} published dataset{'s' * (n != 1)}, leave one "
                            f"dataset out, benchmarks/published_fidelity.py at {doc.get('commit', '?')}")
            worse, sets = held_out(key[0] if key[0] != "all" else "all", sc)
            if worse is not None and worse > u.expected_error:
                return Uncertainty(worse, f"runs held outside the repository ({sets}: {HELD_OUT.name}), larger "
                                          f"than the {100 * u.expected_error:.0f}% of {what}")
            return u
    return Uncertainty(None, f"no published evidence stored ({DATA.name} missing)")


def tied(batch_time, feasible, error: float | None):
    """Feasible rows whose predicted time is within the expected error of the best: the evidence cannot
    order them. With no error known, only the best itself."""
    import numpy as np

    t = np.asarray(batch_time, dtype=float)
    ok = np.asarray(feasible, dtype=bool)
    if not ok.any():
        return np.zeros(len(t), dtype=bool)
    best = t[ok].min()
    return ok & (t <= best * (1 + (error or 0.0)) * (1 + 1e-12))
