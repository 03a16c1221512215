"""A blocking OpenAI server over an EngineClient: run_server, for `serve` (launcher.py) and for
each API server process (api_servers.py), below both so that neither imports the other.
On SIGTERM/SIGINT it drains (draining.py); when an in-process engine dies it stops by itself."""

from __future__ import annotations

import gc
import signal
import threading

import uvicorn
from prometheus_client import start_http_server

from deepinfer_dp.config_file import ServerSection
from deepinfer_dp.engine.client import EngineClient
from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.draining import DEFAULT_GRACE_S, DrainingServer, fail_inflight_on
from deepinfer_dp.entrypoints.openai.http_protocol import uvicorn_config
from deepinfer_dp.entrypoints.openai.server import build_app

DEFAULT_HOST = ServerSection.model_fields["host"].default  # loopback unless asked otherwise
DEFAULT_PORT = ServerSection.model_fields["port"].default


def run_server(client: EngineClient, served_model_name: str | list[str] | None = None, api_key: str | None = None,
               host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, metrics_port: int | None = None,
               sockets: list | None = None, limits: ServerLimits | None = None,
               shutdown_grace_s: float = DEFAULT_GRACE_S, model_root: str | None = None,
               scaler=None) -> int:
    """Serves until interrupted (Ctrl-C): returns 0, or 1 when the engine died (the server
    then stops by itself, so a supervisor sees the process end and restarts it). /metrics is
    always on `port`; `metrics_port` serves the same registry on a port of its own too.
    `sockets`: already listening sockets to serve on (shared by several API servers).
    On SIGTERM/SIGINT requests in flight get `shutdown_grace_s` to finish, then end with a 503
    error (entrypoints/openai/draining.py). `model_root`: the model argument, `scaler`: the DP
    deployment with --enable-elastic-ep (build_app)."""
    app = build_app(client, served_model_name, api_key, limits, model_root, scaler)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=app.state.ctx.metrics.exposed_registry())
    server = DrainingServer(server_config(app, host, port, limits, "info"), shutdown_grace_s,
                            fail_inflight_on(client, shutdown_grace_s))
    died = stop_when_the_engine_dies(client, server)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again for the
    # handler it found; with this one that ends here, so the caller stops the engine and the
    # process exits with status 0 (outside server.run the default handlers apply).
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, _already_handled) for sig in handled}
    # Everything built so far (torch, the model, the tokenizer) lives as long as the process:
    # frozen, a full collection no longer walks it. Unfrozen, the objects one large request
    # body creates set off a full collection that held the event loop for 1.0 s (vLLM freezes
    # its start-up heap the same way).
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if died else 0


def server_config(app, host: str, port: int, limits: ServerLimits | None, log_level: str) -> uvicorn.Config:
    limits = limits or ServerLimits()
    return uvicorn_config(app, host, port, limits.request_read_timeout_s, limits.timeout_keep_alive_s, log_level)


def _already_handled(signum: int, frame) -> None:
    """uvicorn already shut the server down for this signal."""


def stop_when_the_engine_dies(client: EngineClient, server: uvicorn.Server) -> list[BaseException]:
    """An in-process engine whose loop failed stops the server, instead of a process that is
    up but answers 503 forever. Returns the list its error lands in."""
    died: list[BaseException] = []

    def stop(error: BaseException) -> None:
        died.append(error)
        server.should_exit = True

    if hasattr(client, "on_fatal"):
        client.on_fatal = stop
    return died
