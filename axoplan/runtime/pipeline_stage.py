"""Pipeline stages of the bundled trainer, on torch's own torch.distributed.pipelining.

Each pipeline rank holds one ParallelGPT slice (runtime/model.py) on its own 4D sub-grid (runtime/grid.py:
the pipeline axis is outermost); the slice is cut into the rank's virtual stages, v = stage + k * pp for
k < vpp, as the planner splits them (planner/pipeline.stage_blocks: the first L mod (pp*vpp) virtual stages
one block more; the embedding on virtual stage 0, the final norm and LM head on the last). Each virtual stage
is a torch PipelineStage around a StageModule, run by torch's Schedule1F1B or ScheduleInterleaved1F1B.

torch's package hosts these stages as they are. The 3D-parallel layers issue their own collectives inside
forward and backward (autograd functions), which torch runs like any module. Three things are the trainer's,
done in a PipelineStage subclass rather than a schedule of its own:
- each forward and backward chunk announces its weight gathers (the prefetch sequence, Runtime.start_sequence)
  and a backward collects its outstanding reduce-scatters (Runtime.finish_backward), since a micro-batch's
  forward and backward no longer run back to back;
- every point-to-point transfer is recorded beside the collectives (Runtime.calls) and every chunk in an op
  log, for the schedule's proof (tests/test_pipeline_schedule.py);
- the stage metadata is static (input and output shapes given), so torch's start-up vote carries no
  information: under fake tensors (axoplan dryrun) the received vote holds no value, and it is read as the
  static vote every one of these stages casts.
The gradient reduction stays the trainer's: after the schedule, one blocking all-reduce of the rank's
gradient buffer over D (no per-bucket overlap across stages, as the planner times it: stage_timing).
"""
from __future__ import annotations

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from axoplan.planner.pipeline import stage_blocks
from axoplan.runtime.loss import vocab_parallel_cross_entropy
from axoplan.runtime.parallel_linear import CollectiveCall

P2P_LAYERS = {"fwd": "activation", "bwd": "activation gradient"}


def virtual_stages(n_layers: int, pp: int, vpp: int, stage: int) -> list[tuple[int, range, bool, bool]]:
    """(virtual stage, its blocks, first, last) of pipeline rank `stage`, in the rank's order."""
    counts = stage_blocks(n_layers, pp, vpp)
    starts = np.concatenate([[0], np.cumsum(counts)])
    V = pp * vpp
    return [(v, range(int(starts[v]), int(starts[v + 1])), v == 0, v == V - 1) for v in range(stage, V, pp)]


def rank_slice(n_layers: int, pp: int, vpp: int, stage: int) -> dict:
    """ParallelGPT's slice arguments for pipeline rank `stage`: the blocks of all its virtual stages."""
    vs = virtual_stages(n_layers, pp, vpp, stage)
    return {"blocks": [i for _, r, _, _ in vs for i in r], "embedding": any(f for _, _, f, _ in vs),
            "head": any(la for _, _, _, la in vs)}


class StageModule(torch.nn.Module):
    """One virtual stage as torch's PipelineStage wants it: a module. Its parameters are the rank's
    ParallelGPT's, which the trainer's optimizer and gradient buffer own; none is registered here, so that
    torch's parameter walks (device moves, gradient scaling, which the trainer turns off) leave them alone."""

    def __init__(self, model, blocks: range, first: bool, last: bool, shape: tuple[int, int]):
        super().__init__()
        self.gpt, self.chunk, self.shape = model, (blocks, first, last), shape

    def forward(self, x):
        return self.gpt.stage_forward(x, self.chunk[0], self.chunk[1], self.chunk[2], self.shape)


