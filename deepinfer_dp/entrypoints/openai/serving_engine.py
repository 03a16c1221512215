"""What both endpoints share: request checks, SamplingParams, and running the choices.

A choice is one (prompt, sample) pair: n > 1 or a list of prompts fan out to several
engine requests. Each choice's token deltas are detokenized incrementally and watched for
stop strings here; ChoiceEvents carry the text each delta adds. Closing the event iterator
(the client went away) closes every choice's EngineClient.generate iterator, which aborts
the request where it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deepinfer_dp.engine.client import EngineClient, EngineError
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.entrypoints.openai.detokenizer import IncrementalDetokenizer
from deepinfer_dp.entrypoints.openai.protocol import SamplingFields
from deepinfer_dp.entrypoints.openai.stop_watch import StopWatch
from deepinfer_dp.metrics import ServerMetrics
from deepinfer_dp.sampling_params import SamplingParams

MAX_N = 128
# What a checked request becomes: token ids per prompt, engine params per prompt, stop strings.
Prepared = tuple[list[list[int]], list[SamplingParams], list[str]]


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # set on a choice's last event
    num_output_tokens: int


@dataclass
class ServingContext:
    client: EngineClient
    model_name: str
    metrics: ServerMetrics


def make_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """SamplingParams for one engine request (n=1; stop strings stay with the server)."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    values = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
              "repetition_penalty": req.repetition_penalty, "seed": req.seed}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, min_tokens=req.min_tokens,
                              ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                              **{k: v for k, v in values.items() if v is not None})
    except ValueError as e:
        field_name = str(e).split()[0].removeprefix("SamplingParams.")
        raise bad_request(str(e).removeprefix("SamplingParams."), field_name) from e


def stop_strings(req: SamplingFields) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    return stops


def check_prompt(ids: list[int], max_tokens: int | None, client: EngineClient, which: str = "prompt") -> int:
    """Checks one tokenized prompt with the engine's validator; returns the max_tokens to ask for."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    try:
        ids, params = client.input_processor.process(ids, SamplingParams(max_tokens=max_tokens),
                                                     None if which == "prompt" else which, max_tokens_must_fit=True)
    except InvalidRequest as e:
        raise bad_request(str(e), e.param) from e
    return params.max_tokens


async def run_choice(ctx: ServingContext, request_id: str, index: int, ids: list[int], params: SamplingParams,
                     stops: list[str], arrival: float) -> AsyncIterator[ChoiceEvent]:
    """One engine request, as text events; stops it early when a stop string shows up."""
    detok = IncrementalDetokenizer(ctx.client.tokenizer, params.skip_special_tokens)
    watch = StopWatch(stops)
    gen = ctx.client.generate(f"{request_id}-{index}", ids, params)
    rank, last, num_tokens, status = None, arrival, 0, "abort"
    try:
        async for delta in gen:
            now = time.perf_counter()
            if rank is None:
                rank = delta.dp_rank
                ctx.metrics.routed_to(rank)
                ctx.metrics.first_token(rank, now - arrival)
            else:
                ctx.metrics.inter_token(rank, now - last)
            last, num_tokens = now, num_tokens + len(delta.token_ids)
            text = detok.add(delta.token_ids) + (detok.flush() if delta.finished else "")
            text = watch.feed(text, delta.finished)
            reason = "stop" if watch.stopped else (delta.finish_reason if delta.finished else None)
            if reason is not None:
                status = reason
            yield ChoiceEvent(index, text, list(delta.token_ids), delta.logprobs, reason, num_tokens)
            if reason is not None:
                break  # on a stop string, leaving the loop closes gen, which aborts the request
    except EngineError as e:
        status = "rejected" if e.status_code == 400 else "unavailable"
        raise
    finally:
        await gen.aclose()
        done = status in ("stop", "length")
        ctx.metrics.finished(rank, status, time.perf_counter() - arrival if done else None)


async def run_choices(ctx: ServingContext, request_id: str, prompts: list[list[int]],
                      params: list[SamplingParams], n: int, stops: list[str]) -> AsyncIterator[ChoiceEvent]:
    """All choices of a request, interleaved as they come; choice index = prompt * n + sample."""
    arrival = time.perf_counter()
    gens = [run_choice(ctx, request_id, p * n + i, ids, params[p].for_sample(i), stops, arrival)
            for p, ids in enumerate(prompts) for i in range(n)]
    if len(gens) == 1:
        async for event in gens[0]:
            yield event
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(g, queue)) for g in gens]
    try:
        for _ in range(len(gens)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(gen: AsyncIterator[ChoiceEvent], queue: asyncio.Queue) -> None:
    try:
        async for event in gen:
            queue.put_nowait(event)
        queue.put_nowait(None)  # this choice is done
    except Exception as e:  # handed to the consumer, which raises it
        queue.put_nowait(e)
