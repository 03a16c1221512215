"""What clients written for vLLM send, against a tiny-model server (dp 1): vLLM's stream
options, nested-field refusals that name the nested field, and every 400 in the log."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tiny_model_dir(tmp_path_factory.mktemp("models"))) as srv:
        yield srv


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_continuous_usage_stats_puts_usage_in_every_chunk(server, path, body):
    events = _events(server, path, {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert all(e["usage"] is not None for e in events)
    completions = [e["usage"]["completion_tokens"] for e in events]
    assert completions == sorted(completions) and completions[-1] == 8
    assert events[-1]["choices"] == []
    assert {e["usage"]["prompt_tokens"] for e in events} == {events[-1]["usage"]["prompt_tokens"]}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("options", [{"include_usage": True, "continuous_usage_stats": False},
                                     {"continuous_usage_stats": True}])
def test_without_continuous_usage_only_the_last_chunk_has_usage(server, path, body, options):
    events = _events(server, path, {**body, "stream": True, "stream_options": options})
    with_usage = [e for e in events if e.get("usage")]
    if options.get("include_usage"):  # vLLM: continuous_usage_stats counts only with include_usage
        assert with_usage == [events[-1]] and events[-1]["usage"]["completion_tokens"] == 8
    else:
        assert with_usage == []


@pytest.mark.parametrize("extra, param", [
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, "stream_options.continuous_usage_stats"),
    ({"stream": True, "stream_options": {"include_usage": True, "per_token": True}}, "stream_options.per_token"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"structured_outputs": {"json": {}, "whitespace": 1}}, "structured_outputs.whitespace"),
])
def test_a_refused_nested_field_is_named_and_logged(server, caplog, extra, param):
    with caplog.at_level(logging.INFO, logger="deepinfer_dp.entrypoints.openai.errors"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":")
    logged = [rec for rec in caplog.records if rec.levelno == logging.INFO and error["message"] in rec.getMessage()]
    assert logged, "the 400 and its message are in the server's log"


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("extra", [
    {"request_id": "abc", "session_id": "s1", "length_penalty": 0.5, "stream_interval": 4},
    {"use_beam_search": False, "watermarking": False, "priority": 0, "return_token_ids": False,
     "spaces_between_special_tokens": True, "return_token_offsets": True, "return_mm_kwargs": False},
    {"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}, "ignore_eos": False},
])
def test_vllm_fields_that_change_nothing_are_accepted(server, path, body, extra):
    r = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, extra, param", [
    ("/v1/completions", COMPLETION, {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", COMPLETION, {"add_special_tokens": False}, "add_special_tokens"),
    ("/v1/completions", COMPLETION, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", COMPLETION, {"priority": 3}, "priority"),
    ("/v1/completions", COMPLETION, {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", COMPLETION, {"length_penalty": "long"}, "length_penalty"),
    ("/v1/chat/completions", CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", CHAT, {"documents": [{"title": "a", "text": "b"}]}, "documents"),
    ("/v1/chat/completions", CHAT, {"bad_words": ["x"]}, "bad_words"),
    ("/v1/chat/completions", CHAT, {"structured_outputs": {"regex": "a", "structural_tag": "x"}, "ignore_eos": False},
     "structured_outputs.structural_tag"),
])
def test_vllm_fields_that_would_change_the_result_are_refused(server, path, body, extra, param):
    r = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
