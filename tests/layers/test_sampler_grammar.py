"""The sampler under grammar masks: a plain greedy batch with constrained rows stays the
one-argmax fast path (the C++ masked argmax on CPU float32, torch otherwise) and picks the
same tokens as the full path (masking a copy to -inf, then sampling); the logits are left
as they were."""

import torch

from deepinfer_dp.layers.sampler import Sampler, SamplingBatch
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.structured_output.manager import GrammarMask

VOCAB = 1000  # not a multiple of 32


def batch_of(params: list[SamplingParams], mask: GrammarMask) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, [None] * n, None, None, [0] * n, [None] * n, VOCAB,
                               torch.device("cpu")).with_grammar(mask)


def grammar_mask(rows: list[int], seed: int) -> GrammarMask:
    g = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (VOCAB + 31) // 32), generator=g, dtype=torch.int64)
    bitmask = (bitmask & bitmask.roll(1, 1)).to(torch.int32)  # about a quarter of the tokens allowed
    return GrammarMask(torch.tensor(rows, dtype=torch.int64), bitmask)


def test_greedy_with_grammar_stays_fast_and_matches_the_full_path():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[2, :] = 0.5  # ties among the allowed tokens
    before = logits.clone()
    mask = grammar_mask([4, 0, 2], seed=3)
    fast = batch_of([SamplingParams(temperature=0.0)] * 6, mask)
    assert fast.fast_greedy and fast.grammar is mask
    # greedy rows in a batch that is not the fast path (one random row) take the full path
    full = batch_of([SamplingParams(temperature=0.0)] * 5 + [SamplingParams(temperature=1.0, seed=1)], mask)
    assert not full.fast_greedy
    got = Sampler()(logits, fast).token_ids
    assert torch.equal(got[:5], Sampler()(logits, full).token_ids[:5])
    assert torch.equal(logits, before)
    masked = logits.clone()
    mask.apply(masked)
    assert torch.equal(got, masked.argmax(dim=-1))
    # not CPU float32 contiguous: the torch fallback, the same tokens
    strided = torch.randn(VOCAB, 6).t().copy_(logits)
    assert not strided.is_contiguous()
    assert torch.equal(Sampler()(strided, fast).token_ids, got)
