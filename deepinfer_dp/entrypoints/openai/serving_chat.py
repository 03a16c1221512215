"""POST /v1/chat/completions: messages through the model's chat template, then the same
choices machinery as completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from deepinfer_dp.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
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


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own checks (e.g. roles it does not know) are user errors
        raise bad_request(f"the model's chat template rejected the messages: {e}", "messages") from e
    # transformers 5 returns a BatchEncoding here, older versions a list
    return list(encoded["input_ids"]) if hasattr(encoded, "keys") else list(encoded)


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise bad_request(f"content parts of type {part.type!r} are not supported; send text", "messages")
        parts.append(part.text or "")
    return "".join(parts)


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    """Checks the request; returns (prompts, params, stops) or raises OpenAIError."""
    if req.top_logprobs:
        raise bad_request(f"top_logprobs must be 0: this engine reports the logprob of the sampled token "
                          f"only, got {req.top_logprobs}", "top_logprobs")
    ids = chat_prompt_ids(req, ctx.client.tokenizer)
    stops = stop_strings(req)
    max_tokens = check_prompt(ids, req.max_completion_tokens or req.max_tokens, ctx.client, "messages")
    return [ids], [make_params(req, max_tokens, 0 if req.logprobs else None)], stops


def _logprobs(ctx: ServingContext, ev: ChoiceEvent) -> ChatLogprobs:
    content = []
    for tok, lp in zip(ev.token_ids, ev.logprobs or [], strict=False):
        piece = ctx.client.tokenizer.decode([tok])
        content.append(ChatTokenLogprob(token=piece, logprob=lp, bytes=list(piece.encode())))
    return ChatLogprobs(content=content)


async def complete(ctx: ServingContext, req: ChatCompletionRequest, events: AsyncIterator[ChoiceEvent],
                   prompts: list[list[int]]) -> ChatCompletionResponse:
    texts, reasons, tokens = [""] * req.n, [None] * req.n, [0] * req.n
    logprobs = [ChatLogprobs(content=[]) for _ in range(req.n)] if req.logprobs else None
    async for ev in events:
        texts[ev.index] += ev.text
        tokens[ev.index] = ev.num_output_tokens
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
        if logprobs is not None:
            logprobs[ev.index].content += _logprobs(ctx, ev).content
    choices = [ChatChoice(index=i, message=ChatResponseMessage(content=texts[i]), finish_reason=reasons[i],
                          logprobs=logprobs[i] if logprobs else None) for i in range(req.n)]
    completion = sum(tokens)
    usage = UsageInfo(prompt_tokens=len(prompts[0]), completion_tokens=completion,
                      total_tokens=len(prompts[0]) + completion)
    return ChatCompletionResponse(id=random_id("chatcmpl"), model=ctx.model_name, choices=choices,
                                  usage=usage)


async def stream(ctx: ServingContext, req: ChatCompletionRequest, events: AsyncIterator[ChoiceEvent],
                 prompts: list[list[int]]) -> AsyncIterator[str]:
    rid, tokens = random_id("chatcmpl"), {}

    def chunk(choice: ChatStreamChoice, usage: UsageInfo | None = None) -> str:
        choices = [choice] if choice else []
        body = ChatCompletionChunk(id=rid, model=ctx.model_name, choices=choices, usage=usage)
        return f"data: {body.model_dump_json()}\n\n"

    for i in range(req.n):  # OpenAI opens each choice with the role
        yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
    async for ev in events:
        tokens[ev.index] = ev.num_output_tokens
        if not ev.text and ev.finish_reason is None and not req.logprobs:
            continue  # nothing a client can see yet
        yield chunk(ChatStreamChoice(index=ev.index, delta=ChatDelta(content=ev.text or None),
                                     finish_reason=ev.finish_reason,
                                     logprobs=_logprobs(ctx, ev) if req.logprobs else None))
    if req.stream_options and req.stream_options.include_usage:
        completion = sum(tokens.values())
        yield chunk(None, UsageInfo(prompt_tokens=len(prompts[0]), completion_tokens=completion,
                                    total_tokens=len(prompts[0]) + completion))
    yield "data: [DONE]\n\n"
