"""Where draft tokens come from: the Proposer interface and the n-gram proposer.

A proposer runs on the host between two steps, after the previous step's tokens were
appended and before the next schedule(). It sets drafts on the scheduler's draft
candidates (running, decode-ready sequences with nothing in flight that allow drafting)
through `set_drafts`; the scheduler then feeds them after each sequence's last token and
verifies them in the same forward pass.

A proposer with a network of its own (a draft model, an MTP head) also needs to see the
target's forward passes: to keep its own KV cache in step with the target's, and (MTP) to
read the target's last hidden states. Such a proposer has `observe_target`, which the
model runner calls on the device right after each speculative target forward (steps with
speculation auto-off, ZOS-deferred ones and the placeholder step are not shown) with a
`TargetStep`, and `after_target`, which the engine calls on the host after every step with
whether the proposer saw it, so it can tell which positions its own cache is missing.
An MTP head drafts from the hidden state of the row that
sampled a sequence's newest token and that token: `TargetStep.hidden_states` holds every
fed row, `sample_indices` picks the sampled ones, and the scheduler output that the
proposer sees in `propose` (through the scheduler's sequences) says which rows were
accepted. Under sampling, a proposer that samples its drafts from a distribution q
returns q through `draft_probs` so that verification can run the min(1, p/q) test
(layers/rejection_sampler.py); a deterministic proposer (n-gram) has no `draft_probs`.
(A draft model recomputes what it missed from the tokens; an MTP head cannot recompute the
target's hidden states, so it will want every pass shown: Worker.execute_model_step sets
ModelInput.observe_target, today for speculative steps only.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.attention import AttentionMetadata


@dataclass
class TargetStep:
    """One target forward pass, as a proposer with its own network sees it (on the device)."""

    input_ids: torch.Tensor  # int64 [T]: the fed tokens, in-flight (ZOS) ones already filled in
    positions: torch.Tensor  # int64 [T]
    attn_metadata: AttentionMetadata  # the step's slots and block tables (the target's cache layout)
    hidden_states: torch.Tensor  # [T, hidden]: the target's last hidden states (after the final norm)
    sample_indices: torch.Tensor | None  # int64 [N]: the rows that sample, one per output row


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        """Sets up to `k` drafts on each of `scheduler.draft_candidates()`; returns how many
        sequences got drafts. Drafts are valid for the next schedule() only."""


class ObservingProposer(Proposer, Protocol):
    """A proposer with a network of its own (draft model; MTP head next)."""

    def observe_target(self, step: TargetStep) -> None:
        """Called on the device after every speculative target forward."""

    def after_target(self, sched_out: _C.SchedulerOutput, observed: bool) -> None:
        """Called on the host after every step (`observed`: observe_target saw its forward)."""

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """The draft distributions q [k, vocab] this request's drafts were sampled from in
        the latest propose(), or None (greedy drafts, or no drafts)."""


class NgramProposer:
    """Prompt lookup: a sequence's next tokens are guessed from what followed the latest
    earlier occurrence of its last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). The search runs in C++ over the token history in place."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        return scheduler.propose_ngram(k, self.min_n, self.max_n)
