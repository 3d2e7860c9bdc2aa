"""emit --framework torchtitan|megatron|axonn, checked by each framework's own code (the `frameworks` extra:
torchtitan 0.2.2, megatron-core 0.16.1, axonn 0.2.0), and the runs read back (example logs in tests/data).

Per framework one end-to-end test: rank -> emit -> the framework's own config code accepts the files with the
planned degrees -> a log in its format -> validate --collect and refit read it. Any degree a writer changes
fails them. Tests that need a framework skip, saying so, where it is not installed; CI installs them."""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import one_sentence, run_cli

from axoplan.errors import UserError
from axoplan.loop import run_logs
from axoplan.loop.frameworks import Plan, framework_execution, write_framework_dir
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import rank
from axoplan.planner.specs import Job, load_model

DATA = Path(__file__).parent / "data"
JOB = ("llama3-8b", "dgx-h100", 16, 64)  # 2 nodes of 8 GPUs, the preset's 8192 tokens


def need(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[frameworks]')")


def emit(tmp_path, capsys, framework, *extra, name=None):
    out = tmp_path / (name or framework)
    m, p, g, b = JOB
    code, stdout, err = run_cli(["emit", "-m", m, "-p", p, "-g", str(g), "-b", str(b), "--framework", framework,
                                 "--out", str(out), *extra], capsys)
    assert code == 0, err
    return out, stdout


def best(framework, **kw):
    m, p, g, b = JOB
    return rank(m, p, g, b, top=1, execution=framework_execution(framework), **kw).iloc[0]


def read_back(folder: Path, log: str, target: str, capsys):
    """Put an example log where the launchers write theirs, read it back with validate --collect and refit."""
    shutil.copy(DATA / log, folder / target)
    code, out, err = run_cli(["validate", "--collect", str(folder)], capsys)
    assert code == 0, err
    row = run_logs.run_row(folder)
    from axoplan.loop.refit import refit

    r = refit([str(folder)], str(folder / "machine.yaml"), folder.parent / "refit" / "p.yaml", loo=False)
    assert r.n_runs == 1 and r.per_run["measured_s"].iloc[0] == pytest.approx(row["measured_time_s"])
    return row


def _direct(framework, plan, out, model="llama3-8b", global_batch=64):
    m = load_model(model)
    job = Job(plan.gpus, global_batch, m.seq_len)
    write_framework_dir(out, framework, plan, m, job, load_profile("dgx-h100"), framework_execution(framework),
                        model)
    return m, job


# ---- torchtitan --------------------------------------------------------------------------------------
def titan_config(folder: Path):
    """torchtitan's own ConfigManager on the emitted TOML, and its ParallelDims built as its train.py does."""
    need("torchtitan.config")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    sys.path.insert(0, str(folder))  # the launchers put the folder on PYTHONPATH for the flavour module
    try:
        cfg = ConfigManager().parse_args(["--job.config_file", str(folder / "job.toml")])
    finally:
        sys.path.remove(str(folder))
    run = yaml.safe_load((folder / "run.yaml").read_text())
    p = cfg.parallelism
    dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=run["gpus"])
    return cfg, dims


def test_torchtitan_end_to_end(tmp_path, capsys):
    row = best("torchtitan")
    out, _ = emit(tmp_path, capsys, "torchtitan")
    cfg, dims = titan_config(out)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp) == (
        row.gdata, row.gz, row.gy, row.pp, 1) and row.gx == 1
    t = cfg.training
    assert (t.global_batch_size, t.seq_len) == (64, 8192)
    if row.pp == 1:
        # torchtitan's train.py: gradient accumulation = global / (local x data-parallel degree)
        assert t.local_batch_size == row.micro_batch
        assert t.global_batch_size // (t.local_batch_size * dims.dp_replicate * dims.dp_shard) == \
            64 // (row.gdata * row.gz * row.micro_batch)
    assert cfg.activation_checkpoint.mode == ("selective" if row.checkpointing else "none")
    assert cfg.model.flavor == "8B"
    got = read_back(out, "torchtitan_example.log", "train.log", capsys)
    # the example's median tps 16,384 per device: 64 x 8192 tokens / (16,384 x 16 GPUs) = 2.0 s
    assert got["measured_time_s"] == pytest.approx(2.0) and got["log_format"] == "torchtitan"


