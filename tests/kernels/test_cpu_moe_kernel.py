"""The C++ mixture-of-experts kernel (`_C.moe_experts`): equal to the torch reference within
float noise, bit-identical whatever the batch around a token and the thread split, no token
dropped however skewed the routing, slots of other ranks' experts (-1) ignored, and every bad
argument a ValueError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.moe import experts_torch, select_experts


def problem(tokens: int, top_k: int, experts: int, hidden: int, inter: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    logits = torch.randn(tokens, experts, generator=gen)
    ids, weights = select_experts(logits, top_k, renormalize=True)
    return x, ids, weights, w13, w2


def run(x, ids, weights, w13, w2, threads: int = 1) -> torch.Tensor:
    out = torch.empty(x.shape[0], w2.shape[1])
    _C.moe_experts(x.numpy(), ids.numpy(), weights.numpy(), w13.numpy(), w2.numpy(), out.numpy(), threads)
    return out


@pytest.mark.parametrize("shape", [(1, 2, 8, 64, 32), (37, 4, 8, 64, 48), (130, 8, 64, 128, 96), (5, 2, 4, 40, 20)])
def test_matches_torch_reference(shape):
    x, ids, weights, w13, w2 = problem(*shape)
    assert (run(x, ids, weights, w13, w2) - experts_torch(x, ids, weights, w13, w2)).abs().max().item() < 1e-5


def test_bit_identical_whatever_the_batch_and_thread_split():
    x, ids, weights, w13, w2 = problem(96, 8, 64, 128, 96, seed=1)
    whole = run(x, ids, weights, w13, w2, threads=1)
    for threads in (2, 3, 4):
        assert torch.equal(run(x, ids, weights, w13, w2, threads), whole)
    # each token alone, and inside other batches, gives the very same bits
    for t in (0, 17, 95):
        assert torch.equal(run(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w13, w2, threads=2)[0], whole[t])
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(2))[:40]
    assert torch.equal(run(x[perm], ids[perm], weights[perm], w13, w2, threads=3), whole[perm])


def test_no_token_dropped_when_every_token_picks_the_same_experts():
    x, _, _, w13, w2 = problem(300, 2, 16, 64, 48, seed=3)
    ids = torch.tensor([[5, 9]] * 300, dtype=torch.int32)
    weights = torch.full((300, 2), 0.5)
    out = run(x, ids, weights, w13, w2, threads=2)
    assert (out - experts_torch(x, ids, weights, w13, w2)).abs().max().item() < 1e-5
    assert (out.abs().sum(dim=1) > 0).all()


def test_slots_of_other_ranks_add_nothing():
    x, ids, weights, w13, w2 = problem(20, 4, 8, 64, 32, seed=4)
    local = torch.where(ids < 4, ids, -1)  # experts 4..7 live on another rank
    local[3] = -1  # a token with no local slot at all
    out = run(x, local, weights, w13[:4].contiguous(), w2[:4].contiguous())
    assert torch.equal(out[3], torch.zeros(64))
    assert (out - experts_torch(x, local, weights, w13, w2)).abs().max().item() < 1e-5


def test_strided_rows_are_read_in_place():
    x, ids, weights, w13, w2 = problem(12, 2, 8, 64, 32, seed=5)
    wide = torch.cat([x, torch.randn(12, 7)], dim=1)  # rows of a received buffer: hidden + metadata
    out = torch.empty(12, 64)
    _C.moe_experts(wide.numpy()[:, :64], ids.numpy(), weights.numpy(), w13.numpy(), w2.numpy(), out.numpy(), 1)
    assert torch.equal(out, run(x, ids, weights, w13, w2))


def test_bad_arguments_raise_value_errors():
    x, ids, weights, w13, w2 = problem(4, 2, 8, 64, 32)
    out = np.empty((4, 64), dtype=np.float32)
    args = [x.numpy(), ids.numpy(), weights.numpy(), w13.numpy(), w2.numpy(), out]
    bad_id = ids.clone()
    bad_id[1, 1] = 8
    cases = {
        "expert id 8 outside": [args[0], bad_id.numpy(), *args[2:]],
        r"w2 must be \[E, H, I\]": [*args[:4], w2[:, :32].contiguous().numpy(), out],
        "topk_ids and topk_weights": [args[0], args[1], weights[:, :1].contiguous().numpy(), *args[3:]],
        "out must be": [*args[:5], np.empty((3, 64), dtype=np.float32)],
    }
    for message, call in cases.items():
        with pytest.raises(ValueError, match=f"moe_experts: {message}"):
            _C.moe_experts(*call, 1)
    with pytest.raises(TypeError):  # wrong dtype: never converted silently
        _C.moe_experts(x.double().numpy(), *args[1:], 1)
