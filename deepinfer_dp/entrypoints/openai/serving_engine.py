"""What both endpoints share: request checks, SamplingParams, and running the choices.

A request's values are checked once, by the engine's validator (`check_request` calls
InputProcessor.process for each prompt); what it refuses is a 400 whose `param` names the
request field (`InvalidRequest.param`, renamed to this API's field where they differ). Fields
the client did not send take the model's sampling defaults (engine/sampling_defaults.py).

Blocking work on the request's text (tokenizing, the chat template) runs in a thread pool,
so one huge prompt never stalls other streams or /health; every bound is checked before it.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from deepinfer_dp.engine.client import EngineClient, EngineError
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.sampling_defaults import FIELDS as DEFAULT_FIELDS
from deepinfer_dp.entrypoints.openai.admission import Admission, ServerLimits
from deepinfer_dp.entrypoints.openai.chat_template import ChatTokenizer
from deepinfer_dp.entrypoints.openai.detokenizer import IncrementalDetokenizer
from deepinfer_dp.entrypoints.openai.protocol import SamplingFields
from deepinfer_dp.entrypoints.openai.stop_watch import StopWatch
from deepinfer_dp.entrypoints.openai.unsupported import unsupported_field
from deepinfer_dp.metrics import ServerMetrics
from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.structured_output.params import StructuredOutputsParams

T = TypeVar("T")
# What a checked request becomes: token ids per prompt, engine params per prompt, stop strings.
Prepared = tuple[list[list[int]], list[SamplingParams], list[str]]


class PromptIds(list):
    """A prompt's token ids that carry its images (`mm`, a chat with image_url parts): the
    engine's image worker fetches them and the model's processor expands the prompt."""

    mm: Any = None


class OpenAIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def refuse_unsupported(body, table: dict, prefix: str = "") -> None:
    found = unsupported_field(body, table, prefix)
    if found is not None:
        raise bad_request(found[1], found[0], "unsupported_parameter")


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # set on a choice's last event
    num_output_tokens: int
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None  # on a choice's first event, when asked
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_len: int = 0  # as the engine ran it (a prompt with images: expanded by its processor)


@dataclass
class ServingContext:
    client: EngineClient
    model_name: str
    metrics: ServerMetrics
    limits: ServerLimits = field(default_factory=ServerLimits)
    admission: Admission = field(init=False)
    # Tokenizing and chat templates: off the event loop (the Rust tokenizer releases the GIL).
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, "deepinfer-tokenize"))
    chat_tokenizer: ChatTokenizer = field(init=False)
    _max_chars: int = field(init=False)  # see check_text_length

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits)
        self.chat_tokenizer = ChatTokenizer(self.client.tokenizer, self.limits.chat_special_tokens_as_text,
                                            self.limits.chat_template)
        # Once, at start: scanning the vocabulary holds the GIL for a moment (~1 s at 49k tokens).
        tok = self.client.tokenizer
        longest = max(map(len, tok.batch_decode([[i] for i in range(len(tok))])), default=1)
        self._max_chars = 4 * (longest + 1) * self.client.max_model_len

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def check_text_length(self, num_chars: int, which: str, param: str) -> None:
        """Refuses a text that cannot fit the context whatever it says, before it is tokenized
        (tokenizing 10 MB takes a core for many seconds). No token spans more characters than
        the longest one in the vocabulary; the 4x margin covers normalizers that merge characters."""
        if num_chars > self._max_chars:
            raise bad_request(f"{which} has {num_chars} characters; no text over {self._max_chars} characters fits "
                              f"this model's maximum context length of {self.client.max_model_len} tokens", param)


def check_common(req: SamplingFields, limits: ServerLimits) -> None:
    if not 1 <= req.n <= limits.max_n:
        raise bad_request(f"n must be in [1, {limits.max_n}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")


# SamplingParams fields a request may leave to the model's defaults (max_tokens aside)
_DEFAULTED = tuple(f for f in DEFAULT_FIELDS.values() if f != "max_tokens")


def make_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None, defaults: dict,
                prompt_logprobs: int | None = None,
                structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """SamplingParams for the request (n as asked; stop strings stay with the server); fields
    the client did not send take `defaults`. Not checked here: check_request does that."""
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:  # OpenAI's range
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    values = {"seed": req.seed, "presence_penalty": req.presence_penalty,
              "frequency_penalty": req.frequency_penalty}
    for name in _DEFAULTED:
        values[name] = getattr(req, name) if getattr(req, name) is not None else defaults.get(name)
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, n=req.n,
                          skip_special_tokens=req.skip_special_tokens, stop_token_ids=req.stop_token_ids,
                          include_stop_str_in_output=req.include_stop_str_in_output,
                          logit_bias=_logit_bias(req), structured_outputs=structured_outputs,
                          **{k: v for k, v in values.items() if v is not None})


def default_max_tokens(sent: int | None, was_sent: bool, defaults: dict, prompt_len: int,
                       max_model_len: int, fallback: int | None) -> int | None:
    """max_tokens as sent; unsent: the model's default (max_new_tokens) capped at the room
    the prompt leaves, else `fallback` (completions: 16; chat: None, as much as fits)."""
    if was_sent:
        return sent
    if "max_tokens" in defaults:
        return max(1, min(defaults["max_tokens"], max_model_len - prompt_len))
    return fallback


def _logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings; the validator checks the ids."""
    if not req.logit_bias:
        return None
    bias = {}
    for key, value in req.logit_bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 20:
            shown = key if len(key) <= 40 else key[:40] + "..."
            raise bad_request(f"logit_bias: key {shown!r} is not a token id", "logit_bias")
        bias[int(key)] = value
    return bias


