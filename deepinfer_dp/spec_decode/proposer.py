"""Where draft tokens come from: the proposer protocols, what a proposer is built with, and
the n-gram proposer.

A proposer (`Proposer`) runs on the host between two steps, after the previous step's tokens
were appended and before the next schedule(). It sets drafts on the scheduler's draft
candidates (running, decode-ready sequences with nothing in flight that allow drafting)
through `set_drafts` (n-gram: `propose_ngram`, in C++); the scheduler then feeds them after
each sequence's last token and verifies them in the same forward pass. A proposer with a
network drafts on the device and the engine takes its drafts (`take_draft_token_ids`, as in
vLLM) and hands them to the scheduler.

A proposer with a network of its own (`ObservingProposer`: a draft model, an MTP head) also
sees the target's forward passes: to keep its own KV cache in step with the target's, and
(MTP) to read the target's last hidden states. The engine hands the worker, with each step,
whom to show the forward (Speculator.observer_for): the runner calls `observe_target` on the
device right after the forward with a `TargetStep` -- for speculative steps, or for every
pass when `observes_every_pass` (MTP: it cannot recompute hidden states it did not see) --
and the engine calls `after_target` on the host after every step with whether it was shown,
so that a draft model can tell which positions its own cache is missing. An MTP head drafts
from the hidden state of the row that sampled a sequence's newest token and that token:
`TargetStep.hidden_states` holds every fed row, `sample_indices` picks the sampled ones.
Under sampling, a proposer that samples its drafts from a distribution q returns q through
`draft_probs` so that verification can run the min(1, p/q) test
(layers/rejection_sampler.py); a deterministic proposer (n-gram) has none.

Such a proposer is built with a `ProposerContext` (the target's block layout, where its
passes run, the live requests) and a `DraftTarget` (what a draft model must match, the MTP
layer the loader attached), never with the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.attention import AttentionMetadata
from deepinfer_dp.sampling_params import SamplingParams


@dataclass
class TargetStep:
    """One target forward pass, as a proposer with its own network sees it (on the device)."""

    input_ids: torch.Tensor  # int64 [T]: the fed tokens, in-flight (ZOS) ones already filled in
    positions: torch.Tensor  # int64 [T]
    attn_metadata: AttentionMetadata  # the step's slots and block tables (the target's cache layout)
    hidden_states: torch.Tensor  # [T, hidden]: the target's last hidden states (after the final norm)
    sample_indices: torch.Tensor | None  # int64 [N]: the rows that sample, one per output row


class DraftRequest(Protocol):
    """What a proposer reads of a live request (the engine's RequestState): how it samples."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer with a network of its own is built with, instead of the engine: the
    target's block layout (its own cache mirrors it block for block), where and how its passes
    run, and the live requests by id."""

    num_blocks: int  # the target's KV blocks; the proposer adds max_num_seqs scratch blocks after them
    block_size: int
    max_num_seqs: int
    cpu_linear_kernel: bool  # fp32 on the CPU: the proposer's linears through the C++ kernel too
    requests: Mapping[str, DraftRequest]  # the engine's request table, read only
    run_on_device: Callable[..., Any]  # runs fn(*args) where the target's forwards run, returns its result
    thread_plan: Callable[[int], AbstractContextManager]  # the target's CPU thread plan for a pass of n tokens


@dataclass(frozen=True)
class DraftTarget:
    """The target model as a proposer sees it: what a draft model must match, and the MTP
    layer the loader attached to it (None unless the loader was asked for it)."""

    vocab_size: int
    vocab: Callable[[], dict[str, int]]  # the target tokenizer's token -> id (read only for a draft model)
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    packed_weights: bool  # how a draft model is loaded: as the target was
    mtp_layer: torch.nn.Module | None = None


class Proposer(Protocol):
    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        """Sets up to `k` drafts on each of `scheduler.draft_candidates()`; returns how many
        sequences got drafts. Drafts are valid for the next schedule() only."""


@runtime_checkable
class ObservingProposer(Proposer, Protocol):
    """A proposer with a network of its own (a draft model, an MTP head)."""

    # True: it must see every target pass, the placeholder's included (it cannot recompute
    # what it missed: MTP reads the target's hidden states); False: speculative passes only.
    observes_every_pass: bool
    # True: every step under the auto-off threshold is speculative, drafts or not, and a step
    # above it still makes the drafting passes on padding (draft_padding): under expert
    # parallelism MTP's MoE is a collective, and every DP rank must make the same passes.
    drafts_every_step: bool

    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        """Drafts up to `k` tokens for each of `scheduler.draft_candidates()` and keeps them for
        take_draft_token_ids (it does not set them); returns how many sequences got drafts."""

    def take_draft_token_ids(self) -> list[tuple[_C.Sequence, list[int]]]:
        """The drafts of the latest propose(), once: the engine hands them to the scheduler
        (vLLM's take_draft_token_ids)."""

    def observe_target(self, step: TargetStep) -> None:
        """Called on the device after every target forward it is shown."""

    def after_target(self, sched_out: _C.SchedulerOutput, observed: bool) -> None:
        """Called on the host after every step (`observed`: observe_target saw its forward)."""

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """The draft distributions q [k, vocab] this request's drafts were sampled from in
        the latest propose(), or None (greedy drafts, or no drafts)."""

    def draft_padding(self, k: int) -> None:
        """A step this rank drafts nothing in (drafts_every_step): its k passes on padding."""

    def stats(self) -> dict[str, Any]:
        """Its own counters for the rank's stats ({} when it has none)."""


class NgramProposer:
    """Prompt lookup: a sequence's next tokens are guessed from what followed the latest
    earlier occurrence of its last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min). The search runs in C++ over the token history in place."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, scheduler: _C.Scheduler, k: int) -> int:
        return scheduler.propose_ngram(k, self.min_n, self.max_n)
