"""The min(1, p/q) test on its own: a draft drawn from q, verified against p, leaves tokens
distributed as p; drafts are kept at the rate sum(min(p, q)); a rejected row never repeats
its draft (the scheduler reads acceptance off that); seeded rows reproduce."""

from __future__ import annotations

import torch

from deepinfer_dp.layers.rejection_sampler import DraftRows, draft_distribution, exponential_race, verify

P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
Q = torch.tensor([0.1, 0.4, 0.1, 0.3, 0.1])
N = 200_000


def draws(n: int, gens=None):
    torch.manual_seed(3)
    gens = gens or (None,) * n
    q = Q.expand(n, -1).contiguous()
    drafts = exponential_race(q, gens)
    rows = DraftRows(torch.arange(n), drafts, q, gens)
    return drafts, verify(P.expand(n, -1) * 7.0, rows)  # p need not be normalised


def test_verified_tokens_are_distributed_as_p():
    drafts, tokens = draws(N)
    freq = torch.bincount(tokens, minlength=5).float() / N
    assert torch.allclose(freq, P, atol=0.005), freq
    kept = (tokens == drafts).float().mean().item()
    assert abs(kept - torch.minimum(P, Q).sum().item()) < 0.005, kept
    # where p >= q the draft is always kept; elsewhere a rejection never returns the draft
    always = P >= Q
    assert bool((tokens[always[drafts]] == drafts[always[drafts]]).all())


def test_a_draft_the_target_excludes_is_never_kept():
    p = torch.tensor([[0.0, 1.0, 0.0]]).expand(1000, -1)
    q = torch.tensor([[1.0, 0.0, 0.0]]).expand(1000, -1).contiguous()
    tokens = verify(p, DraftRows(torch.arange(1000), torch.zeros(1000, dtype=torch.int64), q, (None,) * 1000))
    assert bool((tokens == 1).all())


def test_seeded_rows_reproduce():
    def gens():
        return tuple(torch.Generator().manual_seed(i) for i in range(64))
    assert torch.equal(draws(64, gens())[1], draws(64, gens())[1])


def test_draft_distribution_follows_temperature_and_top_k():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    q = draft_distribution(logits, torch.tensor([1.0]), torch.tensor([2]), None, None)
    assert torch.allclose(q, torch.tensor([[2 / 3, 1 / 3, 0.0]]))
