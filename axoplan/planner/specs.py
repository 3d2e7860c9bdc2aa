"""What is trained (ModelSpec) and how much of it (Job): plain data shared by planner and trainer.

A ModelSpec is a decoder-only transformer in the AxoNN/Megatron shape: token embedding,
optional learned positions (or RoPE), `n_layers` blocks of [norm, attention, norm, MLP] with
pre-norm residuals, a final norm and an untied LM head. Linear layers carry no bias
(PaLM/Llama style); in GPT-3-sized models biases are below 0.01% of the FLOP and of the bytes
communicated, so the planner and the trainer both leave them out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from axoplan import inputs
from axoplan.errors import UserError
from axoplan.yamlio import load_yaml

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")


@dataclass(frozen=True)
class LinearShape:
    """One fully-connected layer of a block, O = I·W with W of shape [k, n]."""

    name: str
    k: int  # in_features
    n: int  # out_features
    transposed: bool  # AxoNN's transpose=True: in-features over Y, out-features over X

    @property
    def axes(self) -> tuple[str, str]:
        """(axis splitting the in-features, axis splitting the out-features): normal x, y; transposed y, x."""
        return ("y", "x") if self.transposed else ("x", "y")

    def local(self, gx, gy) -> tuple:
        """(k, n) of one rank's [k/g_in, n/g_out] block of the weight, per candidate (gx, gy arrays or ints)."""
        size = {"x": gx, "y": gy}
        ax_in, ax_out = self.axes
        return self.k // size[ax_in], self.n // size[ax_out]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    vocab: int
    seq_len: int = 2048
    n_kv_heads: int | None = None  # None: same as n_heads (multi-head attention)
    ffn_hidden: int | None = None  # None: 4 * hidden
    mlp: str = "gelu"  # gelu: fc1 H->F; swiglu: fc1 H->2F (gate and up), fc2 F->H
    norm: str = "layernorm"
    position: str = "learned"
    vocab_multiple: int = 128  # the embedding and LM head are padded to a multiple of this
    description: str = ""
    source: str = ""

    # ---- derived shapes -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def qkv_out(self) -> int:
        return self.hidden + 2 * self.kv_heads * self.head_dim

    @property
    def fc1_out(self) -> int:
        return 2 * self.ffn if self.mlp == "swiglu" else self.ffn

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab // m) * m

    def block_linears(self) -> tuple[LinearShape, ...]:
        """The four GEMM layers of one block in execution order (reference §2)."""
        h = self.hidden
        return (
            LinearShape("qkv", h, self.qkv_out, False),
            LinearShape("attn_out", h, h, True),
            LinearShape("fc1", h, self.fc1_out, False),
            LinearShape("fc2", self.ffn, h, True),
        )

    def lm_head(self) -> LinearShape:
        return LinearShape("lm_head", self.hidden, self.padded_vocab, False)

    def embedding_local(self, gx, gy) -> tuple:
        """(rows, columns) of one rank's [V/gy, H/gx] block of the vocabulary-parallel embedding."""
        return self.padded_vocab // gy, self.hidden // gx

    @property
    def n_params(self) -> int:
        per_block = sum(lin.k * lin.n for lin in self.block_linears()) + 2 * self.hidden  # two norms
        emb = self.padded_vocab * self.hidden
        pos = self.seq_len * self.hidden if self.position == "learned" else 0
        return self.n_layers * per_block + 2 * emb + pos + self.hidden

    def flops_per_token(self, seq_len: int | None = None, recompute: bool = False) -> float:
        """Model FLOP per token for forward+backward (matmuls and attention scores, causal not halved,
        as in the paper's accounting); with recompute the forward is counted twice."""
        s = seq_len or self.seq_len
        mm = sum(lin.k * lin.n for lin in self.block_linears()) * self.n_layers + self.hidden * self.padded_vocab
        attn = 2 * s * self.hidden * self.n_layers  # QK^T and AV per token, forward
        fwd = 2 * mm + 2 * attn
        factor = 4 if recompute else 3
        # the LM head is not recomputed under block checkpointing
        extra = 0.0
        if recompute:
            extra = -2 * self.hidden * self.padded_vocab
        return factor * fwd + extra

    def validate(self, where: str = "model") -> ModelSpec:
        def bad(msg: str) -> None:
            raise UserError(f"{where}: {msg}")

        if not isinstance(self.name, str) or not self.name.strip():
            bad(f"field 'name' must be a non-empty string, got {inputs.show(self.name)}")
        for f in ("name", "description", "source"):
            v = getattr(self, f)
            if not isinstance(v, str):
                bad(f"field '{f}' must be text, got {inputs.show(v)}")
        inputs.text(self.name, f"{where}: field 'name'")  # a name stays one line; a description may span lines
        for f in ("n_layers", "hidden", "n_heads", "vocab", "seq_len", "vocab_multiple", "n_kv_heads", "ffn_hidden"):
            v = getattr(self, f)
            if v is None and f in ("n_kv_heads", "ffn_hidden"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"field '{f}' must be a positive integer{' or absent' if f in ('n_kv_heads', 'ffn_hidden') else ''}, "
                    f"got {inputs.show(v)}")
            hi = MODEL_LIMITS.get(f, inputs.MAX_COUNT)
            if v > hi:
                bad(f"field '{f}' must be at most {hi:,}, got {inputs._short(v)}")
        if self.hidden % self.n_heads:
            bad(f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            bad(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.mlp not in MLP_KINDS:
            bad(f"field 'mlp' must be one of {', '.join(MLP_KINDS)}, got {inputs.show(self.mlp)}")
        if self.norm not in NORM_KINDS:
            bad(f"field 'norm' must be one of {', '.join(NORM_KINDS)}, got {inputs.show(self.norm)}")
        if self.position not in POSITION_KINDS:
            bad(f"field 'position' must be one of {', '.join(POSITION_KINDS)}, got {inputs.show(self.position)}")
        if self.position == "rope" and self.head_dim % 2:
            bad(f"rope needs an even head dimension, got {self.head_dim}")
        return self


@dataclass(frozen=True)
class Job:
    """How much training one step does: `global_batch` sequences of `seq_len` tokens on `gpus` GPUs."""

    gpus: int
    global_batch: int
    seq_len: int

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch * self.seq_len

    def validate(self) -> Job:
        inputs.count(self.gpus, "--gpus", 1, inputs.MAX_GPUS)
        inputs.count(self.global_batch, "--global-batch", 1, inputs.MAX_GLOBAL_BATCH)
        inputs.count(self.seq_len, "--seq-len", 1, inputs.MAX_SEQ_LEN)
        return self


# Bounds on a model's sizes: far above any real model (GPT-1T has 25,600 hidden, 128 layers), low
# enough that every product the planner forms stays exact in int64 and float64.
MODEL_LIMITS = {"n_layers": 2**16, "hidden": 2**20, "n_heads": 2**16, "n_kv_heads": 2**16, "ffn_hidden": 2**22,
                "vocab": 2**24, "seq_len": inputs.MAX_SEQ_LEN, "vocab_multiple": 2**16}


# ---- presets and YAML ----------------------------------------------------------------
_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}


def _preset_dir():
    return resources.files("axoplan") / "presets"


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".yaml"))


