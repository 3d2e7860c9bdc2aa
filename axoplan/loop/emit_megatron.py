"""A planned candidate as a Megatron-LM run: megatron_args.sh, the arguments of Megatron-LM's pretrain_gpt.py, which
the launchers start from $MEGATRON_LM (a Megatron-LM checkout of the branch core_r0.16.0, the source of
megatron-core 0.16.1 on PyPI, whose config classes the tests build from these arguments).

Megatron-LM turns its arguments into megatron.core's config dataclasses field by field, an argument whose
name is a field's name becoming that field (megatron/training/arguments.py, core_transformer_config_from_args),
with a few translations; tests/test_frameworks.py does the same (documented in docs/frameworks.md). Its
process groups nest tp innermost, then cp, dp, pp ('tp-cp-ep-dp-pp', megatron/core/parallel_state.py), or with
the pipeline just inside data (an order with p last, e.g. yzxp) pp before dp: --use-tp-pp-dp-mapping ('tp-cp-ep-pp-dp').
"""
from __future__ import annotations

from axoplan.loop.frameworks import Emitted, cannot, split_text
from axoplan.shell import quote

NAME = "Megatron-LM"
VERSION = "Megatron-LM core_r0.16.0 (megatron-core 0.16.1)"
ARGS_NAME = "megatron_args.sh"
# its --pipeline-model-parallel-layout (megatron-core 0.13 on) places any split of the layers over the stages
UNEVEN_STAGES = True


def layout(plan, n_layers: int) -> str | None:
    """Megatron-Core's --pipeline-model-parallel-layout for the planner's split (pipeline.stage_blocks) where the
    layers do not divide by pp x vpp: the (virtual) stages in layer order, 'E' the embedding on the first, 't*N' its
    N decoder layers, 'L' the LM head and loss on the last (megatron/core/transformer/pipeline_parallel_layer_layout.py,
    whose virtual stage v runs on pipeline rank v mod pp, as the planner's); None where the layers divide evenly."""
    counts = plan.uneven_stages(n_layers)
    return None if counts is None else "E" + "|".join(f"t*{n}" for n in counts) + "L"


