"""The engine's speculative decoding: decides per step whether to draft, drafts, and
reports the counters.

Per step (LLMEngine.step calls `before_schedule` before Scheduler::schedule):
- above `disable_by_batch_size` requests running or waiting, no drafts: the step is an ordinary
  decode step, deferred by ZOS as usual;
- the acceptance back-off (`disable_by_acceptance`, Scheduler::set_draft_backoff): a
  request drafts one more token than its last verification kept (all K after a run kept
  whole), and one whose verifications keep nothing several times in a row is no draft
  candidate for a while: it decodes one token a step;
- otherwise the proposer sets drafts and the step is not deferred: the next step's drafts
  need this step's accepted tokens on the host, and how many are accepted is known only
  after verification. (A sequence whose token is still in flight from a deferred step gets
  no drafts; one undeferred step later it has them.)
Lockstep is unchanged: a speculative step is one engine step, and the placeholder step
feeds 1 + K dummy tokens (draft padding), so its shapes match a speculative step's.

A draft model (spec_decode/draft_model.py) runs over the target's speculative passes only:
ZOS-deferred and auto-off steps cost nothing extra, and the draft catches up on the tokens
it missed (one draft pass) the next time it drafts for that sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.mla import is_mla, mla_entry_size
from deepinfer_dp.layers.rejection_sampler import DraftRows
from deepinfer_dp.layers.sampler import SamplingBatch
from deepinfer_dp.models import kv_cache_bytes_per_block
from deepinfer_dp.models.loader import load_hf_config, resolve_model_dir
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.spec_decode.config import DRAFT_PAUSE_TOKENS, SpeculativeConfig
from deepinfer_dp.spec_decode.draft_model import load_draft_proposer
from deepinfer_dp.spec_decode.mtp import MTPProposer
from deepinfer_dp.spec_decode.proposer import (
    DraftRequest,
    DraftTarget,
    NgramProposer,
    ObservingProposer,
    Proposer,
    ProposerContext,
    TargetStep,
)

TargetObserver = Callable[[TargetStep], None]


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # The proposer's own network, if it has one: it sees the target's passes and may
        # sample its drafts from a distribution of its own.
        self.network: ObservingProposer | None = proposer if isinstance(proposer, ObservingProposer) else None
        self._observer = None if self.network is None else self.timed(self.network.observe_target)
        self.spec_steps = 0  # steps with speculation on (drafted, not deferred); auto-off steps are not counted
        # Host seconds the proposer spent: drafting, and a network's own passes over the
        # target's forwards (timed()). On CUDA the drafts' copy to the host waits for the
        # drafting kernels; a network's passes over the target's forwards count their launches.
        self.draft_time_s = 0.0

    def before_schedule(self, scheduler: _C.Scheduler) -> bool:
        """Drafts for the next step unless the batch is too large; True when speculating
        (the step must then be post-processed in place, not deferred)."""
        limit = self.config.disable_by_batch_size
        every_step = self.network is not None and self.network.drafts_every_step
        # Requests waiting count, as vLLM counts enqueued requests: a batch being admitted
        # passes through a moment with one request running (the others wait to share its
        # prompt's blocks), and drafting for it then (a draft model's pass over the whole
        # prompt) was thrown away when the next step filled up with prefills.
        if limit is not None and scheduler.num_running + scheduler.num_waiting > limit:
            if every_step:  # MTP under EP: the peers may draft, their collectives need ours
                start = time.perf_counter()
                self.network.draft_padding(self.k)
                self.draft_time_s += time.perf_counter() - start
            return False
        start = time.perf_counter()
        drafted = self.proposer.propose(scheduler, self.k)
        if self.network is not None:  # a network's drafts are taken and handed to the scheduler here
            for seq, drafts in self.network.take_draft_token_ids():
                scheduler.set_drafts(seq, drafts)
        self.draft_time_s += time.perf_counter() - start
        # No drafts and every request paused by the acceptance back-off: an ordinary step,
        # deferred under ZOS and unseen by a draft model (it catches up when it drafts next).
        # MTP keeps every step speculative: under EP its collectives follow the steps.
        if drafted == 0 and not scheduler.may_draft() and not every_step:
            return False
        self.spec_steps += 1
        return True

    def observer_for(self, speculating: bool, placeholder: bool) -> TargetObserver | None:
        """Who sees this step's target forward (on the device): the network, for a speculative
        step's (a draft model catches up on the others when it drafts next), or for every
        pass, the placeholder's included, when it cannot catch up (MTP); else nobody."""
        if self.network is None:
            return None
        if self.network.observes_every_pass or (speculating and not placeholder):
            return self._observer
        return None

    def timed(self, observe: TargetObserver) -> TargetObserver:
        """`observe` (a proposer's pass over a target forward, run on the device thread)
        with its time added to draft_time_s."""
        def timed_observe(step: TargetStep) -> None:
            start = time.perf_counter()
            try:
                observe(step)
            finally:
                self.draft_time_s += time.perf_counter() - start
        return timed_observe

    def after_step(self, sched_out: _C.SchedulerOutput, speculating: bool) -> None:
        """Tells a proposer with its own network which positions its forward saw (only
        speculative steps'; a draft model catches up on the others when it drafts next)."""
        if self.network is not None and not sched_out.is_empty():
            self.network.after_target(sched_out, speculating)

    def with_drafts(self, batch: SamplingBatch | None, sched_out: _C.SchedulerOutput,
                    requests: dict[str, DraftRequest]) -> SamplingBatch | None:
        """Adds to a step's sampling batch the rows verifying drafts that were sampled from a
        distribution q (draft model, sampled requests): they need the min(1, p/q) test."""
        if batch is None or self.network is None or batch.all_greedy:
            return batch
        probs_of = self.network.draft_probs
        rids, fed, row_token = sched_out.sample_request_ids, sched_out.input_ids, sched_out.sample_indices
        rows, tokens, qs, gens = [], [], [], []
        start = 0
        while start < len(rids):  # a sequence's rows are contiguous: 1 + its number of drafts
            end = start + 1
            while end < len(rids) and rids[end] == rids[start]:
                end += 1
            k, q = end - start - 1, probs_of(rids[start])
            if k > 0 and q is not None:
                rows += range(start, start + k)
                tokens += [int(fed[row_token[r] + 1]) for r in range(start, start + k)]  # draft j after row j
                qs.append(q[:k])
                gens += [requests[rids[start]].generator] * k
            start = end
        if not rows:
            return batch
        device = qs[0].device
        return batch.with_drafts(DraftRows(torch.tensor(rows, dtype=torch.int64, device=device),
                                           torch.tensor(tokens, dtype=torch.int64, device=device),
                                           torch.cat(qs), tuple(gens)))

    @staticmethod
    def stats(scheduler_stats: dict[str, Any]) -> dict[str, Any]:
        """Derived rates, as vLLM reports them, from the scheduler's counters."""
        drafts = scheduler_stats["spec_decode_num_drafts"]
        draft_tokens = scheduler_stats["spec_decode_num_draft_tokens"]
        accepted = scheduler_stats["spec_decode_num_accepted_tokens"]
        per_pos = scheduler_stats["spec_decode_num_accepted_tokens_per_pos"]
        return {
            "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            # tokens a verified sequence gains per step: its accepted drafts plus the target's own
            "spec_decode_mean_accepted_length": 1 + accepted / drafts if drafts else None,
            "spec_decode_acceptance_rate_per_pos": [n / drafts for n in per_pos] if drafts else [],
        }


