"""Memorization study: standard loss against goldfish loss (Hans et al. 2024; reference §6).

One study trains the same model twice from the same seed on the same documents, each seen
`repeats` times (standard loss, then goldfish loss), with the bundled 4D trainer on any grid.
At chosen repeat counts it prompts the model with every training document minus its last 50
tokens, greedy-decodes 50 tokens and scores them against the true ending: exact match (all 50
equal) and RougeL (F-measure of the longest common subsequence, over tokens). It also measures
the mean loss on held-out documents that were never trained on, so the cost of the cure shows.

Tokens are bytes (the trainer's byte-level data, vocab 256). A document is exactly one training
sequence of seq_len + 1 bytes, so every repeat of it sits at the same positions and, under
goldfish loss, gets the same mask.

    settings = StudySettings(model="gpt-tiny", repeats=256, threads=1, out="mem")
    result = run_study(settings)          # trains, evaluates, writes OUT/summary.json and a PNG

The module imports no torch at load time: the metrics, documents and outputs are plain Python
and numpy; the training side (`measure_on_ranks`) imports torch when it runs, on every rank.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from axoplan import inputs, plots
from axoplan.atomic import (
    append_line,
    atomic_write_text,
    check_writable,
    ensure_dir,
    write_files,
)
from axoplan.errors import UserError
from axoplan.yamlio import read_bytes

SUFFIX = 50  # tokens decoded and compared per document (the goldfish paper's setting)
LOSSES = ("standard", "goldfish")


# ---- metrics (pure) ------------------------------------------------------------------------------
def exact_match(generated, reference) -> bool:
    """All tokens equal and nothing missing or extra."""
    return len(generated) == len(reference) and all(int(a) == int(b) for a, b in zip(generated, reference))


def lcs_length(a, b) -> int:
    """Length of the longest common subsequence (not necessarily contiguous) of two token lists."""
    a, b = [int(t) for t in a], [int(t) for t in b]
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(generated, reference) -> float:
    """RougeL F-measure: 2PR/(P+R) with P = LCS/len(generated), R = LCS/len(reference).
    For two sequences of 50 tokens it is simply LCS/50."""
    lcs = lcs_length(generated, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(generated), lcs / len(reference)
    return 2 * p * r / (p + r)


@dataclass
class Scores:
    exact: list[bool]
    rouge: list[float]

    @property
    def exact_rate(self) -> float:
        return sum(self.exact) / len(self.exact) if self.exact else 0.0

    @property
    def mean_rouge(self) -> float:
        return sum(self.rouge) / len(self.rouge) if self.rouge else 0.0


def score(generations, references) -> Scores:
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations for {len(references)} references")
    return Scores([exact_match(g, r) for g, r in zip(generations, references)],
                  [rouge_l(g, r) for g, r in zip(generations, references)])


# ---- documents -----------------------------------------------------------------------------------
@dataclass
class Documents:
    """Training documents and held-out documents, each row one sequence of `length` byte tokens."""

    train: np.ndarray  # [n, length] int64
    heldout: np.ndarray  # [m, length] int64
    train_names: list[str]
    heldout_names: list[str]
    source: str  # "python-stdlib-docstrings" or the user's path

    @property
    def length(self) -> int:
        return int(self.train.shape[1])

    def digest(self) -> str:
        h = hashlib.sha256(self.train.astype(np.uint8).tobytes())
        h.update(self.heldout.astype(np.uint8).tobytes())
        return h.hexdigest()[:16]


def _module_docstring(path: Path) -> str | None:
    """The module docstring read from the first tokens only (no parse of the whole file)."""
    try:
        with open(path, "rb") as f:
            for tok in tokenize.tokenize(f.readline):
                if tok.type in (tokenize.ENCODING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                    continue
                if tok.type != tokenize.STRING:
                    return None
                value = ast.literal_eval(tok.string)
                return value if isinstance(value, str) else None
    except (OSError, SyntaxError, ValueError, tokenize.TokenError, UnicodeDecodeError):
        return None
    return None


def stdlib_texts() -> list[tuple[str, bytes]]:
    """The module docstrings of this Python's standard library (top-level modules and packages),
    whitespace collapsed, ASCII only: English prose that ships with every Python, read at run time.
    The set depends on the Python version, so a study records a digest of the documents it used."""
    import sysconfig

    root = Path(sysconfig.get_path("stdlib"))
    files = sorted(list(root.glob("*.py")) + list(root.glob("*/__init__.py")))
    out = []
    for f in files:
        doc = _module_docstring(f)
        if not doc:
            continue
        text = re.sub(r"\s+", " ", doc).strip()
        if text.isascii():
            name = f.parent.name if f.name == "__init__.py" else f.stem
            out.append((name, text.encode()))
    return out


MAX_DOCUMENT_BYTES = 256 * 2**20  # one text file of the --docs folder


def folder_texts(path: str) -> list[tuple[str, bytes]]:
    """The bytes of a text file, or of every file under a folder (sorted, hidden files skipped)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"documents path '{path}' does not exist (give a text file or a folder of text files)")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*")
                                            if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
    out = []
    for f in files:
        try:
            name = str(f.relative_to(p)) if p.is_dir() else f.name
            # a file name need not be UTF-8: its bytes escaped, so every output can name the document
            name = inputs.printable(os.fsencode(name).decode("utf-8", "backslashreplace"))
            out.append((name, read_bytes(f, f"document '{f}'", MAX_DOCUMENT_BYTES)))
        except OSError as e:
            raise UserError(f"cannot read document '{f}': {e.strerror or e}") from None
    return out


