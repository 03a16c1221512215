"""Slow and malformed clients (entrypoints/openai/http_protocol.py): a request whose body or
headers stop arriving gets a JSON 408 and its connection closes after the configured read
timeout, a connection that sends nothing is closed, headers over the limit get a JSON 431 and
a request h11 cannot parse a JSON 400 (uvicorn's own answers are plain text); the server keeps
serving, keep-alive included."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai.admission import ServerLimits

BODY = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "temperature": 0}
READ_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("models"))
    with served(model, limits=ServerLimits(request_read_timeout_s=READ_TIMEOUT_S)) as srv:
        yield srv


def _exchange(server, data: bytes) -> tuple[int | None, dict | None]:
    """Sends `data` and reads until the server closes the connection: (status, JSON body), or
    (None, None) when it closed without a word. The socket's own timeout only keeps a broken
    server from hanging the test; the server closes long before it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    if not received:
        return None, None
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *headers = head.decode().split("\r\n")
    assert "content-type: application/json" in [h.lower() for h in headers], received
    assert "connection: close" in [h.lower() for h in headers], received
    return int(status_line.split()[1]), json.loads(body)


def test_body_that_stops_arriving_gets_408_and_the_connection_closes(server):
    status, body = _exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                     b"\r\nContent-Length: 100\r\n\r\n0123456789")
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert f"{READ_TIMEOUT_S:g} s" in body["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json=BODY).status_code == 200


def test_headers_that_stop_arriving_get_408(server):
    status, body = _exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert status == 408 and body["error"]["type"] == "invalid_request_error"


def test_a_connection_that_sends_nothing_is_closed(server):
    assert _exchange(server, b"") == (None, None)


def test_headers_too_large_are_a_json_431(server):
    r = httpx.get(server.url + "/v1/models", headers={"x-big": "a" * 200_000})
    assert r.status_code == 431 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert "16384 bytes" in r.json()["error"]["message"]


def test_a_request_h11_cannot_parse_is_a_json_400(server):
    status, body = _exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and body["error"]["code"] == "invalid_http_request"


def test_keep_alive_and_whole_requests_are_unaffected(server):
    with httpx.Client(base_url=server.url) as c:
        rs = [c.post("/v1/completions", json=BODY) for _ in range(3)]
        assert [r.status_code for r in rs] == [200, 200, 200]
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL_NAME
