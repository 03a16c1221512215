"""Every integer field of both endpoints at and past every 64-bit bound, and structured-output
specs past the grammar bounds: each answer is under 500, and each 4xx names the field at
fault in `param` (the matrix of the request-validation rules, engine/input_processor.py)."""

from __future__ import annotations

import json
import typing

import httpx
import pytest
from server_utils import MODEL_NAME

from deepinfer_dp.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer_dp.structured_output.limits import MAX_CHOICES, MAX_REPEAT, MAX_SPEC_CHARS

HUGE = "9" * 5000  # more digits than Python turns into an int from text (4300)
BOUNDS = [-(2**63) - 1, -(2**63), -1, 0, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, HUGE, "-" + HUGE]
BOUND_IDS = ["-2**63-1", "-2**63", "-1", "0", "2**31", "2**32", "2**63-1", "2**63", "2**64-1", "2**64", "2**70",
             "huge", "-huge"]
COMPLETION_INTS = ["n", "max_tokens", "top_k", "seed", "min_tokens", "logprobs", "best_of", "stop_token_ids", "prompt",
                   "data_parallel_rank"]
CHAT_INTS = ["n", "max_tokens", "max_completion_tokens", "top_k", "seed", "min_tokens", "top_logprobs",
             "stop_token_ids", "data_parallel_rank"]
FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"]
LISTS = {"stop_token_ids", "prompt"}  # sent as [value]
BASE = {"/v1/completions": {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1},
        "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}}


def _has_int(annotation) -> bool:
    return annotation is int or any(_has_int(a) for a in typing.get_args(annotation))


def _int_fields(model) -> set[str]:
    return {name for name, f in model.model_fields.items() if _has_int(f.annotation)}


def test_the_matrix_covers_every_integer_field():
    """A new integer field fails here until it is added to the matrix below."""
    assert _int_fields(CompletionRequest) <= set(COMPLETION_INTS)
    assert _int_fields(ChatCompletionRequest) <= set(CHAT_INTS)


def _post(server, route: str, name: str, value) -> httpx.Response:
    """The route's base body with `name` set to `value` (a str of digits goes in as a JSON number)."""
    body = dict(BASE[route])
    placeholder = 123456789123456789
    wire = placeholder if isinstance(value, str) else value
    body[name] = [wire] if name in LISTS else {"5": wire} if name == "logit_bias" else wire
    if name == "top_logprobs":
        body["logprobs"] = True
    text = json.dumps(body)
    if isinstance(value, str):
        text = text.replace(str(placeholder), value)
    return httpx.post(server.url + route, content=text, headers={"Content-Type": "application/json"}, timeout=120)


def _assert_named(r: httpx.Response, name: str) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["param"] == name, error


@pytest.mark.parametrize("value", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("name", COMPLETION_INTS + FLOATS)
def test_completions_numbers_at_64_bit_bounds(server, name, value):
    _assert_named(_post(server, "/v1/completions", name, value), name)


@pytest.mark.parametrize("value", BOUNDS, ids=BOUND_IDS)
@pytest.mark.parametrize("name", CHAT_INTS + FLOATS)
def test_chat_numbers_at_64_bit_bounds(server, name, value):
    _assert_named(_post(server, "/v1/chat/completions", name, value), name)


def test_top_k_past_64_bits_is_a_400_naming_it(server):
    """Was a 500: "OverflowError: can't serialize ints > 2**64 - 1"."""
    for value in (2**64, 2**70):
        r = _post(server, "/v1/completions", "top_k", value)
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text


def test_a_logit_bias_key_of_5000_digits_names_logit_bias(server):
    """Was `param: "Exceeds"`, read out of Python's message about long integers."""
    body = {**BASE["/v1/completions"], "logit_bias": {"1" * 5000: 1.0}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


SPECS = [
    ({"regex": "a{1000000}"}, "structured_outputs.regex"),  # was a 500: "lexer error: too many expressions"
    ({"regex": f"a{{{MAX_REPEAT + 1}}}"}, "structured_outputs.regex"),
    ({"regex": "(a{200}b){200}"}, "structured_outputs.regex"),  # 40,000 with its group's count
    ({"regex": "x" * (MAX_SPEC_CHARS + 1)}, "structured_outputs.regex"),
    ({"choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, "structured_outputs.choice"),
    ({"choice": ["y" * (MAX_SPEC_CHARS + 1)]}, "structured_outputs.choice"),
    ({"grammar": 'start: "a"{1000000}'}, "structured_outputs.grammar"),
    ({"json": {"type": "string", "maxLength": 10**6}}, "structured_outputs.json"),
    ({"json": {"type": "array", "minItems": 10**30}}, "structured_outputs.json"),
    ({"json": {"type": "string", "pattern": "b{1000000}"}}, "structured_outputs.json"),
    ({"json": {"type": "object", "description": "z" * MAX_SPEC_CHARS}}, "structured_outputs.json"),
]


@pytest.mark.parametrize(("spec", "param"), SPECS, ids=[p + str(i) for i, (_, p) in enumerate(SPECS)])
def test_grammar_past_its_bounds_is_a_400_naming_the_field(server, spec, param):
    for route in BASE:
        r = httpx.post(server.url + route, json={**BASE[route], "structured_outputs": spec}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_schemas_past_the_bounds_name_their_request_field(server):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**6}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = httpx.post(server.url + "/v1/chat/completions", json={**BASE["/v1/chat/completions"], "response_format": fmt},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {**BASE["/v1/chat/completions"], "tools": tools, "tool_choice": "required"}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.function.parameters", r.text


def test_specs_within_the_bounds_are_served(server):
    for spec in ({"regex": "a{3}"}, {"regex": f"a{{1,{MAX_REPEAT}}}"}, {"choice": ["yes", "no"]}):
        r = httpx.post(server.url + "/v1/completions", json={**BASE["/v1/completions"], "structured_outputs": spec},
                       timeout=120)
        assert r.status_code == 200, r.text
