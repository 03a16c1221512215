"""The C++ masked argmax (greedy structured output) against what the sampler did before it:
the bitmask applied to a copy of the logits with llguidance's torch helper, then
torch.argmax. Ties, NaN, nearly-empty and empty masks, vocabularies that are not a multiple
of 32 (or of 8: the portable loop), unmasked rows, and bad shapes raising."""

import llguidance.torch
import numpy as np
import pytest
import torch

from deepinfer_dp import _C


def reference(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    masked = logits.clone()
    sub = masked.index_select(0, rows)
    llguidance.torch.apply_token_bitmask_inplace(sub, bitmask)
    masked.index_copy_(0, rows, sub)
    return masked.argmax(dim=-1)


def masked_argmax(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(_C.masked_argmax(logits.numpy(), rows.numpy(), bitmask.numpy()))


def random_bitmask(rows: int, vocab: int, keep: float, g: torch.Generator) -> torch.Tensor:
    allowed = torch.rand(rows, vocab, generator=g) < keep
    bitmask = llguidance.torch.allocate_token_bitmask(rows, vocab)
    bitmask.zero_()
    for t in range(vocab):  # bit t % 32 of word t // 32 (int32 wraps at bit 31)
        word = bitmask[:, t // 32].to(torch.int64) | (allowed[:, t].to(torch.int64) << (t % 32))
        bitmask[:, t // 32] = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return bitmask


@pytest.mark.parametrize("vocab", [49152, 1000, 1003, 13])  # 1000: not a multiple of 32; 1003, 13: of 8
@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_masked_argmax_matches_masking_then_argmax(vocab, keep):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=g)
    rows = torch.tensor([5, 0, 2, 3, 6], dtype=torch.int64)  # rows 1 and 4 unmasked
    bitmask = random_bitmask(len(rows), vocab, keep, g)
    logits[2, :] = 1.0  # all equal: the first allowed token wins
    logits[3, 7] = logits[3, vocab - 1] = 80.0  # a tie between two tokens
    logits[4, vocab // 3] = float("nan")  # unmasked row: the first NaN, as torch.argmax
    logits[6, vocab - 1] = float("nan")
    assert torch.equal(masked_argmax(logits, rows, bitmask), reference(logits, rows, bitmask))


@pytest.mark.parametrize("vocab", [49152, 1000, 13])
def test_ties_nan_single_and_empty_masks(vocab):
    logits = torch.zeros(6, vocab)
    logits[:, vocab - 1] = 100.0  # the unmasked maximum, forbidden below
    bitmask = torch.zeros(6, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 0b1010  # tokens 1 and 3, tied: 1
    bitmask[1, (vocab - 2) // 32] = 1 << ((vocab - 2) % 32)  # only token vocab-2 (below the others' 100)
    bitmask[2] = -1
    bitmask[2, (vocab - 1) // 32] = 0  # all but the last word: token 0 wins the tie at 0.0
    # row 3: nothing allowed -> every value -inf -> index 0, as torch.argmax
    bitmask[4] = -1
    logits[4, 5] = float("nan")  # an allowed NaN is returned
    bitmask[5] = -1
    bitmask[5, 0] = ~(1 << 5)  # a forbidden NaN is not
    logits[5, 5] = float("nan")
    rows = torch.arange(6)
    got = masked_argmax(logits, rows, bitmask)
    assert torch.equal(got, reference(logits, rows, bitmask))
    assert got.tolist()[:5] == [1, vocab - 2, 0, 0, 5] and got[5] == vocab - 1


def test_no_masked_rows_is_plain_argmax():
    logits = torch.randn(3, 256)
    got = _C.masked_argmax(logits.numpy(), np.zeros(0, dtype=np.int64), np.zeros((0, 8), dtype=np.int32))
    assert torch.equal(torch.from_numpy(got), logits.argmax(dim=-1))


def test_bad_shapes_raise():
    x = np.zeros((2, 64), dtype=np.float32)
    rows, mask = np.array([0, 1], dtype=np.int64), np.full((2, 2), -1, dtype=np.int32)
    bad = [
        ((np.zeros((2, 0), dtype=np.float32), rows, mask), "V > 0"),
        ((np.zeros(64, dtype=np.float32), rows, mask), "want x"),
        ((x, rows.reshape(2, 1), mask), "want rows"),
        ((x, rows, mask[:1]), "1 rows for 2 row indices"),
        ((x, rows, np.full((2, 1), -1, dtype=np.int32)), "fewer than the 64 logits"),
        ((x, np.array([0, 2], dtype=np.int64), mask), "row index 2 outside"),
        ((x, np.array([0, -1], dtype=np.int64), mask), "row index -1 outside"),
        ((x, np.array([1, 1], dtype=np.int64), mask), "given twice"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=f"masked_argmax: .*{message}"):
            _C.masked_argmax(*args)
    with pytest.raises(TypeError):  # no silent conversion of the dtypes
        _C.masked_argmax(x, rows.astype(np.int32), mask)
    with pytest.raises(TypeError):
        _C.masked_argmax(x, rows, mask.astype(np.int64))
