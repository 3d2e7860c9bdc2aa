"""The training loop: one LaunchConfig in, a trained model, its metrics and checkpoints out
(nanoGPT-style, one sitting). Reporting, the LR schedule and checkpoints live in report.py,
lr_schedule.py and checkpoint.py beside it.

    trainer = Trainer.from_config(cfg)        # process groups, model, optimizer, data
    trainer.fit()                             # steps (from a checkpoint with resume) + metrics + summary
    full = trainer.model.gather_full_params() # whole tensors, loadable by ReferenceGPT
"""
from __future__ import annotations

import io
import math
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from axoplan.atomic import atomic_write_bytes
from axoplan.errors import UserError
from axoplan.runconfig import LaunchConfig
from axoplan.planner.space import grid_problem
from axoplan.planner.specs import ModelSpec, load_model
from axoplan.runtime.data import local_indices, open_source
from axoplan.runtime.dist_env import DistEnv, cpu_threads, export_for_env_init, read_env
from axoplan.runtime import checkpoint
from axoplan.runtime.goldfish import goldfish_keep
from axoplan.runtime.grid import ParallelGrid, build_grid
from axoplan.runtime.lr_schedule import config_lr
from axoplan.runtime.model import ParallelGPT
from axoplan.runtime.parallel_linear import Runtime
from axoplan.runtime.reference import decays
from axoplan.runtime.report import MEMORY_KIND, Reporter, new_run_id

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- configuration checks that must pass on every rank before any process group exists ----------
# fp32 master weights, their gradients and AdamW's two moments: the least a rank holds per parameter of its shard
STATE_BYTES_PER_PARAM = 16