class TracedStage(PipelineStage):
    """A PipelineStage that runs each chunk inside the trainer's Runtime (gather sequence, memory kinds,
    outstanding reduce-scatters) and records its transfers and chunks."""

    def __init__(self, module: StageModule, v: int, n_stages: int, device, group, rt, log: list, transfers: list,
                 **kw):
        super().__init__(module, v, n_stages, device, group=group, **kw)
        self.rt, self.log, self.transfers, self.module_ = rt, log, transfers, module

    # ---- the chunks ------------------------------------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.log.append(("F", self.stage_index, fwd_chunk_id))
        self.rt.start_sequence(self.module_.gpt.forward_sequence(self.module_.chunk))
        with self.rt.memory_kind("activations"):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        self.log.append(("B", self.stage_index, bwd_chunk_id))
        self.rt.start_sequence(self.module_.gpt.backward_sequence(self.module_.chunk))
        with self.rt.memory_kind("transients"):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            self.rt.finish_backward()

    # ---- the stage boundaries' receive buffers (memory.pipeline_buffers), allocated by torch on the first step --
    def _prepare_forward_infra(self, num_microbatches, *args, **kw):
        with self.rt.memory_kind("pipeline buffers"):
            return super()._prepare_forward_infra(num_microbatches, *args, **kw)

    def _prepare_backward_infra(self, num_microbatches, *args, **kw):
        with self.rt.memory_kind("pipeline buffers"):
            return super()._prepare_backward_infra(num_microbatches, *args, **kw)

    # ---- the transfers, recorded as they are issued ----------------------------------------------
    def _recorded(self, ops, kind: str, direction: str, chunk: int):
        for op in ops:
            t = op.tensor
            self.rt.record_p2p(CollectiveCall(P2P_LAYERS[direction], kind, "p", t.numel() * t.element_size()))
            # with the chunks run so far: a receive must be posted before its own chunk runs
            self.transfers.append((kind, P2P_LAYERS[direction], self.stage_index, chunk, len(self.log)))
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_recv_ops(fwd_chunk_id), "recv", "fwd", fwd_chunk_id)

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_send_ops(fwd_chunk_id), "send", "fwd", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_recv_ops(bwd_chunk_id), "recv", "bwd", bwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_send_ops(bwd_chunk_id), "send", "bwd", bwd_chunk_id)

    def _warmup_backward_result(self, received_result=None):
        if isinstance(received_result, _FakeVote):
            received_result = received_result.tensor
        result = super()._warmup_backward_result(received_result)
        return _FakeVote(result) if isinstance(result, FakeTensor) else result


class _FakeVote:
    """torch's start-up vote as received under fake tensors (axoplan dryrun): it holds no value, and every
    TracedStage votes static (its shapes are given), so the schedule reads 1."""

    def __init__(self, tensor):
        self.tensor = tensor

    def item(self) -> int:
        return 1


class Pipeline:
    """The rank's virtual stages and torch's schedule over them; `step` runs one optimizer step's
    micro-batches (forwards, backwards, transfers) and returns the sum of the kept per-token losses
    (zero on ranks without the last stage)."""

    def __init__(self, cfg, model, rt, grid, device, compute_dtype, grad_acc: int, seq: int):
        spec = model.spec
        mb = cfg.micro_batch
        tokens = mb * seq
        self.model, self.rt = model, rt
        self.log: list = []  # ("F" | "B", virtual stage, micro-batch) in the order run
        # (send | recv, activation | activation gradient, virtual stage, micro-batch, chunks run before it)
        self.transfers: list = []
        self.stages = []
        V = cfg.pp * cfg.vpp
        for v, blocks, first, last in virtual_stages(spec.n_layers, cfg.pp, cfg.vpp, grid.stage):
            module = StageModule(model, blocks, first, last, (mb, seq))
            x = torch.empty(tokens, model.hx, dtype=compute_dtype, device=device)
            inp = torch.empty(mb, seq, dtype=torch.int64, device=device) if first else x.requires_grad_(True)
            # examples of what each stage takes and gives (torch's static metadata: no shape inference run)
            out = (torch.empty(tokens, spec.padded_vocab // grid.gy, dtype=compute_dtype, device=device) if last
                   else torch.empty(tokens, model.hx, dtype=compute_dtype, device=device)).requires_grad_(True)
            self.stages.append(TracedStage(module, v, V, device, grid.group("p"), rt, self.log, self.transfers,
                                           input_args=inp, output_args=out))
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self._n_kept = None
        self._loss_sum = None
        # the loss is a sum over kept targets divided by their global count: no gradient scaling by torch
        if cfg.schedule == "1f1b":
            self.schedule = Schedule1F1B(self.stages[0], grad_acc, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(self.stages, grad_acc, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One micro-batch's share of the step's loss: target [mb, 2, seq] holds the next tokens and the
        keep mask."""
        m = self.model
        with self.rt.memory_kind("logits"):
            per_tok = vocab_parallel_cross_entropy(logits, target[:, 0].reshape(-1), m.vocab_lo, m.spec.vocab,
                                                   self.rt)
            part = (per_tok * target[:, 1].reshape(-1).to(per_tok.dtype)).sum()
        self._loss_sum += part.detach().double()
        return part / self._n_kept

    def step(self, tokens: torch.Tensor, keep: torch.Tensor, n_kept: torch.Tensor) -> torch.Tensor:
        self._n_kept = n_kept.float()
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=tokens.device)
        args = (tokens[:, :-1],) if self.first else ()
        target = torch.stack([tokens[:, 1:], keep.to(torch.int64)], 1) if self.last else None
        self.schedule.step(*args, target=target, return_outputs=False)
        return self._loss_sum

