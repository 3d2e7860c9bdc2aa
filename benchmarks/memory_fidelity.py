"""Memory fidelity: the planner's peak memory per GPU against the bundled trainer's own, traced.

Fake tensors and a fake process group (`axoplan dryrun`): one real training step as rank 0 of
the full job, every allocation counted. For every grid the model divides (order xyz, activation
checkpointing on, micro-batch B/(gz*gdata)) of GPT-20B on 32 and GPT-40B on 64 perlmutter GPUs and
Llama-3 8B on 64: predicted / traced peak, and whether every collective agrees in calls and bytes.
`--real` adds gloo runs of gpt-small on 1, 2, 4 and 8 ranks: the trainer's tracked peak of live
tensor bytes (not RSS) against the model.

    python benchmarks/memory_fidelity.py [--cases gpt-20b:32:32,...] [--real] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from axoplan.launch import ORDERS
from axoplan.runtime.dryrun import compare
from axoplan.space import enumerate_space

CASES = "gpt-20b:32:32,gpt-40b:64:64,llama3-8b:64:64"


def grids(model: str, gpus: int, batch: int) -> list[tuple[int, int, int, int]]:
    """Grids the model divides, order xyz, micro-batch B/(gz*gdata), checkpointing on."""
    from axoplan.costmodel.batch import evaluate
    from axoplan.machine import load_profile
    from axoplan.specs import Job, load_model

    m = load_model(model)
    c = enumerate_space(gpus, batch, "xyz", None, "on")
    ev = evaluate(m, load_profile("perlmutter"), Job(gpus, batch, m.seq_len), c)
    mem_code = len(ev.reasons) - 1
    out = set()
    for i in range(len(c)):
        ok = ev.reason_code[i] < 0 or ev.reason_code[i] == mem_code
        if ok and c.micro_batch[i] * c.gz[i] * c.gdata[i] == batch and ORDERS[c.order[i]] == "xyz":
            out.add((int(c.gx[i]), int(c.gy[i]), int(c.gz[i]), int(c.gdata[i])))
    return sorted(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="model:gpus:batch,...")
    ap.add_argument("--machine", default="perlmutter")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        model, gpus, batch = case.split(":")
        gpus, batch = int(gpus), int(batch)
        errs = []
        t0 = time.perf_counter()
        print(f"\n{model} on {gpus} x {args.machine}, global batch {batch}, checkpointing on, order xyz")
        print(f"{'grid':>14} {'predicted GiB':>13} {'traced GiB':>10} {'error':>7} {'colls':>6}  peak (predicted | traced)")
        for g in grids(model, gpus, batch):
            r = compare(model, args.machine, gpus, batch, g, micro_batch=batch // (g[2] * g[3]), checkpointing=True)
            err = r["predicted_memory_gib"] / r["traced_memory_gib"] - 1
            same = all(c["predicted_calls"] == c["traced_calls"] and c["predicted_bytes"] == c["traced_bytes"]
                       for c in r["collectives"])
            errs.append(abs(err))
            rows.append({"model": model, "gpus": gpus, "grid": g, **r, "error": err, "collectives_equal": same})
            print(f"{'x'.join(map(str, g)):>14} {r['predicted_memory_gib']:13.2f} {r['traced_memory_gib']:10.2f} "
                  f"{100 * err:+6.1f}% {'equal' if same else 'DIFFER':>6}  {r['predicted_peak_at']} | {r['traced_peak_at']}")
            sys.stdout.flush()
        print(f"{model}: {len(errs)} grids, |error| mean {100 * statistics.mean(errs):.2f}%, max {100 * max(errs):.2f}%, "
              f"collectives equal in {sum(r['collectives_equal'] for r in rows if r['model'] == model)}/{len(errs)} "
              f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
