"""The bad-input matrix: every refusal of the HTTP API, each with its status, `error.param` and
`error.type` in OpenAI's shape, and the server still serving after each one. Then the fields
that change nothing by definition, which are accepted."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai.admission import ServerLimits

LIMITS = ServerLimits(max_request_body_bytes=64 * 1024, max_n=4, max_prompts=3)
C = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
H = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
USER = {"role": "user", "content": "hi"}
BAD = "invalid_request_error"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

COMPLETIONS = [  # (body, status, param)
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
    ({**C, "prompt": [5, 400]}, 400, "prompt"),
    ({**C, "prompt": [-1, 5]}, 400, "prompt"),
    ({**C, "prompt": [5] * 600}, 400, "prompt"),
    ({**C, "prompt": [True, False]}, 400, "prompt"),
    ({**C, "prompt": ""}, 400, "prompt"),
    ({**C, "prompt": []}, 400, "prompt"),
    ({**C, "prompt": "\ud800 lone surrogate"}, 400, "prompt"),
    ({**C, "prompt": ["a", "b", "c", "d"]}, 400, "prompt"),  # over max_prompts
    ({**C, "prompt": "ab " * 20_000}, 400, "prompt"),  # too many characters to fit: refused untokenized
    ({**C, "max_tokens": 100000}, 400, "max_tokens"),
    ({**C, "max_tokens": 0}, 400, "max_tokens"),
    ({**C, "max_tokens": "many"}, 400, "max_tokens"),
    ({**C, "temperature": -0.5}, 400, "temperature"),
    ({**C, "temperature": 3}, 400, "temperature"),
    ({**C, "top_p": 0}, 400, "top_p"),
    ({**C, "top_k": -5}, 400, "top_k"),
    ({**C, "min_p": 2}, 400, "min_p"),
    ({**C, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({**C, "presence_penalty": 9}, 400, "presence_penalty"),
    ({**C, "frequency_penalty": "a"}, 400, "frequency_penalty"),
    ({**C, "n": 0}, 400, "n"),
    ({**C, "n": 5}, 400, "n"),  # over max_n
    ({**C, "logprobs": 21}, 400, "logprobs"),
    ({**C, "echo": True, "logprobs": 25}, 400, "logprobs"),
    ({**C, "stop": [""]}, 400, "stop"),
    ({**C, "stream": "yes"}, 400, "stream"),
    ({**C, "stream": 1}, 400, "stream"),
    ({**C, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({**C, "seed": 2**64}, 400, "seed"),
    ({**C, "seed": 1.5}, 400, "seed"),
    ({**C, "min_tokens": 5}, 400, "min_tokens"),  # above max_tokens
    ({**C, "suffix": "the end"}, 400, "suffix"),
    ({**C, "best_of": 3}, 400, "best_of"),
    ({**C, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({**C, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({**C, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({**C, "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({**C, "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ({**C, "service_tier": "flex"}, 400, "service_tier"),
    ({**C, "store": True}, 400, "store"),
    ({**C, "temprature": 0.5}, 400, "temprature"),  # a typo is named, never ignored
    ({**C, "data_parallel_rank": 1}, 400, "data_parallel_rank"),  # dp 1: only rank 0 exists
    ({**C, "data_parallel_rank": -1}, 400, "data_parallel_rank"),
]

CHAT = [
    ({**H, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     400, "response_format.json_schema.schema"),
    ({**H, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ({**H, "response_format": {"type": "xml"}}, 400, "response_format.type"),  # the nested field itself
    ({**H, "tools": [TOOL]}, 400, "tool_choice"),  # the default "auto" needs --enable-auto-tool-choice
    ({**H, "tool_choice": "required"}, 400, "tool_choice"),  # without tools
    ({**H, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "tool_choice.function.name"),
    ({**H, "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs.regex"),
    ({**H, "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs"),
    ({**H, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, 400,
     "structured_outputs"),
    ({**H, "functions": [TOOL["function"]]}, 400, "functions"),
    ({**H, "function_call": "auto"}, 400, "function_call"),
    ({**H, "audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ({**H, "modalities": ["text", "audio"]}, 400, "modalities"),
    ({**H, "prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ({**H, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ({**H, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({**H, "max_tokens": 0}, 400, "max_tokens"),
    ({**H, "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
    ({**H, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**H, "logprobs": "yes"}, 400, "logprobs"),
    ({**H, "messages": []}, 400, "messages"),
    ({**H, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({**H, "messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages"),
    ({**H, "messages": [{"role": "user", "content": "hi " * 20_000}]}, 400, "messages"),
    ({**H, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ({**H, "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400,
     "messages.1.tool_calls.0.function"),
    ({**H, "messages": [USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, 400, "messages.1.tool_calls.0.function.arguments"),
    ({**H, "messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages.0.content"),
    ({**H, "n": 7}, 400, "n"),
    ({**H, "data_parallel_rank": 3}, 400, "data_parallel_rank"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tiny_model_dir(tmp_path_factory.mktemp("models")), limits=LIMITS) as srv:
        yield srv


def _still_serving(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={**C, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def _check(server, route: str, body: dict, status: int, param: str | None, type_: str = BAD) -> dict:
    # json.dumps escapes non-ASCII, so a lone surrogate travels as the JSON text \ud800
    r = httpx.post(server.url + route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["type"]) == (param, type_), err
    assert err["message"]
    _still_serving(server)
    return err


def test_matrix_is_large_enough():
    assert len(COMPLETIONS) + len(CHAT) >= 40


@pytest.mark.parametrize(("body", "status", "param"), COMPLETIONS)
def test_completions_refusals(server, body, status, param):
    _check(server, "/v1/completions", body, status, param)


@pytest.mark.parametrize(("body", "status", "param"), CHAT)
def test_chat_refusals(server, body, status, param):
    err = _check(server, "/v1/chat/completions", body, status, param)
    if err["code"] == "unsupported_parameter":
        assert "not supported" in err["message"] and param in err["message"]


@pytest.mark.parametrize(("body", "param"), [({**C, "prompt": [True, False]}, "prompt"),
                                             ({**C, "max_tokens": 100000}, "max_tokens"),
                                             ({**C, "suffix": "the end"}, "suffix")])
def test_refusals_when_streaming_are_plain_http_errors(server, body, param):
    _check(server, "/v1/completions", {**body, "stream": True}, 400, param)


def test_body_over_the_limit_is_413(server):
    r = httpx.post(server.url + "/v1/completions", json={**C, "prompt": "x" * 70_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds for a chunked body too
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(80):
            yield b"y" * 1000
        yield b'"}'
    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == BAD
    _still_serving(server)


@pytest.mark.parametrize(("content", "words"), [(b'{"model": "tiny-llama", "prompt": ', "Malformed JSON"),
                                                (b"[1, 2]", "JSON object"), (b"\xff\xfe", "Malformed JSON")])
def test_malformed_bodies(server, content, words):
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    _still_serving(server)


def test_unknown_routes_and_methods_answer_json(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == BAD
    r = httpx.post(server.url + "/v1/embeddings", json={})
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/completions", {**C, "user": "u-1", "best_of": 1, "suffix": "", "store": False, "service_tier": "auto",
                         "metadata": {"k": "v"}, "data_parallel_rank": 0}),
    ("/v1/chat/completions", {**H, "user": "u-1", "metadata": {"k": "v"}, "store": False,
                              "parallel_tool_calls": True, "tool_choice": "none", "tools": [],
                              "response_format": {"type": "text"}, "modalities": ["text"],
                              "safety_identifier": "s", "prompt_cache_key": "p"}),
    ("/v1/chat/completions", {**H, "messages": [USER, {"role": "assistant", "content": "x", "refusal": None,
                                                       "tool_calls": []}, USER]}),
    ("/v1/chat/completions", {**H, "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}, USER], "tools": [TOOL], "tool_choice": "none"}),
])
def test_fields_that_change_nothing_are_accepted(server, route, body):
    r = httpx.post(server.url + route, json={**body, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("header", "status"), [("1", 400), ("zero", 400), ("0", 200)])
def test_vllms_rank_header_is_checked_as_the_field(server, header, status):
    r = httpx.post(server.url + "/v1/completions", json=C, headers={"X-data-parallel-rank": header})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "data_parallel_rank"
