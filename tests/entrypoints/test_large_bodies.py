"""Request bodies over 1 MB are parsed off the event loop (entrypoints/openai/request_body.py):
`GET /v1/models` is answered while a large chat body is still being parsed, and a large body's
errors read exactly as a small one's; the request models stay in /openapi.json."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai import request_body

JSON = {"content-type": "application/json"}
# 40,000 messages, 11 MB: FastAPI's inline parse held the event loop for 1.8 s.
BIG_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 50}] * 40_000, "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tiny_model_dir(tmp_path_factory.mktemp("models"))) as srv:
        yield srv


def test_get_is_answered_while_a_large_body_parses(server, monkeypatch):
    """The parse is held open until the GET is answered: on the event loop, the GET could not be
    answered at all while it is held, and its timeout fails the test. No race on timings."""
    started, release, held = threading.Event(), threading.Event(), {}
    real = request_body.validate_body

    def held_open(model, body, content_type):
        started.set()
        held["released_by_get"] = release.wait(60)
        return real(model, body, content_type)

    monkeypatch.setattr(request_body, "validate_body", held_open)
    raw = json.dumps(BIG_CHAT).encode()
    assert len(raw) > 10 * request_body.OFF_LOOP_BYTES
    result = {}
    post = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        server.url + "/v1/chat/completions", content=raw, headers=JSON, timeout=None)))
    post.start()
    try:
        assert started.wait(60)
        r = httpx.get(server.url + "/v1/models", timeout=20)
    finally:
        release.set()
        post.join()
    assert r.status_code == 200
    assert held["released_by_get"]  # the parse was still waiting when the GET was answered
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "messages"


def _error(server, raw: bytes, headers=JSON) -> tuple[int, dict]:
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers=headers, timeout=None)
    return r.status_code, r.json()["error"]


@pytest.mark.parametrize("case", ["unknown field", "wrong type", "malformed JSON", "no content type"])
def test_large_and_small_bodies_fail_alike(server, case):
    def body(padding: int) -> tuple[bytes, dict]:
        msg = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * padding}]}
        if case == "unknown field":
            msg["bogus_field"] = 1
        elif case == "wrong type":
            msg["max_tokens"] = "ten"
        raw = json.dumps(msg).encode()
        if case == "malformed JSON":
            raw = raw[:-1]
        return raw, {} if case == "no content type" else JSON

    small, big = body(10), body(2 * request_body.OFF_LOOP_BYTES)
    assert len(big[0]) > request_body.OFF_LOOP_BYTES
    status_small, err_small = _error(server, *small)
    status_big, err_big = _error(server, *big)
    assert status_small == status_big == 400
    assert err_small["param"] == err_big["param"]
    if case != "malformed JSON":  # (the decode error names its position)
        assert err_small["message"] == err_big["message"]
    else:
        assert err_big["message"].startswith("Malformed JSON body")


def test_openapi_documents_the_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert "prompt" in json.dumps(schema["components"]["schemas"][model]) or model.startswith("Chat")
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in chat["properties"] and "max_tokens" in chat["properties"]
    assert all(ref.split("/")[-1] in schema["components"]["schemas"]
               for ref in _refs(schema["components"]["schemas"]))


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