def model_from_dict(d: Any, where: str) -> ModelSpec:
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected a mapping of model fields at the top level")
    unknown = sorted(str(k) for k in set(d) - _FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown field '{unknown[0]}' (known: {', '.join(sorted(_FIELDS))})")
    for req in ("name", "n_layers", "hidden", "n_heads", "vocab"):
        if req not in d:
            raise UserError(f"{where}: missing required field '{req}'")
    return ModelSpec(**d).validate(where)


def _read_yaml(path: Path | Any, where: str) -> Any:
    return load_yaml(path, where)


def load_model(name_or_path: str | ModelSpec) -> ModelSpec:
    """A preset name (see `axoplan models`) or a path to a model YAML."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    s = inputs.text(str(name_or_path), "--model")
    p = Path(s)
    if s.endswith((".yaml", ".yml")) or p.exists():
        if not p.is_file():
            raise UserError(f"model file '{s}' {'is not a file' if p.exists() else 'does not exist'}")
        return model_from_dict(_read_yaml(p, f"model file '{s}'"), f"model file '{s}'")
    # a preset is a name among the bundled files, never a path ('../../x/m' would load m.yaml from anywhere)
    res = _preset_dir() / f"{s}.yaml"
    if s not in preset_names():
        raise UserError(f"unknown model '{s}'; known presets: {', '.join(preset_names())} (or give a YAML path)")
    return model_from_dict(_read_yaml(res, f"preset '{s}'"), f"preset '{s}'")
