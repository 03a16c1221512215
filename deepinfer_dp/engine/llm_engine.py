"""One rank's engine: admits requests into the C++ scheduler and takes steps.

step() = schedule (C++) -> Worker.execute_model_step (the four phases) -> the outputs
ready now. Outputs are pooled: valid until the next step() or flush_inflight_reqs();
keep one with clone(). The loop that calls step() is engine/step_loop.py.

The worker calls back into the engine twice per step (the StepHost protocol of
worker/worker.py): sampling_batch() before sampling and post_process() after it. A failure
while post-processing one request finishes that request with finish_reason "error" and
leaves the others and the engine running.

A structured-output request waits outside the C++ scheduler until its grammar is built
(structured_output/manager.py), a request with images until the image worker has them ready
(engine/image_requests.py); both count as local work, and a failure finishes the request with
finish_reason "error".
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.distributed.lockstep import Lockstep
from deepinfer_dp.engine import prompt_logprobs
from deepinfer_dp.engine.client import TokenDelta
from deepinfer_dp.engine.image_requests import ImageRequests
from deepinfer_dp.engine.input_processor import InputProcessor, InvalidRequest
from deepinfer_dp.engine.outputs import OwnedOutput
from deepinfer_dp.engine.request_state import RequestState, check_fits, eos_token_ids, is_special, sequence_limits
from deepinfer_dp.engine.sampling_defaults import checked_sampling_defaults
from deepinfer_dp.engine.stop_strings import StopStringChecker
from deepinfer_dp.layers.sampler import SamplingBatch, make_generator
from deepinfer_dp.models import LoadedModel, load_model, max_context_len
from deepinfer_dp.models.tokenizer import load_tokenizer
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.multimodal.processing import PSEUDO_ID_SPAN
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.spec_decode import speculator
from deepinfer_dp.spec_decode.proposer import DraftTarget, ProposerContext
from deepinfer_dp.structured_output.backend import GrammarBackend
from deepinfer_dp.structured_output.manager import StructuredOutputManager
from deepinfer_dp.worker.model_runner import ModelRunner, check_kv_capacity, kv_cache_dtype_for, num_kv_blocks_for
from deepinfer_dp.worker.worker import StepState, Worker

logger = logging.getLogger(__name__)
MAX_DEFAULT_CONTEXT = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        threads = config.resolved_threads()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        self.device = config.torch_device()
        expert_shard = (config.dp_rank, config.dp_size) if config.enable_expert_parallel else (0, 1)
        if config.enable_eplb:  # + the redundant slots: the layers hold physical slots and a map
            expert_shard = (*expert_shard, config.eplb_config.num_redundant_experts)
        spec = config.speculative_config
        loaded = load_model(config.model, config.torch_dtype(), self.device, config.packed_weights, expert_shard,
                            mtp=spec is not None and spec.method == "mtp", revision=config.revision)
        self.hf_config = loaded.hf_config
        self.model_dir = loaded.model_dir
        self.tokenizer = load_tokenizer(loaded.tokenizer_dir, config.tokenizer)
        self.eos_token_ids = eos_token_ids(loaded.model_dir, self.tokenizer)
        self.max_model_len = config.max_model_len or min(max_context_len(self.hf_config), MAX_DEFAULT_CONTEXT)
        self.vocab_size = self.hf_config.vocab_size
        self.input_processor = InputProcessor(self.vocab_size, self.max_model_len,
                                              checked_sampling_defaults(config.generation_config, loaded.model_dir))
        # a draft model's (or MTP head's) own KV cache comes out of the same budget
        draft_per_block = speculator.kv_bytes_per_block(spec, self.hf_config, config.block_size,
                                                        config.torch_dtype())
        cache_dtype = kv_cache_dtype_for(config, self.hf_config)
        num_blocks = num_kv_blocks_for(config, loaded, cache_dtype, self.max_model_len, draft_per_block)
        check_kv_capacity(config, loaded, cache_dtype, num_blocks, self.max_model_len, draft_per_block)
        # Requests with images (None: a model without vision); their placeholder ids sit above the vocabulary.
        self.images = ImageRequests.for_model(loaded.model, loaded.model_dir, config.media_limits(),
                                              config.mm_encoder_cache_tokens)
        self.worker = Worker(ModelRunner(config, loaded, num_blocks), config.zos)
        self.scheduler = _C.Scheduler(_C.SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, num_blocks=num_blocks, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size + (PSEUDO_ID_SPAN if self.images else 0),
            enable_prefix_caching=config.enable_prefix_caching, **self.worker.runner.kv_groups.scheduler_args(),
            max_num_encoder_input_tokens=config.max_num_encoder_input_tokens))
        self.requests: dict[str, RequestState] = {}
        self.speculator = None if spec is None else self._build_speculator(spec, loaded)
        # The DP vote when this engine is one rank of a group (set by cluster/); None: alone.
        self.lockstep: Lockstep | None = None
        self._finished: list[str] = []
        self._num_special = 0  # live requests needing more than plain greedy sampling
        self._prompt_logprobs: dict[str, prompt_logprobs.PromptLogprobs] = {}  # requests that asked
        self._counter = itertools.count()
        self.structured = StructuredOutputManager(GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids))
        self._build_failures: list[OwnedOutput] = []  # reported by the next step
        self.generate_step = 0
        self.placeholder_steps = 0
        self.requests_failed = 0

    def _build_speculator(self, spec: speculator.SpeculativeConfig, loaded: LoadedModel) -> speculator.Speculator:
        """The proposer gets what it may use of this engine (ProposerContext), not the engine."""
        runner, cfg = self.worker.runner, self.config
        ctx = ProposerContext(runner.num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.cpu_linear_kernel,
                              self.requests, self.worker.run_on_device, runner.thread_plan)
        target = DraftTarget(self.vocab_size, self.tokenizer.get_vocab, self.max_model_len, cfg.torch_dtype(),
                             self.device, cfg.packed_weights, loaded.mtp)
        return speculator.build_speculator(spec, ctx, target, self.scheduler)

    # ---- admission ---------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None) -> str:
        """Tokenizes if needed, validates (InputProcessor.process, InvalidRequest) and add_checked."""
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequest("add_request needs a prompt or prompt_token_ids", "prompt")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        params = sampling_params if sampling_params is not None else self.input_processor.default_params()
        return self.add_checked(*self.input_processor.process(prompt_token_ids, params, one_sample=True), request_id)

    def add_checked(self, ids: list[int], params: SamplingParams, request_id: str | None = None,
                    mm: MultiModalPrompt | None = None) -> str:
        """Enqueues a request (n=1) that passed InputProcessor.process; no check again, no model work.
        With `mm` (prompt text and images) it waits for the image worker, whose expanded prompt replaces `ids`."""
        request_id = str(next(self._counter)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise InvalidRequest(f"request {request_id} is already running")
        if mm is not None and (self.images is None or params.prompt_logprobs is not None):
            raise InvalidRequest("this model does not take images" if self.images is None else
                                 "prompt_logprobs are not supported for prompts with images", "multi_modal_data")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        checker = (StopStringChecker(params.stop, self.tokenizer, params.skip_special_tokens)
                   if params.stop else None)
        state = RequestState(params, make_generator(params.seed, self.device), eos, checker)
        if mm is not None:
            self.images.submit(request_id, mm)  # enters the scheduler once its images are ready
        else:
            self._enqueue(_C.Sequence(request_id, ids, self._limits(request_id, len(ids), params)), params)
        self.requests[request_id] = state
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = prompt_logprobs.PromptLogprobs.for_prompt(ids, params.prompt_logprobs)
        self._num_special += is_special(state)
        return request_id

    def _limits(self, request_id: str, prompt_len: int, params: SamplingParams, drafts: bool = True):
        check_fits(request_id, prompt_len, params.max_tokens, self.scheduler.max_seq_len)
        return sequence_limits(params, self.eos_token_ids, drafts and speculator.may_draft(params))

    def _enqueue(self, seq: _C.Sequence, params: SamplingParams) -> None:
        if params.structured_outputs is not None:  # enters the scheduler once its grammar is built
            self.structured.submit(seq.request_id, params.structured_outputs, seq)
        else:
            self.scheduler.add_sequence(seq)  # last: nothing to undo

    def abort_request(self, request_id: str | Iterable[str]) -> list[str]:
        """Aborts the given requests and frees their KV blocks; returns the ids it found."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        found = [rid for rid in ids if self.scheduler.abort(str(rid)) is not None]
        found += self.structured.cancel(str(rid) for rid in ids if rid not in found)
        if self.images is not None:
            found += self.images.cancel([str(rid) for rid in ids if rid not in found])
        for rid in found:
            self._forget(str(rid))
        return found

    def join_dp_group(self, groups) -> None:
        """Steps in lockstep with the DP group `groups` (DPGroups) from now on; with expert
        parallelism the MoE layers dispatch over it too (a collective call: every rank of
        the group makes it). Called again with a re-formed group after a peer failed."""
        self.lockstep = Lockstep(groups, use_cpu_group=self.config.zos, interval=self.config.dp_vote_interval)
        model = self.worker.runner.model
        if self.config.enable_expert_parallel and hasattr(model, "bind_ep_group"):
            from deepinfer_dp.distributed.moe_dispatch import init_ep_group

            model.bind_ep_group(init_ep_group(groups), self.config.all2all_backend,
                                self.config.eplb_config if self.config.enable_eplb else None)

    def drop_lost_step(self) -> tuple[list[str], str]:
        """After the DP group failed: if a forward pass failed with it (a MoE collective lost
        its peer mid-step), that step's tokens never come, so every request of this rank is
        aborted; returns their ids and the cause, for the caller to fail them with. The engine
        is then empty and usable again. ([], "") when no step was lost (the vote failed
        between steps): the requests go on in the re-formed group.

        Every request the engine holds is returned, also one the scheduler no longer has: a
        prompt step post-processes the deferred step before its own sample fails, so a finish
        can be applied whose output never left this rank (the caller ignores ids it has seen
        finish); and one still waiting for its grammar or images."""
        self.worker.drain()  # a forward queued behind the failed one must not touch freed blocks
        dispatcher = getattr(self.worker.runner.model, "dispatcher", None)
        if dispatcher is None or dispatcher.broken is None:
            return [], ""
        self.worker.prev_step_state = None
        self.scheduler.release_outputs()
        lost = list(self.requests)
        for rid in lost:
            self.scheduler.abort(rid)
            self._forget(rid)
        self._prompt_logprobs.clear()
        self._finished.clear()
        self.scheduler.release_outputs()
        self.scheduler.discard_unprocessed()  # the failed step's batch never comes back
        return lost, str(dispatcher.broken)

    # ---- what the step loop calls -------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """Local queues non-empty, combined with MAX over the DP group when there is one, so
        every rank keeps stepping until the last rank is done."""
        return self.vote(self.has_local_unfinished_requests())

    def has_local_unfinished_requests(self) -> bool:
        # a grammar still building, or images still loading, are work: the rank keeps stepping
        return (self.scheduler.has_unfinished_seqs() or self.structured.has_pending() or bool(self._build_failures)
                or (self.images is not None and self.images.has_pending()))

    def vote(self, local: bool) -> bool:
        """The DP vote: True if this rank (`local`) or any peer has work (Lockstep.vote)."""
        return local if self.lockstep is None else self.lockstep.vote(local)

    def step(self) -> list:
        self._drop_finished_states()
        if self.images is not None:
            self._admit_ready_images()
        failed = self._admit_built_grammars()
        # Drafting (speculative decoding) needs the accepted tokens, so such a step is not deferred.
        speculating = self.speculator is not None and self.speculator.before_schedule(self.scheduler)
        sched_out = self.scheduler.schedule()  # also releases the previous step's outputs
        if sched_out.is_empty():
            self.placeholder_steps += 1
        spec = self.prompt_logprobs_spec(sched_out) if sched_out.is_prompt else None
        observer = self.speculator.observer_for(speculating, sched_out.is_empty()) if self.speculator else None
        mm = self.images.plan(sched_out) if self.images is not None else None
        outputs = self.worker.execute_model_step(sched_out, self, spec, defer=not speculating, observer=observer,
                                                 mm=mm)
        if self.speculator is not None:
            self.speculator.after_step(sched_out, speculating)
        self.generate_step += 1
        return failed + outputs if failed else outputs

    def _admit_built_grammars(self) -> list[OwnedOutput]:
        """Requests whose grammar is ready enter the scheduler; a failed build finishes its
        request with the error. Returns the failures (and any left from a flush)."""
        if not self.scheduler.has_unfinished_seqs() and self.lockstep is None:
            self.structured.wait_for_build(0.05)  # alone and only compiling: wait, don't spin
        for rid, seq, error in self.structured.take_ready():
            if error is None:
                self.scheduler.add_sequence(seq)
            else:
                self._fail_waiting(rid, error, seq.data.get_prompt_len())
        failed, self._build_failures = self._build_failures, []
        return failed

    def _fail_waiting(self, request_id: str, error: str, prompt_len: int) -> None:
        self.requests_failed += 1  # never reached the scheduler: reported by the next step
        self._finished.append(request_id)
        self._build_failures.append(OwnedOutput(request_id, [], True, "error", prompt_len, 0, None,
                                                self.config.dp_rank, error))

    def _admit_ready_images(self) -> None:
        """Ready requests enter the scheduler (or the grammar build); a failed one finishes."""
        if not self.scheduler.has_unfinished_seqs() and self.lockstep is None and not self.structured.has_pending():
            self.images.worker.wait(0.05)  # alone and only waiting for images: wait, don't spin
        ready, failed = self.images.admit_ready(self.requests, self._limits, self.max_model_len, self.vocab_size)
        for rid, error in failed:
            self._fail_waiting(rid, error, 0)
        for seq in ready:
            self._enqueue(seq, self.requests[seq.request_id].params)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's reset_prefix_cache), so that a prompt seen before is
        prefilled again; False, and nothing forgotten, while a request holds KV blocks."""
        return self.scheduler.reset_prefix_cache()

    def flush_inflight_reqs(self) -> list:
        """Post-processes the decode step that ZOS kept in flight."""
        self.scheduler.release_outputs()
        return self.worker.flush_inflight_reqs(self)

    def to_deltas(self, outputs: list) -> list[TokenDelta]:
        """A step's outputs as TokenDeltas for a front end or the wire (logprobs where asked)."""
        deltas = []
        for out in outputs:
            state = self.requests.get(out.request_id)  # kept until the next step, see _finished
            want = state is not None and state.params.logprobs is not None
            deltas.append(TokenDelta.of(out, self.config.dp_rank, want))
        return deltas

    # ---- call-backs of the worker ------------------------------------------------------
    def sampling_batch(self, sched_out: _C.SchedulerOutput, vocab_size: int) -> SamplingBatch | None:
        if self._num_special == 0:
            return None
        rids = sched_out.sample_request_ids
        mask = self.structured.bitmask(rids, self.device)  # after the previous step's tokens were accepted
        states = [self.requests[r] for r in rids]
        params = [s.params for s in states]
        seqs = [self.scheduler.get_sequence(r) for r in rids]
        history = any(p.needs_history for p in params)
        outputs = [s.data.get_output_token_ids() if s else [] for s in seqs] if history else None
        prompts = ([s.data.get_token_ids()[: s.data.get_prompt_len()] if s else [] for s in seqs]
                   if history else None)
        batch = SamplingBatch.build(
            params, [s.generator for s in states], prompts, outputs,
            [s.data.get_output_len() if s else 0 for s in seqs], [s.eos_token_id for s in states],
            vocab_size, self.device).with_grammar(mask)
        return batch if self.speculator is None else self.speculator.with_drafts(batch, sched_out, self.requests)

    def prompt_logprobs_spec(self, sched_out: _C.SchedulerOutput) -> prompt_logprobs.PromptLogprobsSpec | None:
        if not self._prompt_logprobs:
            return None
        return prompt_logprobs.build_spec(sched_out, self._prompt_logprobs, self.device)

    def post_process(self, state: StepState) -> list:
        """Appends the sampled tokens in C++ (stop rules, freeing finished blocks) and
        returns the step's pooled outputs, after this engine's own per-request checks."""
        tokens, logprobs = state.tokens_and_logprobs()
        step_outputs = self.scheduler.process_outputs(state.sched_out, tokens, logprobs)
        top = state.top_logprobs()
        if top is not None:
            # (a request aborted while this step was in flight has no state and no output)
            row_k = [(s.params.logprobs or 0) if (s := self.requests.get(r)) else 0
                     for r in state.sched_out.sample_request_ids]
            step_outputs.set_top_logprobs(top[0], top[1], np.asarray(row_k, dtype=np.int32))
        if state.prompt_logprobs is not None:
            prompt_logprobs.absorb(state.prompt_logprobs, self._prompt_logprobs)
        outputs = list(step_outputs)
        stopped: set[str] = set()  # several outputs per request under speculation: none after a stop
        for i, out in enumerate(outputs):
            if out.request_id in stopped:
                outputs[i] = None
                continue
            pl = self._prompt_logprobs.get(out.request_id)
            if pl is not None and not pl.delivered:  # a request's first output carries them
                outputs[i] = out = out.with_prompt_logprobs(pl.logprobs, pl.top_ids, pl.top_logprobs)
                pl.delivered = True
            try:
                if self.structured.tracks(out.request_id):  # constrained: advance its matcher
                    self.structured.accept(out.request_id, out.token_ids, out.output_len,
                                           lambda rid=out.request_id: self._output_ids(rid))
                outputs[i] = out = self._check_stop_strings(out)
            except Exception as e:  # one request's failure must not end the others
                outputs[i] = out = self._fail_request(out, e)
            if out.finished:
                self._finished.append(out.request_id)
                stopped.add(out.request_id)
        return [o for o in outputs if o is not None] if stopped else outputs

    def _check_stop_strings(self, out):
        req = self.requests.get(out.request_id)
        if req is not None and req.stop_checker is not None and not out.finished \
                and req.stop_checker.append(out.token_ids):
            self.scheduler.finish_request(out.request_id, _C.SequenceStatus.FINISHED_STOPPED)
            return out.clone_finished(_C.SequenceStatus.FINISHED_STOPPED)
        return out

    def _output_ids(self, request_id: str) -> list[int]:
        seq = self.scheduler.get_sequence(request_id)
        return list(seq.data.get_output_token_ids()) if seq is not None else []

    def _fail_request(self, out, error: Exception) -> OwnedOutput:
        """Finishes one request with an error (its blocks freed) instead of failing the step."""
        rid = out.request_id
        logger.exception("request %s failed while post-processing; the engine goes on", rid, exc_info=error)
        self.scheduler.finish_request(rid, _C.SequenceStatus.FINISHED_ABORTED)
        self.requests_failed += 1
        return OwnedOutput.failed(out, f"{type(error).__name__}: {error}", self.config.dp_rank)

    # ---- bookkeeping -------------------------------------------------------------------
    def _drop_finished_states(self) -> None:
        # Kept one step longer: a ZOS step may still sample for a request that just ended.
        for rid in self._finished:
            self._forget(rid)
        self._finished.clear()

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self.structured.forget(request_id)
        if self.images is not None:
            self.images.forget(request_id)
        if state is not None:
            self._num_special -= is_special(state)

    def stats(self) -> dict:
        s = self.scheduler
        return {"num_running": s.num_running, "num_waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
                "num_free_blocks": s.num_free_blocks, "num_usable_blocks": s.num_usable_blocks,
                "generate_step": self.generate_step, "placeholder_steps": self.placeholder_steps,
                "requests_failed": self.requests_failed, "device_busy_s": self.worker.device_busy_s,
                "forward_time_s": self.worker.runner.forward_time_s, **speculator.stats(s.stats, self.speculator),
                **self.structured.stats.as_dict(), **self._moe_stats(), **(self.images.stats() if self.images else {})}

    def _moe_stats(self) -> dict:
        model = self.worker.runner.model
        return model.moe_stats(self.worker.device_busy_s) if hasattr(model, "moe_stats") else {}

    def shutdown(self) -> None:
        """Stops the worker's thread and lets go of the DP vote (its groups are the owner's)."""
        self.worker.shutdown()
        self.structured.shutdown()
        if self.images is not None:
            self.images.shutdown()
        self.lockstep = None
