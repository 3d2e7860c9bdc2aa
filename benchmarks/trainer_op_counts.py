"""Counts the operators the bundled trainer dispatches per block and per step (world size 1, CPU),
split into GEMMs, metadata-only ops (views, transposes: no kernel) and compute kernels. The planner's
per-kernel launch cost (axoplan/costmodel/compute.py KERNELS_*) uses these counts.

    python benchmarks/trainer_op_counts.py
"""
import collections, os, tempfile, yaml
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from axoplan.launch import LaunchConfig
from axoplan.runtime.train import Trainer

META = {"aten.view", "aten.detach", "aten.t", "aten.transpose", "aten.slice", "aten._unsafe_view", "aten.expand",
        "aten.split_with_sizes", "aten.unsqueeze", "aten.squeeze", "aten.as_strided", "aten.reshape", "aten.alias",
        "aten.select", "aten.permute", "aten.split"}
MM = {"aten.mm", "aten.addmm", "aten.bmm"}

class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.c = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.c[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

def phases(layers, ckpt):
    d = tempfile.mkdtemp()
    m = {"name": f"t{layers}", "n_layers": layers, "hidden": 64, "n_heads": 8, "vocab": 256, "seq_len": 64, "vocab_multiple": 64}
    p = os.path.join(d, "m.yaml"); open(p, "w").write(yaml.safe_dump(m))
    cfg = LaunchConfig(model=p, steps=1, global_batch=1, micro_batch=1, metrics=None, checkpointing=ckpt)
    tr = Trainer.from_config(cfg)
    tr.train_step(0)
    tokens, keep = tr.local_batch(1)
    model, rt = tr.model, tr.rt
    out = {}
    with Count() as c:
        rt.start_sequence(model.gather_sequence(backward=True))
        part = model.loss_sum(tokens, keep)
    out["fwd"] = c.c
    with Count() as c:
        (part / keep.sum()).backward(); rt.finish_backward()
    out["bwd"] = c.c
    with Count() as c:
        tr.reduce_gradients(); tr.clip_gradients(); tr.opt.step()
    out["step"] = c.c
    tr.close()
    return out

def split(counter):
    mm = sum(v for k, v in counter.items() if k in MM)
    meta = sum(v for k, v in counter.items() if k in META)
    return mm, meta, sum(counter.values()) - mm - meta

for ckpt in (False, True):
    a, b = phases(2, ckpt), phases(4, ckpt)
    for ph in ("fwd", "bwd", "step"):
        sa, sb = split(a[ph]), split(b[ph])
        per = [(y - x) / 2 for x, y in zip(sa, sb)]
        rest = [x - 2 * q for x, q in zip(sa, per)]
        print(f"ckpt={ckpt} {ph}: per block mm/meta/compute = {per}   outside blocks = {rest}")
