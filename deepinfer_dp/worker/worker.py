"""The device worker: every step goes through four phases.

  1. Forward current step (in the background: a thread on CPU, async kernels on CUDA)
  2. Post-process previous step (host work that overlaps the forward)
  3. Sample current step
  4. Post-process current step: in place for prefill, placeholder or ZOS-off steps; a ZOS
     decode step is kept in `prev_step_state` and post-processed during the next step.

Phases 2-4 need the engine's per-request state, so the worker calls back into it: the two
methods of StepHost, and nothing else. The engine is passed to each call rather than kept,
so worker and engine hold no reference cycle (which kept the DP groups alive until
interpreter teardown).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.sampler import Sampler, SamplerOutput, SamplingBatch, greedy_token_ids
from deepinfer_dp.multimodal.step_inputs import MultiModalStep
from deepinfer_dp.spec_decode.proposer import TargetStep
from deepinfer_dp.worker.model_runner import ModelInput, ModelRunner
from deepinfer_dp.worker.prompt_logprobs import PromptLogprobsSpec


@dataclass
class StepState:
    """One executed step whose sampled tokens the host has not consumed yet."""

    sched_out: _C.SchedulerOutput
    # None: nothing sampled (placeholder, mid-prompt chunks); on CPU a Future of the device
    # thread until the host first needs the tokens
    sampled: SamplerOutput | Future | None
    host_tokens: torch.Tensor | None = None  # CUDA: pinned copy, ready once `event` fires
    host_logprobs: torch.Tensor | None = None
    host_top: tuple[torch.Tensor, torch.Tensor] | None = None  # CUDA: pinned top ids and logprobs
    event: torch.cuda.Event | None = None
    prompt_logprobs: PromptLogprobsSpec | None = None  # filled by the forward

    def tokens_and_logprobs(self) -> tuple[np.ndarray, np.ndarray | None]:
        sampled = self.sampled.result() if isinstance(self.sampled, Future) else self.sampled
        if sampled is None:
            return np.empty(0, dtype=np.int64), None
        if self.event is not None:
            self.event.synchronize()  # waits for this step's sampling only, not later work
        tokens = self.host_tokens if self.host_tokens is not None else sampled.token_ids
        logprobs = self.host_logprobs if self.host_logprobs is not None else sampled.logprobs
        return tokens.cpu().numpy(), None if logprobs is None else logprobs.cpu().numpy()

    def top_logprobs(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The top-k ids and logprobs [N, k] when some row asked for alternatives; call after
        tokens_and_logprobs() (which waits for the sampling)."""
        sampled = self.sampled.result() if isinstance(self.sampled, Future) else self.sampled
        if sampled is None or sampled.top_logprob_ids is None:
            return None
        ids, values = self.host_top or (sampled.top_logprob_ids, sampled.top_logprobs)
        return ids.cpu().numpy(), values.cpu().numpy()


class StepHost(Protocol):
    """The worker's only two calls up into its engine (LLMEngine implements them)."""

    def sampling_batch(self, sched_out: _C.SchedulerOutput, vocab_size: int) -> SamplingBatch | None:
        """How to sample this step's rows; None when every row is plain greedy (phase 3)."""

    def post_process(self, state: StepState) -> list:
        """Consumes a step's sampled tokens and returns its outputs (phases 2 and 4)."""


