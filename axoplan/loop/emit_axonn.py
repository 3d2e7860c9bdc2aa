"""A planned candidate as an AxoNN run: train_axonn.py, a GPT training entry point on AxoNN 0.2.0's own layers, and
axonn_plan.json, the plan it reads.

The entry point calls axonn.init(G_inter, G_data, G_intra_r, G_intra_c, G_intra_d, gpus_per_node) (axonn/axonn.py)
with the planned grid: G_intra_c = gx (column, X), G_intra_r = gy (row, Y), G_intra_d = gz (depth, Z),
G_data = gdata, G_inter = pp (shared/reference/axonn-facts.md), and trains inside
axonn.intra_layer.optimize_communication with the planned overlaps (OAR, ORS, OAG). Its Linear layers run in
AxoNN's default (non-expert) mode: the layers between them are data parallel over every rank and each Linear
gathers the batch of its X x Y group, so a micro-batch is split over the gx * gy ranks (the execution's
micro_batch_over_tensor rule). It trains on synthetic tokens, as the bundled trainer does by default, and prints
the bundled trainer's JSON metric lines, so `validate --collect` reads it like one of the bundled runs.
AxoNN's pipeline (G_inter > 1) needs its own inter-layer engine and a model cut into stages, which this entry
point does not write: pp > 1 is refused (the axonn execution has no pipeline schedules).
"""
from __future__ import annotations

import json

from axoplan.loop.frameworks import Emitted
from axoplan.runconfig import Overlap

NAME = "AxoNN"
VERSION = "axonn 0.2.0"
SCRIPT_NAME = "train_axonn.py"
PLAN_NAME = "axonn_plan.json"


def init_kwargs(plan, gpus_per_node: int) -> dict:
    """axonn.init's arguments for the plan (the mapping of axonn-facts.md: X column, Y row, Z depth)."""
    return {"G_inter": plan.pp, "G_data": plan.gdata, "G_intra_r": plan.gy, "G_intra_c": plan.gx,
            "G_intra_d": plan.gz, "gpus_per_node": gpus_per_node}


def plan_json(plan, model, job, profile, execution, steps: int) -> dict:
    return {"init": init_kwargs(plan, profile.gpus_per_node),
            # the planner's overlaps (OAR, ORS, OAG: runconfig.Overlap), which AxoNN has under these names
            "overlap": {"overlap_all_reduce": Overlap().all_reduce, "overlap_reduce_scatter": Overlap().reduce_scatter,
                        "overlap_all_gather": Overlap().all_gather},
            "grid": {"gx": plan.gx, "gy": plan.gy, "gz": plan.gz, "gdata": plan.gdata, "pp": plan.pp},
            "micro_batch": plan.micro_batch, "grad_acc": plan.grad_acc(job.global_batch),
            "global_batch": job.global_batch, "seq_len": job.seq_len, "checkpointing": plan.checkpointing,
            "steps": steps, "warmup_steps": min(2, steps - 1),
            "model": {"name": model.name, "n_layers": model.n_layers, "hidden": model.hidden,
                      "n_heads": model.n_heads, "kv_heads": model.kv_heads, "ffn": model.ffn,
                      "vocab": model.padded_vocab, "mlp": model.mlp, "norm": model.norm,
                      "position": model.position, "max_seq_len": max(job.seq_len, model.seq_len)},
            "bf16": profile.dtype_bytes == 2}


def write(plan, model, job, profile, execution, steps: int = 10) -> Emitted:
    d = plan_json(plan, model, job, profile, execution, steps)
    mapping = [f"gx={plan.gx} -> G_intra_c (column), gy={plan.gy} -> G_intra_r (row), gz={plan.gz} -> G_intra_d "
               f"(depth), gdata={plan.gdata} -> G_data, pp={plan.pp} -> G_inter",
               "overlaps OAR, ORS, OAG -> optimize_communication(overlap_all_reduce, overlap_reduce_scatter, "
               "overlap_all_gather)",
               f"micro-batch {plan.micro_batch} -> {plan.micro_batch // (plan.gx * plan.gy)} sequence(s) per rank "
               f"(AxoNN's Linear gathers the gx x gy group's), {d['grad_acc']} micro-batches per step",
               f"checkpointing {'on' if plan.checkpointing else 'off'} -> torch.utils.checkpoint per block"]
    return Emitted({PLAN_NAME: (json.dumps(d, indent=1) + "\n", 0o644), SCRIPT_NAME: (SCRIPT, 0o644)},
                   [f'"$RUN_DIR/{SCRIPT_NAME}"'], mapping=mapping)


