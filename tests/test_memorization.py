"""Memorization study: the metrics on hand-made cases, the documents and their repetition, greedy
decoding and held-out loss of the parallel model against the single-process reference (2 gloo
ranks), and short end-to-end runs of `axoplan memorization` in-process and under torchrun."""
from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml

from axoplan.errors import UserError
from axoplan.studies.memorization import (SUFFIX, RepeatedDocuments, chunk_texts, exact_match, lcs_length, make_documents,
                                  rouge_l, score, stdlib_texts, steps_for)

TINY = dict(name="mem-tiny", n_layers=2, hidden=64, n_heads=8, vocab=256, seq_len=64, vocab_multiple=64)


# ---- metrics --------------------------------------------------------------------------------------
def test_exact_match_needs_every_token_and_the_same_length():
    ref = list(range(50))
    assert exact_match(list(range(50)), ref)
    assert exact_match(np.arange(50), ref)  # numpy ids compare by value
    assert not exact_match(list(range(49)) + [0], ref)  # the last token differs
    assert not exact_match([99] + list(range(1, 50)), ref)  # the first token differs
    assert not exact_match(list(range(49)), ref)  # one missing
    assert not exact_match(list(range(51)), ref)  # one extra


def test_lcs_on_hand_made_cases():
    assert lcs_length(b"ABCBDAB", b"BDCABA") == 4  # textbook example (BCBA)
    assert lcs_length(b"abc", b"abc") == 3
    assert lcs_length(b"abc", b"xyz") == 0
    assert lcs_length(b"", b"abc") == 0
    assert lcs_length(b"axbxc", b"abc") == 3  # a subsequence, not a substring
    assert lcs_length([1, 2, 3, 4], [4, 3, 2, 1]) == 1  # order matters


def test_rouge_l_is_the_lcs_f_measure():
    assert rouge_l(list(range(50)), list(range(50))) == 1.0
    assert rouge_l([1] * 50, [2] * 50) == 0.0
    # 50 vs 50 tokens sharing a 30-token subsequence: P = R = 30/50
    gen = list(range(30)) + [100] * 20
    ref = [200] * 10 + list(range(30)) + [201] * 10
    assert rouge_l(gen, ref) == pytest.approx(0.6)
    # unequal lengths: LCS 2, P = 2/4, R = 2/2, F = 2PR/(P+R) = 2/3
    assert rouge_l([1, 5, 3, 6], [1, 3]) == pytest.approx(2 / 3)
    # a shifted copy (one token dropped at the front) keeps 49 of 50
    assert rouge_l(list(range(1, 50)) + [7], list(range(50))) == pytest.approx(49 / 50)


def test_score_rates():
    refs = [[1] * 50, [2] * 50, [3] * 50, [4] * 50]
    gens = [[1] * 50, [2] * 50, [3] * 25 + [0] * 25, [0] * 50]
    s = score(gens, refs)
    assert s.exact == [True, True, False, False]
    assert s.exact_rate == 0.5
    assert s.mean_rouge == pytest.approx((1 + 1 + 0.5 + 0) / 4)


# ---- documents ------------------------------------------------------------------------------------
def test_stdlib_docstrings_are_ascii_prose():
    texts = stdlib_texts()
    assert len(texts) > 50
    assert all(t.isascii() and b"\n" not in t for _, t in texts)
    docs = make_documents(texts, 65, 16, 4, seed=0, source="stdlib", max_per_text=1)
    assert docs.train.shape == (16, 65) and docs.heldout.shape == (4, 65)
    assert not set(docs.train_names) & set(docs.heldout_names)  # held-out text is never trained on


def test_documents_chunk_dedupe_and_errors():
    texts = [("a", b"x" * 30 + b"y" * 100), ("b", b"x" * 30 + b"z" * 100), ("c", b"w" * 99)]
    chunks = chunk_texts(texts, 60)
    # 60-byte documents have 10-byte prompts: b#0 starts like a#0, so it cannot be told apart and is skipped
    assert [n for n, _ in chunks] == ["a#0", "a#1", "b#1", "c"]
    assert all(len(c) == 60 for _, c in chunks)
    same_prompt = [("p", b"q" * 10 + b"1" * 50), ("r", b"q" * 10 + b"2" * 50)]
    assert len(chunk_texts(same_prompt, 60)) == 1  # one prompt cannot reproduce two endings
    with pytest.raises(UserError, match="fewer than"):
        make_documents(texts, 60, 4, 2, seed=0, source="t")
    with pytest.raises(UserError, match="no prompt"):
        make_documents(texts, SUFFIX, 1, 1, seed=0, source="t")