class Worker:
    def __init__(self, runner: ModelRunner, zos: bool) -> None:
        self.runner = runner
        self.zos = zos
        self.sampler = Sampler()
        self.prev_step_state: StepState | None = None
        self.on_cuda = runner.device.type == "cuda"
        # The "device" on CPU: one thread runs every torch op (forward and sampling). torch
        # releases the GIL in its kernels, so it computes while the host thread
        # post-processes; and only this thread owns an OpenMP team -- a second team (torch
        # ops on the host thread) would spin against it and slow both down several times.
        self._device = None if self.on_cuda else ThreadPoolExecutor(1, thread_name_prefix="device")
        # CPU: seconds the device thread spent computing (forward and sampling). Against wall
        # time it shows how much the host or the DP lockstep left the compute idle.
        self.device_busy_s = 0.0

    def execute_model_step(self, sched_out: _C.SchedulerOutput, host: StepHost,
                           prompt_logprobs: PromptLogprobsSpec | None = None, defer: bool = True,
                           observer: Callable[[TargetStep], None] | None = None,
                           mm: MultiModalStep | None = None) -> list:
        """`defer=False` post-processes even a ZOS decode step in place (speculative steps);
        `observer`: a proposer's network, shown this step's forward (Speculator.observer_for);
        `mm`: the step's image rows (ImageRequests.plan)."""
        placeholder = sched_out.is_empty()
        prev = self.prev_step_state
        if placeholder:
            model_input = self.runner.placeholder_input()
        else:
            model_input = self.runner.prepare(sched_out)
            model_input.prompt_logprobs = prompt_logprobs
            model_input.mm = mm
        model_input.observer = observer
        # 1. Forward current step
        logits = self._on_device(self._forward, model_input, prev.sampled if prev is not None else None)
        # 2. Post-process previous step
        self.prev_step_state = None
        outputs = self._post_process_step(prev, host)
        # 3. Sample current step (queued on the device after the forward)
        batch = host.sampling_batch(sched_out, self.runner.vocab_size) if sched_out.num_samples else None
        # On CPU a ZOS decode step returns while its forward still runs: the host goes on to
        # the DP vote and the next schedule, and waits for these tokens only when it
        # post-processes them, after the next forward is queued behind this one.
        curr = StepState(sched_out, self._on_device(self._sample, logits, batch),
                         prompt_logprobs=model_input.prompt_logprobs)
        # 4. Post-process current step, now or (ZOS decode) during the next step
        if sched_out.is_prompt or placeholder or not self.zos or not defer:
            outputs.extend(self._post_process_step(curr, host))
        else:
            self._stage_to_host(curr)
            self.prev_step_state = curr
        return outputs

    def flush_inflight_reqs(self, host: StepHost) -> list:
        """Post-processes the step ZOS kept back; the step loop calls this once at the end."""
        state, self.prev_step_state = self.prev_step_state, None
        return self._post_process_step(state, host)

    def run_on_device(self, fn, *args):
        """Runs `fn` where the forward passes run and waits for its result (a proposer's
        drafting between steps: its torch ops must share the device thread's OpenMP team)."""
        result = self._on_device(fn, *args)
        return result.result() if isinstance(result, Future) else result

    def _on_device(self, fn, *args):
        """Queues `fn` on the device thread (CPU) or runs it now (CUDA: kernels are queued
        on the stream, not waited for). Arguments that are futures of earlier device work
        are resolved on the device thread, where that work has already finished."""
        if self._device is None:
            return fn(*args)

        def run():
            start = time.perf_counter()
            try:
                return fn(*(a.result() if isinstance(a, Future) else a for a in args))
            finally:
                self.device_busy_s += time.perf_counter() - start
        return self._device.submit(run)

    def _forward(self, model_input: ModelInput, prev_sampled: SamplerOutput | None) -> torch.Tensor | None:
        if prev_sampled is not None:  # ZOS: in-flight input tokens come from the previous step's sample
            model_input.prev_tokens = prev_sampled.token_ids
        return self.runner.forward(model_input)

    def _sample(self, logits: torch.Tensor | None, batch: SamplingBatch | None) -> SamplerOutput | None:
        if logits is None:
            return None
        if batch is None:  # every row greedy and plain: the hot path
            return SamplerOutput(token_ids=greedy_token_ids(logits), logprobs=None)
        return self.sampler(logits, batch)

    def _stage_to_host(self, state: StepState) -> None:
        """CUDA: start the copy of the sampled ids to pinned host memory and mark it with an
        event, so the next step can read them without waiting for its own forward."""
        if not self.on_cuda or state.sampled is None:  # (on CUDA, never a Future)
            return
        state.host_tokens = state.sampled.token_ids.to("cpu", non_blocking=True)
        if state.sampled.logprobs is not None:
            state.host_logprobs = state.sampled.logprobs.to("cpu", non_blocking=True)
        if state.sampled.top_logprob_ids is not None:
            state.host_top = (state.sampled.top_logprob_ids.to("cpu", non_blocking=True),
                              state.sampled.top_logprobs.to("cpu", non_blocking=True))
        state.event = torch.cuda.Event()
        state.event.record()

    def _post_process_step(self, state: StepState | None, host: StepHost) -> list:
        if state is None:
            return []
        return host.post_process(state)

    def drain(self) -> None:
        """Returns once the device thread has finished everything queued on it."""
        if self._device is not None:
            self._device.submit(lambda: None).result()

    def shutdown(self) -> None:
        if self._device is not None:
            self._device.shutdown(wait=True)
