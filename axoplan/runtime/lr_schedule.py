"""The learning rate of each step: linear warm-up, then cosine (or linear) decay to a floor, the
schedule of Megatron-LM (`--lr-warmup-iters`, `--lr-decay-iters`, `--lr-decay-style`, `--min-lr`)
and torchtitan (`lr_scheduler.warmup_steps`, `decay_type`, `min_lr_factor`). Torch-free and pure:
the step alone decides the rate, so a resumed run needs no scheduler state."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup: int = 0, decay_steps: int | None = None, min_lr: float = 0.0,
          style: str = "cosine", total_steps: int | None = None) -> float:
    """The rate of 0-based `step`, as nanoGPT's get_lr (train.py) computes it. Warm-up, step < warmup:
    lr*(step+1)/(warmup+1), so the first step already trains. Then the decay's progress
    p = (step-warmup)/(end-warmup), end = decay_steps or the run's length `total_steps`, goes from 0
    (the peak, at step warmup) towards 1 (min_lr, at step end; the run's last step is end-1, just
    above it) and stays at 1 after: cosine min_lr + (lr-min_lr)*(1+cos(pi*p))/2, linear
    min_lr + (lr-min_lr)*(1-p); constant: lr after the warm-up."""
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    end = decay_steps if decay_steps is not None else total_steps
    if style == "constant" or end is None or end <= warmup:
        return lr
    p = min(1.0, (step - warmup) / (end - warmup))
    if style == "linear":
        return min_lr + (lr - min_lr) * (1.0 - p)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr decay style {style!r}")


def config_lr(cfg, step: int) -> float:
    """lr_at with a LaunchConfig's keys (decay over the whole run unless lr_decay_steps is given)."""
    return lr_at(step, cfg.lr, cfg.lr_warmup_steps, cfg.lr_decay_steps, cfg.min_lr, cfg.lr_decay_style, cfg.steps)
