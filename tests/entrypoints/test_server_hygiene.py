"""HTTP hygiene under load and failure: a full queue answers 503 with Retry-After; tokenizing
runs off the event loop; a dropped non-streamed request logs no InvalidStateError; an
unexpected exception is a JSON 500 (or an SSE error event), never plain text; the API key."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import threading

import httpx
import pytest
from server_utils import MODEL_NAME, served

from deepinfer_dp.entrypoints.openai import serving_completion
from deepinfer_dp.entrypoints.openai.admission import ServerLimits

BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    with served(model_dir, limits=ServerLimits(max_waiting_requests=2)) as srv:
        yield srv


@contextlib.contextmanager
def engine_paused(client):
    """Holds the engine thread at its next step() until the block exits: admitted requests
    stay waiting for their first token."""
    release = threading.Event()
    real_step = client.engine.step

    def step():
        release.wait()
        return real_step()

    client.engine.step = step
    try:
        yield
    finally:
        release.set()
        del client.engine.step


def _waiting(server) -> int:
    return server.app.state.ctx.admission.waiting


async def _until(predicate) -> None:
    while not predicate():  # no time limit: pytest's
        await asyncio.sleep(0.02)


def test_full_queue_is_503_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as c:
            with engine_paused(server.client):
                held = [asyncio.create_task(c.post("/v1/completions", json=BODY)) for _ in range(2)]
                await _until(lambda: _waiting(server) == 2)
                r = await c.post("/v1/completions", json=BODY)
                n = await c.post("/v1/completions", json={**BODY, "prompt": ["a", "b"]})
                health = await c.get("/health")
            done = await asyncio.gather(*held)
            return r, n, health, done

    r, n, health, done = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable_error" and r.json()["error"]["code"] == "queue_full"
    assert n.status_code == 503  # two choices do not fit either
    assert health.status_code == 200  # overload is not an outage
    assert [d.status_code for d in done] == [200, 200]
    assert _waiting(server) == 0
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200
    # more choices than the queue ever holds: a 400, not a 503 to retry forever
    r = httpx.post(server.url + "/v1/completions", json={**BODY, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """While one request's tokenizer call is held (as a huge prompt would hold it), /health and
    other requests are answered: the event loop is free."""
    entered, release = threading.Event(), threading.Event()
    real = serving_completion._tokenize

    def slow_tokenize(tokenizer, texts):
        if texts[0].startswith("HUGE"):
            entered.set()
            release.wait()
        return real(tokenizer, texts)

    monkeypatch.setattr(serving_completion, "_tokenize", slow_tokenize)
    # (a text too long to ever fit is refused before tokenizing; this one must be tokenized to know)
    big = {**BODY, "prompt": "HUGE " + "word " * 2_000}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(server.url + "/v1/completions",
                                                                          json=big, timeout=None)))
    t.start()
    entered.wait()
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.post(server.url + "/v1/completions", json=BODY).json()["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        t.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["param"] == "prompt"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_dropped_non_streamed_request_logs_no_invalid_state_error(server):
    handler, loggers = _Records(), [logging.getLogger(n) for n in ("uvicorn.error", "asyncio", "")]
    for lg in loggers:
        lg.addHandler(handler)
    body = json.dumps({**BODY, "prompt": [5] * 50, "max_tokens": 200, "ignore_eos": True}).encode()
    try:
        with engine_paused(server.client):
            for _ in range(3):
                before = _waiting(server)
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                asyncio.run(_until(lambda b=before: _waiting(server) > b))
                sock.close()  # the client leaves before the answer
                asyncio.run(_until(lambda b=before: _waiting(server) == b))
        assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    text = " ".join(r.getMessage() + str(r.exc_info) for r in handler.records)
    assert "InvalidStateError" not in text and "Exception in ASGI" not in text


def test_unexpected_exception_is_json_500(server, monkeypatch):
    async def broken(ctx, req):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(serving_completion, "prepare", broken)
    r = httpx.post(server.url + "/v1/completions", json=BODY)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error" and "injected failure" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200


def test_unexpected_exception_mid_stream_is_an_sse_error(server, monkeypatch):
    count = itertools.count()
    real = serving_completion._ChoiceText.event

    def event(self, ev):
        if next(count) == 1:
            raise RuntimeError("injected mid-stream")
        return real(self, ev)

    monkeypatch.setattr(serving_completion._ChoiceText, "event", event)
    body = {**BODY, "max_tokens": 6, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["type"] == "server_error"


def test_api_key_compared_safely(model_dir):
    with served(model_dir, api_key="sekret") as srv:
        url = srv.url + "/v1/models"
        assert httpx.get(url, headers={"authorization": "Bearer sekret"}).status_code == 200
        for wrong in ("Bearer sekreT", "Bearer sekret2", "bearer sekret", "Bearer s\xe9kret", ""):
            r = httpx.get(url, headers={"authorization": wrong.encode("latin-1")})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
