"""Tool calls read out of chat answers (entrypoints/openai/tool_calls.py and the chat
endpoint's stream/complete): named (arguments streamed as they come), required (calls at the
end) and auto with the Hermes parser (content streamed, <tool_call> blocks parsed at the end),
each split into pieces at every possible point; answers that do not parse stay content. The
streamed chunks are parsed back with the `openai` package's own chunk type."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deepinfer_dp.entrypoints.openai import serving_chat
from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer_dp.entrypoints.openai.serving_engine import ChoiceEvent
from deepinfer_dp.entrypoints.openai.tool_calls import ToolMode, ToolReader, joined

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES_TWO = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def _read(mode: ToolMode, pieces: list[str], reason: str) -> tuple[str, list, str | None]:
    reader, content, deltas = ToolReader(mode), "", []
    for p in pieces:
        text, calls = reader.feed(p)
        content, deltas = content + text, deltas + calls
    text, calls, reason = reader.finish(reason)
    return content + text, joined(deltas + calls), reason


def _splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every point."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize("pieces", _splits(HERMES_TWO))
def test_hermes_two_calls_any_split(pieces):
    content, calls, reason = _read(ToolMode("auto"), pieces, "stop")
    assert content == "Let me check. " and reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("text", ["Paris is sunny.", "a < b and <tool is not a tag", "ends with <tool_ca"])
def test_hermes_plain_text_is_content(text):
    for pieces in _splits(text):
        assert _read(ToolMode("auto"), pieces, "stop") == (text, [], "stop")


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": "get_weather", "argum', "length"),  # cut by max_tokens
    ('<tool_call>{"name": get_weather}</tool_call>', "stop"),  # not JSON
    ('<tool_call>{"arguments": {}}</tool_call>', "stop"),  # no name
])
def test_hermes_unparsable_call_stays_content(text, reason):
    assert _read(ToolMode("auto"), [text[:7], text[7:]], reason) == (text, [], reason)


@pytest.mark.parametrize("pieces", _splits('{"city": "Paris"}'))
def test_named_arguments_stream_as_generated(pieces):
    reader = ToolReader(ToolMode("named", "get_weather"))
    deltas = [d for p in pieces for d in reader.feed(p)[1]]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])  # only pieces after the header
    content, last, reason = reader.finish("stop")
    calls = joined(deltas + last)
    assert (content, reason, calls[0].function.arguments) == ("", "tool_calls", '{"city": "Paris"}')


def test_named_cut_by_length_keeps_length():
    assert _read(ToolMode("named", "get_weather"), ['{"ci'], "length")[2] == "length"


def test_required_calls_come_at_the_end():
    text = '[{"name": "get_time", "parameters": {"city": "Oslo"}}]'
    reader = ToolReader(ToolMode("required"))
    assert all(reader.feed(c) == ("", []) for c in text)
    content, deltas, reason = reader.finish("stop")
    assert (content, reason) == ("", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in joined(deltas)] == [
        ("get_time", {"city": "Oslo"})]
    assert _read(ToolMode("required"), [text[:20]], "length") == (text[:20], [], "length")


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _ctx(parser: str | None = "hermes"):
    return SimpleNamespace(model_name="m", limits=ServerLimits(tool_call_parser=parser),
                           client=SimpleNamespace(tokenizer=_Tokenizer()))


async def _events(pieces: list[str], reason: str):
    for i, p in enumerate(pieces):
        yield ChoiceEvent(index=0, text=p, token_ids=[ord(c) for c in p], logprobs=None,
                          finish_reason=reason if i == len(pieces) - 1 else None, num_output_tokens=i + 1)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME],
                                 **fields)


async def _stream(req: ChatCompletionRequest, pieces: list[str], reason: str) -> list[ChatCompletionChunk]:
    lines = [c async for c in serving_chat.stream(_ctx(), req, _events(pieces, reason), [[1]])]
    assert lines[-1] == "data: [DONE]\n\n"
    return [ChatCompletionChunk.model_validate_json(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("fields, pieces, reason", [
    ({}, [HERMES_TWO[:20], HERMES_TWO[20:50], HERMES_TWO[50:]], "stop"),
    ({}, ["Just text ", "<tool_", "call> but cut"], "length"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, ['{"city"', ': "Rome"}'], "stop"),
    ({"tool_choice": "required"}, ['[{"name": "get_time", ', '"parameters": {}}]'], "stop"),
])
def test_stream_joins_to_the_non_streamed_answer(fields, pieces, reason):
    req = _request(**fields)
    chunks = asyncio.run(_stream(req, pieces, reason))
    whole = ChatCompletion.model_validate(asyncio.run(serving_chat.complete(
        _ctx(), req, _events(pieces, reason), [[1]])).model_dump())
    message = whole.choices[0].message
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed_content == (message.content or "")
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, [d.function.name, ""])
            entry[1] += d.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [[t.function.name, t.function.arguments]
                                                for t in message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert (whole.choices[0].finish_reason == "tool_calls") == bool(message.tool_calls)


def test_auto_needs_the_parser_and_free_text():
    from deepinfer_dp.entrypoints.openai.serving_engine import OpenAIError
    from deepinfer_dp.entrypoints.openai.structured import structured_params

    assert structured_params(_request(), "hermes") == (None, ToolMode("auto"))
    with pytest.raises(OpenAIError) as e:
        structured_params(_request())  # no parser: "auto" (the default with tools) is refused
    assert e.value.param == "tool_choice" and "--enable-auto-tool-choice" in str(e.value)
    with pytest.raises(OpenAIError) as e:
        structured_params(_request(response_format={"type": "json_object"}), "hermes")
    assert e.value.param == "tool_choice"