def chunk_texts(texts: list[tuple[str, bytes]], length: int, max_per_text: int | None = None) -> list[tuple[str, bytes]]:
    """Consecutive, non-overlapping chunks of `length` bytes from each text (the remainder is dropped);
    chunks whose first SUFFIX-free prompt repeats an earlier one are skipped, since two documents with
    the same prompt cannot both be reproduced from it."""
    out, seen = [], set()
    for name, data in texts:
        n = len(data) // length
        if max_per_text is not None:
            n = min(n, max_per_text)
        for i in range(n):
            chunk = data[i * length:(i + 1) * length]
            prompt = chunk[: length - SUFFIX]
            if prompt in seen:
                continue
            seen.add(prompt)
            out.append((f"{name}#{i}" if n > 1 else name, chunk))
    return out


def make_documents(texts: list[tuple[str, bytes]], length: int, n_train: int, n_heldout: int, seed: int,
                   source: str, max_per_text: int | None = None) -> Documents:
    """Cut texts into documents of `length` bytes, shuffle them with `seed`, take the first n_train
    for training and the next n_heldout as held-out text (never trained on)."""
    if length <= SUFFIX:
        raise UserError(f"documents of {length} tokens leave no prompt before the last {SUFFIX}; "
                        f"use a sequence length of at least {SUFFIX + 1}")
    chunks = chunk_texts(texts, length, max_per_text)
    need = n_train + n_heldout
    if len(chunks) < need:
        raise UserError(f"'{source}' gives {len(chunks)} distinct documents of {length} bytes, fewer than the "
                        f"{n_train} training + {n_heldout} held-out asked for")
    order = np.random.default_rng([seed, 11]).permutation(len(chunks))[:need]
    rows = np.array([np.frombuffer(chunks[i][1], dtype=np.uint8) for i in order], dtype=np.int64)
    names = [chunks[i][0] for i in order]
    return Documents(rows[:n_train], rows[n_train:], names[:n_train], names[n_train:], source)


def load_documents(docs: str | None, length: int, n_train: int, n_heldout: int, seed: int) -> Documents:
    if docs is None:
        # one document per module: chunks of one docstring would share a topic, not a prompt
        return make_documents(stdlib_texts(), length, n_train, n_heldout, seed, "python-stdlib-docstrings",
                              max_per_text=1)
    return make_documents(folder_texts(docs), length, n_train, n_heldout, seed, docs)


