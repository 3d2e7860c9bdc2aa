"""A planned candidate as a torchtitan job: job.toml for torchtitan's JobConfig and, for a model that is not one of
torchtitan's Llama 3 flavours, a module registering its shape as the flavour 'axoplan'.

torchtitan 0.2.2 (PyPI; torchtitan/config/job_config.py and manager.py): `python -m torchtitan.train
--job.config_file job.toml`; ConfigManager reads the TOML into JobConfig and imports job.custom_config_module
(merging that module's JobConfig) before the trainer builds the model from
torchtitan.models.llama3.llama3_args[model.flavor]. The 0.3 series replaced the TOML by Python config
registries, hence the pin. Its device mesh nests pp, dp_replicate, dp_shard, cp, tp with tp innermost
(torchtitan/distributed/parallel_dims.py): Y innermost, then Z, then data.
"""
from __future__ import annotations

import json

from axoplan.loop.frameworks import Emitted, cannot, split_text

NAME = "torchtitan"
VERSION = "torchtitan 0.2.2"
TOML_NAME = "job.toml"
FLAVOR_MODULE = "axoplan_flavor"
# axoplan presets that are torchtitan's own Llama 3 flavours (torchtitan/models/llama3/__init__.py); the test
# checks each against torchtitan's shapes
FLAVORS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}
SCHEDULE_NAMES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}  # torch.distributed.pipelining names
# parallelism.module_fqns_per_model_part places any split of the layers over the (virtual) stages
UNEVEN_STAGES = True


def stage_modules(plan, n_layers: int) -> list[list[str]] | None:
    """torchtitan's parallelism.module_fqns_per_model_part for the planner's split (pipeline.stage_blocks) where
    the layers do not divide by pp x vpp: each (virtual) stage's modules in layer order, the embedding on the
    first, the final norm and the LM head on the last; torchtitan runs stage v on pipeline rank v mod pp
    (torchtitan/distributed/pipeline_parallel.py pipeline_module_split, 'loop' style), as the planner does.
    None where the layers divide evenly."""
    counts = plan.uneven_stages(n_layers)
    if counts is None:
        return None
    out, start = [], 0
    for v, n in enumerate(counts):
        names = [f"layers.{i}" for i in range(start, start + n)]
        start += n
        out.append((["tok_embeddings"] if v == 0 else []) + names + (["norm", "output"] if v == len(counts) - 1 else []))
    return out


