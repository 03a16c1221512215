"""The server's bounds on what one request and all requests together may ask for.

Every bound is a clear 4xx before any work, never an out-of-memory error or a hang: a body over
`max_request_body_bytes` is 413 (BodyLimit, before the body is even parsed); `n` over
`max_n`, a prompt list over `max_prompts`, or more choices than the queue may ever hold are 400;
and while `max_waiting_requests` engine requests already wait for their first token, a new
request is answered 503 with Retry-After instead of queueing without bound. Counting happens
here, on the server, so it holds the same way for one engine and for the DP router.
"""

from __future__ import annotations

import json

from deepinfer_dp.config_file import ServerLimits

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


class QueueFull(Exception):
    """More engine requests wait for their first token than the server allows."""


class Admission:
    """Counts the engine requests that wait for their first token (asyncio side only)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.waiting = 0

    def admit(self, num_choices: int) -> None:
        """Raises QueueFull when `num_choices` more would pass the limit; else counts them."""
        if self.waiting + num_choices > self.limits.max_waiting_requests:
            raise QueueFull(f"the server is at capacity: {self.waiting} requests are waiting to start "
                            f"(limit {self.limits.max_waiting_requests}); retry after {RETRY_AFTER_S} s")
        self.waiting += num_choices

    def started(self, count: int = 1) -> None:
        """`count` of the admitted choices got their first token, failed or left."""
        self.waiting -= count


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's error shape, both
    when Content-Length says so up front and when a chunked body grows past it (it is read
    here, bounded, and handed on whole: the app reads whole bodies anyway)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes
        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        body = json.dumps({"error": {"message": f"The request body is larger than the server's limit of "
                                                f"{self.max_bytes} bytes", "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
