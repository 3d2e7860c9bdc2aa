"""A framework that fuses its element-wise work (execution field elementwise_kernels: fused):
each norm, activation, rotary embedding and the loss is one kernel reading its inputs and writing its
output once. Hand-computed bytes for one block and the head; the bundled trainer's own (eager) kernels
are proven against the trainer in test_optrace.py."""
import numpy as np
import pytest
from conftest import tiny_model

from axoplan.planner.compute import elementwise_work
from axoplan.planner.execution import AXOPLAN, PRESETS, Execution
from axoplan.planner.profile_reader import load_profile

FUSED = Execution(elementwise_kernels="fused", loss_kernel="fused")


def test_fused_block_and_head_by_hand():
    m = tiny_model()  # hidden 64, 8 heads, ffn 256, gelu, layernorm, learned positions, vocab 256
    gx, gy, gz, mb, S, e = 2, 2, 1, 2, 64, 2
    w = elementwise_work(m, gx, gy, gz, mb, S, e, grad_acc=1, execution=FUSED)
    T, hx, f, V = mb * S, 64 / gx, 256 / gy, 256 / gy
    # two norms (read x, write y), the GELU (read fc1's output, write its own), two residual adds (2 in, 1 out)
    assert float(w.block_fwd.bytes) == pytest.approx(2 * 2 * e * T * hx + 2 * e * T * f + 2 * 3 * e * T * hx)
    assert float(w.block_fwd.kernels) == 2 + 1 + 2
    # the final norm and a fused cross-entropy reading the [T, V/gy] logits once (gz = 1: the LM head's block is
    # cast to bf16 where it is used, 6 bytes per element of its shard)
    lm_shard = 64 // gx * (256 // gy)
    assert float(w.head_fwd.bytes) == pytest.approx(2 * e * T * hx + (4 + e) * lm_shard + e * T * V)


def test_fused_is_never_more_traffic_than_the_eager_trainer():
    m = tiny_model(n_layers=3, mlp="swiglu", norm="rmsnorm", position="rope", n_kv_heads=4)
    grid = np.array([1, 2, 4, 8])
    for gx in grid:
        for gy in (1, 2):
            eager = elementwise_work(m, gx, gy, 2, 2, 64, 2, grad_acc=2)
            fused = elementwise_work(m, gx, gy, 2, 2, 64, 2, grad_acc=2, execution=FUSED)
            for part in ("block_fwd", "block_bwd", "head_fwd", "head_bwd"):
                assert float(getattr(fused, part).bytes) < float(getattr(eager, part).bytes), part
                assert float(getattr(fused, part).kernels) <= float(getattr(eager, part).kernels), part


def test_the_execution_selects_them_and_the_machine_cannot(write_profile):
    import yaml
    from conftest import profile_dict

    from axoplan.errors import UserError

    assert AXOPLAN.elementwise_kernels == "eager" and PRESETS["megatron-core"].elementwise_kernels == "fused"
    raw = profile_dict(name="fused-test")
    raw["compute"]["elementwise_kernels"] = "fused"  # the framework's choice, not the machine's: one sentence
    with pytest.raises(UserError, match="elementwise_kernels.*execution"):
        load_profile(str(write_profile(raw=yaml.safe_dump(raw), name="fused-test")))


def test_fused_kernels_memory_by_hand():
    """The same execution field selects the fused kernels' memory: the loss keeps no fp32 copy of the [T, V/gy] logits
    (a log-sum-exp per token instead) and the norm's backward no fp32 temporaries of [T, H/gx]."""
    from axoplan.planner.memory import NORM_BWD_FP32_COPIES, step_moments
    from axoplan.planner import comm, schedule
    from axoplan.planner.space import Candidates
    from axoplan.planner.specs import Job

    m = tiny_model()  # hidden 64, 8 heads, vocab 256
    gx, gy, gz, T, e = 2, 2, 1, 128.0, 2
    blocks = [64 // gx * (192 // gy), 64 // gy * (64 // gx), 64 // gx * (256 // gy), 256 // gy * (64 // gx)]
    args = (m, gx, gy, gz, T, False, 1000.0, 200.0, blocks, 64 // gx * (256 // gy), 256 // gy * (64 // gx), e,
            True, 2)
    prof = load_profile("dgx-h100")
    c = Candidates(*(np.array([v]) for v in (gx, gy, gz, 1, 0, 1)), np.array([False]))
    sched = schedule.build(m, prof, Job(4, 1, m.seq_len), c, c.checkpointing, True, True, comm.place(prof, c))
    args = args + ((sched.forward, sched.backward),)
    eager, fused = step_moments(*args), step_moments(*args, execution=FUSED)
    V, hx = 256 / gy, 64 / gx
    assert eager["forward loss"]["logits"] == pytest.approx(T * V * (e + 4))
    assert fused["forward loss"]["logits"] == pytest.approx(T * V * e + T * 4)
    assert eager["backward loss"]["logits"] == pytest.approx(T * V * (e + 4 + e))
    assert fused["backward loss"]["logits"] == pytest.approx(T * V * 2 * e + T * 4)
    eager_t, fused_t = eager["backward final norm"]["transients"], fused["backward final norm"]["transients"]
    assert eager_t - fused_t == pytest.approx(T * hx * NORM_BWD_FP32_COPIES[m.norm] * 4)
    for k in ("states", "gathered", "gradients", "activations"):  # nothing else changes
        assert np.all(np.asarray(eager["backward lm_head"][k]) == np.asarray(fused["backward lm_head"][k]))
