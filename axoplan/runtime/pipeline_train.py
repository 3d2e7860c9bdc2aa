"""The pipelined trainer: the bundled trainer's step with its micro-batches run by torch's pipeline schedule
over this rank's stages (runtime/pipeline_stage.py). Everything else is Trainer's: the token count, the
gradient reduction (here always the blocking one over D: the buckets of the overlapped one would launch
inside whichever stage's backward ends last), the global norm over every rank of every stage, AdamW on the
rank's own slice, the loss over Z and D. The metrics come from the first rank of the last stage, which
holds the loss."""
from __future__ import annotations

import torch

from axoplan.runtime.pipeline_stage import Pipeline, rank_slice
from axoplan.runtime.train import Trainer


class PipelineTrainer(Trainer):
    def __init__(self, cfg, grid, res, **kw):
        super().__init__(cfg, grid, res, **kw)
        self.pipeline = Pipeline(cfg, self.model, self.rt, grid, res.device, res.compute_dtype, self.grad_acc,
                                 self.seq)
        c = grid.coords  # the last stage's first rank holds the loss
        self.reporting = grid.stage == grid.pp - 1 and c.x == c.y == c.z == c.d == 0

    def model_slice(self) -> dict:
        return rank_slice(self.spec.n_layers, self.cfg.pp, self.cfg.vpp, self.grid.stage)

    def micro_batches(self, tokens, keep, n_kept) -> tuple[torch.Tensor, bool]:
        return self.pipeline.step(tokens, keep, n_kept), False
