"""Goldfish loss (reference §6): the hashed mask and the loss it gives."""
import subprocess
import sys

import numpy as np
import pytest

from axoplan.runtime.goldfish import goldfish_keep


def _text(n, seed):  # random printable bytes (no NUL, as in text)
    return np.random.default_rng(seed).integers(32, 127, size=n)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_drops_about_one_in_k(k):
    keep = goldfish_keep(_text(200_000, 1), k=k, h=13)
    assert abs((1 - keep.mean()) - 1 / k) < 0.01


def test_first_h_minus_1_never_dropped():
    keep = goldfish_keep(_text(64 * 500, 2).reshape(500, 64), k=2, h=13)
    assert keep[:, :12].all()
    assert not keep[:, 12:].all()


def test_same_context_same_mask():
    passage = _text(300, 3)
    a = np.concatenate([_text(50, 4), passage])
    b = np.concatenate([_text(80, 5), passage, _text(10, 6)])
    ka, kb = goldfish_keep(a, 4, 13), goldfish_keep(b, 4, 13)
    # positions whose whole window of h targets lies in the passage are masked identically
    assert np.array_equal(ka[50 + 12:50 + 300], kb[80 + 12:80 + 300])
    assert np.array_equal(goldfish_keep(a, 4, 13), ka)  # deterministic
    assert not ka[50 + 12:].all()


def test_mask_is_torch_free():
    code = "import sys, axoplan.runtime.goldfish; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loss_standard_when_disabled_and_mean_over_kept():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from axoplan.runtime.reference import ReferenceGPT
    from axoplan.planner.specs import load_model

    ref = ReferenceGPT(load_model("gpt-tiny"), seed=1)
    tokens = torch.from_numpy(_text(4 * 33, 7).reshape(4, 33))
    with torch.no_grad():
        logits = ref(tokens[:, :-1])
        per_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        keep = torch.from_numpy(goldfish_keep(tokens[:, 1:].numpy(), 4, 13)).reshape(-1)
        assert torch.allclose(ref.loss(tokens), per_tok.mean())
        assert torch.allclose(ref.loss(tokens, (4, 13)), per_tok[keep].mean())
        assert 0 < (~keep).sum() < keep.numel()