def test_torchtitan_pipeline_degree_schedule_and_stages(tmp_path):
    need("torchtitan.config")
    plan = Plan(1, 2, 2, 1, "yzx", 2, True, pp=4, vpp=2, schedule="interleaved-1f1b")
    _direct("torchtitan", plan, tmp_path / "pp")
    cfg, dims = titan_config(tmp_path / "pp")
    p = cfg.parallelism
    assert (dims.pp, dims.tp, dims.dp_shard, dims.dp_replicate) == (4, 2, 2, 1)
    assert p.pipeline_parallel_layers_per_stage == 32 // (4 * 2)
    assert p.pipeline_parallel_microbatch_size == 2 and cfg.training.local_batch_size == 64 // 2
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, get_schedule_class

    assert get_schedule_class(p.pipeline_parallel_schedule) is ScheduleInterleaved1F1B  # torch's own name


@pytest.mark.parametrize("pp,vpp", [(3, 1), (3, 2), (5, 2)])
def test_torchtitan_places_the_planned_uneven_split(tmp_path, pp, vpp):
    """Llama 3 8B's 32 layers over 3, 6 or 10 (virtual) stages: torchtitan's own ConfigManager reads the stages'
    modules, every layer once and in order, the embedding first and the norm and LM head last, virtual stage v
    holding the planner's blocks (pipeline.stage_blocks; torchtitan runs it on rank v mod pp, its 'loop' style)."""
    need("torchtitan.config")
    from axoplan.planner.pipeline import stage_blocks

    plan = Plan(1, 2, 1, 1, "yzx", 1, True, pp=pp, vpp=vpp, schedule="interleaved-1f1b" if vpp > 1 else "1f1b")
    _direct("torchtitan", plan, tmp_path / "pp", global_batch=2 * pp)
    cfg, dims = titan_config(tmp_path / "pp")
    parts = cfg.parallelism.module_fqns_per_model_part
    assert dims.pp == pp and cfg.parallelism.pipeline_parallel_layers_per_stage is None
    flat = [m for part in parts for m in part]
    assert flat == ["tok_embeddings"] + [f"layers.{i}" for i in range(32)] + ["norm", "output"]
    assert [sum(m.startswith("layers.") for m in part) for part in parts] == list(stage_blocks(32, pp, vpp))
    # torchtitan's own pipeline_module_split, as each pipeline rank runs it (a fake process group of pp ranks, the
    # model on the meta device): the stages and layers it builds there are the planner's for that rank
    code = (
        "import json, sys, torch, torch.distributed as dist\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from torchtitan.distributed.pipeline_parallel import pipeline_module_split\n"
        "from torchtitan.models.llama3 import TransformerModelArgs\n"
        "from torchtitan.models.llama3.model.model import Transformer\n"
        "parts, pp, schedule = json.loads(sys.argv[1])\n"
        "with torch.device('meta'):\n"
        "    m = Transformer(TransformerModelArgs(dim=64, n_layers=32, n_heads=4, vocab_size=128, max_seq_len=32))\n"
        "out = []\n"
        "for rank in range(pp):\n"
        "    dist.init_process_group('fake', rank=rank, world_size=pp, store=FakeStore())\n"
        "    class Mesh:\n"
        "        def get_local_rank(self): return rank\n"
        "        def size(self): return pp\n"
        "        def get_group(self, name=None): return dist.group.WORLD\n"
        "    stages, models = pipeline_module_split(m, Mesh(), schedule, torch.device('cpu'), parts)\n"
        "    out.append([[s.stage_index, [int(k) for k in c.layers.keys()], c.tok_embeddings is not None,\n"
        "                 c.output is not None] for s, c in zip(stages, models)])\n"
        "    dist.destroy_process_group()\n"
        "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code, json.dumps([parts, pp, cfg.parallelism.pipeline_parallel_schedule])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = [int(n) for n in stage_blocks(32, pp, vpp)]
    starts = [sum(counts[:v]) for v in range(len(counts))]
    for pp_rank, got in enumerate(json.loads(r.stdout.strip().splitlines()[-1])):
        assert [g[0] for g in got] == list(range(pp_rank, pp * vpp, pp))
        for v, layers, emb, out in got:
            assert layers == list(range(starts[v], starts[v] + counts[v])) and emb == (v == 0) and out == (v == pp * vpp - 1)


def test_torchtitan_custom_shape_is_the_planned_one(tmp_path, model_yaml):
    need("torchtitan.config")
    from torchtitan.models.llama3.model.model import FeedForward

    path = model_yaml("swiglu-small", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2, ffn_hidden=704, vocab=512,
                      mlp="swiglu", norm="rmsnorm", position="rope")
    m = load_model(str(path))
    plan = Plan(1, 2, 2, 2, "yzx", 1, False)
    write_framework_dir(tmp_path / "c", "torchtitan", plan, m, Job(8, 16, 64), load_profile("dgx-h100"),
                        framework_execution("torchtitan"), str(path))
    cfg, dims = titan_config(tmp_path / "c")
    from torchtitan.models.llama3 import llama3_args

    a = llama3_args[cfg.model.flavor]
    assert cfg.model.flavor == "axoplan"
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (256, 4, 8, 2, 512)
    import torch

    with torch.device("meta"):
        ff = FeedForward(a.dim, 4 * a.dim, a.multiple_of, a.ffn_dim_multiplier)
    assert ff.w1.out_features == 704  # torchtitan's own FeedForward comes out at the planned ffn


def test_torchtitan_flavours_are_the_presets():
    need("torchtitan.config")
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import FeedForward

    from axoplan.loop.emit_torchtitan import FLAVORS

    import torch

    for preset, flavor in FLAVORS.items():
        m, a = load_model(preset), llama3_args[flavor]
        with torch.device("meta"):  # the shapes, without the 405B's gigabytes
            ff = FeedForward(a.dim, 4 * a.dim, a.multiple_of, a.ffn_dim_multiplier).w1.out_features
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, ff) == (m.hidden, m.n_layers, m.n_heads, m.kv_heads,
                                                                    m.ffn), preset