def host_memory_available() -> int | None:
    """Bytes the kernel says can be allocated now without swapping (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(spec: ModelSpec, cfg: LaunchConfig, local_world_size: int) -> None:
    """Refuse a model whose weights and optimizer states alone exceed this host's free memory (every
    rank here on CPU), before the allocator kills the run half-way through building it."""
    if cfg.backend == "nccl" or (cfg.backend == "auto" and torch.cuda.is_available()):
        return  # on GPUs the planner's memory model and the profile's capacity decide
    g = cfg.grid
    need = STATE_BYTES_PER_PARAM * spec.n_params / (g.gx * g.gy * g.gz) * max(1, local_world_size)
    have = host_memory_available()
    if have is not None and need > have:
        raise UserError(f"model '{spec.name}' needs at least {need / 2**30:.3g} GiB on this host for its weights, "
                        f"gradients and AdamW states ({STATE_BYTES_PER_PARAM} bytes per parameter, "
                        f"{local_world_size} rank(s) here), and only {have / 2**30:.3g} GiB is available")


def check_config(cfg: LaunchConfig, world_size: int, local_world_size: int | None = None) -> ModelSpec:
    spec = load_model(cfg.model)
    g = cfg.grid
    if world_size % cfg.pp:
        raise UserError(f"pp={cfg.pp} pipeline stages do not divide the {world_size} process(es) started")
    if cfg.world != world_size:
        raise UserError(f"the grid gx*gy*gz*gdata{'*pp' if cfg.pp > 1 else ''} = {g.gx}*{g.gy}*{g.gz}*{g.gdata}"
                        f"{f'*{cfg.pp}' if cfg.pp > 1 else ''} = {cfg.world} does not match "
                        f"the {world_size} process(es) started; write a config for them with 'axoplan train "
                        f"--print-config --gpus {world_size}' or start {cfg.world}")
    seq = cfg.seq_len or spec.seq_len
    why = grid_problem(spec, g.gx, g.gy, g.gz, g.gdata, cfg.global_batch, cfg.micro_batch, seq, cfg.pp, cfg.vpp,
                       cfg.schedule)
    if why:
        raise UserError(f"config cannot run model '{spec.name}': {why}")
    check_memory(spec, cfg, world_size if local_world_size is None else local_world_size)
    open_source(cfg.data, cfg.seed, seq + 1)  # a missing or too short data path fails here, on all ranks
    peak_tflops(cfg)  # an unknown machine profile fails here too
    resume_from(cfg, seq)  # and a checkpoint this run cannot continue
    return spec


def resume_from(cfg: LaunchConfig, seq: int) -> Path | None:
    """The checkpoint a `resume: true` run continues: the newest in checkpoint_dir (None: none yet, start at 0)."""
    if not cfg.resume:
        return None
    found = checkpoint.checkpoints(cfg.path(cfg.checkpoint_dir))
    if not found:
        return None
    checkpoint.check_resumable(checkpoint.read_meta(found[-1]), cfg, seq, found[-1])
    return found[-1]


def peak_tflops(cfg: LaunchConfig) -> float | None:
    if not cfg.machine:
        return None
    try:
        from axoplan.planner.profile_reader import load_profile
    except ImportError:
        return None
    return float(load_profile(cfg.machine).peak_tflops)


@dataclass
class Resolved:
    device: torch.device
    backend: str
    compute_dtype: torch.dtype
    collective_dtype: torch.dtype
    blas_tuning: bool
    fused_optimizer: bool = False  # one fused AdamW kernel, no full-size temporaries (GPU runs, dryrun)


def resolve(cfg: LaunchConfig, local_rank: int = 0) -> Resolved:
    cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if cuda else "gloo")
    # a launcher that binds one GPU per task shows each task a single device: wrap around
    device = (torch.device(f"cuda:{local_rank % max(1, torch.cuda.device_count())}") if backend == "nccl"
              else torch.device("cpu"))
    cdt = DTYPES[cfg.dtype] if cfg.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    coll = DTYPES[cfg.collective_dtype] if cfg.collective_dtype != "auto" else cdt
    blas = cfg.blas_tuning == "on" or (cfg.blas_tuning == "auto" and device.type == "cuda")
    return Resolved(device, backend, cdt, coll, blas, fused_optimizer=device.type == "cuda")


def init_distributed(cfg: LaunchConfig, de: DistEnv | None = None) -> tuple[DistEnv, Resolved]:
    """Start the world process group from torchrun's or srun's environment (or a world of one)."""
    de = de or read_env()
    res = resolve(cfg, de.local_rank)
    threads = cpu_threads(de.local_world_size)
    if threads:
        torch.set_num_threads(threads)
    if res.device.type == "cuda":
        torch.cuda.set_device(res.device)
    if not dist.is_initialized():
        timeout = timedelta(minutes=10)
        if de.launcher == "single":
            dist.init_process_group(res.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            export_for_env_init(de)
            dist.init_process_group(res.backend, init_method="env://", timeout=timeout)
    return de, res


def _item(t: torch.Tensor) -> float:
    """A scalar for the metrics; NaN for a fake tensor (axoplan dryrun), which holds no value."""
    return float("nan") if isinstance(t, FakeTensor) else float(t)


# ---- the trainer -----------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: LaunchConfig, grid: ParallelGrid, res: Resolved, *, init_params=None,
                 data_source=None, adam_eps: float = 1e-8):
        self.cfg, self.grid, self.res = cfg, grid, res
        self.spec = load_model(cfg.model)
        self.seq = cfg.seq_len or self.spec.seq_len
        ov = cfg.overlap
        self.rt = Runtime(grid, compute_dtype=res.compute_dtype, collective_dtype=res.collective_dtype,
                          overlap_all_reduce=ov.all_reduce, overlap_reduce_scatter=ov.reduce_scatter,
                          overlap_all_gather=ov.all_gather, max_inflight_rs=ov.max_inflight_reduce_scatters,
                          blas_tuning=res.blas_tuning, overlap_data_parallel=ov.data_parallel)
        self.model = ParallelGPT(self.spec, self.rt, seed=cfg.seed, checkpointing=cfg.checkpointing,
                                 device=res.device, init_params=init_params, **self.model_slice())
        m = self.model
        decay = [w.param for n, w in m.weights.items() if decays(n)]
        no_decay = [w.param for n, w in m.weights.items() if not decays(n)] + m.replicated_params()
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95), eps=adam_eps,
                                     **({"fused": True} if res.fused_optimizer else {}))
        self.source = data_source or open_source(cfg.data, cfg.seed, self.seq + 1)
        c = grid.coords
        self.indices = local_indices(cfg.global_batch, grid.gdata, grid.gz, c.d, c.z)
        self.grad_acc = len(self.indices) // cfg.micro_batch
        self.peak = peak_tflops(cfg)
        # useful model FLOP of one step, the planner's accounting (recomputation is not useful work)
        self.step_flops = self.spec.flops_per_token(self.seq, recompute=False) * cfg.global_batch * self.seq
        self.step = 0  # the next step to train: where fit() continues (a resumed run starts past 0)
        self.records: list[dict] = []
        self.reporter: Reporter | None = None  # opened by the first fit(): dryrun and the proofs write nothing
        self.dp_bucket_bytes: int | None = None  # None: comm.DP_BUCKET_BYTES (the proofs set small caps)
        self.reporting = grid.rank == 0  # the rank that prints and writes the metrics

    def model_slice(self) -> dict:
        """The part of the model this rank holds: all of it (a pipeline rank holds its stages')."""
        return {}

    @classmethod
    def from_config(cls, cfg: LaunchConfig, **kw) -> Trainer:
        de = read_env()
        check_config(cfg, de.world_size)
        de, res = init_distributed(cfg, de)
        g = cfg.grid
        grid = build_grid(g.gx, g.gy, g.gz, g.gdata, cfg.order, pp=cfg.pp)
        return cls.for_grid(cfg, grid, res, **kw)

    @classmethod
    def for_grid(cls, cfg: LaunchConfig, grid: ParallelGrid, res: Resolved, **kw) -> Trainer:
        """The trainer of cfg on a built grid: pipelined where cfg.pp > 1 (runtime/pipeline_train.py)."""
        if cfg.pp > 1:
            from axoplan.runtime.pipeline_train import PipelineTrainer

            cls = PipelineTrainer
        return cls(cfg, grid, res, **kw)

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()
        self.grid.destroy()

    # ---- one optimizer step ----------------------------------------------------------------
    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This (d, z) coordinate's sequences [local, seq+1] and their keep mask [local, seq]."""
        tokens = np.asarray(self.source.sequences(step, self.indices, self.seq + 1), dtype=np.int64)
        gf = self.cfg.goldfish
        keep = goldfish_keep(tokens[:, 1:], gf.k, gf.h) if gf else np.ones((len(tokens), self.seq), dtype=bool)
        dev = self.res.device
        return torch.from_numpy(tokens).to(dev), torch.from_numpy(keep).to(dev, torch.float32)

    def train_step(self, step: int) -> dict:
        rt, model = self.rt, self.model
        tokens, keep = self.local_batch(step)
        n_kept = keep.sum().double()  # the loss is a mean over the kept targets of the global batch
        rt.all_reduce(n_kept, "zd", layer="token count")
        model.grad_buffer.zero_()
        for p in model.replicated_params():
            p.grad = None
        loss_sum, dp_armed = self.micro_batches(tokens, keep, n_kept)
        rt.moment("step")
        self.reduce_gradients(overlapped=dp_armed)
        grad_norm = self.clip_gradients()
        with rt.memory_kind("states"):  # AdamW's moments appear at the first step
            self.opt.step()
        rt.all_reduce(loss_sum, "zd", layer="loss")
        return {"loss": _item(loss_sum / n_kept), "grad_norm": _item(grad_norm)}

    def micro_batches(self, tokens: torch.Tensor, keep: torch.Tensor,
                      n_kept: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Every micro-batch's forward and backward (gradient accumulation): the sum of their losses, and
        whether the D all-reduce was launched inside the last backward. The part a pipeline schedule replaces."""
        rt, model, mb = self.rt, self.model, self.cfg.micro_batch
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.res.device)
        dp_armed = False
        for m in range(self.grad_acc):
            rt.start_sequence(model.gather_sequence(backward=True))
            if m == self.grad_acc - 1:  # the gradients become final in this backward: reduce them over D inside it
                dp_armed = rt.arm_data_parallel(model.grad_buckets(self.dp_bucket_bytes))
            with rt.memory_kind("activations"):
                part = model.loss_sum(tokens[m * mb:(m + 1) * mb], keep[m * mb:(m + 1) * mb])
            with rt.memory_kind("transients"):
                (part / n_kept.float()).backward()
                rt.finish_backward()
            loss_sum += part.detach().double()
        return loss_sum, dp_armed

    def reduce_gradients(self, overlapped: bool = False) -> None:
        """Once per step: weight-shard gradients over D (fp32: one buffer, or with overlapped its
        buckets, already launched during the last backward: only waited for here); replicated
        parameters (norms, positions) over Z and D, where the samples differ."""
        model, rt = self.model, self.rt
        if overlapped:
            rt.finish_data_parallel()
        else:
            rt.all_reduce(model.grad_buffer, "d", layer="gradients", exact=True)
        reps = model.replicated_params()
        for p in reps:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.grid.group("zd") is not None:
            flat = torch.cat([p.grad.reshape(-1) for p in reps])
            rt.all_reduce(flat, "zd", layer="replicated", exact=True)
            off = 0
            for p in reps:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def clip_gradients(self) -> torch.Tensor:
        """Global norm over all shards, each element counted once: weight shards are unique over
        (x, y, z) and identical over D; replicated parameters are unique over X only. The scale is
        applied whether or not it clips (a factor of exactly 1 changes nothing): no host sync."""
        c, model = self.grid.coords, self.model
        sq = torch.zeros((), dtype=torch.float64, device=self.res.device)
        if c.d == 0:
            sq += torch.linalg.vector_norm(model.grad_buffer).double() ** 2
            if c.y == 0 and c.z == 0:
                for p in model.replicated_params():
                    sq += torch.linalg.vector_norm(p.grad).double() ** 2
        self.rt.all_reduce(sq, "all", layer="gradient norm", exact=True)
        norm = sq.sqrt()
        coef = (self.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0).float()
        model.grad_buffer.mul_(coef)
        for p in model.replicated_params():
            p.grad.mul_(coef)
        return norm

    # ---- the loop with metrics ---------------------------------------------------------------
    def _sync(self) -> None:
        if self.res.device.type == "cuda":
            torch.cuda.synchronize(self.res.device)
        if self.grid.size > 1:
            self.rt.barrier()

    def timed_step(self, step: int) -> tuple[dict, float]:
        """One optimizer step between two synchronisations of every rank: the time per batch the trainer
        reports (and calibration measures the same way)."""
        self._sync()
        t0 = time.perf_counter()
        out = self.train_step(step)
        self._sync()
        return out, time.perf_counter() - t0

    def set_lr(self, step: int) -> float:
        lr = config_lr(self.cfg, step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        return lr

    def fit(self, steps: int | None = None) -> dict:
        """Train `steps` more steps, or up to the config's `steps`, from self.step (where a resumed run
        or an earlier fit() left off); report each, checkpoint every `checkpoint_every`; the summary."""
        cfg = self.cfg
        if self.reporter is None:
            self.begin()
        end = self.step + steps if steps else cfg.steps
        if end <= self.step:
            raise UserError(f"nothing to train: the run is at step {self.step} and steps is {cfg.steps}")
        self.reporter.total_steps = end
        tokens = cfg.global_batch * self.seq
        while self.step < end:
            step = self.step
            lr = self.set_lr(step)
            out, dt = self.timed_step(step)
            if not math.isfinite(out["loss"]):  # the same value on every rank: all stop together
                msg = (f"the loss became {out['loss']} at step {step + 1} (lr {lr:.2e}); training stopped: "
                       f"lower lr or lengthen lr_warmup_steps")
                self.reporter.event("error", step=step, error=msg)
                raise UserError(msg)
            tflops = self.step_flops / dt / self.grid.size / 1e12
            rec = {"step": step, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": lr, "batch_time_s": dt,
                   "tokens_per_s": tokens / dt, "model_tflops_per_gpu": tflops,
                   "pct_of_peak": 100.0 * tflops / self.peak if self.peak else None,
                   "peak_memory_gib": self.peak_memory_gib()}
            self.records.append(rec)
            self.reporter.step(rec)
            self.step += 1
            if cfg.checkpoint_every and (self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps):
                self.save_checkpoint()
        summary = self.summary()
        self.reporter.summary(summary)
        if cfg.save:
            self.save(cfg.path(cfg.save))
        return summary

    def begin(self) -> None:
        """Start the run's reporting, from the checkpoint when the config resumes one."""
        cfg, start = self.cfg, None
        run_id = new_run_id()
        path = resume_from(cfg, self.seq)
        if path is not None:
            meta = checkpoint.load(self, path)
            self.step = start = int(meta["step"])
            run_id = meta["run_id"]
        elif cfg.resume and self.grid.rank == 0:
            print(f"note: no checkpoint in '{cfg.path(cfg.checkpoint_dir)}' yet: starting at step 0", file=sys.stderr)
        if self.res.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.res.device)
        self.reporter = Reporter(cfg, active=self.reporting, run_id=run_id, total_steps=cfg.steps,
                                 memory_kind=MEMORY_KIND.get(self.res.device.type, self.res.device.type),
                                 resumed_from=start,
                                 start={"checkpoint": str(path) if path else None, "world_size": self.grid.size,
                                        "config": cfg.to_dict()})

    def save_checkpoint(self) -> None:
        """Every rank, at the same step: the sharded state of the step just finished."""
        cfg = self.cfg
        meta = {"step": self.step, "run_id": self.reporter.run_id,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **checkpoint.run_identity(cfg, self.seq)}
        t0 = time.perf_counter()
        path = checkpoint.save(self, cfg.path(cfg.checkpoint_dir), meta, cfg.checkpoint_keep)
        self.reporter.event("checkpoint", step=self.step, path=str(path), seconds=time.perf_counter() - t0)

    def peak_memory_gib(self) -> float:
        if self.res.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.res.device) / 2**30
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
        return kib * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20

    def summary(self) -> dict:
        cfg, g = self.cfg, self.grid
        timed = self.records[cfg.timing_warmup_steps:] or self.records
        med = statistics.median(r["batch_time_s"] for r in timed)
        tflops = self.step_flops / med / g.size / 1e12
        return {"summary": True, "median_batch_time_s": med, "median_tokens_per_s": cfg.global_batch * self.seq / med,
                "model_tflops_per_gpu": tflops, "pct_of_peak": 100.0 * tflops / self.peak if self.peak else None,
                "peak_memory_gib": max(r["peak_memory_gib"] for r in self.records),
                "first_loss": self.records[0]["loss"], "final_loss": self.records[-1]["loss"],
                "steps": len(self.records), "timing_warmup_steps": cfg.timing_warmup_steps,
                "last_step": self.step, "model": self.spec.name,
                "grid": {"gx": g.gx, "gy": g.gy, "gz": g.gz, "gdata": g.gdata}, "order": g.order,
                "pp": cfg.pp, "vpp": cfg.vpp, "schedule": cfg.schedule,
                "global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch, "seq_len": self.seq,
                "checkpointing": cfg.checkpointing, "overlap": vars(cfg.overlap).copy(),
                "device": str(self.res.device), "dtype": str(self.res.compute_dtype).replace("torch.", ""),
                "blas_tuning": self.res.blas_tuning, "goldfish": vars(cfg.goldfish).copy() if cfg.goldfish else None}

    def save(self, path: str) -> None:
        """Gather full parameters (a collective) and write them from rank 0 as a torch file."""
        full = self.model.gather_full_params()
        if self.grid.rank == 0:
            buf = io.BytesIO()
            torch.save({"model": self.spec.name, "params": full}, buf)
            atomic_write_bytes(path, buf.getvalue())


def run(cfg: LaunchConfig) -> dict:
    """What `axoplan train` does after the config passed its checks."""
    trainer = Trainer.from_config(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["Trainer", "check_config", "init_distributed", "resolve", "run"]