class RepeatedDocuments:
    """Trainer data source (the `sequences(step, indices, length)` protocol of runtime/data.py):
    global position p = step·batch + i walks through epochs, each a seeded permutation of the
    documents, so every document is seen once per epoch. Successive `Trainer.fit` calls continue the
    step count, so they continue the walk; `offset` shifts it (0: from the first document)."""

    def __init__(self, docs: np.ndarray, global_batch: int, seed: int):
        self.docs = np.asarray(docs, dtype=np.int64)
        self.batch, self.seed = global_batch, seed
        self.offset = 0
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.default_rng([self.seed, 13, epoch]).permutation(len(self.docs))
        return self._perms[epoch]

    def doc_at(self, position: int) -> int:
        n = len(self.docs)
        return int(self._perm(position // n)[position % n])

    def sequences(self, step: int, indices, length: int) -> np.ndarray:
        if length != self.docs.shape[1]:
            raise ValueError(f"documents have {self.docs.shape[1]} tokens, the trainer asks for {length}")
        base = (self.offset + step) * self.batch
        return self.docs[[self.doc_at(base + int(g)) for g in indices]]


# ---- settings ------------------------------------------------------------------------------------
@dataclass
class StudySettings:
    model: str
    out: str = "memorization-out"
    docs: str | None = None  # None: the Python standard library's module docstrings
    repeats: int = 256
    goldfish_k: int = 4
    goldfish_h: int = 13
    nproc: int = 1
    grid: tuple[int, int, int, int] | None = None  # gx, gy, gz, gdata; None: data parallel over nproc
    n_docs: int = 64
    n_heldout: int = 16
    seq_len: int | None = None  # None: the model's; a document is seq_len + 1 tokens
    global_batch: int = 8
    micro_batch: int | None = None  # None: the whole local batch at once
    lr: float = 3e-3
    weight_decay: float = 0.0  # memorization is the point: nothing pulls the weights back
    seed: int = 0
    eval_at: list[int] | None = None  # repeat counts to measure at; None: see checkpoints()
    threads: int | None = None  # torch threads per process; None: the trainer's rule (cores / processes)

    def checkpoints(self) -> list[int]:
        """Repeat counts to measure at: eval_at (within 1..repeats) and repeats itself; by default
        repeats/8, /4, /2 and repeats (each decoding pass over all documents costs time)."""
        pts = self.eval_at if self.eval_at else [self.repeats // 2 ** i for i in range(4)]
        return sorted({int(r) for r in pts if 0 < int(r) <= self.repeats} | {self.repeats})


def resolve_settings(s: StudySettings):
    """Check everything a user can get wrong before any training starts; return (spec, seq, grid, micro)."""
    from axoplan.planner.space import grid_problem
    from axoplan.planner.specs import load_model

    spec = load_model(s.model)
    if spec.vocab < 256:
        raise UserError(f"model '{spec.name}' has a vocabulary of {spec.vocab}; byte-level documents need at least 256")
    if s.threads is not None and s.threads < 1:
        raise UserError(f"--threads must be at least 1, got {s.threads}")
    for name in ("repeats", "nproc", "n_docs", "n_heldout", "global_batch", "goldfish_k", "goldfish_h"):
        v = getattr(s, name)
        if v < 1 or (name == "goldfish_k" and v < 2):
            raise UserError(f"--{name.replace('_', '-')} must be at least {2 if name == 'goldfish_k' else 1}, got {v}")
    inputs.number(s.lr, "--lr", lo=0, lo_open=True)
    inputs.number(s.weight_decay, "--weight-decay", lo=0)
    inputs.count(s.seed, "--seed", 0, inputs.MAX_SEED)
    if s.seq_len is not None:
        inputs.count(s.seq_len, "--seq-len", 1, inputs.MAX_SEQ_LEN)
    inputs.text(str(s.out), "--out")
    check_writable(Path(s.out) / "summary.json", "--out")  # before hours of training, not after
    seq = spec.seq_len if s.seq_len is None else s.seq_len
    if seq + 1 <= SUFFIX:
        raise UserError(f"a sequence of {seq} tokens is too short to hold a prompt and the last {SUFFIX} tokens; "
                        f"use --seq-len {SUFFIX} or more")
    grid = tuple(s.grid) if s.grid else (1, 1, 1, s.nproc)
    if math.prod(grid) != s.nproc:
        raise UserError(f"the grid {'x'.join(map(str, grid))} has {math.prod(grid)} ranks, not --nproc {s.nproc}")
    gx, gy, gz, gd = grid
    micro = s.micro_batch or s.global_batch // (gd * gz) or 1
    why = grid_problem(spec, gx, gy, gz, gd, s.global_batch, micro, seq)
    if why:
        raise UserError(f"cannot train '{spec.name}' on grid {'x'.join(map(str, grid))}: {why}")
    return spec, seq, grid, micro


def steps_for(repeats: int, n_docs: int, global_batch: int) -> int:
    """Optimizer steps for every document to be seen `repeats` times (rounded up to whole batches)."""
    return -(-repeats * n_docs // global_batch)


# ---- the measurement, on every rank (torch from here on) -------------------------------------------
def generate_suffixes(model, prompts: np.ndarray, n_new: int = SUFFIX) -> list[list[int]]:
    """Greedy continuation of every prompt with the parallel model (a collective: all ranks call)."""
    from axoplan.runtime.model import generate_greedy

    return [generate_greedy(model, [int(t) for t in p], n_new) for p in prompts]


def mean_loss(model, seqs: np.ndarray, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over every target of `seqs` [n, s+1], no mask. Every rank
    feeds the same sequences, so the result is the same everywhere (a collective, like decoding)."""
    import torch

    rt = model.rt
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            tokens = torch.from_numpy(np.ascontiguousarray(seqs[i:i + batch])).to(model.device)
            keep = torch.ones(tokens.shape[0], tokens.shape[1] - 1, device=model.device)
            rt.start_sequence(model.gather_sequence(backward=False))
            total += float(model.loss_sum(tokens, keep))
            rt.finish_backward()
            count += keep.numel()
    return total / count


def _launch_config(s: StudySettings, seq: int, grid, micro: int, goldfish: bool, metrics: str | None):
    from axoplan.runconfig import Goldfish, Grid, LaunchConfig

    gx, gy, gz, gd = grid
    return LaunchConfig(model=s.model, grid=Grid(gx, gy, gz, gd), global_batch=s.global_batch, micro_batch=micro,
                        seq_len=seq, steps=1, timing_warmup_steps=0, lr=s.lr, lr_decay_style="constant", weight_decay=s.weight_decay,
                        goldfish=Goldfish(s.goldfish_k, s.goldfish_h) if goldfish else None,
                        metrics=metrics, tensorboard=str(Path(s.out) / "tensorboard"),
                        seed=s.seed).validate("memorization")


def train_and_measure(s: StudySettings, docs: Documents, loss: str, seq: int, grid, micro: int,
                      progress=None) -> dict:
    """On every rank: train one model with `loss` through the bundled trainer, measuring at each
    checkpoint. Returns the same record on every rank."""
    from axoplan.runtime.train import Trainer

    out = Path(s.out)
    cfg = _launch_config(s, seq, grid, micro, loss == "goldfish", str(out / f"{loss}.metrics.jsonl"))
    source = RepeatedDocuments(docs.train, s.global_batch, s.seed)
    trainer = Trainer.from_config(cfg, data_source=source)
    if s.threads:
        # small models on a shared CPU: one thread per process avoids OpenMP oversubscription
        import torch

        torch.set_num_threads(s.threads)
    rank0 = trainer.grid.rank == 0
    if rank0 and os.path.exists(cfg.metrics):
        os.remove(cfg.metrics)  # a fresh log per study; the trainer appends as it goes
    prompts, suffixes = docs.train[:, :-SUFFIX], docs.train[:, -SUFFIX:]
    points, done, t_train, t_eval = [], 0, 0.0, 0.0
    try:
        for r in s.checkpoints():
            steps = steps_for(r, len(docs.train), s.global_batch) - done
            t0 = time.perf_counter()
            if steps > 0:
                with contextlib.redirect_stdout(io.StringIO()):  # the step lines go to the metrics file
                    summary = trainer.fit(steps)
                done += steps
            t1 = time.perf_counter()
            gens = generate_suffixes(trainer.model, prompts)
            sc = score(gens, suffixes)
            point = {"loss": loss, "repeats": r, "steps": done, "exact_match_rate": sc.exact_rate,
                     "mean_rouge_l": sc.mean_rouge, "train_loss": mean_loss(trainer.model, docs.train),
                     "heldout_loss": mean_loss(trainer.model, docs.heldout),
                     "last_step_loss": trainer.records[-1]["loss"] if trainer.records else None}
            t_train += t1 - t0
            t_eval += time.perf_counter() - t1
            points.append(point)
            if rank0 and progress:
                progress(point)
        final = {"generations": gens, "exact": sc.exact, "rouge_l": sc.rouge}
        return {"loss": loss, "points": points, "final": final, "train_seconds": t_train, "eval_seconds": t_eval,
                "median_batch_time_s": summary["median_batch_time_s"], "grid": summary["grid"],
                "goldfish": summary["goldfish"]}
    finally:
        trainer.close()


def measure_on_ranks(job: dict) -> dict | None:
    """Both trainings in one process world (in-process for a world of one, else under torchrun).
    Rank 0 returns the results; other ranks return None."""
    import torch
    import torch.distributed as dist

    s = settings_from_dict(job["settings"])
    docs = documents_from_dict(job["documents"])
    _spec, seq, grid, micro = resolve_settings(s)
    owned = not dist.is_initialized()
    progress_path = Path(s.out) / "progress.jsonl"

    def progress(point):
        append_line(progress_path, json.dumps(point))
        print(_progress_line(point), flush=True)

    runs, threads = {}, torch.get_num_threads()
    try:
        for loss in LOSSES:
            runs[loss] = train_and_measure(s, docs, loss, seq, grid, micro, progress)
        rank = dist.get_rank() if dist.is_initialized() else 0
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)  # an in-process study leaves its caller as it found it
    return runs if rank == 0 else None


def _progress_line(p: dict) -> str:
    return (f"{p['loss']:>8}  repeats {p['repeats']:>4}  exact match {100 * p['exact_match_rate']:5.1f}%  "
            f"RougeL {p['mean_rouge_l']:.3f}  train loss {p['train_loss']:.3f}  held-out loss {p['heldout_loss']:.3f}")


# ---- job files (what torchrun workers read) ----------------------------------------------------------
def settings_from_dict(d: dict) -> StudySettings:
    d = dict(d)
    if d.get("grid") is not None:
        d["grid"] = tuple(d["grid"])
    return StudySettings(**d)


def documents_to_dict(docs: Documents) -> dict:
    return {"train": docs.train.tolist(), "heldout": docs.heldout.tolist(), "train_names": docs.train_names,
            "heldout_names": docs.heldout_names, "source": docs.source}


def documents_from_dict(d: dict) -> Documents:
    return Documents(np.array(d["train"], dtype=np.int64), np.array(d["heldout"], dtype=np.int64),
                     d["train_names"], d["heldout_names"], d["source"])


def _worker_main(job_path: str) -> int:
    """Entry point of each torchrun rank: run the study's trainings, rank 0 writes the results."""
    job = json.loads(Path(job_path).read_text())
    runs = measure_on_ranks(job)
    if runs is not None:
        atomic_write_text(job["results_path"], json.dumps(runs))
    return 0


# ---- orchestration -----------------------------------------------------------------------------------
def run_study(s: StudySettings, echo=print) -> dict:
    """Train both losses (in-process for one rank, under torchrun otherwise), then write
    OUT/summary.json, OUT/per_document.csv, OUT/generations.jsonl and OUT/memorization.png."""
    spec, seq, grid, _micro = resolve_settings(s)
    docs = load_documents(s.docs, seq + 1, s.n_docs, s.n_heldout, s.seed)
    out = ensure_dir(s.out)
    atomic_write_text(out / "progress.jsonl", "")  # a fresh progress log; lines are appended as they come
    job = {"settings": dataclasses.asdict(s), "documents": documents_to_dict(docs),
           "results_path": str(out / ".runs.json")}
    echo(f"memorization: model {spec.name}, {len(docs.train)} documents of {docs.length} tokens "
         f"(prompt {docs.length - SUFFIX}, suffix {SUFFIX}) from {docs.source}, {s.repeats} repeats, "
         f"grid gx,gy,gz,gdata = {','.join(map(str, grid))}, goldfish k={s.goldfish_k} h={s.goldfish_h}")
    t0 = time.perf_counter()
    if s.nproc == 1:
        runs = measure_on_ranks(job)
    else:
        runs = _run_torchrun(s, job, out)
    wall = time.perf_counter() - t0
    summary = build_summary(s, spec.name, grid, docs, runs, wall)
    # every output is made in memory first, then all replace the last run's together (or none does)
    write_files(out, {"summary.json": (json.dumps(summary, indent=2) + "\n", None),
                      "per_document.csv": (per_document_csv(docs, runs), None),
                      "generations.jsonl": (generations_jsonl(docs, runs), None),
                      "memorization.png": (plot_png(summary), None)})
    return summary


def _run_torchrun(s: StudySettings, job: dict, out: Path) -> dict:
    job_path = out / ".job.json"
    results = Path(job["results_path"])
    if results.exists():
        results.unlink()
    atomic_write_text(job_path, json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={s.nproc}",
           "-m", "axoplan.studies.memorization", str(job_path)]
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a study launched from inside another job starts its own world
    if s.threads:
        env["OMP_NUM_THREADS"] = str(s.threads)  # the trainer then leaves torch's thread count alone
    proc = subprocess.run(cmd, env=env, check=False)
    if proc.returncode != 0 or not results.exists():
        raise UserError(f"the {s.nproc}-rank training under torchrun failed (exit code {proc.returncode}); "
                        f"see its output above")
    runs = json.loads(results.read_text())
    results.unlink()
    job_path.unlink()
    return runs


def build_summary(s: StudySettings, model_name: str, grid, docs: Documents, runs: dict, wall: float) -> dict:
    per_loss = {}
    for loss in LOSSES:
        r = runs[loss]
        last = r["points"][-1]
        per_loss[loss] = {"exact_match_rate": last["exact_match_rate"], "mean_rouge_l": last["mean_rouge_l"],
                          "exact_matches": int(sum(r["final"]["exact"])), "heldout_loss": last["heldout_loss"],
                          "train_loss": last["train_loss"], "curve": r["points"],
                          "train_seconds": r["train_seconds"], "eval_seconds": r["eval_seconds"],
                          "median_batch_time_s": r["median_batch_time_s"]}
    return {
        "model": model_name, "documents": len(docs.train), "heldout_documents": len(docs.heldout),
        "document_tokens": docs.length, "prompt_tokens": docs.length - SUFFIX, "suffix_tokens": SUFFIX,
        "tokenizer": "bytes", "documents_source": docs.source, "documents_digest": docs.digest(),
        "repeats": s.repeats, "steps": steps_for(s.repeats, len(docs.train), s.global_batch),
        "global_batch": s.global_batch, "lr": s.lr, "weight_decay": s.weight_decay, "seed": s.seed,
        "goldfish": {"k": s.goldfish_k, "h": s.goldfish_h},
        "grid": dict(zip(("gx", "gy", "gz", "gdata"), grid)), "nproc": s.nproc,
        "python": sys.version.split()[0], "wall_seconds": wall,
        "standard": per_loss["standard"], "goldfish_loss": per_loss["goldfish"],
    }


def per_document_csv(docs: Documents, runs: dict) -> str:
    lines = ["index,name,exact_standard,rouge_l_standard,exact_goldfish,rouge_l_goldfish"]
    fs, fg = runs["standard"]["final"], runs["goldfish"]["final"]
    for i, name in enumerate(docs.train_names):
        safe = name.replace('"', "'")
        lines.append(f'{i},"{safe}",{int(fs["exact"][i])},{fs["rouge_l"][i]:.4f},{int(fg["exact"][i])},{fg["rouge_l"][i]:.4f}')
    return "\n".join(lines) + "\n"


def _text(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("latin-1")


def generations_jsonl(docs: Documents, runs: dict) -> str:
    rows = []
    for i, name in enumerate(docs.train_names):
        rows.append(json.dumps({"index": i, "name": name, "prompt": _text(docs.train[i, :-SUFFIX]),
                                "true_suffix": _text(docs.train[i, -SUFFIX:]),
                                "standard": _text(runs["standard"]["final"]["generations"][i]),
                                "goldfish": _text(runs["goldfish"]["final"]["generations"][i])}))
    return "\n".join(rows) + "\n"


def format_table(summary: dict) -> str:
    k, h = summary["goldfish"]["k"], summary["goldfish"]["h"]
    rows = [("loss", "exact match", "RougeL", "train loss", "held-out loss")]
    for key, label in (("standard", "standard"), ("goldfish_loss", f"goldfish k={k} h={h}")):
        r = summary[key]
        rows.append((label, f"{r['exact_matches']}/{summary['documents']} ({100 * r['exact_match_rate']:.1f}%)",
                     f"{r['mean_rouge_l']:.3f}", f"{r['train_loss']:.3f}", f"{r['heldout_loss']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{summary['documents']} documents x {summary['repeats']} repeats, last {summary['suffix_tokens']} of "
                 f"{summary['document_tokens']} tokens decoded greedily; losses in nats per token")
    return "\n".join(lines)


def plot_png(summary: dict) -> bytes:
    """Exact match and RougeL against repeats for both losses (bars when measured at one repeat count)."""
    plt = plots.pyplot()

    k = summary["goldfish"]["k"]
    series = (("standard", "standard loss", "o-"), ("goldfish_loss", f"goldfish loss (k={k})", "s-"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    metrics = (("exact_match_rate", 100.0, "exact match of the last 50 tokens (% of documents)", 103),
               ("mean_rouge_l", 1.0, "mean RougeL of the last 50 tokens", 1.03))
    one_point = all(len(summary[key]["curve"]) == 1 for key, _, _ in series)
    for ax, (metric, scale, ylabel, top) in zip(axes, metrics):
        if one_point:
            vals = [scale * summary[key]["curve"][0][metric] for key, _, _ in series]
            bars = ax.bar([label for _, label, _ in series], vals, color=["tab:blue", "tab:orange"])
            ax.bar_label(bars, fmt="%.2f" if scale == 1.0 else "%.1f")
            ax.set_title(f"after {summary['repeats']} repeats")
        else:
            for key, label, style in series:
                c = summary[key]["curve"]
                ax.plot([p["repeats"] for p in c], [scale * p[metric] for p in c], style, label=label)
            ax.set_xscale("log", base=2)
            reps = sorted({p["repeats"] for key, _, _ in series for p in summary[key]["curve"]})
            ax.set_xticks(reps, [str(r) for r in reps])
            ax.minorticks_off()
            ax.set_xlabel("times each document was seen")
            ax.legend()
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{summary['model']}: {summary['documents']} documents of {summary['document_tokens']} tokens, "
                 f"greedy decoding of the last {summary['suffix_tokens']}")
    fig.tight_layout()
    return plots.png_bytes(fig, dpi=100)


if __name__ == "__main__":  # torchrun -m axoplan.studies.memorization JOB.json (started by run_study)
    sys.exit(_worker_main(sys.argv[1]))
