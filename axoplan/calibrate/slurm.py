"""The sbatch script that runs the same calibration across nodes: one torchrun agent per node
(srun), c10d rendezvous on the first node, then the fit on the collected results."""
from __future__ import annotations

from axoplan import slurm
from axoplan.shell import comment, join, quote, slug


def sbatch_script(nodes: int, nproc_per_node: int, out: str, results: str, quick: bool, models: str | None,
                  device: str = "auto", time_limit_s: float = 3600.0, port: int = 29500) -> str:
    opts = (["--quick"] if quick else []) + (["--models", models] if models else []) + \
        (["--device", device] if device != "auto" else [])
    fit = ["axoplan", "calibrate", "--from-results", results, "--out", out]
    cmd = join(["axoplan", "calibrate", "--emit-slurm", str(nodes), "--nproc", str(nproc_per_node), "--out", out]
               + opts, "calibrate --out/--results/--models")
    job = slug(f"axoplan-calibrate-{out.rsplit('/', 1)[-1].rsplit('.', 1)[0]}")
    about = [comment(f"Written by: {cmd}"),
             f"# Measures GEMMs, memory and collectives on {nodes} node(s) x {nproc_per_node} ranks, including the groups",
             comment("that cross nodes (on GPUs swept on to 4 GiB: the size x node-count curves NCCL's protocol model "
                     f"is fitted to), then fits and writes the profile {quote(out, '--out')}. "
                     f"Submit with: sbatch <this file>")]
    # the nodes are measured whole: another job beside the ranks would slow what they measure
    lines = slurm.header(job_name=job, nodes=nodes, ntasks_per_node=1,
                         gpus_per_node=None if device == "cpu" else nproc_per_node, exclusive=True,
                         time_s=time_limit_s, log_dir=None, log_name=f"{job}-%j.out", about=about)
    lines += [
        "",
        f"RESULTS={quote(results, '--results')}",
        slurm.head_node("HEAD_NODE"),
        "# measured beside an earlier complete run, which is replaced only once this one has finished",
        'STAGE="$RESULTS/.measuring-slurm-$SLURM_JOB_ID"',
        'mkdir -p "$STAGE"',
        "",
        f"# one torchrun agent per node; they meet at the first node and start {nproc_per_node} workers each",
        'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 \\',
        "  python -m torch.distributed.run \\",
        f'    --nnodes="$SLURM_NNODES" --nproc-per-node={nproc_per_node} \\',
        f'    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:{port}" --rdzv-id="$SLURM_JOB_ID" \\',
        # --results is the staging folder, a shell variable
        f'    -m axoplan.calibrate.worker --results "$STAGE" {join(opts, "calibrate options")} '
        f'--command {quote(cmd, "the command line")}',
        "",
        "# every file over the earlier run's, one rename each; meta.json, which marks the run complete, last",
        'for f in "$STAGE"/*; do',
        '  [ "$(basename "$f")" = meta.json ] || mv -f "$f" "$RESULTS/"',
        "done",
        'mv -f "$STAGE/meta.json" "$RESULTS/meta.json"',
        'rmdir "$STAGE"',
        "",
        "# fit alpha/beta, GEMM curve and memory numbers; write the profile atomically",
        join(fit, "calibrate --out"),
    ]
    return slurm.script(lines, "the calibration's Slurm script")
