"""The sbatch script that runs the same calibration across nodes: one torchrun agent per node
(srun), c10d rendezvous on the first node, then the fit on the collected results."""
from __future__ import annotations

from axoplan.shell import comment, join, quote
from axoplan.shell import slug as _slug


def sbatch_script(nodes: int, nproc_per_node: int, out: str, results: str, quick: bool, models: str | None,
                  device: str = "auto", time_limit: str = "01:00:00", port: int = 29500) -> str:
    gpus = device != "cpu"
    # #SBATCH lines are read by sbatch, not a shell: only a slug of the name goes there
    name = _slug(out.rsplit("/", 1)[-1].rsplit(".", 1)[0])
    opts = (["--quick"] if quick else []) + (["--models", models] if models else []) + \
        (["--device", device] if device != "auto" else [])
    worker = opts  # --results is the staging folder, a shell variable
    fit = ["axoplan", "calibrate", "--from-results", results, "--out", out]
    cmd = join(["axoplan", "calibrate", "--emit-slurm", str(nodes), "--nproc", str(nproc_per_node), "--out", out]
               + (["--quick"] if quick else []) + (["--models", models] if models else [])
               + (["--device", device] if device != "auto" else []), "calibrate --out/--results/--models")
    gpu_line = f"#SBATCH --gpus-per-node={nproc_per_node}\n" if gpus else ""
    return f"""#!/bin/bash
{comment(f"Written by: {cmd}")}
# Measures GEMMs, memory and collectives on {nodes} node(s) x {nproc_per_node} ranks, including the groups
{comment(f"that cross nodes, then fits and writes the profile {quote(out, '--out')}. Submit with: sbatch <this file>")}
#SBATCH --job-name=axoplan-calibrate-{name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{gpu_line}#SBATCH --exclusive
#SBATCH --time={time_limit}
#SBATCH --output=axoplan-calibrate-{name}-%j.out
##SBATCH --account=YOUR_ACCOUNT   (uncomment and fill in what your site requires)
##SBATCH --partition=YOUR_PARTITION
set -euo pipefail

RESULTS={quote(results, "--results")}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# measured beside an earlier complete run, which is replaced only once this one has finished
STAGE="$RESULTS/.measuring-slurm-$SLURM_JOB_ID"
mkdir -p "$STAGE"

# one torchrun agent per node; they meet at the first node and start {nproc_per_node} workers each
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 \\
  python -m torch.distributed.run \\
    --nnodes="$SLURM_NNODES" --nproc-per-node={nproc_per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:{port}" --rdzv-id="$SLURM_JOB_ID" \\
    -m axoplan.calibrate.worker --results "$STAGE" {join(worker, "calibrate options")} --command {quote(cmd, "the command line")}

# every file over the earlier run's, one rename each; meta.json, which marks the run complete, last
for f in "$STAGE"/*; do
  [ "$(basename "$f")" = meta.json ] || mv -f "$f" "$RESULTS/"
done
mv -f "$STAGE/meta.json" "$RESULTS/meta.json"
rmdir "$STAGE"

# fit alpha/beta, GEMM curve and memory numbers; write the profile atomically
{join(fit, "calibrate --out")}
"""
