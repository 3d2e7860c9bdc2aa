"""A pipeline rank's memory beyond its blocks: the receive buffers torch.distributed.pipelining keeps per
micro-batch, the outputs and logits its forwards in flight keep, the other micro-batches' activations at the
embedding's backward, and the fp32 copy a completing reduce-scatter makes. Hand-computed against
memory.pipeline_buffers and memory.step_moments, and against the trainer traced (fake tensors, fake process
group)."""
import dataclasses

import numpy as np
import pytest

from conftest import tiny_model

from axoplan.planner import comm, schedule
from axoplan.planner.execution import AXOPLAN, PRESETS
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.memory import NORM_BWD_FP32_COPIES, PipelineBuffers, pipeline_buffers, step_moments
from axoplan.planner.pipeline import peak_in_flight
from axoplan.planner.space import Candidates
from axoplan.planner.specs import Job


def test_buffers_of_each_rank_of_a_1f1b_pipeline_by_hand():
    """pp 4, 8 micro-batches: 1F1B's rank i holds pp - i forwards at its peak. The first rank receives only
    gradients (one buffer per micro-batch), the last only activations (its one forward's input is one of
    them), a middle rank both; each non-last rank keeps its forwards' outputs, the last its one's logits."""
    flight = peak_in_flight("1f1b", 4, 1, 8)
    assert flight == ((4, 0, 0, 0), (0, 3, 0, 0), (0, 0, 2, 0), (0, 0, 0, 1))
    first, middle, last = (pipeline_buffers(AXOPLAN, 4, 1, r, 8, flight[r]) for r in (0, 1, 3))
    assert first == PipelineBuffers(recv=8, received_inputs=0, outputs=4, logits=0)
    assert middle == PipelineBuffers(recv=16, received_inputs=3, outputs=3, logits=0)
    assert last == PipelineBuffers(recv=8, received_inputs=1, outputs=0, logits=1)


def test_interleaved_ranks_buffer_each_virtual_stage():
    """pp 2, vpp 2 (virtual stages 0..3, rank 0 holds 0 and 2, rank 1 holds 1 and 3), 4 micro-batches:
    rank 0 receives gradients for 0 and 2 and activations for 2: 3 x 4 buffers."""
    flight = [3, 0, 2, 0]
    b = pipeline_buffers(AXOPLAN, 2, 2, 0, 4, flight)
    assert b == PipelineBuffers(recv=12, received_inputs=2, outputs=5, logits=0)
    b = pipeline_buffers(AXOPLAN, 2, 2, 1, 4, [0, 2, 0, 1])
    assert b == PipelineBuffers(recv=12, received_inputs=3, outputs=2, logits=1)


def test_megatron_keeps_no_buffers_beyond_its_inputs():
    assert pipeline_buffers(PRESETS["megatron-core"], 4, 1, 0, 8, (4, 0, 0, 0)) == PipelineBuffers()


def _moments(gz=1, norm="layernorm", **kw):
    """step_moments of the tiny model (hidden 64, vocab 256, 4h MLP) on gx = gy = 1, bf16, checkpointing off,
    reduce-scatters overlapped (at most 2 in flight)."""
    m = tiny_model(norm=norm)
    T, e = 128.0, 2
    blocks = [64 * 192, 64 * 64, 64 * 256, 256 * 64]
    prof = load_profile("dgx-h100")
    c = Candidates(*(np.array([v]) for v in (1, 1, gz, 1, 0, 1)), np.array([False]))
    sched = schedule.build(m, prof, Job(gz, 1, m.seq_len), c, c.checkpointing, True, True, comm.place(prof, c))
    return step_moments(m, 1, 1, gz, T, False, 1000.0, 200.0, blocks, 64 * 256, 256 * 64, e, True, 2,
                        (sched.forward, sched.backward), **kw)


def test_pipeline_buffers_and_held_tensors_by_hand():
    """A middle-like stage (embedding and head kept for simplicity) with 8 receive buffers, 3 held outputs of
    which 2 are received inputs, and 1 held logits: every moment gains the buffers (the optimizer step too);
    every moment in the step the held outputs net of the received inputs and the held logits."""
    T, e, H, V = 128.0, 2, 64, 256
    base = _moments()
    piped = _moments(buffers=PipelineBuffers(recv=8, received_inputs=2, outputs=3, logits=1))
    x, logits = T * H * e, T * V * e
    for name in base:
        assert piped[name]["buffers"] == pytest.approx(8 * x), name
        in_step = name != "optimizer step"
        assert piped[name]["activations"] - base[name]["activations"] == pytest.approx((3 - 2) * x * in_step), name
        # the loss's own saved logits are the held ones: counted once
        own = logits if name in ("forward loss", "backward loss") else 0.0
        assert piped[name]["logits"] - base[name]["logits"] == pytest.approx((logits - own) * in_step), name