def arguments(plan, model, job, profile, execution, steps: int = 10) -> list[tuple[str, list[str], str]]:
    """(flag, values, why) of every argument, in the order written."""
    a: list[tuple[str, list[str], str]] = []

    def add(flag, *values, why=""):
        a.append((flag, [str(v) for v in values], why))

    add("--tensor-model-parallel-size", plan.gy, why="gy")
    add("--pipeline-model-parallel-size", plan.pp, why="pp")
    if plan.pp > 1 and "p" in plan.order and plan.gdata > 1:
        add("--use-tp-pp-dp-mapping", why=f"order {plan.order}: the pipeline inside data (ranks tp-cp-ep-pp-dp)")
    uneven = layout(plan, model.n_layers)
    if uneven:
        add("--pipeline-model-parallel-layout", uneven,
            why=f"{model.n_layers} layers over pp x vpp = {plan.pp} x {plan.vpp} stages, the first "
                f"{model.n_layers % (plan.pp * plan.vpp)} taking one more"
                + (": the interleaved 1F1B schedule" if plan.vpp > 1 else ""))
    elif plan.vpp > 1:
        add("--num-layers-per-virtual-pipeline-stage", plan.layers_per_stage(model.n_layers),
            why=f"vpp={plan.vpp}: the interleaved 1F1B schedule")
    if execution.sequence_parallel and plan.gy > 1:  # Megatron refuses sequence parallelism without TP
        add("--sequence-parallel", why="norms and dropout split over the tensor-parallel ranks")
    if execution.optimizer_sharding == "data-parallel":
        add("--use-distributed-optimizer", why="optimizer states split over the data-parallel ranks")
    if execution.overlap_grad_reduce and plan.gdata > 1:
        add("--overlap-grad-reduce", why="the D gradient reduction beside the backward")
    if execution.overlap_param_gather and plan.gdata > 1 and execution.optimizer_sharding == "data-parallel":
        add("--overlap-param-gather", why="the D weight all-gather beside the next forward")
    if execution.tp_comm_overlap and plan.gy > 1 and execution.sequence_parallel:
        add("--tp-comm-overlap", why="tensor-parallel collectives pipelined with their GEMMs (Transformer Engine)")
    if plan.checkpointing:
        if execution.recompute == "full":
            add("--recompute-granularity", "full", why="each block's forward recomputed")
            add("--recompute-method", "uniform")
            add("--recompute-num-layers", 1)
        elif execution.recompute == "attention-core":
            add("--recompute-granularity", "selective", why="the attention core recomputed (Korthikanti et al.)")
        else:
            cannot(NAME, f"it has no '{execution.recompute}' recomputation (full or selective)")
    add("--micro-batch-size", plan.micro_batch)
    add("--global-batch-size", job.global_batch)
    add("--num-layers", model.n_layers)
    add("--hidden-size", model.hidden)
    add("--num-attention-heads", model.n_heads)
    if model.kv_heads != model.n_heads:
        add("--group-query-attention")
        add("--num-query-groups", model.kv_heads)
    add("--ffn-hidden-size", model.ffn)
    add("--seq-length", job.seq_len)
    add("--max-position-embeddings", max(job.seq_len, model.seq_len))
    if model.mlp == "swiglu":
        add("--swiglu")
    if model.norm == "rmsnorm":
        add("--normalization", "RMSNorm")
    if model.position == "rope":
        add("--position-embedding-type", "rope")
    # every ModelSpec has an untied LM head and bias-free linears (planner/specs.py); Megatron ties and adds biases
    # unless told, which would launch another model than the one planned
    add("--untie-embeddings-and-output-weights")
    add("--disable-bias-linear")
    add("--make-vocab-size-divisible-by", model.vocab_multiple)
    add("--attention-backend", "flash" if execution.attention == "flash" else "unfused")
    if not execution.dropout:
        add("--attention-dropout", 0)
        add("--hidden-dropout", 0)
    if profile.dtype_bytes == 2:
        add("--bf16")
    add("--train-iters", steps)
    add("--log-interval", 1, why="a log line per iteration: axoplan validate --collect reads them")
    add("--lr", "3.0e-4")
    add("--min-lr", "3.0e-5")
    add("--lr-decay-style", "cosine")
    add("--lr-warmup-iters", max(1, min(200, steps // 5)))
    add("--weight-decay", 0.1)
    add("--clip-grad", 1.0)
    add("--adam-beta1", 0.9)
    add("--adam-beta2", 0.95)
    add("--mock-data", why="SET your data: replace by --data-path PREFIX and a tokenizer")
    add("--tokenizer-type", "NullTokenizer")
    add("--vocab-size", model.vocab)
    add("--save", "checkpoint", why="a requeued run resumes from here")
    add("--load", "checkpoint")
    add("--save-interval", max(steps, 500))
    return a


def args_script(args) -> str:
    lines = ["# axoplan: the arguments of Megatron-LM's pretrain_gpt.py for the planned candidate; the launchers",
             f"# source this file and run: torchrun ... \"$MEGATRON_LM/pretrain_gpt.py\" \"${{MEGATRON_ARGS[@]}}\" ({VERSION})",
             "# shellcheck disable=SC2034  # used by the launchers",
             "MEGATRON_ARGS=("]
    for flag, values, why in args:
        words = " ".join([flag, *(quote(v, f"the value of {flag}") for v in values)])
        lines.append(f"  {words}" + (f"  # {why}" if why else ""))
    return "\n".join(lines + [")"]) + "\n"


def write(plan, model, job, profile, execution, steps: int = 10) -> Emitted:
    args = arguments(plan, model, job, profile, execution, steps)
    uneven = plan.uneven_stages(model.n_layers)
    mapping = [f"gy={plan.gy} -> --tensor-model-parallel-size",
               f"pp={plan.pp} -> --pipeline-model-parallel-size"
               + (f", {split_text(uneven)} -> --pipeline-model-parallel-layout" if uneven else
                  f", vpp={plan.vpp} -> --num-layers-per-virtual-pipeline-stage {plan.layers_per_stage(model.n_layers)}"
                  if plan.vpp > 1 else ""),
               f"gdata={plan.gdata} -> the data-parallel size, which Megatron derives: GPUs / (tp x pp)",
               f"micro-batch {plan.micro_batch}, global batch {job.global_batch} -> --micro-batch-size, --global-batch-size",
               f"checkpointing {'on' if plan.checkpointing else 'off'} -> --recompute-granularity",
               f"execution {execution.name} -> sequence parallel, distributed optimizer and overlap flags",
               "gx and gz have no Megatron-LM equivalent (1D tensor parallelism, ZeRO-1 over D): both are 1"]
    return Emitted({ARGS_NAME: (args_script(args), 0o644)},
                   ['"$MEGATRON_LM/pretrain_gpt.py"', '"${MEGATRON_ARGS[@]}"'],
                   env=[("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                         "Megatron orders tensor-parallel communication before compute with one connection")],
                   required=[("MEGATRON_LM", "the folder of a Megatron-LM checkout (branch core_r0.16.0) holding "
                                             "pretrain_gpt.py")],
                   shell_lines=["# shellcheck source=/dev/null  # megatron_args.sh, beside this script",
                                f'source "$RUN_DIR/{ARGS_NAME}"',
                                'export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"'],
                   mapping=mapping)
