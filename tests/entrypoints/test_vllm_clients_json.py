"""Bounded JSON by default and vLLM's structured-output fields: a random-weight tiny model
given a JSON schema, json_object or two tools with tool_choice "required" ends in valid JSON
well before max_tokens (greedy and sampled); the grammar's own bounds (whitespace, nesting,
tool-call count); vLLM's guided_* fields as aliases of structured_outputs."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import httpx
import jsonschema
import llguidance
import llguidance.hf
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.structured_output import backend
from deepinfer_dp.structured_output.params import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).parent.parent))
from model_utils import build_tiny_tokenizer  # noqa: E402

MAX_TOKENS = 450  # the tiny model's context is 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
        "additionalProperties": False}}}]
ASKS = {"json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
        "json_object": {"response_format": {"type": "json_object"}},
        "two_tools_required": {"tools": TOOLS, "tool_choice": "required"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tiny_model_dir(tmp_path_factory.mktemp("models")), max_model_len=512) as srv:
        yield srv


def _chat(server, **body) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Answer in JSON"}], **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("ask", list(ASKS))
@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (1.0, 0), (1.0, 1)])
def test_a_random_model_ends_in_valid_json(server, ask, temperature, seed):
    out = _chat(server, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, **ASKS[ask])
    choice, used = out["choices"][0], out["usage"]["completion_tokens"]
    assert used < MAX_TOKENS * 2 // 3, f"{used} tokens: {choice}"
    if ask == "two_tools_required":
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert 1 <= len(calls) <= len(TOOLS)  # maxItems: one call per tool at most
        for call in calls:
            tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])
        return
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    if ask == "json_schema":
        jsonschema.validate(value, SCHEMA)
    assert isinstance(value, dict)


@functools.cache
def _tokenizers():
    tok = build_tiny_tokenizer()
    return tok, llguidance.hf.from_tokenizer(tok)


def _accepts(params: StructuredOutputsParams, text: str) -> bool:
    tok, ll_tok = _tokenizers()
    matcher = llguidance.LLMatcher(ll_tok, backend.grammar_text(params))
    ids = tok(text, add_special_tokens=False).input_ids
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
DIGIT = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
         "additionalProperties": False}


@pytest.mark.parametrize("options, text, accepted", [
    ({}, '{"a": 1}', True),
    ({}, '{"a":1}', True),
    ({}, '{\n  "a": 1\n}', True),
    ({}, '{   "a": 1}', False),  # the default gap: nothing, one space, or a newline and an indent
    ({}, '{\n\n"a": 1}', False),
    ({}, "{\n" + " " * 17 + '"a": 1}', False),
    ({"disable_any_whitespace": True}, '{"a":1}', True),
    ({"disable_any_whitespace": True}, '{"a": 1}', False),
    ({"whitespace_pattern": "[ \t\n]*"}, '{   \n\n  "a": 1}', True),  # the way back to unbounded
])
def test_json_whitespace_is_bounded_by_default(options, text, accepted):
    assert _accepts(StructuredOutputsParams(json=OBJ, **options), text) is accepted


@pytest.mark.parametrize("depth, text, accepted", [
    (None, '{"a": ' * 8 + "1" + "}" * 8, True),
    (None, '{"a": ' * 9 + "1" + "}" * 9, False),
    (2, '{"a": {"b": [1]}}', False),
    (2, '{"a": {"b": 1}, "c": [1, "x"]}', True),
    (1, '{"a": "x", "b": null}', True),
])
def test_json_object_nesting_is_bounded(depth, text, accepted):
    assert _accepts(StructuredOutputsParams(json_object=True, json_object_max_depth=depth), text) is accepted


def test_json_object_keys_and_members_are_bounded():
    params = StructuredOutputsParams(json_object=True)
    assert _accepts(params, json.dumps({"k" * backend.JSON_OBJECT_MAX_KEY: 1}))
    assert not _accepts(params, json.dumps({"k" * (backend.JSON_OBJECT_MAX_KEY + 1): 1}))
    assert _accepts(params, json.dumps({str(i): i for i in range(backend.JSON_OBJECT_MAX_ITEMS)}))
    assert not _accepts(params, json.dumps({str(i): i for i in range(backend.JSON_OBJECT_MAX_ITEMS + 1)}))


@pytest.mark.parametrize("guided, expect", [
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": DIGIT, "guided_whitespace_pattern": ""},
     lambda t: t == json.dumps(json.loads(t), separators=",:")),
    ({"guided_grammar": 'start: "a" "b"+'}, lambda t: t.startswith("ab")),
])
def test_guided_fields_are_aliases_of_structured_outputs(server, caplog, guided, expect):
    with caplog.at_level(logging.WARNING, logger="deepinfer_dp.entrypoints.openai.guided"):
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "Answer:", "max_tokens": 200, "temperature": 0, **guided})
    assert r.status_code == 200, r.text
    assert expect(r.json()["choices"][0]["text"])
    assert any("deprecated" in rec.getMessage() and next(iter(guided)) in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("body, param", [
    ({"guided_json": OBJ, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "("}, "structured_outputs.regex"),
])
def test_guided_conflicts_are_named(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
