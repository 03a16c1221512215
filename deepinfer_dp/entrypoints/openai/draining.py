"""Stopping an HTTP server in seconds: uvicorn with a bounded drain.

On SIGTERM or SIGINT uvicorn stops accepting and waits for every open connection, with no
limit by default: one long stream holds the whole stop (systemd and Kubernetes then kill the
process after their own timeout). DrainingServer waits `grace_s` for the requests in flight to
finish, then ends the rest through `on_grace_over` (the engine client fails them: a stream
ends with an error event and [DONE], a whole answer with 503), and past a short margin
uvicorn cancels what still runs.

exit_at_once() ends the `serve` process as soon as it has stopped everything it started: the
interpreter's own teardown after that (native libraries' destructors, with nothing left to
do) took 4-7 s of the stop on a loaded machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator

import uvicorn

from deepinfer_dp.config_file import ServerSection
from deepinfer_dp.engine.client import EngineClient, NoCapacity

logger = logging.getLogger(__name__)
DEFAULT_GRACE_S = ServerSection.model_fields["shutdown_grace_s"].default
CANCEL_MARGIN_S = 1.0  # after the grace: for the failed requests' last events to be written


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float = DEFAULT_GRACE_S,
                 on_grace_over: Callable[[], None] | None = None) -> None:
        config.timeout_graceful_shutdown = grace_s + CANCEL_MARGIN_S
        super().__init__(config)
        self.grace_s = grace_s
        self._on_grace_over = on_grace_over

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _grace_over(self) -> None:
        if self._on_grace_over is not None and self.server_state.tasks:
            self._on_grace_over()


def fail_inflight_on(client: EngineClient, grace_s: float) -> Callable[[], None]:
    """What a draining server calls when its grace is over: the engine client ends the requests
    still in flight with a 503 error that says why (a client without fail_inflight leaves them
    to uvicorn's cancellation)."""

    def fail() -> None:
        fail_inflight = getattr(client, "fail_inflight", None)
        if fail_inflight is not None:
            n = fail_inflight(NoCapacity(f"the server is shutting down: the request did not finish within the "
                                         f"{grace_s:g}s drain time"))
            if n:
                logger.warning("shutdown: %d request(s) still running after %gs were ended", n, grace_s)
    return fail


@contextlib.contextmanager
def exit_at_once() -> Iterator[None]:
    """Around the whole of `serve`: once it returns or raises SystemExit (having stopped the
    servers, the router, the ranks and the private Ray instance), the process exits with that
    status at once, logs and output flushed. Other exceptions propagate as usual."""
    try:
        yield
        code = 0
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    exit_now(code or 0)


def exit_now(code: int) -> None:
    """Ends this process with `code`, logs and output flushed, skipping the interpreter's
    teardown (call it only once everything the process started has stopped)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