def stop_strings(req: SamplingFields) -> list[str]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stops):
        raise bad_request("stop strings must be non-empty", "stop")
    return stops


def check_request(ids: list[int], params: SamplingParams, client: EngineClient, which: str = "prompt",
                  names: dict[str, str] | None = None) -> tuple[list[int], SamplingParams]:
    """The engine's validator, once for this prompt: the prompt and params it accepted (max
    tokens resolved), or a 400 naming the field. `names` renames the validator's field names
    to this request's (e.g. prompt -> messages, max_tokens -> max_completion_tokens,
    structured_outputs.json -> response_format.json_schema.schema)."""
    names = names or {}
    try:
        return client.input_processor.process(ids, params, None if which == "prompt" else which,
                                              max_tokens_must_fit=True)
    except InvalidRequest as e:
        param, message = e.param, str(e)
        if param is not None and param.startswith("structured_outputs") and names.get("structured_outputs"):
            message = message.replace(param, names["structured_outputs"], 1)
            param = names["structured_outputs"]
        elif param == "max_tokens" and names.get("max_tokens"):
            message = message.replace("max_tokens", names["max_tokens"])
        raise bad_request(message, names.get(param, param)) from e


def pinned_rank(body_value: int | None, header: str | None, client: EngineClient) -> int | None:
    """The DP rank a request pins (vLLM's `data_parallel_rank` field, or its X-data-parallel-rank
    header), checked against the ranks behind this endpoint; None: the router's choice."""
    value = body_value
    if value is None and header is not None:
        try:
            value = int(header)
        except ValueError:
            raise bad_request(f"X-data-parallel-rank must be an integer, got {header!r}",
                              "data_parallel_rank") from None
    served = list(getattr(client, "dp_ranks", [0]))
    if value is not None and value not in served:
        raise bad_request(f"data_parallel_rank {value} does not exist here: this endpoint serves DP ranks "
                          f"{served}", "data_parallel_rank")
    return value


async def run_choice(ctx: ServingContext, request_id: str, index: int, ids: list[int], params: SamplingParams,
                     stops: list[str], arrival: float, on_start: Callable[[int], None],
                     dp_rank: int | None = None) -> AsyncIterator[ChoiceEvent]:
    """One engine request, as text events; stops it early when a stop string shows up.
    `dp_rank`: the rank it is pinned to (None: the router's choice)."""
    detok = IncrementalDetokenizer(ctx.client.tokenizer, params.skip_special_tokens)
    watch = StopWatch(stops, params.include_stop_str_in_output)
    mm = getattr(ids, "mm", None)
    extra = {**({"mm": mm} if mm is not None else {}), **({"data_parallel_rank": dp_rank} if dp_rank is not None
                                                           else {})}
    gen = ctx.client.generate(f"{request_id}-{index}", ids, params, **extra)
    rank, last, num_tokens, status = None, arrival, 0, "abort"
    try:
        async for delta in gen:
            now = time.perf_counter()
            if rank is None:
                on_start(index)
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
            yield ChoiceEvent(index, text, list(delta.token_ids), delta.logprobs, reason, num_tokens,
                              delta.top_logprobs, delta.prompt_logprobs, delta.prompt_top_logprobs, delta.prompt_len)
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
                      params: list[SamplingParams], n: int, stops: list[str],
                      dp_rank: int | None = None) -> AsyncIterator[ChoiceEvent]:
    """All choices of a request, interleaved as they come; choice index = prompt * n + sample.
    The choices count against the server's waiting queue until their first token (QueueFull
    when it is full, raised before anything is submitted)."""
    arrival = time.perf_counter()
    waiting = set(range(len(prompts) * n))
    if len(waiting) > ctx.limits.max_waiting_requests:  # would be refused forever: not a 503
        raise bad_request(f"this request asks for {len(waiting)} choices (prompts x n), more than the "
                          f"{ctx.limits.max_waiting_requests} the server queues at once", "n")
    ctx.admission.admit(len(waiting))

    def on_start(index: int) -> None:
        waiting.discard(index)
        ctx.admission.started()

    gens = [run_choice(ctx, request_id, p * n + i, ids, params[p].for_sample(i), stops, arrival, on_start, dp_rank)
            for p, ids in enumerate(prompts) for i in range(n)]
    try:
        async for event in _interleave(gens):
            yield event
    finally:
        ctx.admission.started(len(waiting))  # choices that failed or were dropped before a token


async def _interleave(gens: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    if len(gens) == 1:
        try:
            async for event in gens[0]:
                yield event
        finally:
            await gens[0].aclose()
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
    finally:
        await gen.aclose()  # now, not at garbage collection: it aborts the engine request