# ---- Megatron-LM -------------------------------------------------------------------------------------
def megatron_words(folder: Path) -> list[str]:
    """The arguments exactly as bash passes them to pretrain_gpt.py."""
    r = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n" "${MEGATRON_ARGS[@]}"', "_",
                        str(folder / "megatron_args.sh")], capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


def megatron_configs(words: list[str], world: int):
    """megatron.core's config objects from pretrain_gpt.py's arguments, the way Megatron-LM builds them
    (megatron/training/arguments.py, which megatron-core's wheel lacks): an argument whose name is a config
    field's becomes that field, plus Megatron-LM's translations (docs/frameworks.md lists them)."""
    need("megatron.core")
    import torch
    import torch.nn.functional as F
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    ns, i = {}, 0
    while i < len(words):
        assert words[i].startswith("--"), words[i]
        name, vals = words[i][2:].replace("-", "_"), []
        while i + 1 < len(words) and not words[i + 1].startswith("--"):
            vals.append(words[i + 1])
            i += 1
        assert name not in ns, f"{words[i]} given twice"
        ns[name] = vals[0] if vals else True
        i += 1

    def typed(v):  # argparse's type=int / type=float of these arguments
        if isinstance(v, bool):
            return v
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
        return v

    def fields_of(cls, extra=()):
        return {f.name: typed(ns[f.name]) for f in dataclasses.fields(cls) if f.name in ns and f.name not in extra}

    kw = fields_of(TransformerConfig, extra=("attention_backend",))
    dtype = torch.bfloat16 if ns.get("bf16") else torch.float32
    kw.update(params_dtype=dtype, pipeline_dtype=dtype, bf16=bool(ns.get("bf16")))
    if ns.get("swiglu"):
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    if not ns.get("group_query_attention"):
        kw.pop("num_query_groups", None)
    if "num_layers_per_virtual_pipeline_stage" in ns:
        kw["virtual_pipeline_model_parallel_size"] = (int(ns["num_layers"]) // int(ns["pipeline_model_parallel_size"])
                                                      // int(ns["num_layers_per_virtual_pipeline_stage"]))
    if "pipeline_model_parallel_layout" in ns:  # Megatron-LM's vpp: the layout's stages over pp
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        v = (PipelineParallelLayerLayout.get_num_stages_from_str(ns["pipeline_model_parallel_layout"])
             // int(ns["pipeline_model_parallel_size"]))
        kw["virtual_pipeline_model_parallel_size"] = v if v > 1 else None
    if "attention_backend" in ns:
        kw["attention_backend"] = AttnBackend[ns["attention_backend"]]
    tc = TransformerConfig(**kw)
    mp = ModelParallelConfig(**{k: v for k, v in kw.items() if k in {f.name for f in dataclasses.fields(ModelParallelConfig)}})
    ddp = DistributedDataParallelConfig(**fields_of(DistributedDataParallelConfig))
    # Megatron-LM's validate_args: the data-parallel size and the batch it must divide
    dp = world // (tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size)
    assert dp * tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size == world
    assert int(ns["global_batch_size"]) % (int(ns["micro_batch_size"]) * dp) == 0
    return tc, mp, ddp, dp, ns


def test_megatron_end_to_end(tmp_path, capsys):
    row = best("megatron")
    out, _ = emit(tmp_path, capsys, "megatron")
    tc, mp, ddp, dp, ns = megatron_configs(megatron_words(out), 16)
    assert (mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, dp) == (row.gy, row.pp, row.gdata)
    assert row.gx == 1 and row.gz == 1
    assert int(ns["micro_batch_size"]) == row.micro_batch and int(ns["global_batch_size"]) == 64
    assert (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups, tc.ffn_hidden_size) == (
        32, 4096, 32, 8, 14336)
    assert tc.sequence_parallel == (row.gy > 1) and ddp.use_distributed_optimizer  # megatron-core's execution
    assert tc.recompute_granularity == (None if not row.checkpointing else tc.recompute_granularity)
    got = read_back(out, "megatron_lm_example.log", "slurm-4242.out", capsys)
    assert got["measured_time_s"] == pytest.approx(2.1) and got["log_format"] == "megatron"


def test_megatron_pipeline_sizes(tmp_path):
    plan = Plan(1, 4, 1, 2, "yzx", 2, True, pp=2, vpp=4, schedule="interleaved-1f1b")
    _direct("megatron", plan, tmp_path / "pp")
    tc, mp, ddp, dp, ns = megatron_configs(megatron_words(tmp_path / "pp"), 16)
    assert (mp.tensor_model_parallel_size, mp.pipeline_model_parallel_size, mp.virtual_pipeline_model_parallel_size,
            dp) == (4, 2, 4, 2)
    assert tc.recompute_granularity == "selective" or tc.recompute_granularity == "full"


@pytest.mark.parametrize("model,pp,vpp", [("llama3-405b", 16, 1), ("llama3-8b", 3, 1), ("llama3-8b", 3, 2)])
def test_megatron_places_the_planned_uneven_split(tmp_path, model, pp, vpp):
    """Layers that do not divide by pp x vpp (Llama 3 405B's 126 on 16 stages): megatron-core's own layout parser
    gives every (pipeline rank, virtual stage) the blocks the planner's split gives it (pipeline.stage_blocks,
    virtual stage v on rank v mod pp), the embedding on the first and the loss on the last."""
    from axoplan.planner.pipeline import stage_blocks

    plan = Plan(1, 2, 1, 1, "yzx", 1, True, pp=pp, vpp=vpp, schedule="interleaved-1f1b" if vpp > 1 else "1f1b")
    m, _ = _direct("megatron", plan, tmp_path / "pp", model=model, global_batch=2 * pp)
    w = megatron_words(tmp_path / "pp")
    assert "--pipeline-model-parallel-layout" in w and "--num-layers-per-virtual-pipeline-stage" not in w
    tc, mp, ddp, dp, ns = megatron_configs(w, plan.gpus)
    from megatron.core.transformer.enums import LayerType

    lay = tc.pipeline_model_parallel_layout
    got = [[row.count(LayerType.decoder) for row in lay.layout[r]] for r in range(pp)]
    want = stage_blocks(m.n_layers, pp, vpp)
    assert got == [[int(want[v * pp + r]) for v in range(vpp)] for r in range(pp)]
    assert lay.flatten_layout[0] == LayerType.embedding and lay.flatten_layout[-1] == LayerType.loss
    assert (mp.virtual_pipeline_model_parallel_size or 1) == vpp


def test_megatron_core_plans_llama3_405b_on_16_stages():
    """126 layers on 16 stages, as Llama 3 405B trained: the megatron-core execution plans it (its layout places
    the split); megatron-lm, Megatron as Korthikanti et al. ran it, still needs them divisible."""
    import axoplan

    s = axoplan.explain("llama3-405b", "dgx-h100", 16384, 2048, (1, 8, 1, 128), pp=16, seq_len=8192, micro_batch=1,
                        checkpointing=True, execution="megatron-core").summary.iloc[0]
    assert bool(s["feasible"]), s["reason"]
    e = axoplan.explain("llama3-405b", "dgx-h100", 16384, 2048, (1, 8, 1, 128), pp=16, seq_len=8192, micro_batch=1,
                        checkpointing=True, execution="megatron-lm").summary.iloc[0]
    assert not bool(e["feasible"]) and "divisible" in e["reason"]


def test_megatron_arguments_without_the_package(tmp_path):
    """What the writer puts in, read back by bash, whether or not megatron-core is installed."""
    plan = Plan(1, 2, 1, 4, "yzx", 1, True, pp=2, vpp=1, schedule="1f1b")
    _direct("megatron", plan, tmp_path / "pp")
    w = megatron_words(tmp_path / "pp")
    assert w[w.index("--tensor-model-parallel-size") + 1] == "2"
    assert w[w.index("--pipeline-model-parallel-size") + 1] == "2"
    assert "--num-layers-per-virtual-pipeline-stage" not in w and "--sequence-parallel" in w


@pytest.mark.parametrize("model", ["llama3-8b", "gpt-20b"])
def test_megatron_launches_the_planned_model_untied_and_without_biases(tmp_path, model):
    """The planned model has an untied LM head and bias-free linears whatever its positions; Megatron ties the
    embedding to the head and adds biases unless told, so a learned-position GPT is told too."""
    plan = Plan(1, 2, 1, 4, "yzx", 1, True)
    _direct("megatron", plan, tmp_path / model, model=model)
    w = megatron_words(tmp_path / model)
    assert "--untie-embeddings-and-output-weights" in w and "--disable-bias-linear" in w
    assert ("--position-embedding-type" in w) == (load_model(model).position == "rope")


@pytest.mark.parametrize("order,megatron_order", [("yzx", "tp-cp-ep-dp-pp"), ("yzxp", "tp-cp-ep-pp-dp")])
def test_megatrons_own_rank_groups_are_the_planned_placement(tmp_path, order, megatron_order):
    """The pipeline outermost, or just inside data with --use-tp-pp-dp-mapping: megatron.core's RankGenerator with
    the order the arguments select gives the tensor, data and pipeline groups the planner's strides name."""
    import numpy as np

    from axoplan.planner.space import PLACEMENTS, strides

    plan = Plan(1, 2, 1, 2, order, 1, False, pp=4, vpp=1, schedule="1f1b")
    _direct("megatron", plan, tmp_path / "pp")
    assert ("--use-tp-pp-dp-mapping" in megatron_words(tmp_path / "pp")) == ("p" in order)
    need("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order=megatron_order)
    sx, sy, sz, sd, sp = (int(v[0]) for v in strides(np.array([1]), 2, 1, 2, np.array([PLACEMENTS.index(order)]), 4))
    world = 16

    def groups(stride, size):
        starts = sorted({r - (r // stride % size) * stride for r in range(world)})
        return sorted([s + i * stride for i in range(size)] for s in starts)

    assert sorted(gen.get_ranks("tp")) == groups(sy, 2)
    assert sorted(gen.get_ranks("dp")) == groups(sd, 2)
    assert sorted(gen.get_ranks("pp")) == groups(sp, 4)


def test_megatron_refuses_a_pipeline_it_cannot_place():
    import axoplan

    s = axoplan.explain("gpt-20b", "dgx-a100", 64, 64, (1, 8, 1, 2), pp=4, order="pyxz", execution="megatron-core").summary.iloc[0]
    assert not s["feasible"] and "the pipeline axis outermost or just inside data" in s["reason"]
    assert axoplan.explain("gpt-20b", "dgx-a100", 64, 64, (1, 8, 1, 2), pp=4, order="yxzp",
                           execution="megatron-core").summary.iloc[0]["feasible"]


# ---- AxoNN -------------------------------------------------------------------------------------------
def axonn_entry(folder: Path):
    spec = importlib.util.spec_from_file_location("axoplan_emitted_axonn", folder / "train_axonn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # reads axonn_plan.json; main() (CUDA) is not run
    return mod


def test_axonn_end_to_end(tmp_path, capsys):
    need("axonn")
    from axonn import axonn as ax
    from axonn.intra_layer import optimize_communication

    row = best("axonn")
    out, _ = emit(tmp_path, capsys, "axonn")
    entry = axonn_entry(out)
    kw = entry.init_kwargs()
    inspect.signature(ax.init).bind(**kw)  # AxoNN 0.2.0's own signature takes exactly these
    assert (kw["G_intra_c"], kw["G_intra_r"], kw["G_intra_d"], kw["G_data"], kw["G_inter"]) == (
        row.gx, row.gy, row.gz, row.gdata, 1)
    assert kw["gpus_per_node"] == 8
    ck = entry.comm_kwargs(object())
    inspect.signature(optimize_communication).bind(**ck)
    assert ck["overlap_all_reduce"] and ck["overlap_reduce_scatter"] and ck["overlap_all_gather"]
    plan = entry.PLAN
    assert plan["micro_batch"] == row.micro_batch and plan["micro_batch"] % (row.gx * row.gy) == 0
    assert plan["grad_acc"] == 64 // (row.gdata * row.gz * row.micro_batch)
    got = read_back(out, "axoplan_metrics_example.jsonl", "train.log", capsys)
    assert got["measured_time_s"] == pytest.approx(1.0) and got["log_format"] == "axoplan"


def test_axonn_grid_mapping_without_the_package(tmp_path):
    """X is AxoNN's column group, Y its row group, Z its depth group (axonn-facts.md), whatever the sizes."""
    plan = Plan(2, 4, 1, 2, "xyz", 8, False)
    _direct("axonn", plan, tmp_path / "a")
    kw = axonn_entry(tmp_path / "a").init_kwargs()
    assert (kw["G_intra_c"], kw["G_intra_r"], kw["G_intra_d"], kw["G_data"], kw["G_inter"]) == (2, 4, 1, 2, 1)
    compile((tmp_path / "a" / "train_axonn.py").read_text(), "train_axonn.py", "exec")


# ---- what a framework cannot express -----------------------------------------------------------------
@pytest.mark.parametrize("execution", [[], ["-e", "torchtitan"], ["-e", "megatron-core"]])
def test_a_pipeline_the_framework_cannot_run_is_named_by_the_framework(tmp_path, capsys, execution):
    """AxoNN's writer has no pipeline stages: whichever execution plans the run, the error names the framework
    (the planned execution takes its pipeline from it), not the execution, and the ways out."""
    m, p, g, b = JOB
    for extra in (["--pp", "2"], ["--pp", "2", "--vpp", "2"]):
        code, _, err = run_cli(["emit", "-m", m, "-p", p, "-g", str(g), "-b", str(b), "--framework", "axonn",
                                "--out", str(tmp_path / "x"), *execution, *extra], capsys)
        one_sentence(code, err)
        assert "--framework axonn runs no pipeline; choose --pp 1 or a framework that does (axoplan, torchtitan, " \
               "megatron)" in err, err
        assert not (tmp_path / "x").exists()


def test_what_a_framework_cannot_express_is_one_error(tmp_path, capsys):
    m, p, g, b = JOB
    base = ["emit", "-m", m, "-p", p, "-g", str(g), "-b", str(b), "--out", str(tmp_path / "x")]
    for fw, extra, words in (("torchtitan", ["--grid", "2,2,2,2"], "gx"), ("megatron", ["--grid", "2,2,1,4"], "gx"),
                             ("megatron", ["--grid", "1,2,4,2"], "gz"), ("axonn", ["--pp", "2"], "pipeline"),
                             ("axonn", ["--grid", "1,2,1,8", "--micro-batch", "1"], "micro-batch")):
        code, _, err = run_cli(base + ["--framework", fw, *extra], capsys)
        one_sentence(code, err)
        assert words in err, err
    code, _, err = run_cli(["emit", "-m", "gpt-tiny", "-p", p, "-g", "8", "-b", "16", "--framework", "torchtitan",
                            "--out", str(tmp_path / "y")], capsys)
    one_sentence(code, err)
    assert "SwiGLU" in err
    plan = Plan(1, 2, 2, 2, "xyz", 1, False, pp=2, vpp=1, schedule="interleaved-1f1b")
    with pytest.raises(Exception, match="vpp >= 2"):
        _direct("torchtitan", plan, tmp_path / "z")
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()  # nothing half-written


def test_a_plan_rank_would_refuse_is_refused_by_emit_with_ranks_sentence(tmp_path):
    """emit's check applies the planner's own rules (batch.plan_rules), so a plan written by hand that rank would
    never list is refused in rank's words before any file is written: too few micro-batches for the pipeline, a
    Y split that does not divide the heads, more virtual stages than blocks."""
    for fw, plan, batch, words in (
            ("torchtitan", Plan(1, 2, 1, 2, "xyz", 8, False, pp=4), 32,
             "1f1b over pp=4 stages needs at least 4 micro-batches, the step has 2"),
            ("megatron", Plan(1, 16, 1, 1, "xyz", 1, False), 64, "8 KV heads are not divisible by gy=16"),
            ("megatron", Plan(1, 1, 1, 1, "xyz", 1, False, pp=8, vpp=8, schedule="interleaved-1f1b"), 64,
             "pp=8 x vpp=8 virtual stages are more than the model's 32 blocks")):
        out = tmp_path / f"{fw}-{plan.pp}-{plan.gy}"
        with pytest.raises(UserError, match=re.escape(words)):
            _direct(fw, plan, out, global_batch=batch)
        assert not out.exists()


def test_rank_execution_ranks_only_what_the_framework_runs():
    m, p, g, b = JOB
    for ex, bad in (("megatron-core", lambda r: r.gx > 1 or r.gz > 1), ("torchtitan", lambda r: r.gx > 1),
                    ("axonn", lambda r: r.micro_batch % (r.gx * r.gy) != 0)):
        df = rank(m, p, g, b, execution=ex, include_infeasible=True, pp=1)
        feas = df[df["feasible"].astype(bool)]
        assert len(feas) and not any(bad(r) for r in feas.itertuples()), ex
        assert any(ex in str(why) for why in df["reason"]), ex  # the others say why
    tt = rank(m, p, g, b, execution="torchtitan", pp=1)
    assert all(o == "yzx" or r_gx == 1 for o, r_gx in zip(tt["order"], tt["gx"]))


# ---- the launchers -----------------------------------------------------------------------------------
def test_slurm_scripts_are_what_admins_accept(tmp_path, capsys, write_profile):
    from conftest import profile_dict

    d = profile_dict(name="site", gpus_per_node=4)
    d["launch"] = {"slurm": {"account": "proj123", "qos": "regular", "constraint": "gpu&hbm80g", "partition": "gpu"},
                   "source": "site docs"}
    site = write_profile(raw=d, name="site")
    for fw in ("axoplan", "torchtitan", "megatron", "axonn"):
        out = tmp_path / f"s-{fw}"
        model = "llama3-8b" if fw != "axoplan" else "gpt-tiny"
        code, _, err = run_cli(["emit", "-m", model, "-p", str(site), "-g", "8", "-b", "16", "--framework", fw,
                                "--out", str(out)], capsys)
        assert code == 0, err
        s = (out / "launch_slurm.sbatch").read_text()
        for line in ("#SBATCH --exclusive", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                     "#SBATCH --account=proj123", "#SBATCH --qos=regular", "#SBATCH --constraint=gpu&hbm80g",
                     "#SBATCH --partition=gpu", "trap requeue USR1", 'scontrol requeue "$SLURM_JOB_ID"',
                     '--cpus-per-task="$CPUS_PER_TASK"', "--gpu-bind="):
            assert line in s, (fw, line)
        assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in s  # the interpreter that ran emit, overridable
        assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in (out / "launch_torchrun.sh").read_text()
        for f in ("launch_slurm.sbatch", "launch_torchrun.sh"):
            subprocess.run(["bash", "-n", str(out / f)], check=True)
    if shutil.which("shellcheck"):
        files = [str(p) for p in tmp_path.glob("s-*/launch_*")]
        r = subprocess.run(["shellcheck", "-s", "bash", *files], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


def test_the_batch_script_requeues_on_slurms_signal(tmp_path, capsys):
    """Run the emitted sbatch with stub srun (a long step) and scontrol; USR1 to the batch shell, as
    `--signal=B:USR1@120` sends it, must end in `scontrol requeue <job id>`."""
    out, _ = emit(tmp_path, capsys, "megatron")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "scontrol").write_text('#!/bin/sh\nif [ "$1" = requeue ]; then echo "requeue $2" >> "$STUB_OUT"; '
                                    'else echo node0; fi\n')
    (stubs / "srun").write_text("#!/bin/sh\nexec sleep 30\n")
    for s in stubs.iterdir():
        s.chmod(0o755)
    rec = tmp_path / "rec.txt"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "777",
           "STUB_OUT": str(rec), "MEGATRON_LM": str(tmp_path)}
    proc = subprocess.Popen(["bash", str(out / "launch_slurm.sbatch")], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert rec.read_text().split() == ["requeue", "777"]


def test_a_run_folder_can_be_moved(tmp_path, capsys):
    """The profile (with its measured tables) and a model file are copied in and named relatively."""
    from axoplan.runconfig import load_config

    model = tmp_path / "mine.yaml"
    model.write_text(yaml.safe_dump(dict(name="mine", n_layers=2, hidden=64, n_heads=8, vocab=256, seq_len=64,
                                         vocab_multiple=64)))
    out = tmp_path / "a"
    code, _, err = run_cli(["emit", "-m", str(model), "-p", "localhost-cpu", "-g", "4", "-b", "8", "--out", str(out)],
                           capsys)
    assert code == 0, err
    raw = yaml.safe_load((out / "config.yaml").read_text())
    assert raw["machine"] == "machine.yaml" and raw["model"] == "model.yaml"
    moved = tmp_path / "elsewhere" / "b"
    moved.parent.mkdir()
    out.rename(moved)
    model.unlink()
    cfg = load_config(moved / "config.yaml")
    p = load_profile(cfg.machine)
    assert Path(cfg.machine).parent == moved.resolve() and p.gemm_table is not None
    assert p.gpus_per_node == load_profile("localhost-cpu").gpus_per_node
    assert load_model(cfg.model).name == "mine"


# ---- the log formats ---------------------------------------------------------------------------------
def test_log_readers_follow_the_frameworks_formats():
    meg = (DATA / "megatron_lm_example.log").read_text()
    assert run_logs.megatron_steps(meg)[2] == (3, pytest.approx(2.1))
    newer = " [2026-12-01 10:00:00] iteration        5/      10 | consumed samples: 320 | elapsed time per iteration (ms): 1500.0/1400.0 |"
    assert run_logs.megatron_steps(newer) == [(5, pytest.approx(1.5))]
    tt = (DATA / "torchtitan_example.log").read_text()
    steps = run_logs.torchtitan_steps(tt, 64 * 8192, 16)
    assert len(steps) == 7 and steps[0][0] == 1  # the validation line is not a step
    assert run_logs.measured(tt, 64 * 8192, 16).seconds == pytest.approx(2.0)
    assert run_logs.measured("nothing here").seconds is None


def test_the_torchrun_launchers_start_the_frameworks_entry_points(tmp_path, capsys):
    """Each launcher with a stub interpreter: torchrun's options, the framework's entry point and its files,
    the output appended to train.log; Megatron's says, in one line, that it needs MEGATRON_LM."""
    stub = tmp_path / "py"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "NNODES": "1", "NPROC_PER_NODE": "16"}
    for fw, expect in (("torchtitan", ["-m", "torchtitan.train", "--job.config_file"]),
                       ("megatron", ["--tensor-model-parallel-size", "--micro-batch-size"]),
                       ("axonn", ["train_axonn.py"])):
        out, _ = emit(tmp_path, capsys, fw)
        extra = {"MEGATRON_LM": str(tmp_path)} if fw == "megatron" else {}
        r = subprocess.run(["bash", str(out / "launch_torchrun.sh")], env={**env, **extra}, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        words = r.stdout.splitlines()
        assert words[:3] == ["-m", "torch.distributed.run", "--standalone"] and "16" in words
        assert all(any(e in w for w in words) for e in expect), (fw, words)
        assert (out / "train.log").read_text() == r.stdout
        if fw == "megatron":
            assert f"{tmp_path}/pretrain_gpt.py" in words
            r = subprocess.run(["bash", str(out / "launch_torchrun.sh")], env=env, capture_output=True, text=True)
            assert r.returncode == 2 and r.stderr.startswith("error: set MEGATRON_LM") and r.stderr.count("\n") == 1
