"""Property-based fuzzing of the HTTP API (hypothesis on request bodies): each field drawn from
its valid range, from values just outside it, or from arbitrary JSON; unknown fields and lone
surrogates mixed in. Whatever comes, the answer is a 2xx or a 4xx in OpenAI's shape, never a
5xx, streams end with [DONE] and carry no server error, and the server is healthy and idle
afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai.admission import ServerLimits

EXAMPLES = 250  # per endpoint: 500 requests in all

json_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() |
             st.text(max_size=12) | st.sampled_from(["\ud800", "<|im_start|>system", ""]))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) |
                          st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)


def field(valid: st.SearchStrategy, invalid: st.SearchStrategy | None = None,
          anything: st.SearchStrategy = json_value) -> st.SearchStrategy:
    """Mostly valid values (so that many requests get past parsing and run), sometimes values
    just outside the valid range, and one time in 20 any JSON value at all."""
    invalid = invalid if invalid is not None else anything
    return st.integers(0, 19).flatmap(lambda i: anything if i == 0 else invalid if i <= 2 else valid)


def unit(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi, allow_nan=False)


plain = st.text(max_size=24)
text = st.one_of(plain, plain, plain, plain, st.sampled_from(["\ud800x", "<|im_end|>", "Hello, world"]))
token_ids = st.lists(st.integers(0, 399), min_size=1, max_size=12)
# past every 64-bit bound too (top_k 2**64 was a 500 when msgpack could not carry it)
huge = st.integers(2**31, 2**70) | st.integers(-(2**70), -(2**63))
bad_ids = st.lists(st.integers(-3, 420) | huge, max_size=12)
# (never null: no limit means the whole context, a long run for nothing new)
few_tokens = field(st.integers(1, 3), st.integers(-1, 0) | st.integers(10**4, 10**6) | huge,
                   json_value.filter(lambda v: v is not None))

COMMON = {
    "n": field(st.integers(1, 2), st.integers(-1, 6) | huge),
    "max_tokens": few_tokens,
    "temperature": field(unit(0, 2), unit(-3, 3)),
    "top_p": field(unit(0.01, 1), unit(-0.5, 1.5)),
    "top_k": field(st.integers(-1, 500), st.integers(-9, -2) | huge),
    "min_p": field(unit(0, 1), unit(-0.5, 1.5)),
    "seed": field(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**65), 2**65)),
    "stop": field(text | st.lists(text, max_size=3)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": field(unit(-2, 2), unit(-5, 5)),
    "frequency_penalty": field(unit(-2, 2), unit(-5, 5)),
    "repetition_penalty": field(unit(0.01, 2), unit(-0.5, 3)),
    "logit_bias": field(st.dictionaries(st.integers(0, 399).map(str), unit(-100, 100), max_size=3),
                        st.dictionaries(st.integers(-2, 450).map(str) | st.text(max_size=4), unit(-150, 150),
                                        max_size=3)),
    "stop_token_ids": field(st.lists(st.integers(0, 399), max_size=3), bad_ids),
    "include_stop_str_in_output": field(st.booleans()),
    "min_tokens": field(st.integers(0, 1), st.integers(-1, 10) | huge),
    "ignore_eos": field(st.booleans()),
    "user": field(text),
}
COMPLETION = {
    **COMMON,
    "logprobs": field(st.integers(0, 5), st.integers(-1, 22) | huge),
    "echo": field(st.booleans()),
    "best_of": field(st.none(), st.integers(0, 5)),
    "suffix": field(st.just(""), text),
    "bogus_field": json_value,
}
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": text})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "user", "wizard"]),
                                 "content": st.none() | text | st.lists(part, max_size=2)})
CHAT = {
    **{k: v for k, v in COMMON.items() if k != "max_tokens"},
    "max_completion_tokens": few_tokens,
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.integers(-1, 22) | huge),
    "response_format": field(st.just({"type": "text"}), st.just({"type": "json_object"})),
    "tools": field(st.just([])),
    "tool_choice": field(st.just("none"), st.sampled_from(["auto", "required"])),
    "parallel_tool_calls": field(st.booleans()),
}


def bodies(required: dict, optional: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(required, optional=optional)


completion_bodies = bodies({"model": st.just(MODEL_NAME) | st.just(MODEL_NAME) | text,
                            "prompt": field(text | st.lists(text, min_size=1, max_size=3) | token_ids |
                                            st.lists(token_ids, min_size=1, max_size=3),
                                            bad_ids | st.lists(text, max_size=5))}, COMPLETION)
# max_tokens is always given on chat: its default (the whole context) would make a run long
chat_bodies = bodies({"model": st.just(MODEL_NAME),
                      "messages": field(st.lists(message, min_size=1, max_size=3), st.just([])),
                      "max_tokens": few_tokens}, CHAT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    limits = ServerLimits(max_n=4, max_prompts=3)  # bounded work per request keeps the run short
    with served(tiny_model_dir(tmp_path_factory.mktemp("models")), limits=limits) as srv:
        with httpx.Client(base_url=srv.url, timeout=None) as http:
            srv.http = http
            yield srv
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert srv.app.state.ctx.admission.waiting == 0


def _send(http: httpx.Client, route: str, body: dict) -> None:
    content = json.dumps(body).encode()  # NaN and inf travel as the JSON extensions Python reads
    with http.stream("POST", route, content=content, headers={"content-type": "application/json"}) as r:
        raw = r.read().decode()
    assert r.status_code < 500, raw
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert err["type"] and err["message"]
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), raw
    else:
        assert json.loads(raw)["choices"]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(server, body):
    _send(server.http, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(server, body):
    _send(server.http, "/v1/chat/completions", body)
