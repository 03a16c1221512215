"""Where draft tokens come from: the Proposer interface and the n-gram proposer.

A proposer runs on the host between two steps, after the previous step's tokens were
appended and before the next schedule(). It sets drafts on the scheduler's draft
candidates (running, decode-ready sequences with nothing in flight that allow drafting)
through `set_drafts`; the scheduler then feeds them after each sequence's last token and
verifies them in the same forward pass.

An MTP head implements the same interface: it drafts from the target's last hidden state
and the token just sampled, so it also needs the model runner to keep the hidden states of
the sampled rows (not kept yet; it comes with the DeepSeek-architecture models).
"""

from __future__ import annotations

from typing import Protocol

from deepinfer_dp import _C


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        """Sets up to `k` drafts on each of `scheduler.draft_candidates()`; returns how many
        sequences got drafts. Drafts are valid for the next schedule() only."""


class NgramProposer:
    """Prompt lookup: a sequence's next tokens are guessed from what followed the latest
    earlier occurrence of its last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). The search runs in C++ over the token history in place."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        return scheduler.propose_ngram(k, self.min_n, self.max_n)
