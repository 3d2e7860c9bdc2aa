"""Memory per GPU: weight shards with their gradients and AdamW state, gathered-weight buffers,
gradient blocks waiting for their reduce-scatter, activations with and without checkpointing,
and the fp32 logits of the loss."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..specs import ModelSpec


@dataclass
class Memory:
    states: np.ndarray  # parameters, gradients and optimizer state of the shards
    buffers: np.ndarray  # gathered weights and full gradient blocks
    activations: np.ndarray
    logits: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.states + self.buffers + self.activations + self.logits


def state_bytes_per_element(dtype_bytes: int) -> int:
    """Mixed precision keeps fp32 gradients, an fp32 master copy and AdamW's two fp32 moments beside a
    half-precision parameter (2+4+4+8); fp32 training needs no master copy (4+4+8)."""
    return 18 if dtype_bytes == 2 else 16


def activation_elems_per_token(model: ModelSpec, gx, gy) -> np.ndarray:
    """Elements one block keeps for its backward, per token: norm inputs and outputs, q/k/v, the
    attention output (flash attention keeps no S x S matrix), MLP input, hidden and activation."""
    h_x = model.hidden / gx
    return 4 * h_x + (model.qkv_out + model.hidden + model.fc1_out + model.ffn) / gy


def memory(model: ModelSpec, gx, gy, gz, tokens, checkpointing, shard_elements, block_elems_per_layer,
           max_block_elems, dtype_bytes: int, prefetch: bool, deferred_rs: bool) -> Memory:
    """block_elems_per_layer: gathered elements of one block's four weights together (per GPU)."""
    states = shard_elements * state_bytes_per_element(dtype_bytes)
    # gathered weights: the one in use plus the prefetched one; under checkpointing one block's
    # weights stay gathered from its recompute to its backward.
    gathered = (2 if prefetch else 1) * max_block_elems * dtype_bytes
    gathered = gathered + np.where(checkpointing, block_elems_per_layer * dtype_bytes, 0)
    # full gradient blocks live until their reduce-scatter finishes: all of them when the
    # reduce-scatters are only collected at the end of backward.
    grad_blocks = np.where(deferred_rs, block_elems_per_layer * model.n_layers, max_block_elems) * dtype_bytes
    per_block = activation_elems_per_token(model, gx, gy) * tokens * dtype_bytes
    block_input = tokens * (model.hidden / gx) * dtype_bytes
    acts = np.where(checkpointing, block_input * model.n_layers + per_block, per_block * model.n_layers)
    logits = tokens * (model.padded_vocab / gy) * 4 * 2
    return Memory(states, gathered + grad_blocks, acts, logits)
