"""uvicorn's HTTP/1.1 protocol (h11), with the guards a public server needs against slow or
malformed clients, and the uvicorn.Config that uses it.

uvicorn answers some requests before the app ever runs, and holds others without a limit:
  - a request line and headers over h11's buffer (16 KiB) get a plain-text 400, as does any
    request h11 cannot parse. Here they get OpenAI's JSON error shape, with h11's own status
    hint (431 for headers too large);
  - a connection that opens and sends nothing, or a request whose headers or body stop
    arriving (Content-Length 100, 10 bytes sent), is held for as long as the client likes.
    Here the whole request must arrive within `read_timeout_s` of the connection's opening or
    the request's first byte; then a 408 in the JSON shape (or, when nothing was sent yet or
    a response already started, just the close) ends the connection, and the app, if it was
    waiting for the body, sees the client disconnect.

Idle keep-alive connections are closed after uvicorn's `timeout_keep_alive`. The h11 protocol is
chosen explicitly, so installing httptools does not silently drop these guards.
"""

from __future__ import annotations

import asyncio
import functools
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

MAX_HEADER_BYTES = 16 * 1024  # h11's default bound on an incomplete event: the request line and headers


class _ErrorKeepingConnection(h11.Connection):
    """An h11 connection that remembers the protocol error it raised (uvicorn drops it)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


def error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


def _protocol_error(err: h11.RemoteProtocolError | None) -> tuple[int, bytes]:
    status = err.error_status_hint if err is not None else 400
    if status == 431:
        message = (f"The request line and headers are larger than this server's limit of {MAX_HEADER_BYTES} "
                   f"bytes")
        return status, error_body(message, "request_header_fields_too_large")
    return status, error_body(f"Invalid HTTP request: {err or 'malformed'}", "invalid_http_request")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with JSON protocol errors and a deadline on reading each request."""

    def __init__(self, *args, read_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _ErrorKeepingConnection(h11.SERVER, MAX_HEADER_BYTES)
        self._read_timeout_s = read_timeout_s
        self._read_timer: asyncio.TimerHandle | None = None
        self._got_bytes = False  # of the request being read (nothing yet: close without a word)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a connection that never sends a request is not held forever either

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self.conn.their_state is h11.IDLE:
            self._got_bytes = True
            self._arm()  # a new request begins (after a response, uvicorn's keep-alive timer ran)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # the request arrived whole (or the connection is ending)
            self._got_bytes = False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, in the JSON shape and with h11's status."""
        status, body = _protocol_error(self.conn.last_error)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                         reason=STATUS_PHRASES[status])))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self._disarm()
        self.transport.close()

    # ---- the read deadline -----------------------------------------------------------------
    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self._read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.conn.their_state is h11.SEND_BODY else None
        answered = cycle is not None and cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app waiting for the body sees the client leave
            cycle.message_event.set()
        if self._got_bytes and not answered:
            body = error_body(f"The request did not arrive whole within {self._read_timeout_s:g} s",
                              "request_timeout")
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.logger.warning("closing a connection whose request did not arrive within %gs", self._read_timeout_s)
        self.transport.close()


def uvicorn_config(app, host: str, port: int, read_timeout_s: float, timeout_keep_alive_s: float,
                   log_level: str) -> uvicorn.Config:
    """The server's uvicorn.Config: the guarded h11 protocol, the keep-alive timeout."""
    protocol = functools.partial(GuardedH11Protocol, read_timeout_s=read_timeout_s)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", http=protocol,
                          timeout_keep_alive=timeout_keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
