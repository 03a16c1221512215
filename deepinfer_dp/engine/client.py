"""The narrow interface between a front end (HTTP server, offline driver) and whatever
serves requests behind it: one engine in-process, or the router over DP ranks.

A front end tokenizes, validates with the client's InputProcessor, calls generate() and
iterates the deltas; closing the iterator early (a client went away) aborts the request
where it runs and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from deepinfer_dp.multimodal.errors import MM_ERROR_PREFIX, image_error_field
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.structured_output.params import BUILD_ERROR_PREFIX

if TYPE_CHECKING:  # the validator pulls in the grammar library (torch, transformers); the wire format must not
    from deepinfer_dp.engine.input_processor import InputProcessor
    from deepinfer_dp.multimodal.image_worker import MultiModalPrompt


class TokenDelta(msgspec.Struct, frozen=True):
    """New tokens of one request since the previous delta."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" once finished
    logprobs: list[float] | None = None  # of each token in token_ids, when asked
    prompt_len: int = 0
    output_len: int = 0
    dp_rank: int = 0
    top_logprobs: list[dict[int, float]] | None = None  # per token: the k best {id: logprob}, when asked
    # On a request's first delta, when it asked for prompt logprobs: per prompt token (None first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # with finish_reason "error": what failed (the engine kept running)

    @classmethod
    def of(cls, out: Any, dp_rank: int, want_logprobs: bool) -> TokenDelta:
        """One step output (a pooled RequestOutput, or an owned one) as a delta; the only
        conversion, so a new output field is added here once. Copies: the pool is reused."""
        logprob = out.logprob if want_logprobs else None
        return cls(out.request_id, list(out.token_ids), out.finished, out.finish_reason if out.finished else None,
                   None if logprob is None else [logprob] * len(out.token_ids), out.prompt_len, out.output_len,
                   dp_rank, out.top_logprobs, out.prompt_logprobs, out.prompt_top_logprobs,
                   getattr(out, "error", None))


class EngineError(Exception):
    """Base of the errors a front end turns into an HTTP status."""

    status_code = 500
    param: str | None = None  # the request field at fault, when one is


class RequestRejected(EngineError):
    """Bad input named in the message (token outside the vocabulary, prompt too long...)."""

    status_code = 400


class NoCapacity(EngineError):
    """No rank can take work right now (all down, or shutting down)."""

    status_code = 503


class RankFailed(EngineError):
    """The rank serving this request died or stopped answering; other ranks keep serving."""

    status_code = 503


class RequestFailed(EngineError):
    """Processing this one request failed inside the engine; the engine keeps serving."""

    status_code = 500


class EngineClient(Protocol):
    tokenizer: Any
    model_name: str
    max_model_len: int
    input_processor: InputProcessor
    dp_ranks: list[int]  # the DP ranks behind this client: those a request may pin

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 mm: MultiModalPrompt | None = None,
                 data_parallel_rank: int | None = None) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> list[dict]: ...  # one entry per DP rank: {"dp_rank", "up", ...}

    def rank_stats(self) -> list[dict]: ...  # one dict per rank, see LLMEngine.stats()


async def deltas_until_finished(queue: asyncio.Queue, abandon: Callable[[], None]) -> AsyncIterator[TokenDelta]:
    """One request's deltas from `queue` (fed from another thread), until the finished one.
    An exception in the queue, or a delta that finished with an error, ends the request with
    that error; leaving before the end (the caller went away) calls `abandon` to abort it."""
    finished = False
    try:
        while not finished:
            item = await queue.get()
            if isinstance(item, Exception):
                finished = True
                raise item
            finished = item.finished
            if item.error is not None and item.error.startswith(MM_ERROR_PREFIX):  # a bad image: 400 naming it
                error = RequestRejected(item.error.removeprefix(MM_ERROR_PREFIX))
                error.param = image_error_field(item.error)
                raise error
            if item.error is not None:
                # a grammar the library refused is the request's own fault: 400, not 500
                kind = RequestRejected if item.error.startswith(BUILD_ERROR_PREFIX) else RequestFailed
                raise kind(f"request {item.request_id} failed: {item.error}")
            yield item
    finally:
        if not finished:
            abandon()
