"""POST /v1/completions: prompts as text or token ids, streamed as SSE or answered whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

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
    check_prompt,
    make_params,
    stop_strings,
)

MAX_LOGPROBS = 0  # the engine reports the sampled token's logprob, not the top alternatives


def prompt_token_lists(req: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [tokenizer(p).input_ids]
    if not p:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(x, str) for x in p):
        return [tokenizer(x).input_ids for x in p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return [list(x) for x in p]


async def prepare(ctx: ServingContext, req: CompletionRequest) -> Prepared:
    """Checks the request; returns (prompts, params, stops) or raises OpenAIError."""
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]: this engine reports the logprob of the "
                          f"sampled token only, got {req.logprobs}", "logprobs")
    prompts = prompt_token_lists(req, ctx.client.tokenizer)
    stops = stop_strings(req)
    params = []
    for i, ids in enumerate(prompts):
        which = "prompt" if len(prompts) == 1 else f"prompt {i}"
        max_tokens = check_prompt(ids, req.max_tokens, ctx.client, which)
        params.append(make_params(req, max_tokens, req.logprobs))
    return prompts, params, stops


def _logprobs(ctx: ServingContext, events: list[ChoiceEvent], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for ev in events:
        for tok, lp in zip(ev.token_ids, ev.logprobs or [], strict=False):
            piece = ctx.client.tokenizer.decode([tok])
            out.tokens.append(piece)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(piece)
    return out


async def complete(ctx: ServingContext, req: CompletionRequest, events: AsyncIterator[ChoiceEvent],
                   prompts: list[list[int]]) -> CompletionResponse:
    num = len(prompts) * req.n
    texts, reasons, tokens = [""] * num, [None] * num, [0] * num
    per_choice: list[list[ChoiceEvent]] = [[] for _ in range(num)]
    async for ev in events:
        texts[ev.index] += ev.text
        per_choice[ev.index].append(ev)
        tokens[ev.index] = ev.num_output_tokens
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
    want_logprobs = req.logprobs is not None
    choices = [CompletionChoice(index=i, text=texts[i], finish_reason=reasons[i],
                                logprobs=_logprobs(ctx, per_choice[i], 0) if want_logprobs else None)
               for i in range(num)]
    return CompletionResponse(id=random_id("cmpl"), model=ctx.model_name, choices=choices,
                              usage=_usage(prompts, sum(tokens)))


async def stream(ctx: ServingContext, req: CompletionRequest, events: AsyncIterator[ChoiceEvent],
                 prompts: list[list[int]]) -> AsyncIterator[str]:
    rid, tokens, offsets = random_id("cmpl"), {}, {}
    async for ev in events:
        tokens[ev.index] = ev.num_output_tokens
        lp = None
        if req.logprobs is not None:
            lp = _logprobs(ctx, [ev], offsets.get(ev.index, 0))
            offsets[ev.index] = offsets.get(ev.index, 0) + sum(len(t) for t in lp.tokens)
        if not ev.text and ev.finish_reason is None and lp is None:
            continue  # nothing a client can see yet (held back for detokenization or stop strings)
        choice = CompletionChoice(index=ev.index, text=ev.text, finish_reason=ev.finish_reason, logprobs=lp)
        yield _sse(CompletionResponse(id=rid, model=ctx.model_name, choices=[choice]).model_dump_json())
    if req.stream_options and req.stream_options.include_usage:
        usage = _usage(prompts, sum(tokens.values()))
        body = CompletionResponse(id=rid, model=ctx.model_name, choices=[], usage=usage)
        yield _sse(body.model_dump_json())
    yield _sse("[DONE]")


def _usage(prompts: list[list[int]], completion_tokens: int) -> UsageInfo:
    prompt_tokens = sum(len(p) for p in prompts)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"