def test_other_micro_batches_stay_saved_through_the_embedding_backward():
    """6 blocks of other micro-batches in flight, checkpointing off: each keeps its input and everything
    its block saved (the 'last block' moment's activations minus the earlier blocks' and the input)."""
    base, piped = _moments(), _moments(others_blocks=6.0)
    assert base["backward embedding"]["activations"] == 0.0
    one_block = (base["backward last block fc2"]["activations"] - base["backward block before it fc2"]["activations"])
    assert piped["backward embedding"]["activations"] == pytest.approx(6 * one_block)


def test_a_received_gradient_is_the_last_blocks_residual_gradient():
    """On a non-last stage the gradient entering the last block is a receive buffer: the MLP branch's backward
    (fc2, fc1, the second norm) holds no residual-stream gradient of its own; the block before it does."""
    T, e, H = 128.0, 2, 64
    base, piped = _moments(), _moments(received_gradient=True)
    for mo in ("fc2", "fc1", "norm2"):
        assert base[f"backward last block {mo}"]["transients"] - piped[f"backward last block {mo}"]["transients"] \
            == pytest.approx(T * H * e)
        assert base[f"backward block before it {mo}"]["transients"] == piped[f"backward block before it {mo}"]["transients"]
    assert base["backward last block attn_out"]["transients"] == piped["backward last block attn_out"]["transients"]


def test_a_completing_reduce_scatter_adds_its_fp32_copy_by_hand():
    """gz = 2, bf16, at most 2 reduce-scatters in flight. At the last block's fc1 the LM head's and fc2's are in
    flight; fc1's dW (16384 elements, 2 B) is live, and room is made first: the LM head's reduced shard (8192)
    is added to its fp32 gradient as an fp32 copy (4 B) while its full block (16384 x 2) and shard (8192 x 2)
    are still held, before fc1's own shard (8192 x 2) exists."""
    g = _moments(gz=2)["backward last block fc1"]["gradients"]
    inflight = 2 * (16384 * 2 + 8192 * 2)  # the LM head and fc2
    assert float(g) == pytest.approx(16384 * 2 + inflight + 8192 * 4)
    # at the LM head's own GEMM nothing is in flight yet: its dW and its reduced shard
    assert float(_moments(gz=2)["backward lm_head"]["gradients"]) == pytest.approx(16384 * 2 + 8192 * 2)
    # gz = 1: no reduce-scatter, the dW and its fp32 copy added at once
    assert float(_moments(gz=1)["backward last block fc1"]["gradients"]) == pytest.approx(16384 * (2 + 4))


def test_an_rmsnorm_backward_holds_one_fp32_copy_fewer():
    """runtime/norm.py: x-hat, dy, g and two temporaries of dx's expression (LayerNorm's mean term one more)."""
    T, H = 128.0, 64
    fused = dataclasses.replace(AXOPLAN, elementwise_kernels="fused")
    for norm, copies in (("layernorm", 6), ("rmsnorm", 5)):
        assert NORM_BWD_FP32_COPIES[norm] == copies
        eager, f = _moments(norm=norm), _moments(norm=norm, execution=fused)
        assert eager["backward final norm"]["transients"] - f["backward final norm"]["transients"] == \
            pytest.approx(T * H * copies * 4)


@pytest.mark.parametrize("grid,pp,batch", [((1, 1, 1, 1), 2, 8), ((1, 1, 2, 1), 4, 16), ((2, 1, 1, 1), 2, 12)])
def test_traced_pipeline_buffers_and_peak_equal_predicted(grid, pp, batch):
    """The trainer on torch's pipelining, traced as each end's first rank: the receive buffers it allocates equal
    the model's (one per micro-batch per boundary), and each end's peak is within 2%."""
    pytest.importorskip("torch")
    from axoplan.runtime.dryrun import compare_pipeline

    r = compare_pipeline("gpt-small", "perlmutter", pp * int(np.prod(grid)), batch, grid, pp=pp, micro_batch=1,
                         checkpointing=True, schedule="1f1b")
    m = r["config"]["micro_batches_traced"]
    for st in r["stages"]:
        buf = st["memory_by_kind"]["pipeline buffers"]
        assert buf["traced"] > 0 and buf["predicted"] == pytest.approx(buf["traced"], rel=1e-9), st["stage"]
        assert st["predicted_memory_gib"] == pytest.approx(st["traced_memory_gib"], rel=0.02), (st["stage"], m)


