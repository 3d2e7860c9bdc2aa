"""Whether a grid can run a model (torch-free, so the planner may share it): the divisibility
rules of the trainer's layouts, each failure as one sentence."""
from __future__ import annotations

from ..specs import ModelSpec


def grid_problem(spec: ModelSpec, gx: int, gy: int, gz: int, gdata: int, global_batch: int,
                 micro_batch: int, seq_len: int) -> str | None:
    """None if the trainer can run this configuration, else the first reason it cannot."""
    rules = (
        (spec.hidden % gx, f"hidden ({spec.hidden}) must be divisible by gx ({gx})"),
        (spec.n_heads % gy, f"n_heads ({spec.n_heads}) must be divisible by gy ({gy})"),
        (spec.kv_heads % gy, f"kv_heads ({spec.kv_heads}) must be divisible by gy ({gy})"),
        (spec.ffn % gy, f"the MLP width ({spec.ffn}) must be divisible by gy ({gy})"),
        (spec.padded_vocab % gy, f"the padded vocabulary ({spec.padded_vocab}) must be divisible by gy ({gy})"),
        (global_batch % (gdata * gz * micro_batch),
         f"global_batch ({global_batch}) must be divisible by gdata*gz*micro_batch ({gdata}*{gz}*{micro_batch})"),
    )
    for bad, why in rules:
        if bad:
            return why
    if spec.position == "learned" and seq_len > spec.seq_len:
        return f"seq_len ({seq_len}) exceeds the model's learned positions ({spec.seq_len})"
    return None