def test_every_document_is_seen_once_per_epoch_whatever_the_split():
    docs = np.arange(12 * 5).reshape(12, 5)
    src = RepeatedDocuments(docs, global_batch=4, seed=3)
    steps = steps_for(3, 12, 4)
    seen = np.concatenate([src.sequences(t, range(4), 5)[:, 0] for t in range(steps)]) // 5
    assert sorted(seen.tolist()) == sorted(list(range(12)) * 3)
    assert sorted(seen[:12].tolist()) == list(range(12))  # the first epoch is a permutation
    assert seen[:12].tolist() != list(range(12))  # ... shuffled
    # continuing with an offset walks on exactly where the previous segment stopped
    cont = RepeatedDocuments(docs, global_batch=4, seed=3)
    cont.offset = 5
    assert np.array_equal(cont.sequences(0, [1, 3], 5), src.sequences(5, [1, 3], 5))


# ---- parallel greedy decoding and held-out loss = the reference's -----------------------------------
GRIDS = [(1, 2, 1, 1), (2, 1, 1, 1), (1, 1, 2, 1)]


def _trained_reference(spec, docs):
    """A reference model trained a few steps on the documents, so its continuations are not noise."""
    import torch

    from axoplan.runtime.reference import ReferenceGPT, reference_optimizer, reference_step

    torch.manual_seed(0)
    ref = ReferenceGPT(spec, seed=0)
    opt = reference_optimizer(ref, 3e-3, 0.0)
    for _ in range(8):
        reference_step(ref, opt, torch.from_numpy(docs), 1.0)
    return ref


def _decode_worker(rank, world, port, spec_d, docs, out):
    import torch
    import torch.distributed as dist

    from axoplan.studies.memorization import generate_suffixes, mean_loss
    from axoplan.runtime.grid import build_grid
    from axoplan.runtime.model import ParallelGPT
    from axoplan.runtime.parallel_linear import Runtime
    from axoplan.planner.specs import ModelSpec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    spec = ModelSpec(**spec_d)
    params = _trained_reference(spec, docs).full_params()
    results = []
    for g in GRIDS:
        grid = build_grid(*g)
        model = ParallelGPT(spec, Runtime(grid), init_params=params)
        results.append({"grid": g, "gens": generate_suffixes(model, docs[:, :-SUFFIX], 12),
                        "loss": mean_loss(model, docs, batch=2)})
        grid.destroy()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parallel_greedy_decoding_and_loss_equal_the_reference(tmp_path):
    import torch
    import torch.multiprocessing as mp

    from axoplan.planner.specs import ModelSpec

    spec = ModelSpec(**TINY)
    texts = stdlib_texts()
    docs = make_documents(texts, 65, 4, 0, seed=1, source="stdlib", max_per_text=1).train
    out = tmp_path / "gens.json"
    mp.start_processes(_decode_worker, args=(2, _free_port(), TINY, docs, str(out)), nprocs=2, join=True,
                       start_method="spawn")
    ref = _trained_reference(spec, docs)
    expected = [ref.generate_greedy(torch.from_numpy(d[:-SUFFIX]), 12) for d in docs]
    assert len({tuple(e) for e in expected}) > 1  # the model says different things to different prompts
    with torch.no_grad():
        ref_loss = float(ref.loss(torch.from_numpy(docs)))
    for r in json.loads(out.read_text()):
        assert r["gens"] == expected, f"grid {r['grid']}"
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-5), f"grid {r['grid']}"


# ---- the command ------------------------------------------------------------------------------------
@pytest.fixture
def tiny_yaml(tmp_path):
    p = tmp_path / "mem-tiny.yaml"
    p.write_text(yaml.safe_dump(TINY))
    return str(p)


def _cli(argv, capsys):
    from axoplan.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    cap = capsys.readouterr()
    return e.value.code, cap.out, cap.err


