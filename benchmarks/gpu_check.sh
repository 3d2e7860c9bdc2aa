#!/usr/bin/env bash
# One GPU, under 10 minutes: what axoplan predicts for this machine against what it measures.
#   0. the GEMM rate in short bursts against the rate held under full load (benchmarks/gemm_sustained.py)
#   1. axoplan calibrate --quick (GEMMs, memory, attention, trainer steps on this GPU)
#   2. the bundled trainer on a 1B-class GPT: model TFLOP/s, % of peak, peak memory (max_memory_allocated)
#   3. that peak against the planner's prediction and against `axoplan dryrun` (the same step, traced)
#   4. axoplan validate over every configuration one GPU allows (micro-batch x checkpointing)
#   5. the emitted AxoNN entry point (emit --framework axonn) run for real on this GPU with axonn 0.2.0
#      (pip install -e '.[frameworks]'; skipped, saying so, without it), read back by validate --collect
# Everything lands in one folder; summary.json holds the numbers, *.log what each part printed.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        (env: MODEL=gpt-1b PROFILE=dgx-h200 BATCH=8 PYTHON=python3)
#
# Nothing is downloaded: the machine's Python must already hold torch, numpy, pandas, scipy, pyyaml, click,
# rich and matplotlib (the GPU images this project is checked on do). The smoke test on a CPU:
#   MODEL=gpt-tiny PROFILE=localhost-cpu BATCH=4 bash benchmarks/gpu_check.sh /tmp/gpu-check-cpu
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
MODEL="${MODEL:-gpt-1b}"
PROFILE="${PROFILE:-dgx-h200}"
BATCH="${BATCH:-8}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
AX=("$PY" -m axoplan.cli)  # an array, not a function: timeout runs programs
part() {  # part NAME SECONDS COMMAND...: run with a limit, keep its output, never stop the script
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/parts.txt"
}

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
} >"$OUT/machine.txt" 2>&1
: >"$OUT/parts.txt"

# 0. the GEMM rate in bursts against the rate held under full load (the profiles' gemm.sustained_fraction)
part gemm-sustained 150 "$PY" benchmarks/gemm_sustained.py --profile "$PROFILE" --out "$OUT/gemm_sustained.json"

# 1. calibration (quick), written beside everything else
part calibrate 240 "${AX[@]}" calibrate --quick --out "$OUT/calibrated.yaml" --results "$OUT/calibration"

# 2. the trainer's speed and peak memory on the planner's best configuration for one GPU
part emit 60 "${AX[@]}" emit --model "$MODEL" --machine "$PROFILE" --gpus 1 --global-batch "$BATCH" --out "$OUT/run"
if [ -f "$OUT/run/config.yaml" ]; then
    "$PY" - "$OUT/run/config.yaml" "$OUT/train.jsonl" <<'EOF'
import sys
import yaml
path, metrics = sys.argv[1], sys.argv[2]
cfg = yaml.safe_load(open(path))
cfg.update(steps=8, timing_warmup_steps=3, metrics=metrics, tensorboard=None)
open(path, "w").write(yaml.safe_dump(cfg, sort_keys=False))
EOF
    part train 180 "${AX[@]}" train --config "$OUT/run/config.yaml"
fi

# 3. the same configuration traced on the CPU with fake tensors, beside the prediction
read -r GRID MB CK < <("$PY" - "$OUT/run/config.yaml" 2>/dev/null <<'EOF'
import sys
import yaml
c = yaml.safe_load(open(sys.argv[1]))
g = c["grid"]
print(f"{g['gx']},{g['gy']},{g['gz']},{g['gdata']}", c["micro_batch"], "on" if c["checkpointing"] else "off")
EOF
) || { GRID=1,1,1,1; MB=1; CK=on; }
part dryrun 120 "${AX[@]}" dryrun --model "$MODEL" --machine "$PROFILE" --gpus 1 --global-batch "$BATCH" --grid "$GRID" \
    --micro-batch "$MB" --checkpointing "$CK" --format json --output "$OUT/dryrun.json"

