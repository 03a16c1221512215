"""POST /v1/completions: prompts as text or token ids, streamed as SSE or answered whole.

`logprobs: k` reports each token's logprob and, in `top_logprobs`, the k most likely tokens plus
the sampled one (OpenAI's "up to logprobs + 1"). `echo: true` puts the prompt before the
completion; with `logprobs` the prompt tokens' logprobs come first too (None for the first
token), computed by the prefill (SamplingParams.prompt_logprobs), as vLLM does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from deepinfer_dp.entrypoints.openai import unsupported
from deepinfer_dp.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from deepinfer_dp.entrypoints.openai.serving_engine import (
    ChoiceEvent,
    Prepared,
    ServingContext,
    bad_request,
    check_common,
    check_request,
    default_max_tokens,
    make_params,
    refuse_unsupported,
    stop_strings,
)
from deepinfer_dp.entrypoints.openai.structured import constraint_field, structured_params
from deepinfer_dp.sampling_params import DEFAULT_MAX_TOKENS


def _tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts).input_ids]


async def prompt_token_lists(ctx: ServingContext, req: CompletionRequest) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise bad_request("prompt is empty", "prompt")
    if isinstance(p[0], int):
        return [list(p)]
    if len(p) > ctx.limits.max_prompts:
        raise bad_request(f"prompt holds {len(p)} prompts; this server takes at most {ctx.limits.max_prompts} "
                          f"in one request", "prompt")
    if isinstance(p[0], str):
        for i, text in enumerate(p):
            ctx.check_text_length(len(text), "prompt" if len(p) == 1 else f"prompt {i}", "prompt")
        return await ctx.off_loop(_tokenize, ctx.client.tokenizer, p)
    return [list(x) for x in p]


def _check_fields(ctx: ServingContext, req: CompletionRequest) -> None:
    refuse_unsupported(req, unsupported.COMPLETION)
    check_common(req, ctx.limits)
    if req.best_of is not None and req.best_of != req.n:
        # best_of == n returns every candidate: nothing to choose from, so nothing ignored.
        raise bad_request(f"best_of must equal n ({req.n}): choosing the best of several samples is not "
                          f"implemented, got {req.best_of}", "best_of", "unsupported_parameter")


async def prepare(ctx: ServingContext, req: CompletionRequest) -> Prepared:
    """Checks the request (each prompt once, with the engine's validator); returns (prompts,
    params, stops) or raises OpenAIError."""
    _check_fields(ctx, req)
    constraint, _ = structured_params(req)
    prompts = await prompt_token_lists(ctx, req)
    stops = stop_strings(req)
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    defaults = ctx.client.input_processor.sampling_defaults
    names = {"structured_outputs": constraint_field(req)}
    checked_prompts, params = [], []
    for i, ids in enumerate(prompts):
        max_tokens = default_max_tokens(req.max_tokens, "max_tokens" in req.model_fields_set, defaults, len(ids),
                                        ctx.client.max_model_len, DEFAULT_MAX_TOKENS)
        wanted = make_params(req, max_tokens, req.logprobs, defaults, prompt_logprobs, constraint)
        ids, checked = check_request(ids, wanted, ctx.client, "prompt" if len(prompts) == 1 else f"prompt {i}", names)
        checked_prompts.append(ids)
        params.append(checked)
    return checked_prompts, params, stops


class _ChoiceText:
    """One choice's text and logprobs as events come (echo puts the prompt first)."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompt: list[int], text: str | None) -> None:
        self.ctx, self.req, self.prompt, self.prompt_text = ctx, req, prompt, text
        self.offset = 0  # text_offset of the next token
        self.started = False

    def event(self, ev: ChoiceEvent) -> tuple[str, CompletionLogprobs | None]:
        """The text and logprobs this event adds."""
        text, lp = "", CompletionLogprobs() if self.req.logprobs is not None else None
        if self.req.echo and not self.started:
            text = self.prompt_text
            if text is None:  # token ids: their text
                text = self.ctx.client.tokenizer.decode(self.prompt, skip_special_tokens=False)
            if lp is not None:
                self._add(lp, self.prompt, ev.prompt_logprobs or [None] * len(self.prompt),
                          ev.prompt_top_logprobs or [None] * len(self.prompt))
        self.started = True
        if lp is not None:
            tops = ev.top_logprobs or [{} for _ in ev.token_ids]
            self._add(lp, ev.token_ids, ev.logprobs or [], tops)
        return text + ev.text, lp

    def _add(self, lp: CompletionLogprobs, ids: list[int], logprobs: list, tops: list) -> None:
        decode = self.ctx.client.tokenizer.decode
        for tok, logprob, top in zip(ids, logprobs, tops, strict=False):
            piece = decode([tok])
            lp.tokens.append(piece)
            lp.token_logprobs.append(logprob)
            lp.text_offset.append(self.offset)
            self.offset += len(piece)
            if top is None:  # the first prompt token: nothing before it to predict it
                lp.top_logprobs.append(None)
                continue
            entry = {decode([t]): v for t, v in top.items()}
            entry.setdefault(piece, logprob)  # the chosen token is always reported
            lp.top_logprobs.append(entry)


