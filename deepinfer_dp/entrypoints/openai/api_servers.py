"""`deepinfer-dp serve --api-server-count N`: N API server processes on one port.

Where HTTP, JSON and detokenization are the bottleneck (a small model, many streams), one
Python process cannot keep the ranks busy. This process starts the router and the ranks under
Ray, binds the listening socket once and starts N API server processes that all accept on it
(the kernel spreads the connections); each is a client of the router process with its own
tokenizer. Their metrics are added up through prometheus-client's multiprocess mode.

The parent only supervises: an API server that dies is replaced by a new process on the same
socket while the others keep serving the port (the listening socket is the parent's, so no
connection is refused meanwhile; the dead process's own connections are closed). A server
that keeps dying (more than MAX_REPLACEMENTS in REPLACEMENT_WINDOW_S) stops everything with
status 1. On SIGTERM or SIGINT each API server drains for `shutdown_grace_s` and ends what is
left with an error (entrypoints/openai/draining.py), then the router, the ranks and the private
Ray instance stop, all within seconds.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

from deepinfer_dp.entrypoints.openai.http_server import run_server

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # every API server loads its tokenizer and connects to the router
EXIT_MARGIN_S = 4.0  # past an API server's drain and cancellation: the process's own exit
CLUSTER_STOP_S = 4.0  # the router, the ranks and the private Ray instance
MAX_REPLACEMENTS = 5
REPLACEMENT_WINDOW_S = 60.0


def run_api_servers(deployment, served_model_name: list[str], model_root: str | None = None) -> int:
    """Serves until SIGINT/SIGTERM, replacing an API server that dies; returns the exit status.
    `model_root`: the model argument, the root of the /v1/models cards."""
    from deepinfer_dp.cluster.data_plane import CLIENT
    from deepinfer_dp.cluster.deployment import DPDeployment

    server = deployment.server
    stop = threading.Event()  # from here on a signal stops everything cleanly, start-up included
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # no client here: each API server process connects its own (_api_server)
    cluster = DPDeployment(deployment.engine_config(), deployment.dp_settings(), None, stop_s=CLUSTER_STOP_S)
    metrics_dir = tempfile.mkdtemp(prefix="deepinfer_dp_metrics_")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    sock = _listen(server.host, server.port)
    ctx = mp.get_context("spawn")
    all_ready = ctx.Barrier(server.api_server_count)  # nobody accepts before every server can
    key = cluster.key.for_role(CLIENT) if cluster.key is not None else None  # a client's secret only

    def spawn(i: int, ready) -> mp.Process:
        return ctx.Process(target=_api_server, name=f"api-server-{i}", args=(
            sock, ready, cluster.frontend, cluster.infos[0], key, cluster.config, served_model_name, model_root,
            server.api_key, server.host, deployment.metrics.port if i == 0 else None, server.limits(),
            server.shutdown_grace_s))
    procs = [spawn(i, all_ready) for i in range(server.api_server_count)]
    code = 0
    try:
        for proc in procs:
            proc.start()
        logger.info("%d API servers on %s:%d", len(procs), server.host, sock.getsockname()[1])
        code = _supervise(procs, spawn, stop)
    finally:
        running = [proc for proc in procs if proc.is_alive()]  # one that died before is not this stop's failure
        _stop_all(running, server.shutdown_grace_s)
        # SIGTERM ends a server still starting before it handles the signal: that is a stop too
        failed = [(p.name, p.exitcode) for p in running if p.exitcode not in (0, None, -signal.SIGTERM)]
        if failed:
            logger.error("API servers that did not exit cleanly: %s", failed)
            code = code or 1
        sock.close()
        cluster.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _supervise(procs: list, spawn, stop: threading.Event) -> int:
    """Until `stop`: an API server that exited is replaced (procs[i] is the new process);
    returns 1 when they keep dying, else 0."""
    replaced: list[float] = []
    while not stop.wait(0.2):
        for i, proc in enumerate(procs):
            if proc.is_alive():
                continue
            now = time.monotonic()
            replaced = [t for t in replaced if now - t < REPLACEMENT_WINDOW_S]
            if len(replaced) >= MAX_REPLACEMENTS:
                logger.error("API server %s exited (status %s), the %d-th time in %.0fs; stopping", proc.name,
                             proc.exitcode, len(replaced) + 1, REPLACEMENT_WINDOW_S)
                return 1
            logger.error("API server %s (pid %s) exited (status %s); starting a new one", proc.name, proc.pid,
                         proc.exitcode)
            _forget_metrics_of(proc.pid)
            procs[i] = spawn(i, None)
            procs[i].start()
            replaced.append(now)
    return 0


def _forget_metrics_of(pid: int) -> None:
    """A dead process's live gauges leave the multiprocess sum (its counters stay counted)."""
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid)
    except OSError:
        logger.exception("could not drop the metrics of API server process %d", pid)


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _stop_all(procs: list, grace_s: float) -> None:
    from deepinfer_dp.entrypoints.openai.draining import CANCEL_MARGIN_S

    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: each drains for grace_s, then ends what is left
    deadline = time.monotonic() + grace_s + CANCEL_MARGIN_S + EXIT_MARGIN_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.error("API server %s did not exit %.0fs after SIGTERM; killing it", proc.name,
                         grace_s + CANCEL_MARGIN_S + EXIT_MARGIN_S)
            proc.kill()
            proc.join()


def _api_server(sock: socket.socket, all_ready, frontend: str, rank_info: dict, key, config,
                name: list[str], root: str | None, api_key: str | None, host: str, metrics_port: int | None, limits,
                shutdown_grace_s: float) -> None:
    """One API server process: a router client behind the OpenAI routes, on the shared socket.
    `key` (the data plane's client key, or None) comes through multiprocessing's pipe, not argv.
    The router connects back to this process's inbox on the data plane's host (the router's),
    not on the HTTP `host`: a server on 0.0.0.0 keeps its ZeroMQ socket on loopback.
    `limits` (a ServerLimits) applies per process: max_waiting_requests counts this server's.
    `all_ready`: a barrier of the first servers (None: a replacement, which serves at once)."""
    signal.signal(signal.SIGTERM, _exit_cleanly)  # stopped while starting: still status 0
    from deepinfer_dp.cluster.data_plane import host_of
    from deepinfer_dp.cluster.deployment import connect
    from deepinfer_dp.entrypoints.openai.draining import exit_now

    client = connect(frontend, rank_info, config, name[0], host_of(frontend), key)
    try:
        if all_ready is not None:
            all_ready.wait(START_TIMEOUT_S)
        code = run_server(client, name, api_key, host, metrics_port=metrics_port, sockets=[sock], model_root=root,
                          limits=limits, shutdown_grace_s=shutdown_grace_s)
    finally:
        client.close()
    exit_now(code)  # everything it started has stopped: no interpreter teardown (seconds)


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)
