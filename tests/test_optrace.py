"""The element-wise kernels of the cost model are the trainer's own: every operator of one training
step, traced under `axoplan dryrun`'s fake tensors (runtime/optrace.py), against
compute.elementwise_work and compute.step_work, per phase, exactly (both count the same kernels of
the same shapes; any difference is a kernel one of them forgot)."""
import pytest

pytest.importorskip("torch")

import yaml

from axoplan.runconfig import Grid, LaunchConfig, Overlap
from axoplan.runtime.optrace import (
    PHASES,
    OpCounter,
    classify,
    count_step,
    modelled_step,
)

LLAMA_LIKE = {"mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "n_kv_heads": 4, "ffn_hidden": 96}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    with open("axoplan/presets/gpt-tiny.yaml") as f:
        base = yaml.safe_load(f)
    out = {"gpt-tiny": "gpt-tiny"}
    for name, over in {"gpt-3l-odd": {"n_layers": 3, "hidden": 48, "n_heads": 6, "vocab": 250},
                       "llama-tiny": LLAMA_LIKE, "llama-3l-odd": {**LLAMA_LIKE, "n_layers": 3, "vocab": 250}}.items():
        p = d / f"{name}.yaml"
        p.write_text(yaml.safe_dump({**base, **over, "name": name}))
        out[name] = str(p)
    return out


# (model, grid, micro-batch, global batch, checkpointing, dtype): bf16 runs with fused AdamW (GPUs), fp32 per
# tensor (the CPU trainer); grids with X, Y, Z, D, padding (gz not dividing a block), several micro-batches
CASES = [
    ("gpt-tiny", (1, 1, 1, 1), 1, 1, False, "fp32"),
    ("gpt-tiny", (2, 2, 2, 1), 1, 2, False, "bf16"),
    ("gpt-tiny", (2, 2, 2, 1), 1, 2, True, "bf16"),
    ("gpt-tiny", (1, 2, 2, 2), 2, 16, False, "bf16"),
    ("gpt-tiny", (2, 1, 4, 1), 2, 16, True, "fp32"),
    ("gpt-3l-odd", (1, 1, 3, 1), 1, 3, True, "bf16"),
    ("llama-tiny", (2, 2, 2, 1), 1, 2, True, "bf16"),
    ("llama-tiny", (1, 2, 1, 2), 1, 4, False, "fp32"),
    ("llama-3l-odd", (4, 2, 1, 1), 4, 8, False, "bf16"),
    ("llama-3l-odd", (1, 1, 3, 1), 2, 12, True, "fp32"),
]


@pytest.mark.parametrize("name,grid,mb,gb,ck,dtype", CASES)
def test_traced_kernels_equal_modelled(models, name, grid, mb, gb, ck, dtype):
    cfg = LaunchConfig(model=models[name], grid=Grid(*grid), global_batch=gb, micro_batch=mb, checkpointing=ck,
                       metrics=None)
    fused = dtype == "bf16"
    traced = count_step(cfg, dtype, fused).counts
    modelled = modelled_step(cfg, dtype, fused)
    for phase in PHASES:
        t, m = traced[phase], modelled[phase]
        assert (t.kernels, t.bytes) == (m.kernels, m.bytes), (phase, dict(t.ops))
    assert traced["recompute"].kernels > 0 if ck else traced["recompute"].kernels == 0
    assert traced["forward"].gemms > 0 and traced["backward"].attention > 0


def test_without_prefetch_each_cast_is_in_its_own_phase(models):
    cfg = LaunchConfig(model=models["gpt-tiny"], grid=Grid(1, 2, 2, 1), global_batch=2, micro_batch=1,
                       checkpointing=True, overlap=Overlap(all_gather=False), metrics=None)
    traced = count_step(cfg, "bf16").counts
    modelled = modelled_step(cfg, "bf16")
    assert all((traced[p].kernels, traced[p].bytes) == (modelled[p].kernels, modelled[p].bytes) for p in PHASES)


def test_classification():
    import torch

    aten = torch.ops.aten
    assert classify(aten.mm.default) == "gemm" and classify(aten.addmm.default) == "gemm"
    assert classify(aten._scaled_dot_product_flash_attention_for_cpu.default) == "attention"
    assert classify(aten.view.default) == "free" and classify(aten.empty.memory_format) == "free"
    assert classify(torch.ops.c10d.allreduce_.default) == "free"
    assert classify(aten.add.Tensor) == "kernel" and classify(aten._to_copy.default) == "kernel"


def test_bytes_are_the_storage_touched():
    """Broadcast operands once, in-place results read and written, overwritten ones only written,
    gathers and scatters only where the index points."""
    import torch

    x, row = torch.ones(8, 4), torch.ones(4)
    with OpCounter() as c:
        y = x + row  # 32 + 4 read, 32 written
        y.add_(x)  # 32 + 32 read, 32 written
        y.copy_(x)  # 32 read, 32 written
        torch.zeros_like(y)  # 32 written
        x.expand(3, 8, 4).sum(0)  # 32 read (stride 0), 32 written
        x.gather(1, torch.zeros(8, 1, dtype=torch.long))  # index 8 x 8 bytes, 8 read, 8 written
    step = c.counts["step"]  # no Runtime attached: all of it counts as step work
    assert step.kernels == 7  # the zeros index tensor is a kernel too
    assert step.bytes == 4 * (68 + 96 + 64 + 32 + 64) + 8 * 8 + 8 * 8 + 4 * 16


def test_the_real_cpu_trainer_issues_the_same(models):
    """Real tensors, one gloo rank: the same kernels and bytes as the fake trace and the model, plus the
    two host reads of the step's metrics that a fake tensor skips."""
    import torch.distributed as dist

    from axoplan.runtime.memtrace import MemoryTracer
    from axoplan.runtime.train import Trainer

    cfg = LaunchConfig(model=models["llama-tiny"], global_batch=4, micro_batch=2, checkpointing=True, metrics=None)
    trainer = Trainer.from_config(cfg)
    try:
        trainer.rt.tracer = MemoryTracer("states")  # the Runtime's moments mark the phases, as under dryrun
        counter = OpCounter()
        with trainer.rt.tracer, counter:
            counter.attach(trainer)
            trainer.train_step(0)
            counter.reset()
            trainer.train_step(1)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    modelled = modelled_step(cfg, "fp32", fused_optimizer=False, fake=False)
    for phase in PHASES:
        t, m = counter.counts[phase], modelled[phase]
        assert (t.kernels, t.bytes) == (m.kernels, m.bytes), (phase, dict(t.ops))
