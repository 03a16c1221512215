"""Lossless verification of drafts sampled from a draft distribution q (a draft model).

Row j of a verification holds the target's distribution p after draft j - 1. Draft token d
(drawn from q) is kept with probability min(1, p(d) / q(d)); otherwise the row's token is
drawn from norm(max(0, p - q)). The row's token is then distributed exactly as p
(Leviathan et al., 2023), and a rejected row's token is never d (there p(d) < q(d), so the
residual is 0 at d), so the scheduler's rule "draft j is accepted when row j's token equals
it" (csrc/engine/scheduler_spec.cpp) reads acceptance off the tokens. The bonus row (after
the last draft) has no q and samples from p as usual. A draft that is one fixed token
(n-gram) is the q = one-hot case: sampling the row from p and comparing is the same test,
so those rows need nothing from here.

Random numbers of a seeded request come from its own generator, in row order, so the same
seed gives the same tokens again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_dp.layers.sampling_filters import apply_min_p, apply_top_k_top_p

_MIN_NOISE = 1e-20


@dataclass
class DraftRows:
    """The verification rows of one step whose drafts came with a distribution q."""

    rows: torch.Tensor  # int64 [M]: sample rows (into the step's logits) that verify a draft
    tokens: torch.Tensor  # int64 [M]: the draft token each row verifies
    probs: torch.Tensor  # float32 [M, vocab]: q, the distribution that draft was drawn from
    generators: tuple[torch.Generator | None, ...]  # per row: the request's, or None (global RNG)


def exponential_race(probs: torch.Tensor, generators: tuple[torch.Generator | None, ...]) -> torch.Tensor:
    """One draw per row from `probs` (unnormalised, non-negative): argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs)
    if any(g is None for g in generators):
        noise.exponential_()
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return (probs / noise.clamp_(min=_MIN_NOISE)).argmax(dim=-1)


def uniforms(n: int, generators: tuple[torch.Generator | None, ...], device: torch.device) -> torch.Tensor:
    u = torch.rand(n, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, device=device, generator=gen)[0]
    return u


def verify(p: torch.Tensor, draft: DraftRows) -> torch.Tensor:
    """The token of each draft row: its draft if kept, else a draw from the residual.
    `p` [M, vocab] is the target's distribution of those rows (need not be normalised)."""
    p = p / p.sum(dim=-1, keepdim=True)
    q = draft.probs
    p_d = p.gather(1, draft.tokens.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, draft.tokens.unsqueeze(1)).squeeze(1)
    # strict: a draft the target gives probability 0 is never kept, whatever q says
    keep = uniforms(len(draft.generators), draft.generators, p.device) * q_d < p_d
    residual = (p - q).clamp_(min=0.0)
    # p == q leaves no residual, but then every draft is kept; guard the 0/0 anyway
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    return torch.where(keep, draft.tokens, exponential_race(residual, draft.generators))


def draft_distribution(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """q for sampled drafts: the draft's logits through the request's own temperature and
    filters, so q is close to p and drafts are kept often. (Any q keeps verification
    lossless; a closer one only raises acceptance.)"""
    logits = logits / temperature.unsqueeze(1)
    if top_k is not None or top_p is not None:
        apply_top_k_top_p(logits, top_k, top_p)
    probs = logits.softmax(dim=-1)
    if min_p is not None:
        apply_min_p(probs, min_p)
    return probs / probs.sum(dim=-1, keepdim=True)