def test_kept_low_precision_gradients_peak_in_the_next_forward_by_hand():
    """DeepSpeed's BF16_Optimizer keeps a backward's bf16 gradients until the next backward starts: the next
    forward, every block's saved activations live (the last block's forward done), holds them too: 2 bytes per
    shard and replicated element (1000 + 200 here). Without the field there is no such moment."""
    kept = dataclasses.replace(AXOPLAN, low_precision_grads_kept=True)
    base, m = _moments(), _moments(execution=kept)
    assert "forward after a backward" not in base
    mo = m["forward after a backward"]
    assert float(mo["gradients"]) == pytest.approx((1000 + 200) * 2)
    one_block = base["backward last block fc2"]["activations"] - base["backward block before it fc2"]["activations"]
    assert float(mo["activations"]) == pytest.approx(2 * one_block)  # both blocks of the one micro-batch
    assert all(np.array_equal(np.asarray(base[k]["gradients"]), np.asarray(m[k]["gradients"])) for k in base)
    # before that forward the BF16_Optimizer adds each bf16 gradient into its fp32 one through an fp32 copy: the
    # largest parameter's (the 256 x 64 embedding and LM head, 64 x 256 fc1 and fc2: 16384 x 4 B) beside the kept
    # gradients; this one micro-batch's blocks are done, so nothing saved
    acc = m["fp32 accumulation after a backward"]
    assert float(acc["transients"]) == pytest.approx(16384 * 4)
    assert float(acc["gradients"]) == pytest.approx((1000 + 200) * 2) and float(acc["activations"]) == 0.0
    assert "fp32 accumulation after a backward" not in base


def test_gradient_reduction_through_a_compute_dtype_copy_by_hand():
    """DeepSpeed's allreduce_bucket with communication_data_type bf16: after the last backward the fp32 gradients
    (in the states) and their bf16 copy (1000 shard elements x 2 B), beside the kept bf16 gradients where the
    BF16_Optimizer keeps them ((1000 + 200) x 2 B); no such moment with fp32 reduction."""
    copy = dataclasses.replace(AXOPLAN, data_parallel_reduce="compute-copy")
    mo = _moments(execution=copy)["gradient reduction"]
    assert float(mo["transients"]) == pytest.approx(1000 * 2) and float(mo["gradients"]) == 0.0
    both = _moments(execution=dataclasses.replace(copy, low_precision_grads_kept=True))["gradient reduction"]
    assert float(both["gradients"]) == pytest.approx((1000 + 200) * 2)
    assert "gradient reduction" not in _moments()


def test_the_swiglu_backward_holds_three_ffn_gradients_by_hand():
    """SwiGLU's product silu(gate) * up, backward: fc2's input is freed, silu(gate) stays saved beside fc1's
    output, and fc2's dI with the two gradients it makes are live ([T, ffn] each); GELU has no such moment."""
    T, e, H = 128.0, 2, 64
    mo = _swiglu_moments()
    ffn = tiny_model(mlp="swiglu").ffn
    sw, fc2 = mo["backward last block swiglu"], mo["backward last block fc2"]
    assert sw["transients"] == pytest.approx(3 * T * ffn * e + T * H * e)  # and the residual's gradient
    # fc2's moment holds the activation's two outputs (silu(gate) and the product); one of them is left
    assert sw["activations"] - fc2["activations"] == pytest.approx(-T * ffn * e)
    assert "backward last block swiglu" not in _moments()


def _swiglu_moments():
    m = tiny_model(mlp="swiglu")
    T, e = 128.0, 2
    blocks = [64 * 192, 64 * 64, 64 * 2 * m.ffn, m.ffn * 64]
    prof = load_profile("dgx-h100")
    c = Candidates(*(np.array([v]) for v in (1, 1, 1, 1, 0, 1)), np.array([False]))
    sched = schedule.build(m, prof, Job(1, 1, m.seq_len), c, c.checkpointing, True, True, comm.place(prof, c))
    return step_moments(m, 1, 1, 1, T, False, 1000.0, 200.0, blocks, 64 * 256, 256 * 64, e, True, 2,
                        (sched.forward, sched.backward))