SCRIPT = '''"""GPT training on AxoNN 0.2.0, written by `axoplan emit --framework axonn` for the plan in axonn_plan.json.

Start it with torchrun (launch_torchrun.sh, launch_slurm.sbatch): it needs one CUDA GPU per rank and NCCL.
It prints one JSON line per step and a last line with "summary": true (the bundled trainer's metrics).
"""
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

PLAN = json.loads(Path(__file__).with_name("axonn_plan.json").read_text())


def init_kwargs(plan=PLAN):
    """axonn.init's arguments: the planned grid; the GPUs per node from torchrun where it says."""
    kw = dict(plan["init"])
    kw["gpus_per_node"] = int(os.environ.get("LOCAL_WORLD_SIZE", kw["gpus_per_node"]))
    return kw


def comm_kwargs(model, plan=PLAN):
    """optimize_communication's arguments: the planned overlaps (the all-gather prefetch walks the model)."""
    kw = dict(plan["overlap"])
    kw["model_object_for_overlapping_allgathers"] = model if kw["overlap_all_gather"] else None
    return kw


class Norm(torch.nn.Module):
    def __init__(self, h, kind):
        super().__init__()
        self.kind, self.weight = kind, torch.nn.Parameter(torch.ones(h))
        self.bias = None if kind == "rmsnorm" else torch.nn.Parameter(torch.zeros(h))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), self.weight)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias)


def rope(x, pos):
    # rotary embedding over the head dimension, half split (RoFormer)
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos[:, None].float() * freq[None]
    cos, sin = ang.cos()[None, None], ang.sin()[None, None]
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        from axonn.intra_layer import Linear

        h, self.heads, self.kv = m["hidden"], m["n_heads"], m["kv_heads"]
        self.hd, self.mlp, self.position = h // self.heads, m["mlp"], m["position"]
        self.ln1, self.ln2 = Norm(h, m["norm"]), Norm(h, m["norm"])
        # AxoNN's GPT block: QKV and fc1 normal, the attention output and fc2 transposed (axonn-facts.md 2)
        self.qkv = Linear(h, h + 2 * self.kv * self.hd, bias=False)
        self.proj = Linear(h, h, transpose=True, bias=False)
        self.fc1 = Linear(h, m["ffn"] * (2 if self.mlp == "swiglu" else 1), bias=False)
        self.fc2 = Linear(m["ffn"], h, transpose=True, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split([h, self.kv * self.hd, self.kv * self.hd], -1)
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, s, self.kv, self.hd).transpose(1, 2)
        if self.position == "rope":
            pos = torch.arange(s, device=x.device)
            q, k = rope(q, pos), rope(k, pos)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        u = self.fc1(self.ln2(x))
        if self.mlp == "swiglu":
            g, u = u.chunk(2, -1)
            u = F.silu(g) * u
        else:
            u = F.gelu(u, approximate="tanh")
        return x + self.fc2(u)


class GPT(torch.nn.Module):
    def __init__(self, m, checkpointing):
        super().__init__()
        from axonn.intra_layer import Linear

        self.checkpointing = checkpointing
        self.embed = torch.nn.Embedding(m["vocab"], m["hidden"])
        self.pos = torch.nn.Embedding(m["max_seq_len"], m["hidden"]) if m["position"] == "learned" else None
        self.blocks = torch.nn.ModuleList(Block(m) for _ in range(m["n_layers"]))
        self.norm = Norm(m["hidden"], m["norm"])
        self.head = Linear(m["hidden"], m["vocab"], bias=False)

    def forward(self, tokens):
        from axonn.intra_layer import overlap_all_gathers_for_checkpointed_forward

        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))[None]
        for blk in self.blocks:
            if self.checkpointing:
                def run(y, blk=blk):
                    if torch.is_grad_enabled():  # the recompute in the backward: prefetch this block's weights
                        with overlap_all_gathers_for_checkpointed_forward(blk):
                            return blk(y)
                    return blk(y)

                x = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=True)
            else:
                x = blk(x)
        return self.head(self.norm(x))


def main():
    from axonn import axonn as ax
    from axonn.intra_layer import clip_grad_norm_, optimize_communication, sync_gradients

    if not torch.cuda.is_available():
        sys.exit("error: AxoNN needs CUDA GPUs (axonn.init calls torch.cuda.set_device)")
    dist.init_process_group("nccl")  # torchrun's env://; AxoNN then builds its groups on it
    ax.init(**init_kwargs())
    g, m = PLAN["grid"], PLAN["model"]
    tensor = g["gx"] * g["gy"]
    local = PLAN["micro_batch"] // tensor  # AxoNN's Linear gathers the X x Y group's sequences
    torch.manual_seed(1234)  # the same initial replicated weights on every rank
    model = GPT(m, PLAN["checkpointing"]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    dtype = torch.bfloat16 if PLAN["bf16"] else torch.float32
    times, rank0 = [], dist.get_rank() == 0
    for step in range(PLAN["steps"]):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(PLAN["grad_acc"]):
            tokens = torch.randint(0, m["vocab"], (local, PLAN["seq_len"] + 1), device="cuda", generator=gen)
            with optimize_communication(**comm_kwargs(model)):
                with torch.autocast("cuda", dtype=dtype, enabled=PLAN["bf16"]):
                    logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
                (loss / PLAN["grad_acc"]).backward()
            total += float(loss) / PLAN["grad_acc"]
        sync_gradients(model, mean=True)
        grad_norm = float(clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        if rank0:
            print(json.dumps({"step": step + 1, "loss": total, "grad_norm": grad_norm, "batch_time_s": dt,
                              "tokens_per_s": PLAN["global_batch"] * PLAN["seq_len"] / dt}), flush=True)
    if rank0:
        timed = times[PLAN["warmup_steps"]:] or times
        med = statistics.median(timed)
        print(json.dumps({"summary": True, "median_batch_time_s": med, "steps": PLAN["steps"],
                          "warmup_steps": PLAN["warmup_steps"], "framework": "axonn",
                          "median_tokens_per_s": PLAN["global_batch"] * PLAN["seq_len"] / med,
                          "loss_finite": math.isfinite(total)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