def _choice_texts(ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]]) -> list[_ChoiceText]:
    texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    texts = texts if texts and isinstance(texts[0], str) else [None] * len(prompts)
    return [_ChoiceText(ctx, req, prompts[i // req.n], texts[i // req.n]) for i in range(len(prompts) * req.n)]


def _merge(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.tokens += more.tokens
    into.token_logprobs += more.token_logprobs
    into.top_logprobs += more.top_logprobs
    into.text_offset += more.text_offset


async def complete(ctx: ServingContext, req: CompletionRequest, events: AsyncIterator[ChoiceEvent],
                   prompts: list[list[int]]) -> CompletionResponse:
    num = len(prompts) * req.n
    texts, reasons, tokens = [""] * num, [None] * num, [0] * num
    states = _choice_texts(ctx, req, prompts)
    logprobs = [CompletionLogprobs() for _ in range(num)] if req.logprobs is not None else None
    async for ev in events:
        text, lp = states[ev.index].event(ev)
        texts[ev.index] += text
        if logprobs is not None:
            _merge(logprobs[ev.index], lp)
        tokens[ev.index] = ev.num_output_tokens
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
    choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                logprobs=logprobs[i] if logprobs is not None else None) for i in range(num)]
    return CompletionResponse(id=random_id("cmpl"), model=ctx.model_name, choices=choices,
                              usage=_usage(prompts, req.n, sum(tokens)))


async def stream(ctx: ServingContext, req: CompletionRequest, events: AsyncIterator[ChoiceEvent],
                 prompts: list[list[int]]) -> AsyncIterator[str]:
    rid, tokens = random_id("cmpl"), {}
    states = _choice_texts(ctx, req, prompts)
    continuous = req.continuous_usage()
    async for ev in events:
        tokens[ev.index] = ev.num_output_tokens
        text, lp = states[ev.index].event(ev)
        if not text and ev.finish_reason is None and lp is None:
            continue  # nothing a client can see yet (held back for detokenization or stop strings)
        choice = CompletionChoice(index=ev.index, text=text, finish_reason=ev.finish_reason, logprobs=lp)
        usage = _usage(prompts, req.n, sum(tokens.values())) if continuous else None
        yield _sse(CompletionResponse(id=rid, model=ctx.model_name, choices=[choice], usage=usage).model_dump_json())
    if req.stream_options and req.stream_options.include_usage:
        usage = _usage(prompts, req.n, sum(tokens.values()))
        body = CompletionResponse(id=rid, model=ctx.model_name, choices=[], usage=usage)
        yield _sse(body.model_dump_json())
    yield _sse("[DONE]")


def _usage(prompts: list[list[int]], n: int, completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, however many samples (as OpenAI)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"