# 4. every configuration one GPU allows (one grid: each micro-batch with checkpointing on and off), run and scored
for mb in 1 2 4 8 16; do
    [ "$mb" -le "$BATCH" ] && [ $((BATCH % mb)) -eq 0 ] || continue
    for ck in on off; do
        part "validate-mb$mb-$ck" 120 "${AX[@]}" validate --model "$MODEL" --machine "$PROFILE" --gpus 1 \
            --global-batch "$BATCH" --all --micro-batch "$mb" --checkpointing "$ck" --steps 6 --warmup 2 \
            --timeout 100 --out "$OUT/validate/mb$mb-$ck"
    done
done

# 5. AxoNN's own code on the planned grid: axonn.init, its Linear layers, optimize_communication
if "$PY" -c "import axonn" 2>/dev/null; then
    part axonn-emit 60 "${AX[@]}" emit --model "$MODEL" --machine "$PROFILE" --gpus 1 --global-batch "$BATCH" \
        --framework axonn --steps 6 --out "$OUT/axonn"
    part axonn-train 300 env NNODES=1 NPROC_PER_NODE=1 PYTHON="$PY" bash "$OUT/axonn/launch_torchrun.sh"
    part axonn-collect 60 "${AX[@]}" validate --collect "$OUT/axonn"
else
    echo "axonn: not installed (pip install -e '.[frameworks]'), its one-GPU run skipped" | tee -a "$OUT/parts.txt"
fi

"$PY" - "$OUT" <<'EOF' >"$OUT/summary.json"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
s = {"parts": (out / "parts.txt").read_text().splitlines()}
if (out / "gemm_sustained.json").exists():
    g = json.loads((out / "gemm_sustained.json").read_text())
    s["gemm_sustained"] = {k: g[k] for k in ("device", "shapes", "median_sustained_over_burst", "profile_sustained_fraction")}
lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()] if (out / "train.jsonl").exists() else []
summ = next((x for x in lines if x.get("summary")), None)
if summ:
    s["trainer"] = {k: summ[k] for k in ("median_batch_time_s", "model_tflops_per_gpu", "pct_of_peak",
                                         "peak_memory_gib", "grid", "micro_batch", "checkpointing", "dtype")}
if (out / "dryrun.json").exists():
    d = json.loads((out / "dryrun.json").read_text())
    s["memory_gib"] = {"predicted": d["predicted_memory_gib"], "traced_dryrun": d["traced_memory_gib"],
                       "measured_max_allocated": summ["peak_memory_gib"] if summ else None}
    s["collectives_equal"] = all(c["predicted_calls"] == c["traced_calls"] and c["predicted_bytes"] == c["traced_bytes"]
                                 for c in d["collectives"])
runs = []
for f in sorted((out / "validate").glob("*/results.csv")):
    import csv
    for r in csv.DictReader(open(f)):
        runs.append({"micro_batch": int(r["micro_batch"]), "checkpointing": r["checkpointing"] == "True",
                     "status": r["status"], "predicted_s": float(r["batch_time_s"]),
                     "measured_s": float(r["measured_time_s"]) if r["measured_time_s"] else None,
                     "predicted_gib": float(r["memory_gib"])})
ok = [r for r in runs if r["status"] == "ok" and r["measured_s"]]
s["validate"] = {"runs": runs}
if len(ok) >= 2:
    from scipy.stats import kendalltau
    ratios = sorted(r["predicted_s"] / r["measured_s"] for r in ok)
    s["validate"].update(kendall_tau=kendalltau([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])[0],
                         median_pred_over_measured=ratios[len(ratios) // 2],
                         mean_abs_pct_error=100 * sum(abs(x - 1) for x in ratios) / len(ratios))
ax = out / "axonn" / "results.csv"
if ax.exists():
    import csv
    r = next(csv.DictReader(open(ax)), {})
    s["axonn"] = {"status": r.get("status"), "error": r.get("error"),
                  "measured_s": float(r["measured_time_s"]) if r.get("measured_time_s") else None,
                  "predicted_s": float(r["batch_time_s"]) if r.get("batch_time_s") else None,
                  "grid": {k: r.get(k) for k in ("gx", "gy", "gz", "gdata")}, "micro_batch": r.get("micro_batch")}
print(json.dumps(s, indent=1))
EOF
cat "$OUT/summary.json"