def build_speculator(config: SpeculativeConfig, ctx: ProposerContext, target: DraftTarget,
                     scheduler: _C.Scheduler) -> Speculator:
    """The speculator of `config` and its proposer, built with what a proposer may use of the
    engine (`ctx`) and the target model (`target`: what a draft must match, the MTP layer);
    gives `scheduler` the config's acceptance back-off."""
    if config.num_speculative_tokens + 1 > ctx.block_size:
        raise ValueError(f"speculative_config: num_speculative_tokens + 1 = {config.num_speculative_tokens + 1} "
                         f"must fit one KV block (block_size={ctx.block_size}): the placeholder step's "
                         "draft padding lives in the reserved block 0")
    if config.disable_by_acceptance is not None:
        # Across requests for a draft model only: its first drafts for a request cost a pass over the prompt.
        scheduler.set_draft_backoff(config.disable_by_acceptance, DRAFT_PAUSE_TOKENS,
                                    skip_requests=config.method == "draft_model")
    if config.method == "ngram":
        return Speculator(config)
    if config.method == "draft_model":
        return Speculator(config, load_draft_proposer(config.model, ctx, target))
    if target.mtp_layer is None:
        raise ValueError("speculative_config method 'mtp': the target model was loaded without its next-n layer")
    return Speculator(config, MTPProposer(target.mtp_layer, ctx))


def kv_bytes_per_block(config: SpeculativeConfig | None, target_config: Any, block_size: int,
                       dtype: torch.dtype) -> int:
    """Bytes one block of the proposer's own KV cache takes (0: it has none), for sizing the
    target's cache so that kv_cache_memory_gb holds both: a draft model's cache has all its
    layers, an MTP head's one latent layer. (Read before anything is loaded: the draft
    model's config only.)"""
    if config is None or config.method == "ngram":
        return 0
    if config.method == "draft_model":
        return kv_cache_bytes_per_block(load_hf_config(resolve_model_dir(config.model)), block_size, dtype)
    if not is_mla(target_config):  # no MTP layer to load: left to the loader to refuse
        return 0
    return block_size * mla_entry_size(target_config) * dtype.itemsize


def may_draft(params: SamplingParams) -> bool:
    """Requests whose sampling does not depend on their own history, so row j of a
    verification (the target after draft j - 1) is exactly the distribution a step without
    speculation would sample from at that position. Penalties and min_tokens depend on
    the tokens before, which in a verification include unverified drafts: such requests
    decode one token per step in the same batch.

    Under sampling, each row draws its token from the target's distribution, and the
    scheduler accepts draft j when row j drew it. For a draft that is one fixed token
    (n-gram, and any deterministic proposer) this IS rejection sampling, lossless: draft j
    is kept with probability p_j(draft), and on rejection the row's token is a draw from
    p_j restricted to the other tokens, renormalised. A proposer with its own draft
    distribution q (a draft model sampling) needs the general min(1, p/q) test instead
    (spec_decode/rejection.py, through Speculator.with_drafts).

    A structured-output request does not draft either: its token mask for row j would need
    the grammar advanced over the unverified drafts before it."""
    return not params.needs_history and params.min_tokens == 0 and params.structured_outputs is None


def stats(scheduler_stats: dict[str, Any], speculator: Speculator | None) -> dict[str, Any]:
    """The scheduler's counters plus the speculator's (zero when speculation is off) and,
    under speculation, the derived rates."""
    if speculator is None:
        return {**scheduler_stats, "spec_decode_steps": 0, "spec_decode_draft_time_s": 0.0}
    own = speculator.network.stats() if speculator.network is not None else {}  # a network's own (MTP's)
    return {**scheduler_stats, **Speculator.stats(scheduler_stats), "spec_decode_steps": speculator.spec_steps,
            "spec_decode_draft_time_s": speculator.draft_time_s, **own}
