"""POST /v1/chat/completions: messages through the model's chat template, then the same
choices machinery as completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from deepinfer_dp.entrypoints.openai import unsupported
from deepinfer_dp.entrypoints.openai.chat_template import TemplateError
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
    ChatTopLogprob,
    UsageInfo,
    random_id,
)
from deepinfer_dp.entrypoints.openai.serving_chat_images import image_prompt
from deepinfer_dp.entrypoints.openai.serving_engine import (
    ChoiceEvent,
    Prepared,
    PromptIds,
    ServingContext,
    bad_request,
    check_common,
    check_request,
    default_max_tokens,
    make_params,
    refuse_unsupported,
    stop_strings,
)
from deepinfer_dp.entrypoints.openai.structured import (
    constraint_field,
    structured_params,
    tool_mode,
    tools_for_template,
)
from deepinfer_dp.entrypoints.openai.tool_calls import ToolReader, joined
from deepinfer_dp.sampling_params import MAX_LOGPROBS
from deepinfer_dp.utils.chat_template import ChatRender, ChatRenderError


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise bad_request(f"content parts of type {part.type!r} are not supported; send text", "messages")
        refuse_unsupported(part, unsupported.CONTENT_PART, f"messages.content.{i}.")
        parts.append(part.text or "")
    return "".join(parts)


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as chat templates take them; an earlier answer's tool calls are sent back
    with their arguments as objects (what the templates that show them expect)."""
    out = []
    for i, m in enumerate(req.messages):
        refuse_unsupported(m, unsupported.MESSAGE, f"messages.{i}.")
        message = {"role": m.role, "content": _text(m.content)}
        if m.tool_calls:
            message["tool_calls"] = [_call_for_template(c, f"messages.{i}.tool_calls.{j}")
                                     for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _call_for_template(call, param: str) -> dict:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise bad_request("arguments must be a JSON object, as text", f"{param}.function.arguments")
    fn = {"name": call.function.name, "arguments": args}
    return {"type": "function", "function": fn} | ({"id": call.id} if call.id is not None else {})


def chat_render(ctx: ServingContext, add_generation_prompt: bool | None, continue_final_message: bool | None,
                chat_template_kwargs: dict | None) -> ChatRender:
    """A request's ChatRender (ChatRender.of, its variables checked by the server's
    ChatTokenizer for every path, images' included), or a 400 naming the field it cannot take."""
    try:
        render = ChatRender.of(add_generation_prompt, continue_final_message, chat_template_kwargs)
        ctx.chat_tokenizer.check_variables(render)
    except (ChatRenderError, TemplateError) as e:
        raise bad_request(str(e), e.param) from e
    return render


def _check_fields(ctx: ServingContext, req: ChatCompletionRequest) -> None:
    refuse_unsupported(req, unsupported.CHAT)
    check_common(req, ctx.limits)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> Prepared:
    """Checks the request (once, with the engine's validator); returns (prompts, params, stops)
    or raises OpenAIError."""
    _check_fields(ctx, req)
    # 400 for tool_choice "auto" without a parser, or more than one constraint
    constraint, _ = structured_params(req, ctx.limits.tool_call_parser)
    render = chat_render(ctx, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs)
    mm = await image_prompt(ctx, req, render)
    if mm is None:
        messages = _messages(req)
        ctx.check_text_length(sum(len(m["content"]) for m in messages), "messages", "messages")
    try:
        ids = (await ctx.off_loop(ctx.chat_tokenizer.prompt_ids, messages, tools_for_template(req), render)
               if mm is None else PromptIds(await ctx.off_loop(_tokenize, ctx, mm.prompt)))
    except TemplateError as e:
        raise bad_request(str(e), e.param) from e
    stops = stop_strings(req)
    # max_completion_tokens wins; 0 is a value (refused below), not "no limit"
    limit, name = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                   else (req.max_tokens, "max_tokens"))
    defaults = ctx.client.input_processor.sampling_defaults
    limit = default_max_tokens(limit, limit is not None, defaults, len(ids), ctx.client.max_model_len, None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    wanted = make_params(req, limit, logprobs, defaults, structured_outputs=constraint)
    names = {"prompt": "messages", "max_tokens": name, "structured_outputs": constraint_field(req)}
    checked, params = check_request(ids, wanted, ctx.client, "messages", names)
    if mm is not None:
        mm.max_tokens_set = req.max_completion_tokens is not None or "max_tokens" in req.model_fields_set
        ids[:] = checked
        ids.mm = mm
    return [ids if mm is not None else checked], [params], stops


def _tokenize(ctx: ServingContext, text: str) -> list[int]:
    return ctx.client.tokenizer(text).input_ids


def _logprobs(ctx: ServingContext, ev: ChoiceEvent) -> ChatLogprobs:
    decode, content = ctx.client.tokenizer.decode, []
    tops = ev.top_logprobs or [{} for _ in ev.token_ids]
    for tok, lp, top in zip(ev.token_ids, ev.logprobs or [], tops, strict=False):
        piece = decode([tok])
        alternatives = [ChatTopLogprob(token=(t := decode([i])), logprob=v, bytes=list(t.encode()))
                        for i, v in top.items()]
        content.append(ChatTokenLogprob(token=piece, logprob=lp, bytes=list(piece.encode()),
                                        top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def _echoed(req: ChatCompletionRequest) -> str:
    """What `echo` puts before each answer: the last message's text when it is the assistant's
    (the role of the answer), as vLLM does; else nothing. Only its text parts: an image model's
    message may hold others, which this late in a request must not fail it."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    if isinstance(last.content, list):
        return "".join(part.text or "" for part in last.content if part.type == "text")
    return last.content or ""


async def complete(ctx: ServingContext, req: ChatCompletionRequest, events: AsyncIterator[ChoiceEvent],
                   prompts: list[list[int]]) -> ChatCompletionResponse:
    texts, reasons, tokens = [""] * req.n, [None] * req.n, [0] * req.n
    logprobs = [ChatLogprobs(content=[]) for _ in range(req.n)] if req.logprobs else None
    prompt_len = len(prompts[0])  # a prompt with images: the engine's expanded length, from its events
    async for ev in events:
        prompt_len = max(prompt_len, ev.prompt_len)
        texts[ev.index] += ev.text
        tokens[ev.index] = ev.num_output_tokens
        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
        if logprobs is not None:
            logprobs[ev.index].content += _logprobs(ctx, ev).content
    tools = tool_mode(req, ctx.limits.tool_call_parser)
    choices = [ChatChoice(index=i, message=ChatResponseMessage(content=texts[i]), finish_reason=reasons[i],
                          logprobs=logprobs[i] if logprobs else None) for i in range(req.n)]
    for choice in choices if tools is not None else []:  # read the same way as a stream is
        reader = ToolReader(tools)
        content, deltas = reader.feed(choice.message.content)
        rest, last, choice.finish_reason = reader.finish(choice.finish_reason)
        calls = joined(deltas + last)
        choice.message = ChatResponseMessage(content=(content + rest) or (None if calls else ""), tool_calls=calls)
    if echo := _echoed(req):
        for choice in choices:
            choice.message.content = echo + (choice.message.content or "")
    completion = sum(tokens)
    usage = UsageInfo(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion)
    return ChatCompletionResponse(id=random_id("chatcmpl"), model=ctx.model_name, choices=choices,
                                  usage=usage)


def _read(reader: ToolReader | None, ev: ChoiceEvent) -> tuple[str, list, str | None]:
    """One event's visible text, tool-call deltas and finish_reason."""
    if reader is None:
        return ev.text, [], ev.finish_reason
    text, calls = reader.feed(ev.text)
    if ev.finish_reason is None:
        return text, calls, None
    rest, last, reason = reader.finish(ev.finish_reason)
    return text + rest, calls + last, reason


async def stream(ctx: ServingContext, req: ChatCompletionRequest, events: AsyncIterator[ChoiceEvent],
                 prompts: list[list[int]]) -> AsyncIterator[str]:
    rid, tokens, prompt_len = random_id("chatcmpl"), {}, [len(prompts[0])]  # images: the expanded length
    continuous = req.continuous_usage()

    def usage() -> UsageInfo:
        completion = sum(tokens.values())
        return UsageInfo(prompt_tokens=prompt_len[0], completion_tokens=completion,
                         total_tokens=prompt_len[0] + completion)

    def chunk(choice: ChatStreamChoice | None, final: bool = False) -> str:
        choices = [choice] if choice else []
        body = ChatCompletionChunk(id=rid, model=ctx.model_name, choices=choices,
                                   usage=usage() if final or continuous else None)
        return f"data: {body.model_dump_json()}\n\n"

    tools = tool_mode(req, ctx.limits.tool_call_parser)
    readers = [ToolReader(tools) if tools else None for _ in range(req.n)]
    for i in range(req.n):  # OpenAI opens each choice with the role
        yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")))
    for i in range(req.n if (echo := _echoed(req)) else 0):  # then vLLM sends each the echo
        yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(content=echo)))
    async for ev in events:
        tokens[ev.index] = ev.num_output_tokens
        prompt_len[0] = max(prompt_len[0], ev.prompt_len)
        text, calls, reason = _read(readers[ev.index], ev)
        if not text and not calls and reason is None and not req.logprobs:
            continue  # nothing a client can see yet
        yield chunk(ChatStreamChoice(index=ev.index, delta=ChatDelta(content=text or None, tool_calls=calls or None),
                                     finish_reason=reason, logprobs=_logprobs(ctx, ev) if req.logprobs else None))
    if req.stream_options and req.stream_options.include_usage:
        yield chunk(None, final=True)
    yield "data: [DONE]\n\n"
