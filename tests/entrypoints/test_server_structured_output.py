"""Structured output over HTTP with SmolLM2 and the real `openai` client: response_format
(json_object, json_schema) on chat and completions, vLLM's structured_outputs extension,
tool calls with a named function and with "required", and invalid specs answered 400 naming
the field while the server keeps serving."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_utils import served

from deepinfer_dp.entrypoints.openai.admission import ServerLimits

sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
from so_cases import ARITHMETIC, CODE_REGEX, PERSON, check_arithmetic, check_json, check_regex  # noqa: E402

NAME = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    limits = ServerLimits(tool_call_parser="hermes")  # --enable-auto-tool-choice
    with served(None, max_model_len=1024, kv_cache_memory_gb=0.2, seed=0, limits=limits) as srv:
        srv.model_name = srv.client.model_name
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_json_schema(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=server.model_name, messages=[
        {"role": "user", "content": "Describe a person as JSON."}], response_format=fmt, temperature=0, max_tokens=80)
    check_json(r.choices[0].message.content, PERSON)


@pytest.mark.slow
def test_chat_json_schema_streamed(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    stream = client.chat.completions.create(model=server.model_name, messages=[
        {"role": "user", "content": "A person as JSON."}], response_format=fmt, temperature=0.8, seed=3,
        max_tokens=80, stream=True)
    check_json("".join(c.choices[0].delta.content or "" for c in stream if c.choices), PERSON)


@pytest.mark.slow
def test_completion_json_object(client, server):
    few_shot = '{"name": "Tom", "age": 3}\n{"name": "Ann", "age": 5}\n'
    r = client.completions.create(model=server.model_name, prompt=few_shot, temperature=0, max_tokens=80,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize("spec, check", [
    ({"regex": CODE_REGEX}, lambda t: check_regex(t, CODE_REGEX)),
    ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    pytest.param({"grammar": ARITHMETIC}, check_arithmetic, marks=pytest.mark.slow),
    pytest.param({"json": PERSON}, lambda t: check_json(t, PERSON), marks=pytest.mark.slow),
])
def test_vllm_structured_outputs_extension(client, server, spec, check):
    r = client.completions.create(model=server.model_name, prompt="Answer:", temperature=0, max_tokens=60,
                                  extra_body={"structured_outputs": spec})
    assert check(r.choices[0].text) is not False, r.choices[0].text


def _arguments_valid(call, tools: list[dict]) -> None:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_tool_call_named_function(client, server, temperature):
    r = client.chat.completions.create(
        model=server.model_name, messages=ASK, tools=[WEATHER, TIME], temperature=temperature, seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _arguments_valid(choice.message.tool_calls[0], [WEATHER])


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])
def test_tool_call_required(client, server, temperature):
    r = client.chat.completions.create(model=server.model_name, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=temperature, seed=2, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        _arguments_valid(call, [WEATHER, TIME])


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """[(name, arguments)] joined from the deltas, as a client does, and the finish_reason."""
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in stream:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [d.function.name, ""])
                entry[1] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_calls_streamed_equal_the_whole_answer(client, server, tool_choice):
    ask = dict(model=server.model_name, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
               temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**ask).choices[0]
    calls, reason = _streamed_calls(client.chat.completions.create(**ask, stream=True))
    assert reason == whole.finish_reason == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    for call in whole.message.tool_calls:
        _arguments_valid(call, [WEATHER, TIME])


def test_auto_tool_choice_without_a_call_is_the_plain_answer(client, server):
    # SmolLM2's chat template does not show tools, so the prompt is the same with and without
    # them; the model writes no <tool_call>, and the answer must be exactly the plain one.
    ask = dict(model=server.model_name, messages=ASK, temperature=0, max_tokens=30)
    plain = client.chat.completions.create(**ask).choices[0]
    auto = client.chat.completions.create(**ask, tools=[WEATHER]).choices[0]
    assert "<tool_call>" not in plain.message.content
    assert (auto.message.content, auto.finish_reason, auto.message.tool_calls) == (
        plain.message.content, plain.finish_reason, [])
    stream = client.chat.completions.create(**ask, tools=[WEATHER], tool_choice="auto", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.message.content


def test_tool_results_sent_back_are_served(client, server):
    first = client.chat.completions.create(model=server.model_name, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=120).choices[0]
    call = first.message.tool_calls[0]
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=server.model_name, messages=turn, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=10)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= \"a"}},
     "structured_outputs.grammar"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": 7}}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required", "tools": [
        WEATHER, {"type": "function", "function": {"name": "bad", "parameters": {"type": "objekt"}}}]},
     "tools.1.function.parameters"),
])
def test_invalid_specs_are_400_naming_the_field(server, route, body, param):
    r = httpx.post(server.url + route, json={"model": server.model_name, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param.split(".")[-1] in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/v1/completions", json={"model": server.model_name, "prompt": "Hi",
                                                          "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_metrics_count_constrained_requests_and_compile_time(client, server):
    client.completions.create(model=server.model_name, prompt="Pick:", temperature=0, max_tokens=5,
                              extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    text = httpx.get(server.url + "/metrics").text
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("deepinfer:structured_output")}
    assert series['deepinfer:structured_output_requests_total{dp_rank="0"}'] >= 1
    assert series['deepinfer:structured_output_compile_seconds_count{dp_rank="0"}'] >= 1
    assert series['deepinfer:structured_output_mask_steps_total{dp_rank="0"}'] >= 1
    assert 'deepinfer:structured_output_compile_seconds_bucket{dp_rank="0",le="+Inf"}' in series