def ffn_args(hidden: int, ffn: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) with which torchtitan's FeedForward (hidden = int(2 * 4H / 3), times the
    multiplier, rounded up to multiple_of) comes out at exactly ffn."""
    base = int(2 * 4 * hidden / 3)
    return ffn, (None if base <= ffn else ffn / base)


def _toml(sections: list[tuple[str, list[tuple[str, object, str]]]]) -> str:
    out = []
    for name, rows in sections:
        out.append(f"[{name}]")
        for key, value, why in rows:
            v = ("true" if value else "false") if isinstance(value, bool) else \
                json.dumps(value) if isinstance(value, (str, list)) else repr(value)
            out.append(f"{key} = {v}" + (f"  # {why}" if why else ""))
        out.append("")
    return "\n".join(out)


def _ac(plan, execution) -> list[tuple[str, object, str]]:
    if not plan.checkpointing:
        return [("mode", "none", "the plan keeps every activation")]
    if execution.recompute == "op-selective":
        return [("mode", "selective", "the plan's per-op selective recomputation"), ("selective_ac_option", "op", "")]
    if execution.recompute == "full":
        return [("mode", "full", "the plan recomputes each block's forward")]
    cannot(NAME, f"its activation checkpointing has no '{execution.recompute}' recomputation (full or op)")


def check_model(model) -> None:
    if (model.mlp, model.norm, model.position) != ("swiglu", "rmsnorm", "rope"):
        cannot(NAME, f"torchtitan trains its Llama 3 architecture (SwiGLU, RMSNorm, RoPE); {model.name} has a "
                     f"{model.mlp} MLP, {model.norm} and {model.position} positions")


def write(plan, model, job, profile, execution, steps: int = 10) -> Emitted:
    """job.toml (+ axoplan_flavor.py) and the torchrun command for one planned candidate."""
    check_model(model)
    flavor = FLAVORS.get(model.name, "axoplan")
    files = {}
    job_rows = [("dump_folder", "./outputs", "checkpoints and traces, inside the run folder"),
                ("description", f"axoplan plan: {model.name} pp={plan.pp} gx={plan.gx} gy={plan.gy} gz={plan.gz} "
                                f"gdata={plan.gdata}", "")]
    if flavor == "axoplan":
        job_rows.append(("custom_config_module", FLAVOR_MODULE, f"registers the flavour 'axoplan' ({FLAVOR_MODULE}.py)"))
        mult_of, mult = ffn_args(model.hidden, model.ffn)
        args = (f"dim={model.hidden}, n_layers={model.n_layers}, n_heads={model.n_heads}, "
                f"n_kv_heads={model.kv_heads}, vocab_size={model.vocab}, multiple_of={mult_of}, "
                f"ffn_dim_multiplier={mult!r}, rope_theta=500000")
        files[f"{FLAVOR_MODULE}.py"] = (
            f'"""axoplan: {model.name}\'s shape as torchtitan\'s llama3 flavour \'axoplan\' ({VERSION} imports\n'
            'job.custom_config_module before it builds the model; multiple_of and ffn_dim_multiplier give its\n'
            f'FeedForward exactly {model.ffn} hidden units)."""\n'
            "from dataclasses import dataclass\n\n"
            "from torchtitan.models.llama3 import TransformerModelArgs, llama3_args\n\n"
            f"llama3_args[\"axoplan\"] = TransformerModelArgs({args})\n\n\n"
            "@dataclass\nclass JobConfig:\n    \"\"\"No settings of its own: torchtitan merges it into its JobConfig.\"\"\"\n",
            0o644)
    dp = plan.gdata * plan.gz
    if plan.pp > 1:
        # one pipeline pass per step: the slot's whole batch, cut into micro-batches of the plan's size
        local, accum_note = job.global_batch // dp, "the (data, z) slot's batch, split into pipeline micro-batches"
    else:
        local, accum_note = plan.micro_batch, "the plan's micro-batch; torchtitan accumulates to the global batch"
    half = profile.dtype_bytes == 2
    par = [("data_parallel_replicate_degree", plan.gdata, "gdata"),
           ("data_parallel_shard_degree", plan.gz, "gz: FSDP over Z"),
           ("tensor_parallel_degree", plan.gy, "gy"),
           ("context_parallel_degree", 1, ""),
           ("pipeline_parallel_degree", plan.pp, "pp"),
           ("fsdp_reshard_after_forward", "always" if execution.reshard_after_forward else "never",
            "the plan's Z weights freed after their forward" if execution.reshard_after_forward else
            "the plan keeps Z-gathered weights to the backward")]
    uneven = stage_modules(plan, model.n_layers)
    if plan.pp > 1:
        par += [("pipeline_parallel_schedule", SCHEDULE_NAMES[plan.schedule], plan.schedule)]
        if uneven:
            par += [("module_fqns_per_model_part", uneven,
                     f"{model.n_layers} layers over pp x vpp = {plan.pp} x {plan.vpp} stages, the first "
                     f"{model.n_layers % (plan.pp * plan.vpp)} taking one more, as planned")]
        else:
            par += [("pipeline_parallel_layers_per_stage", plan.layers_per_stage(model.n_layers),
                     f"{model.n_layers} layers / (pp x vpp = {plan.pp} x {plan.vpp})"),
                    ("pipeline_parallel_first_stage_less_layers", 0, "equal stages, as planned"),
                    ("pipeline_parallel_last_stage_less_layers", 0, "")]
        par += [("pipeline_parallel_microbatch_size", plan.micro_batch, "the plan's micro-batch")]
    sections = [
        ("job", job_rows),
        ("model", [("name", "llama3", ""), ("flavor", flavor, model.name),
                   ("hf_assets_path", "./assets/tokenizer", "SET THIS: the folder of your tokenizer (HF files)")]),
        ("training", [("local_batch_size", local, accum_note),
                      ("global_batch_size", job.global_batch, "sequences per step"),
                      ("seq_len", job.seq_len, ""), ("steps", steps, ""),
                      ("dataset", "c4", "SET THIS (or dataset_path) to your data"),
                      ("mixed_precision_param", "bfloat16" if half else "float32", ""),
                      ("mixed_precision_reduce", "float32", "Z gradient reduce-scatter in fp32")]),
        ("parallelism", par),
        ("activation_checkpoint", _ac(plan, execution)),
        ("lr_scheduler", [("warmup_steps", max(1, min(200, steps // 5)), "")]),
        ("metrics", [("log_freq", 1, "a step line per step: axoplan validate --collect reads them"),
                     ("enable_tensorboard", False, "")]),
        ("checkpoint", [("enable", steps >= 1000, "resumes a requeued run (long runs only)"),
                        ("folder", "checkpoint", ""), ("interval", 500, "")]),
        ("compile", [("enable", False, "")]),
    ]
    header = (f"# axoplan: a planned candidate as a {VERSION} job (torchtitan/config/job_config.py): "
              f"python -m torchtitan.train --job.config_file {TOML_NAME}\n")
    files[TOML_NAME] = (header + _toml(sections), 0o644)
    mapping = [f"gdata={plan.gdata} -> parallelism.data_parallel_replicate_degree",
               f"gz={plan.gz} -> parallelism.data_parallel_shard_degree (FSDP)",
               f"gy={plan.gy} -> parallelism.tensor_parallel_degree (with sequence parallel norms)",
               f"pp={plan.pp} -> parallelism.pipeline_parallel_degree"
               + (f", schedule {SCHEDULE_NAMES[plan.schedule]}, "
                  + (f"{split_text(plan.uneven_stages(model.n_layers))} -> parallelism.module_fqns_per_model_part"
                     if uneven else
                     f"{plan.layers_per_stage(model.n_layers)} layers per stage") if plan.pp > 1 else ""),
               f"micro-batch {plan.micro_batch}, global batch {job.global_batch}, seq_len {job.seq_len} -> [training]",
               f"checkpointing {'on' if plan.checkpointing else 'off'} -> activation_checkpoint.mode",
               f"model {model.name} -> llama3 flavour {flavor}" + (f" ({FLAVOR_MODULE}.py)" if flavor == "axoplan" else ""),
               "gx has no torchtitan equivalent (1D tensor parallelism): it is 1"]
    return Emitted(files, ["-m", "torchtitan.train", "--job.config_file", f'"$RUN_DIR/{TOML_NAME}"'],
                   shell_lines=['export PYTHONPATH="$RUN_DIR${PYTHONPATH:+:$PYTHONPATH}"  # the flavour module'],
                   mapping=mapping)
