"""Executions (axoplan/planner/execution.py): the mechanisms of the frameworks the published runs used, each
checked by hand against the bundled trainer's execution, which they leave unchanged."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import one_sentence, run_cli, tiny_model

from axoplan.errors import UserError
from axoplan.planner import comm, schedule, timing
from axoplan.planner.compute import elementwise_work, step_work
from axoplan.planner.execution import AXOPLAN, PRESETS, Execution, load_execution, op_selective
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import explain, rank
from axoplan.planner.space import Candidates
from axoplan.planner.specs import Job, load_model

FUSED = Execution(elementwise_kernels="fused", loss_kernel="fused")


def test_state_bytes_by_hand():
    assert AXOPLAN.state_bytes(8) == 16  # fp32 weight, gradient, two moments
    # Megatron: bf16 weight, fp32 gradient; fp32 master and two moments split over D
    assert PRESETS["megatron-core"].state_bytes(4) == pytest.approx(2 + 4 + 12 / 4)
    assert PRESETS["megatron-lm"].state_bytes(4) == 2 + 4 + 12
    assert PRESETS["megatron-lm"].state_bytes(4, dtype_bytes=4) == 16  # in fp32 the copy is the master itself
    assert AXOPLAN.bundled and not PRESETS["megatron-core"].bundled


def test_op_selective_policy_by_hand():
    # Llama: q, k, v, o, w1, w3, w2; k, o and w3 (2nd, 4th, 6th) recomputed
    sel = op_selective(load_model("llama3-8b"))  # hidden 4096, 8 kv heads of 128, ffn 14336
    h, kv, f = 4096, 1024, 14336
    assert sel.share == pytest.approx((h * kv / (h * h + 2 * h * kv), 1.0, 0.5, 0.0))
    assert sel.kept_split == h + kv + f and sel.kept_full == h  # q, v, w1 kept; w2's [T, H] output
    # a GELU MLP: q, k, v, o, fc1, fc2; k, o and fc2 recomputed
    g = op_selective(tiny_model())
    assert g.share == pytest.approx((1 / 3, 1.0, 0.0, 1.0)) and g.kept_split == 64 + 64 + 256 and g.kept_full == 0


def test_sequence_parallel_splits_norms_and_residuals_by_hand():
    m = tiny_model()
    gx, gy, mb, S, e = 1, 4, 2, 64, 2
    off = elementwise_work(m, gx, gy, 1, mb, S, e, execution=FUSED)
    on = elementwise_work(m, gx, gy, 1, mb, S, e, execution=dataclasses.replace(FUSED, sequence_parallel=True))
    T, hx = mb * S, 64 / gx
    # two norms (2 e per element) and two residual adds (3 e) on T / gy tokens instead of T
    assert float(off.block_fwd.bytes - on.block_fwd.bytes) == pytest.approx(10 * e * hx * T * (1 - 1 / gy))
    assert float(on.block_fwd.kernels) == float(off.block_fwd.kernels)
    one = elementwise_work(m, gx, 1, 1, mb, S, e, execution=dataclasses.replace(FUSED, sequence_parallel=True))
    assert float(one.block_fwd.bytes) == float(elementwise_work(m, gx, 1, 1, mb, S, e, execution=FUSED).block_fwd.bytes)


def test_low_precision_copy_casts_once_per_step():
    m = tiny_model()
    copy = Execution(weights="low-precision-copy")
    w = elementwise_work(m, 1, 2, 1, 2, 64, 2, execution=copy)
    assert all(float(c.bytes) == 0 for c in w.gather_casts)
    base = elementwise_work(m, 1, 2, 1, 2, 64, 2)
    assert all(float(c.bytes) > 0 for c in base.gather_casts)
    shard = 1000.0
    a = step_work(m, 1, 1, 4, 2, 64, 1, shard, True)
    b = step_work(m, 1, 1, 4, 2, 64, 1, shard, True, copy, 2)
    assert float(b.bytes - a.bytes) == pytest.approx((4 + 2) * shard) and float(b.kernels - a.kernels) == 1
    # optimizer sharding: AdamW (28 bytes per element, fused) over a quarter of the shard, the cast too
    c = step_work(m, 1, 1, 4, 2, 64, 1, shard, True, dataclasses.replace(copy, optimizer_sharding="data-parallel"), 2)
    assert float(b.bytes - c.bytes) == pytest.approx((28 + 6) * shard * 3 / 4)


def _sched(m, prof, grid, ex, mb=1, batch=16, ck=False):
    c = Candidates(*(np.array([v]) for v in grid), np.array([0]), np.array([mb]), np.array([ck]))
    return schedule.build(m, prof, Job(int(np.prod(grid)), batch, m.seq_len), c, c.checkpointing, True, True,
                          comm.place(prof, c), ex), c


def test_distributed_optimizer_collectives_by_hand():
    m = tiny_model()
    prof = load_profile("dgx-h100")
    ex = dataclasses.replace(PRESETS["megatron-core"], overlap_grad_reduce=False)
    s, _ = _sched(m, prof, (1, 2, 1, 4), ex)
    grads, weights = s.step[0], s.step[1]
    shard = float(s.params.total[0])
    assert (grads.kind, grads.axis, float(grads.nbytes[0])) == ("reduce_scatter", "d", shard * 4)
    assert (weights.kind, weights.axis, weights.phase, float(weights.nbytes[0])) == ("all_gather", "d",
                                                                                    "next forward", shard * 2)
    # without optimizer sharding: one fp32 all-reduce and no weight gather
    base, _ = _sched(m, prof, (1, 2, 1, 4), Execution(overlap_grad_reduce=False))
    assert base.step[0].kind == "all_reduce" and all(c.layer != "weights" for c in base.step)


def test_param_gather_hidden_behind_the_first_forward():
    m = tiny_model()
    prof = load_profile("dgx-h100").replace(physics=dataclasses.replace(load_profile("dgx-h100").physics,
                                                                        overlap_slowdown=0.0))
    ex = dataclasses.replace(PRESETS["megatron-core"], overlap_grad_reduce=False)
    hidden = timing.step_time(prof, _sched(m, prof, (1, 1, 1, 8), ex)[0], True)
    s2, _ = _sched(m, prof, (1, 1, 1, 8), dataclasses.replace(ex, overlap_param_gather=False))
    exposed = timing.step_time(prof, s2, True)
    ag = float(s2.step[1].seconds[0])
    fwd = float(hidden.forward[0])
    # with no contention the gather costs only what the forward does not cover
    assert float(exposed.batch[0] - hidden.batch[0]) == pytest.approx(min(ag, fwd), rel=1e-9)


def test_tp_overlap_and_sequence_parallel_timing():
    m = load_model("gpt-20b")
    prof = load_profile("dgx-h100")
    base = dataclasses.replace(PRESETS["megatron-core"], tp_comm_overlap=False)
    t_off = timing.step_time(prof, _sched(m, prof, (1, 8, 1, 4), base, batch=32)[0], True).batch
    s_on, _ = _sched(m, prof, (1, 8, 1, 4), PRESETS["megatron-core"], batch=32)
    t_on = timing.step_time(prof, s_on, True).batch
    assert float(t_on[0]) < float(t_off[0])
    # the forward's tensor-parallel call (under SP its reduce-scatter and the next layer's all-gather) sits beside
    # its window's GEMM; SP's input gather beside the dI GEMM of normal layers
    qkv_f, attn_f = s_on.forward.block[0], s_on.forward.block[1]
    assert [c.kind for c in attn_f.beside["gemm fwd"]] == ["reduce_scatter+all_gather"] and not attn_f.blocking
    qkv_b = [w for w in s_on.backward.block if w.name == "qkv"][0]
    assert [(c.kind, c.axis) for c in qkv_b.beside["gemm dgrad"]] == [("all_gather", "y")]
    assert "gemm dgrad" not in [w for w in s_on.backward.block if w.name == "attn_out"][0].beside
    assert qkv_f.beside["gemm fwd"][0].axis == "x"  # a normal layer's forward all-reduce (here over 1 GPU)


def test_op_selective_recompute_windows():
    m = load_model("llama3-8b")
    prof = load_profile("dgx-h100")
    sel, _ = _sched(m, prof, (1, 1, 8, 1), PRESETS["torchtitan"], ck=True)
    full, _ = _sched(m, prof, (1, 1, 8, 1), dataclasses.replace(PRESETS["torchtitan"], recompute="full"), ck=True)
    shares = op_selective(m).share
    rec_sel = [w for w in sel.backward_recompute.block if w.name.endswith("(recompute)")]
    rec_full = [w for w in full.backward_recompute.block if w.name.endswith("(recompute)")]
    for w_s, w_f, share in zip(rec_sel, rec_full, shares):
        assert float(w_s.compute["gemm fwd"].seconds[0]) == pytest.approx(share * float(w_f.compute["gemm fwd"].seconds[0]))
        assert "attention" not in w_s.compute and w_s.gather == w_f.gather
    assert "attention" in rec_full[0].compute
    # with tensor parallelism a recomputed matmul of a normal layer gathers its sequence-parallel input again
    tp, _ = _sched(m, prof, (1, 8, 1, 1), PRESETS["torchtitan"], ck=True)
    rec = {w.name: w for w in tp.backward_recompute.block if w.name.endswith("(recompute)")}
    def y_gathers(w):
        return [c for c in w.blocking if (c.kind, c.axis) == ("all_gather", "y")]

    assert len(y_gathers(rec["qkv (recompute)"])) == 1 and len(y_gathers(rec["fc1 (recompute)"])) == 1
    assert not rec["attn_out (recompute)"].blocking and not rec["fc2 (recompute)"].blocking
    # memory: each earlier block keeps its policy's outputs beside its input, less than without checkpointing
    kw = dict(grid=(1, 1, 8, 1), micro_batch=1)
    act = {ck: float(explain(m, prof, 8, 8, checkpointing=ck, execution=PRESETS["torchtitan"], **kw)
                     .memory.set_index("kind").gib["activations"]) for ck in (True, False)}
    act_full = float(explain(m, prof, 8, 8, checkpointing=True, execution=dataclasses.replace(
        PRESETS["torchtitan"], recompute="full"), **kw).memory.set_index("kind").gib["activations"])
    assert act_full < act[True] < act[False]


def test_the_bundled_execution_is_the_default():
    m = tiny_model()
    a = rank(m, "dgx-h100", 8, 16, top=5)
    b = rank(m, "dgx-h100", 8, 16, top=5, execution="axoplan")
    assert a.equals(b)
    c = rank(m, "dgx-h100", 8, 16, top=5, execution="megatron-core")
    assert not np.allclose(a.batch_time_s.to_numpy(), c.batch_time_s.to_numpy())


@pytest.mark.parametrize("text,msg", [
    ("sequence_parallel: 3\n", "must be true or false"),
    ("foo: 1\n", "unknown field 'foo'"),
    ("weights: fp16\n", "weights must be one of"),
    ("recompute: some\n", "recompute must be one of"),
    ("attention: sdpa\n", "attention must be one of flash, unfused"),
    ("loss_kernel: triton\n", "loss_kernel must be one of"),
    ("elementwise_kernels: jit\n", "elementwise_kernels must be one of"),
    ("base: deepspeed\n", "is not a preset"),
    ("overlap_param_gather: true\n", "needs optimizer_sharding"),
    ("- 1\n", "expected a mapping"),
])
def test_bad_execution_files_are_one_sentence(tmp_path, text, msg):
    p = tmp_path / "ex.yaml"
    p.write_text(text)
    with pytest.raises(UserError, match=msg):
        load_execution(str(p))


def test_execution_file_and_cli(tmp_path, capsys):
    p = tmp_path / "mine.yaml"
    p.write_text("base: megatron-core\ntp_comm_overlap: false\n")
    ex = load_execution(str(p))
    assert ex.name == "mine" and ex.sequence_parallel and not ex.tp_comm_overlap
    code, out, _ = run_cli(["rank", "-m", "gpt-tiny", "-p", "dgx-h100", "-g", "8", "-b", "16", "-e", str(p)], capsys)
    assert code == 0 and "execution mine: sequence_parallel=True" in out and "elementwise_kernels=fused" in out
    assert "tp_comm_overlap" not in out  # as the bundled trainer's: not listed
    code, out, _ = run_cli(["explain", "-m", "gpt-tiny", "-p", "dgx-h100", "-g", "8", "-b", "16", "--grid", "1,2,1,4",
                            "-e", "torchtitan", "--format", "json"], capsys)
    import json
    got = json.loads(out)["execution"]
    assert code == 0 and got["name"] == "torchtitan" and got["recompute"] == "op-selective"
    for cmd in (["rank"], ["explain", "--grid", "1,1,1,8"], ["scale", "--gpus", "8"]):
        args = cmd + ["--model" if cmd[0] == "scale" else "-m", "gpt-tiny", "--machine", "dgx-h100",
                      "--global-batch", "16", "--execution", "nope"] + ([] if cmd[0] == "scale" else ["-g", "8"])
        code, _, err = run_cli(args, capsys)
        one_sentence(code, err)
        assert "unknown execution 'nope'" in err


def test_recompute_without_prefetch_waits_for_its_first_gather():
    m = load_model("gpt-20b")
    prof = load_profile("perlmutter")
    ahead, _ = _sched(m, prof, (1, 1, 8, 2), Execution(), ck=True)
    restart, _ = _sched(m, prof, (1, 1, 8, 2), Execution(prefetch_into_recompute=False), ck=True)
    first_a, first_r = ahead.backward_recompute.block[0], restart.backward_recompute.block[0]
    assert first_a.gather and not first_r.gather and first_r.blocking[0] is not None
    assert [c.kind for c in first_r.blocking] == ["all_gather"] + [c.kind for c in first_a.blocking]
    t_a = timing.step_time(prof, ahead, True).batch
    t_r = timing.step_time(prof, restart, True).batch
    # the restart exposes the gather the previous block's backward hid: at most the gather, once per block
    gap = float(t_r[0] - t_a[0])
    assert 0 < gap <= m.n_layers * float(first_r.blocking[0].seconds[0]) * (1 + 1e-9)


def test_weights_kept_gathered_after_the_forward():
    m = tiny_model(n_layers=3)
    prof = load_profile("dgx-h100")
    keep = Execution(reshard_after_forward=False)
    s, c = _sched(m, prof, (1, 1, 8, 1), keep)
    base, _ = _sched(m, prof, (1, 1, 8, 1), Execution())
    assert all(not w.gather for w in s.backward.prefix + s.backward.block + s.backward_recompute.block)
    assert all(w.gather for w in base.backward.block)
    assert [w.gather for w in s.forward.block] == [w.gather for w in base.forward.block]
    assert all("weight cast" not in w.compute for w in s.backward.block + s.backward_recompute.block)
    # memory by hand: at the last block's backward every block's gathered weight (bf16, padded to 8 shards)
    # and the embedding's are live
    pad = [-(-(64 * n) // 8) * 8 for n in (192, 64, 256)] + [-(-(256 * 64) // 8) * 8]
    emb = -(-(256 * 64) // 8) * 8
    t_keep = float(rank(m, prof, 8, 16, top=1, execution=keep).batch_time_s.iloc[0])
    t_base = float(rank(m, prof, 8, 16, top=1).batch_time_s.iloc[0])
    assert t_keep <= t_base * (1 + 1e-12)
    from axoplan.planner.memory import step_moments  # the walk itself: L blocks + embedding at the last block
    mom = step_moments(m, 1, 1, 8, 64.0, False, 1000.0, 0.0, [64 * 192, 64 * 64, 64 * 256, 256 * 64], 64 * 256,
                       256 * 64, 2, True, 2, (s.forward, s.backward), execution=keep)
    first = [k for k in mom if k.startswith("backward last block")][0]
    assert mom[first]["gathered"] == pytest.approx(3 * sum(pad) * 2 + emb * 2)


def test_recomputed_flop_counted_as_the_execution_recomputes():
    m = load_model("llama3-8b")
    S = m.seq_len
    full = AXOPLAN.recomputed_flops_per_token(m, S)
    assert full == pytest.approx(m.flops_per_token(S, recompute=True) - m.flops_per_token(S))
    h, kv, f = 4096, 1024, 14336
    # k, o and w3 again: 2 FLOP per weight element per token, every layer
    assert PRESETS["torchtitan"].recomputed_flops_per_token(m, S) == pytest.approx(2 * (h * kv + h * h + h * f) * 32)


def test_the_loss_kernel_apart_from_the_blocks():
    """Megatron fuses norms and activations but runs its cross-entropy op by op over an fp32 copy of the logits."""
    m = tiny_model()
    mega = Execution(elementwise_kernels="fused")
    both = Execution(elementwise_kernels="fused", loss_kernel="fused")
    eager = elementwise_work(m, 1, 2, 1, 2, 64, 2)
    w_mega, w_both = elementwise_work(m, 1, 2, 1, 2, 64, 2, execution=mega), elementwise_work(m, 1, 2, 1, 2, 64, 2,
                                                                                                execution=both)
    assert float(w_mega.block_fwd.bytes) == float(w_both.block_fwd.bytes) < float(eager.block_fwd.bytes)
    T, V, e = 128, 128, 2
    # the fused loss reads the [T, V/gy] logits once forward (e bytes each), twice backward with the gradient write
    head_norm_fwd = float(w_both.head_fwd.bytes) - e * T * V
    assert float(w_mega.head_fwd.bytes) - head_norm_fwd > 36 * T * V  # the fp32 copy and its passes
    prof = load_profile("dgx-h100")
    s, _ = _sched(m, prof, (1, 2, 1, 4), mega)
    from axoplan.planner.memory import step_moments
    args = (m, 1, 2, 1, 64.0, False, 1000.0, 0.0, [64 * 96, 32 * 64, 64 * 128, 128 * 64], 64 * 128, 128 * 64, 2,
            True, 2, (s.forward, s.backward))
    lm = step_moments(*args, execution=mega)["forward loss"]["logits"]
    assert lm == pytest.approx(64 * V * (e + 4))  # the logits and their fp32 copy, as the trainer's
    assert step_moments(*args, execution=both)["forward loss"]["logits"] == pytest.approx(64 * V * e + 64 * 4)


def test_gradients_reduce_scattered_in_fp32():
    m = tiny_model()
    prof = load_profile("dgx-h100")
    up = Execution(gradient_reduce="fp32")
    s_up, _ = _sched(m, prof, (1, 1, 8, 1), up)
    s, _ = _sched(m, prof, (1, 1, 8, 1), Execution())
    rs = [(w.scatter[0], w0.scatter[0]) for w, w0 in zip(s_up.backward.block, s.backward.block)]
    for a, b in rs:  # the same padded block, 4 bytes an element instead of 2
        assert a.kind == "reduce_scatter" and float(a.nbytes[0]) == 2 * float(b.nbytes[0])
    # each block's bf16 gradient cast up before the call ((2 + 4) bytes per padded element), none cast back
    k, n = 64, 192
    shard = -(-(k * n) // 8)
    w_up, w = elementwise_work(m, 1, 1, 8, 1, 64, 2, execution=up), elementwise_work(m, 1, 1, 8, 1, 64, 2)
    qkv = (2 + 4) * shard * 8 - (2 + 4) * shard  # the cast up replaces the reduced shard's cast back
    assert float(w_up.block_bwd.bytes - w.block_bwd.bytes) > qkv
    from axoplan.planner.memory import _layer
    assert float(_layer(k * n, 8, 2, reduce_bytes=4).inflight) == (shard * 8 + shard) * 4


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(PRESETS)), st.sampled_from([8, 16, 32]), st.sampled_from([16, 64]),
       st.sampled_from(["dgx-h100", "perlmutter", "frontier"]))
def test_every_execution_plans_every_grid(name, gpus, batch, machine):
    """Every preset on every grid: positive finite times and memory, the bundled trainer's FLOP except what its
    recompute adds, and each mechanism in its direction (a sharded optimizer never needs more memory)."""
    m = tiny_model(n_layers=2, n_kv_heads=4)
    ex = PRESETS[name]
    from axoplan.planner.batch import evaluate
    from axoplan.planner.space import enumerate_space

    c = enumerate_space(gpus, batch, checkpointing="both")
    job = Job(gpus, batch, m.seq_len)
    prof = load_profile(machine)
    ev, base = evaluate(m, prof, job, c, execution=ex), evaluate(m, prof, job, c)
    ok = np.isfinite(ev.batch_time) & (ev.memory.total > 0)
    assert ok.all() and (ev.batch_time > 0).all() and (ev.compute > 0).all()
    once = ~c.checkpointing
    np.testing.assert_allclose(ev.flops_per_gpu[once], base.flops_per_gpu[once])
    if ex.optimizer_sharding == "data-parallel":
        unsharded = evaluate(m, prof, job, c, execution=dataclasses.replace(ex, optimizer_sharding="none",
                                                                             overlap_param_gather=False))
        assert (ev.memory.total <= unsharded.memory.total * (1 + 1e-12)).all()


def _round_profile():
    """dgx-a100 with round numbers: GEMMs at 1 TFLOP/s whatever their shape (no wave quantization), memory at
    1 TB/s, element-wise kernels at half of it, launches free."""
    return load_profile("dgx-a100").replace(gemm_ceiling=1e12, gemm_dim_half=1e-6, gemm_waves=None, mem_bandwidth=1e12,
                                            elementwise_efficiency=0.5, kernel_overhead=0.0)


def test_unfused_attention_by_hand():
    from axoplan.planner.compute import unfused_attention
    m = tiny_model()  # 8 heads of 8
    prof = _round_profile()
    # gy 2: 4 local heads, micro-batch 2: 8 [64, 64] score matrices, N = 8 * 64 * 64 elements in bf16
    N = 8 * 64 * 64
    product = 2 * 64 * 64 * 8 / 1e12  # each [64, 8] x [8, 64] or [64, 64] x [64, 8] product
    a = unfused_attention(prof, m, 2, 2, 64, 2, dropout=True)
    # forward: Q K^T and P V for 8 (batch, head) pairs; softmax reads and writes N (2 + 2 bytes), dropout reads N
    # and writes its output and a one-byte mask (2 + 2 + 1)
    assert float(a.fwd) == pytest.approx(2 * 8 * product + (4 + 5) * N / 0.5e12, rel=1e-6)
    # backward: four products; softmax reads its output and the gradient and writes one (6), dropout 5
    assert float(a.bwd) == pytest.approx(4 * 8 * product + (6 + 5) * N / 0.5e12, rel=1e-6)
    b = unfused_attention(prof, m, 2, 2, 64, 2, dropout=False)
    assert float(a.fwd - b.fwd) == pytest.approx(5 * N / 0.5e12) and float(b.fwd_work.kernels) == 1


def test_unfused_attention_keeps_its_probabilities():
    """Korthikanti et al.'s 5as/h term: per token and head, the softmax output over S keys (2 bytes), the dropout
    mask (1) and output (2), where FlashAttention keeps one fp32 log-sum-exp."""
    from axoplan.planner.memory import step_moments
    m = tiny_model()
    prof = load_profile("dgx-a100")
    unfused = Execution(attention="unfused", dropout=True)
    s, _ = _sched(m, prof, (1, 1, 1, 1), unfused)
    args = (m, 1, 1, 1, 64.0, False, 1000.0, 0.0, [64 * 192, 64 * 64, 64 * 256, 256 * 64], 64 * 256, 256 * 64, 2,
            True, 2, (s.forward, s.backward))
    flash = step_moments(*args)
    core = step_moments(*args, execution=unfused)
    first = [k for k in flash if k.startswith("backward last block")][0]
    T, heads, S = 64, 8, 64
    # both blocks' saved activations are live when the backward reaches the last block, with the dropout masks
    # of their attention and MLP outputs (a byte per element of [T, 64])
    assert core[first]["activations"] - flash[first]["activations"] == pytest.approx(
        2 * T * heads * (5 * S - 4) + 2 * 2 * T * 64)
    # the attention core recomputed (Megatron's selective recompute): every block keeps all but its core, the
    # last one too until its backward reaches the core
    sel = Execution(attention="unfused", dropout=True, recompute="attention-core")
    ck = step_moments(*args[:5], True, *args[6:], execution=sel)
    assert core[first]["activations"] - ck[first]["activations"] == pytest.approx(2 * T * heads * 5 * S)
    # its backward holds the recomputed probabilities beside two [S, S] gradients
    att = [k for k in ck if k.startswith("backward last block attention")][0]
    assert ck[att]["transients"] - core[att]["transients"] == pytest.approx(T * heads * 5 * S)


def test_attention_core_recompute_windows():
    m = tiny_model()
    prof = load_profile("dgx-a100")
    sel = Execution(attention="unfused", recompute="attention-core")
    s, _ = _sched(m, prof, (1, 2, 4, 1), sel, ck=True)
    names = [w.name for w in s.backward_recompute.block]
    assert names == ["fc2", "fc1", "attn_out", "attention (recompute)", "qkv"]
    core = s.backward_recompute.block[3]
    assert list(core.compute) == ["attention"] and not core.collectives()
    assert core.compute["attention"] is s.forward.block[0].compute["attention"]
    # nothing else is recomputed: each backward window gathers its own weight, as without checkpointing
    assert [w.gather for w in s.backward_recompute.block if w is not core] == [w.gather for w in s.backward.block]
    # the FLOP accounting counts Q K^T and P V again, 2 x 2 x S x hidden per token per layer
    assert sel.recomputed_flops_per_token(m, 64) == 4 * 64 * 64 * 2
    t = {r: float(explain(m, prof, 8, 16, grid=(1, 2, 4, 1), micro_batch=1, checkpointing=True,
                          execution=dataclasses.replace(sel, recompute=r)).summary.batch_time_s.iloc[0])
         for r in ("attention-core", "full")}
    assert t["attention-core"] < t["full"]


@pytest.mark.parametrize("sp,ck,terms", [
    (False, False, "10 + 24/t + 5as/(ht)"), (True, False, "34/t + 5as/(ht)"),
    (False, True, "10 + 24/t"), (True, True, "34/t"),
])
def test_activations_match_korthikanti_equations(sp, ck, terms):
    """Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4), activations per layer with tensor parallelism t:
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes; sequence parallelism splits the 10 over t too; selective recompute
    drops the 5*a*s/(h*t) term. Their GPT-22B (t = 8, b = 4) as Megatron-LM ran it: every layer's at the peak,
    within 2% (the walk also holds fp32 norm statistics and the transients of the layer in its backward)."""
    m = tiny_model(name="gpt-22b", n_layers=48, hidden=6144, n_heads=64, vocab=51200, seq_len=2048)
    s, b, h, a, t, L = 2048, 4, 6144, 64, 8, 48
    core = 5 * a * s / (h * t)
    per_layer = {"10 + 24/t + 5as/(ht)": 10 + 24 / t + core, "34/t + 5as/(ht)": 34 / t + core,
                 "10 + 24/t": 10 + 24 / t, "34/t": 34 / t}[terms]
    ex = dataclasses.replace(PRESETS["megatron-lm"], sequence_parallel=sp)
    e = explain(m, load_profile("dgx-a100"), 8, 4, grid=(1, 8, 1, 1), seq_len=s, micro_batch=b, checkpointing=ck,
                execution=ex)
    act = float(e.memory.set_index("kind").gib["activations"]) * 2 ** 30
    assert act == pytest.approx(s * b * h * per_layer * L, rel=0.02)


# Korthikanti et al. 2022 (arXiv 2205.05198) Table 4: one layer of their GPT-22B (t = 8, micro-batch 4, s = 2048) on
# Selene's A100-80GB, forward and backward ms (benchmarks/data/korthikanti2022_table4_layer_time_a100.csv)
TABLE4 = [("baseline", False, "full", False, 7.7, 11.9),
          ("sequence parallel", True, "full", False, 7.2, 11.8),
          ("full recompute", False, "full", True, 7.7, 19.5),
          ("selective recompute", False, "attention-core", True, 7.7, 13.2),
          ("selective + sequence parallel", True, "attention-core", True, 7.2, 13.1)]


@pytest.mark.parametrize("name,sp,recompute,ck,fwd_ms,bwd_ms", TABLE4, ids=[r[0] for r in TABLE4])
def test_layer_times_match_korthikanti_table4(name, sp, recompute, ck, fwd_ms, bwd_ms):
    """The schedule's forward and backward of one block, as Megatron-LM ran it (unfused attention core, dropout,
    fused kernels), within 8% of the published per-layer times on the dgx-a100 profile: GEMM, attention core,
    element-wise and tensor-parallel all-reduce time together, with and without each recompute."""
    m = tiny_model(name="gpt-22b", n_layers=48, hidden=6144, n_heads=64, vocab=51200, seq_len=2048)
    ex = dataclasses.replace(PRESETS["megatron-lm"], sequence_parallel=sp, recompute=recompute)
    e = explain(m, load_profile("dgx-a100"), 8, 4, grid=(1, 8, 1, 1), seq_len=2048, micro_batch=4,
                checkpointing=ck, execution=ex)
    w = e.windows[e.windows.count_per_micro_batch == 48]
    per_layer = {p: float(w[w["pass"] == p].window_s.sum()) / 48 * 1e3 for p in ("forward", "backward")}
    assert per_layer["forward"] == pytest.approx(fwd_ms, rel=0.08)
    assert per_layer["backward"] == pytest.approx(bwd_ms, rel=0.08)


def test_hidden_dropout_work_by_hand():
    m = tiny_model()
    T, hx, e = 2 * 64, 64, 2
    for base, extra, kernels in ((FUSED, T * hx, 0), (AXOPLAN, (2 * e + 1) * T * hx, 1)):
        off = elementwise_work(m, 1, 1, 1, 2, 64, e, execution=base)
        on = elementwise_work(m, 1, 1, 1, 2, 64, e, execution=dataclasses.replace(base, dropout=True))
        # two residual adds per block, each with its dropout: in the bias-dropout-add a mask written (fused), or a
        # kernel of its own writing the output and the mask (eager); the backward reads them back
        assert float(on.block_fwd.bytes - off.block_fwd.bytes) == pytest.approx(2 * extra)
        assert float(on.block_bwd.bytes - off.block_bwd.bytes) == pytest.approx(2 * extra)
        assert float(on.block_fwd.kernels - off.block_fwd.kernels) == 2 * kernels


def test_sharded_gradients_all_reduced_whole():
    # DeepSpeed's bf16 pipeline engine: the fp32 gradients all-reduced over D, then the partitioned step's
    # weights all-gathered
    m = tiny_model()
    prof = load_profile("dgx-h100")
    ex = dataclasses.replace(PRESETS["megatron-core"], overlap_grad_reduce=False, overlap_param_gather=False,
                             sharded_gradient_all_reduce=True)
    s, _ = _sched(m, prof, (1, 2, 1, 4), ex)
    shard = float(s.params.total[0])
    assert (s.step[0].kind, s.step[0].axis, float(s.step[0].nbytes[0])) == ("all_reduce", "d", shard * 4)
    assert (s.step[1].kind, s.step[1].layer, float(s.step[1].nbytes[0])) == ("all_gather", "weights", shard * 2)
    rs, _ = _sched(m, prof, (1, 2, 1, 4), dataclasses.replace(ex, sharded_gradient_all_reduce=False))
    assert float(s.step[0].seconds[0]) > float(rs.step[0].seconds[0])
    # DeepSpeed's allreduce_bucket under bf16 without ZeRO: through a bf16 copy of the fp32 gradients
    bf, _ = _sched(m, prof, (1, 2, 1, 4), dataclasses.replace(ex, data_parallel_reduce="compute-copy"))
    assert float(bf.step[0].nbytes[0]) == shard * 2 and float(bf.step[0].seconds[0]) < float(s.step[0].seconds[0])
    with pytest.raises(UserError, match="data_parallel_reduce must be one of fp32, compute-copy"):
        load_execution(dataclasses.replace(ex, data_parallel_reduce="bf16"))
    # gradients summed in bf16 over the micro-batches (DeepSpeed ZeRO-1's .grad): there is no fp32 gradient to
    # reduce, so the reduction carries the bf16 one, 2 bytes an element, and its buffer is the gradient itself
    lp, _ = _sched(m, prof, (1, 2, 1, 4), dataclasses.replace(ex, gradient_accumulation="compute"))
    assert float(lp.step[0].nbytes[0]) == shard * 2


def test_a_split_pipeline_transfer_is_gathered_where_it_is_received():
    """Megatron's scatter-gather and DeepSpeed's partitioned transfers: each Y rank sends 1/gy of the boundary
    tensor [T, h/gx] and the receiving stage all-gathers it over Y on its compute stream, in the forward on every
    stage but the first and in the backward on every stage but the last; nothing without a pipeline, nothing for
    an execution that does not split."""
    m = load_model("gpt-20b")  # hidden 7168
    prof = load_profile("dgx-a100")
    ex = dataclasses.replace(PRESETS["megatron-lm"], sequence_parallel=False, recompute="full", pipeline_p2p_split=True)
    c = Candidates(*(np.array([v]) for v in (1, 4, 1, 2)), np.array([0]), np.array([2]), np.array([True]),
                   pp=np.array([2]), vpp=np.array([1]), schedule=np.array([0], dtype=np.int8))
    s = schedule.build(m, prof, Job(16, 64, 2048), c, c.checkpointing, True, True, comm.place(prof, c), ex)
    full = 2 * 2048 * 7168 * 2  # micro-batch 2 x 2048 tokens x hidden x bf16
    assert float(np.ravel(s.p2p_bytes)[0]) == full / 4
    for p, receives in ((s.forward, (False, True)), (s.backward_recompute, (True, False))):
        for (first, last), gets in zip(((True, False), (False, True)), receives):
            got = [w for w in p.stage(first, last).prefix if w.name == schedule.RECEIVE]
            assert len(got) == gets
            if gets:
                (g,) = got[0].blocking
                assert (g.kind, g.axis, float(np.ravel(g.nbytes)[0])) == ("all_gather", "y", full)
                assert float(np.ravel(g.seconds)[0]) > 0
    assert not any(w.name == schedule.RECEIVE for w in s.forward.stage(True, True).prefix)  # one stage: none
    flat = dataclasses.replace(c, pp=np.array([1]))
    one = schedule.build(m, prof, Job(8, 64, 2048), flat, flat.checkpointing, True, True, comm.place(prof, flat), ex)
    assert not any(w.name == schedule.RECEIVE for w in one.forward.prefix + one.backward_recompute.prefix)
    plain, _ = _sched(m, prof, (1, 4, 1, 2), PRESETS["megatron-lm"])
    assert not any(w.name == schedule.RECEIVE for w in plain.forward.prefix + plain.backward.prefix)


def test_tp_backward_all_reduce_without_overlap_blocks():
    m = load_model("gpt-20b")
    prof = load_profile("dgx-a100")
    ex = dataclasses.replace(PRESETS["megatron-lm"], sequence_parallel=False)
    s_on, _ = _sched(m, prof, (1, 8, 1, 4), ex, batch=32)
    s_off, _ = _sched(m, prof, (1, 8, 1, 4), dataclasses.replace(ex, tp_backward_overlap=False), batch=32)
    fc1_on = [w for w in s_on.backward.block if w.name == "fc1"][0]
    fc1_off = [w for w in s_off.backward.block if w.name == "fc1"][0]
    assert [c.kind for c in fc1_on.beside["gemm wgrad"]] == ["all_reduce"]
    assert not fc1_off.beside and "all_reduce" in [c.kind for c in fc1_off.blocking if c.axis == "y"]
    # the all-reduce no longer hidden behind the dW GEMM: the step is slower (no contention to offset it)
    calm = prof.replace(physics=dataclasses.replace(prof.physics, overlap_slowdown=0.0))
    t_on = timing.step_time(calm, _sched(m, calm, (1, 8, 1, 4), ex, batch=32)[0], True).batch
    t_off = timing.step_time(calm, _sched(m, calm, (1, 8, 1, 4), dataclasses.replace(ex, tp_backward_overlap=False),
                                          batch=32)[0], True).batch
    assert float(t_off[0]) > float(t_on[0])


def test_blocking_split_pipeline_transfers():
    # DeepSpeed's pipeline: each TP rank sends 1/gy of the activation, and the send occupies its sender
    m = load_model("gpt-20b")
    prof = load_profile("dgx-a100")
    base = dataclasses.replace(PRESETS["megatron-lm"], sequence_parallel=False, pipeline="1f1b")
    kw = dict(grid=(1, 4, 1, 2), order="yzx", seq_len=2048, micro_batch=1, checkpointing=True, pp=4)

    def run(**ex):
        e = explain(m, prof, 32, 64, execution=dataclasses.replace(base, **ex), **kw)
        return float(e.summary.iloc[0].batch_time_s), e.detail["schedule"]

    t0, s0 = run()
    t_split, s_split = run(pipeline_p2p_split=True)
    t_block, _ = run(pipeline_p2p_split=True, pipeline_blocking_p2p=True)
    assert float(np.ravel(s_split.p2p_bytes)[0]) == pytest.approx(float(np.ravel(s0.p2p_bytes)[0]) / 4)
    # 16 micro-batches, each rank sending at least one transfer per micro-batch on its own time
    assert t_block >= t_split + 16 * float(np.ravel(s_split.p2p_fastest(prof))[0]) * 0.99


def test_gradient_accumulation_by_hand():
    # per micro-batch, each Linear's bf16 weight gradient [k/gx, n/gy]: fp32 (the trainer) casts it (2 + 4 bytes)
    # and adds it to the fp32 one (12 bytes); fused (Megatron) leaves it to the dW GEMM; compute adds it in bf16
    m = tiny_model()
    w = {mode: elementwise_work(m, 1, 2, 1, 2, 64, 2, execution=Execution(gradient_accumulation=mode))
         for mode in ("fp32", "fused", "compute")}
    elems = sum(lin.local(1, 2)[0] * lin.local(1, 2)[1] for lin in m.block_linears())
    lm = m.lm_head().local(1, 2)
    assert float(w["fp32"].block_bwd.bytes - w["fused"].block_bwd.bytes) == pytest.approx(18 * elems)
    assert float(w["fp32"].block_bwd.bytes - w["compute"].block_bwd.bytes) == pytest.approx((18 - 6) * elems)
    assert float(w["fp32"].head_bwd.bytes - w["fused"].head_bwd.bytes) == pytest.approx(18 * lm[0] * lm[1])
    assert float(w["fp32"].block_bwd.kernels - w["fused"].block_bwd.kernels) == 2 * len(m.block_linears())
    assert PRESETS["megatron-lm"].gradient_accumulation == PRESETS["megatron-core"].gradient_accumulation == "fused"
    with pytest.raises(UserError):
        load_execution(Execution(gradient_accumulation="bf16"))
    # what persists per weight element: summed in bf16 the gradient is bf16 (2 B), else fp32 (4 B); here beside the
    # bf16 copy (2 B) and the fp32 master and moments split over 4 D ranks (12 / 4 B)
    zero1 = Execution(weights="low-precision-copy", optimizer_sharding="data-parallel")
    assert float(dataclasses.replace(zero1, gradient_accumulation="compute").state_bytes(4, 2)) == 2 + 2 + 3
    assert float(zero1.state_bytes(4, 2)) == float(dataclasses.replace(zero1, gradient_accumulation="fused").state_bytes(4, 2)) == 2 + 4 + 3


def test_unaligned_gemm_runs_at_most_at_the_profiles_rate_by_hand():
    """compute.gemm.unaligned_tflops: a bf16 GEMM with any dimension not a multiple of 8 elements (16 bytes) takes
    at least 2mnk / 12.2 TFLOP/s; an aligned one of nearly the same size keeps the curve's time; a profile without
    the field (dgx-h100) prices both alike; a rate above the peak is refused."""
    from axoplan.planner.profile_reader import load_profile, profile_from_dict
    from tests.conftest import profile_dict

    p = load_profile("dgx-a100")
    t108, _ = p.gemm_seconds(2048, 2048, 108)
    t104, _ = p.gemm_seconds(2048, 2048, 104)
    assert t108 == pytest.approx(2 * 2048 * 2048 * 108 / 12.2e12 + p.launch_cost)
    assert t104 < t108 / 4  # 18.7 us against 79.3 us
    h = load_profile("dgx-h100")
    assert h.gemm_seconds(2048, 2048, 108)[0] < 2 * h.gemm_seconds(2048, 2048, 104)[0]
    d = profile_dict()
    d["compute"]["gemm"]["unaligned_tflops"] = {"value": 1e6, "source": "test"}
    with pytest.raises(UserError, match="unaligned_tflops"):
        profile_from_dict(d, "test profile")


def test_a_sustained_fraction_prices_gemms_at_the_clock_held_under_load_by_hand():
    """compute.gemm.sustained_fraction f: the curve runs at f x ceiling_tflops, so a compute-bound GEMM (dim_half
    given as a number) takes 1/f as long, launch aside; a profile without it is the burst ceiling; the bundled H100
    carries 0.88 (H200 MSMF / MAMF, same die and power limit): 794.5 x 0.88 = 699.16 TFLOP/s; above 1 is refused."""
    from axoplan.planner.profile_reader import load_profile, profile_from_dict
    from tests.conftest import profile_dict

    burst = profile_from_dict(profile_dict(), "burst")
    d = profile_dict()
    d["compute"]["gemm"]["sustained_fraction"] = {"value": 0.5, "source": "test"}
    held = profile_from_dict(d, "held")
    assert (burst.gemm_sustained, held.gemm_sustained) == (1.0, 0.5)
    m = n = k = 8192  # eff = (8192 / 8240)^3 of the ceiling; far above the memory-traffic time
    t_b = burst.gemm_seconds(m, n, k)[0] - burst.launch_cost
    t_h = held.gemm_seconds(m, n, k)[0] - held.launch_cost
    assert t_b == pytest.approx(2 * m * n * k / (280e12 * (8192 / 8240) ** 3))
    assert t_h == pytest.approx(2 * t_b)
    assert load_profile("dgx-h100").gemm_ceiling == pytest.approx(794.5e12 * 0.88)
    assert load_profile("dgx-a100").gemm_sustained == 1.0  # no measurement of the A100's: the burst ceiling
    from axoplan.planner.rank import explain

    notes = explain("gpt-20b", "dgx-h100", 64, 64, grid=(1, 8, 1, 8)).notes
    assert [n for n in notes if "699.2 TFLOP/s, 0.88 of its burst 794.5" in n]
    assert not [n for n in explain("gpt-20b", "dgx-a100", 64, 64, grid=(1, 8, 1, 8)).notes if "sustained_fraction" in n]
    d["compute"]["gemm"]["sustained_fraction"] = {"value": 1.2, "source": "test"}
    with pytest.raises(UserError, match="sustained_fraction.*at most 1"):
        profile_from_dict(d, "test profile")


def test_explain_names_the_unaligned_gemm_dimensions():
    """gpt-20b (hidden 7168) split 256 ways over gx leaves 28 columns per GPU in its qkv, fc1 and LM-head inputs
    and attention-output and fc2 outputs: explain names them and the cap; an aligned grid gets no such note."""
    from axoplan.planner.rank import explain

    e = explain("gpt-20b", "dgx-a100", 512, 512, grid=(256, 1, 1, 2))
    (note,) = [n for n in e.notes if "16-byte vectors" in n]
    assert "qkv in 28" in note and "fc2 out 28" in note and "12.2 TFLOP/s" in note
    assert not [n for n in explain("gpt-20b", "dgx-a100", 64, 64, grid=(1, 8, 1, 8)).notes if "16-byte" in n]
    assert not [n for n in explain("gpt-20b", "dgx-h100", 512, 512, grid=(256, 1, 1, 2)).notes if "16-byte" in n]
