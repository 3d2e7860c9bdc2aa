"""Element-wise bytes and kernel launches per training step: the bundled trainer traced (every operator
of one steady step, rank 0 of the grid, under `axoplan dryrun`'s fake tensors: runtime/optrace.py)
against the cost model (planner/compute.py elementwise_work, step_work), per phase. Replaces
trainer_op_counts.py, which counted one CPU grid of one and fed hand-copied constants.

    python benchmarks/elementwise_fidelity.py            # GPT-20B on 32, Llama-3 8B on 64 (bf16, fused AdamW)
    python benchmarks/elementwise_fidelity.py --fp32     # the same, as the CPU trainer runs (fp32, AdamW per tensor)
"""
import argparse
import time

from axoplan.runconfig import Grid, LaunchConfig
from axoplan.runtime.optrace import PHASES, count_step, modelled_step

# (model, grid gx,gy,gz,gdata, global batch, micro-batch, checkpointing): the published GPT-20B run, Llama-3 8B
# grids of 64 (FSDP-like, tensor-parallel, 3D)
CASES = [
    ("gpt-20b", (1, 1, 32, 1), 32, 1, True),
    ("llama3-8b", (1, 1, 32, 2), 64, 1, False),
    ("llama3-8b", (1, 4, 8, 2), 64, 1, True),
    ("llama3-8b", (2, 2, 16, 1), 64, 2, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", action="store_true", help="trace the CPU trainer's dtype and optimizer")
    args = ap.parse_args()
    dtype, fused = ("fp32", False) if args.fp32 else ("bf16", True)
    print(f"dtype {dtype}, AdamW {'fused' if fused else 'per tensor'}; per step on rank 0; GB = 1e9 bytes")
    print(f"{'model':10s} {'grid':10s} {'mb':>2s} {'ck':>2s} {'phase':9s} {'traced GB':>10s} {'model GB':>10s} "
          f"{'traced k':>8s} {'model k':>8s}  s")
    worst = 0.0
    for model, grid, gb, mb, ck in CASES:
        cfg = LaunchConfig(model=model, grid=Grid(*grid), global_batch=gb, micro_batch=mb, checkpointing=ck,
                           metrics=None)
        t0 = time.monotonic()
        traced = count_step(cfg, dtype, fused).counts
        wall = time.monotonic() - t0
        modelled = modelled_step(cfg, dtype, fused)
        for i, ph in enumerate(PHASES):
            t, m = traced[ph], modelled[ph]
            if t.bytes:
                worst = max(worst, abs(float(m.bytes) / t.bytes - 1), abs(float(m.kernels) / t.kernels - 1))
            print(f"{model if i == 0 else '':10s} {'x'.join(map(str, grid)) if i == 0 else '':10s} "
                  f"{mb if i == 0 else '':>2} {('on' if ck else 'off') if i == 0 else '':>2s} {ph:9s} "
                  f"{t.bytes / 1e9:10.3f} {float(m.bytes) / 1e9:10.3f} {t.kernels:8d} {float(m.kernels):8.0f}"
                  + (f"  {wall:.0f}" if i == 0 else ""))
    print(f"largest relative difference, bytes or kernels, any phase: {worst:.2e}")


if __name__ == "__main__":
    main()