def _check_outputs(out: Path, n_docs: int, points: int) -> dict:
    s = json.loads((out / "summary.json").read_text())
    for key in ("standard", "goldfish_loss"):
        r = s[key]
        assert 0.0 <= r["exact_match_rate"] <= 1.0 and 0.0 <= r["mean_rouge_l"] <= 1.0
        assert r["exact_matches"] == round(r["exact_match_rate"] * n_docs)
        assert np.isfinite(r["heldout_loss"]) and r["heldout_loss"] < np.log(256)  # it learned something
        assert len(r["curve"]) == points
    assert s["goldfish"] == {"k": 4, "h": 13}
    rows = (out / "per_document.csv").read_text().splitlines()
    assert len(rows) == n_docs + 1
    assert sum(int(r.split(",")[-4]) for r in rows[1:]) == s["standard"]["exact_matches"]
    assert len((out / "progress.jsonl").read_text().splitlines()) == 2 * points
    assert (out / "memorization.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == n_docs and all(len(g["standard"]) == SUFFIX for g in gens)
    return s


def test_command_end_to_end_in_process(tmp_path, tiny_yaml, capsys):
    out = tmp_path / "out"
    code, stdout, err = _cli(["memorization", "--model", tiny_yaml, "--n-docs", "8", "--n-heldout", "2",
                              "--repeats", "2", "--lr", "3e-3", "--threads", "1", "--out", str(out)], capsys)
    assert code == 0, err
    s = _check_outputs(out, 8, points=2)
    assert s["documents_source"] == "python-stdlib-docstrings"
    assert "goldfish k=4 h=13" in stdout and "held-out loss" in stdout
    assert s["steps"] == 2  # 8 documents x 2 repeats / batch 8


def test_command_under_torchrun_matches_one_process(tmp_path, tiny_yaml, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("subprocess", "argparse", "json"):
        text = next(t for n, t in stdlib_texts() if n == name)
        (docs / f"{name}.txt").write_bytes(text)
    common = ["memorization", "--model", tiny_yaml, "--docs", str(docs), "--n-docs", "4", "--n-heldout", "1",
              "--repeats", "2", "--batch", "4", "--eval-at", "2", "--threads", "1"]
    code, _, err = _cli(common + ["--nproc", "2", "--grid", "1,2,1,1", "--out", str(tmp_path / "two")], capsys)
    assert code == 0, err
    two = _check_outputs(tmp_path / "two", 4, points=1)
    assert two["grid"] == {"gx": 1, "gy": 2, "gz": 1, "gdata": 1}
    code, _, err = _cli(common + ["--out", str(tmp_path / "one")], capsys)
    assert code == 0, err
    one = _check_outputs(tmp_path / "one", 4, points=1)
    assert one["documents_digest"] == two["documents_digest"]
    for key in ("standard", "goldfish_loss"):  # the same training, to fp32 summation order
        assert two[key]["heldout_loss"] == pytest.approx(one[key]["heldout_loss"], abs=1e-4)
        assert two[key]["train_loss"] == pytest.approx(one[key]["train_loss"], abs=1e-4)


@pytest.mark.parametrize("args, message", [
    (["--docs", "/nonexistent/docs"], "documents path '/nonexistent/docs' does not exist"),
    (["--grid", "1,2,1"], "--grid must be four positive integers"),
    (["--nproc", "2", "--grid", "1,1,1,1"], "has 1 ranks, not --nproc 2"),
    (["--nproc", "2", "--grid", "1,3,1,1"], "has 3 ranks"),
    (["--n-docs", "100000"], "fewer than the 100000 training"),
    (["--seq-len", "40"], "too short"),
    (["--repeats", "0"], "--repeats must be at least 1"),
])
def test_user_errors_are_one_sentence(tmp_path, tiny_yaml, capsys, args, message):
    code, _, err = _cli(["memorization", "--model", tiny_yaml, "--out", str(tmp_path / "o")] + args, capsys)
    assert code == 2
    assert message in err and err.startswith("error: ") and "Traceback" not in err


def test_model_needs_a_byte_vocabulary(tmp_path, capsys):
    p = tmp_path / "small-vocab.yaml"
    p.write_text(yaml.safe_dump(dict(TINY, vocab=200)))
    code, _, err = _cli(["memorization", "--model", str(p)], capsys)
    assert code == 2 and "at least 256" in err
