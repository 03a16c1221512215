"""The top-k / top-p and min-p filters, in place on one step's rows: the sampler applies them
to the target's distribution and rejection_sampler.py to a draft's (its q), so both see the
same filtering."""

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Set logits outside each row's top-k / top-p nucleus to -inf, in place.

    The row's best token always survives, so no row is left empty.
    """
    # Stable descending sort: among equal logits the lower id ranks first,
    # matching argmax's tie rule.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        drop |= ranks.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 keep everything: cumsum rounding could otherwise
        # exceed 1.0 and drop the tail.
        drop |= (mass_before > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    logits.scatter_(1, order, sorted_logits.masked_fill_(drop, float("-inf")))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero tokens below min_p times the row's top probability, in place."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)
