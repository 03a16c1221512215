"""The narrow interface between a front end (HTTP server, offline driver) and whatever
serves requests behind it: one engine in-process, or the router over DP ranks.

A front end tokenizes, calls generate() and iterates the deltas; closing the iterator
early (a client went away) aborts the request where it runs and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from deepinfer_dp.sampling_params import SamplingParams


class TokenDelta(msgspec.Struct, frozen=True):
    """New tokens of one request since the previous delta."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" once finished
    logprobs: list[float] | None = None  # of each token in token_ids, when asked
    prompt_len: int = 0
    output_len: int = 0
    dp_rank: int = 0
    top_logprobs: list[dict[int, float]] | None = None  # per token: the k best {id: logprob}, when asked
    # On a request's first delta, when it asked for prompt logprobs: per prompt token (None first)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class EngineError(Exception):
    """Base of the errors a front end turns into an HTTP status."""

    status_code = 500


class RequestRejected(EngineError):
    """Bad input named in the message (token outside the vocabulary, prompt too long...)."""

    status_code = 400


class NoCapacity(EngineError):
    """No rank can take work right now (all down, or shutting down)."""

    status_code = 503


class RankFailed(EngineError):
    """The rank serving this request died or stopped answering; other ranks keep serving."""

    status_code = 503


class EngineClient(Protocol):
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> list[dict]: ...  # one entry per DP rank: {"dp_rank", "up", ...}

    def rank_stats(self) -> list[dict]: ...  # one dict per rank, see LLMEngine.stats()
