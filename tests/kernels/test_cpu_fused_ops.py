"""The C++ RMSNorm (with the residual add), RoPE and argmax against the torch ops they
replace on CPU, and their input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.rotary import _apply


def test_rms_norm_matches_torch_and_adds_the_residual_in_place():
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(9, 576, generator=g) * 3, torch.randn(9, 576, generator=g), torch.randn(576, generator=g)
    out = torch.empty_like(x)
    _C.rms_norm(x.numpy(), None, w.numpy(), 1e-5, out.numpy())
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (576,), w, 1e-5), atol=2e-6, rtol=1e-6)
    total = x.clone()
    _C.rms_norm(total.numpy(), res.numpy(), w.numpy(), 1e-5, out.numpy())
    assert torch.equal(total, x + res)  # the residual stream, exactly
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x + res, (576,), w, 1e-5), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("width", [64, 13])  # 13: the tail after the 8-wide partial sums
def test_rms_norm_module_on_cpu(width):
    norm = RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, width))
    x, res = torch.randn(4, 3, width), torch.randn(4, 3, width)
    expected = torch.nn.functional.rms_norm(x, (width,), norm.weight, 1e-6)
    torch.testing.assert_close(norm(x), expected, atol=2e-6, rtol=1e-6)
    total, normed = norm.add_and_norm(x.clone(), res)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(normed, norm(x + res), atol=0, rtol=0)


@pytest.mark.parametrize("d", [64, 40])  # 40: half a head of 20, 16 lanes and a scalar tail
@pytest.mark.parametrize("threads", [1, 2])  # 2: the 40 rows split in two
def test_rotary_in_place_on_strided_q_and_k_equals_torch_exactly(d, threads):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(40, 9 * d + 2 * 3 * d, generator=g)
    q = qkv[:, :9 * d].view(40, 9, d)
    k = qkv[:, 9 * d:12 * d].view(40, 3, d)
    cos, sin = torch.randn(40, d, generator=g), torch.randn(40, d, generator=g)
    want_q, want_k = _apply(q.clone(), cos[:, None], sin[:, None]), _apply(k.clone(), cos[:, None], sin[:, None])
    v_before = qkv[:, 12 * d:].clone()
    _C.rotary(q.numpy(), cos.numpy(), sin.numpy(), threads)
    _C.rotary(k.numpy(), cos.numpy(), sin.numpy(), threads)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 12 * d:], v_before)  # v, beside them in the row, untouched


@pytest.mark.parametrize("vocab", [49152, 1000, 13])  # 13: the portable loop
def test_argmax_matches_torch_with_ties_and_nan(vocab):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, vocab, generator=g)
    logits[1, 3] = logits[1, vocab - 2] = 50.0  # a tie: the first index wins
    logits[2, :] = 1.0  # all equal
    logits[4, vocab // 2] = float("nan")
    logits[4, vocab - 1] = float("nan")
    assert torch.equal(torch.from_numpy(_C.argmax(logits.numpy())), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [49152, 1000, 40, 8])  # 40: one group of 32 and a tail of 8
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_first_index_among_many_ties_at_any_split(vocab, threads):
    """Values from a few integers tie everywhere, so the chains that run over interleaved
    groups of 8 must hand back the first index of the maximum, whichever chain saw it."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 4, (48, vocab), generator=g).float()
    logits[0, :] = float("-inf")  # nothing above -inf: index 0
    logits[1, :] = float("-inf")
    logits[1, vocab - 1] = -1e30  # the last position alone
    logits[2, :] = 0.0
    logits[2, vocab - 8:] = -0.0  # -0.0 == 0.0: still index 0
    logits[3, 24:] = 7.0  # first seen by the fourth chain
    logits[5, vocab // 2] = float("nan")
    got = torch.from_numpy(_C.argmax(logits.numpy(), threads))
    assert torch.equal(got, logits.argmax(dim=-1))


def test_fused_ops_refuse_bad_inputs():
    x, w = np.zeros((2, 8), dtype=np.float32), np.ones(8, dtype=np.float32)
    with pytest.raises(ValueError, match="rms_norm"):
        _C.rms_norm(x, None, np.ones(7, dtype=np.float32), 1e-6, np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="residual"):
        _C.rms_norm(x, np.zeros((2, 7), dtype=np.float32), w, 1e-6, np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(TypeError):
        _C.rms_norm(x.astype(np.float64), None, w, 1e-6, np.zeros((2, 8)))
    with pytest.raises(ValueError, match="contiguous"):
        _C.rotary(np.zeros((2, 4, 8), dtype=np.float32).transpose(0, 2, 1).copy().transpose(0, 2, 1),
                  np.zeros((2, 8), dtype=np.float32), np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="cos and sin"):
        _C.rotary(np.zeros((2, 4, 8), dtype=np.float32), np.zeros((3, 8), dtype=np.float32),
                  np.zeros((3, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="argmax"):
        _C.argmax(np.zeros((2, 0), dtype=np.float32))
    with pytest.raises(ValueError, match="num_threads"):
        _C.argmax(np.zeros((2, 8), dtype=np.float32), 0)
