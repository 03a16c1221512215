"""`deepinfer-dp serve --api-server-count N`: N API server processes on one port.

Where HTTP, JSON and detokenization are the bottleneck (a small model, many streams), one
Python process cannot keep the ranks busy. This process starts the router and the ranks under
Ray, binds the listening socket once and starts N API server processes that all accept on it
(the kernel spreads the connections); each is a client of the router process with its own
tokenizer. Their metrics are added up through prometheus-client's multiprocess mode.

The parent only supervises: when an API server exits on its own, the others are stopped and
the deployment is shut down, and the exit status says whether that was a failure.
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

logger = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 30.0
START_TIMEOUT_S = 600.0  # every API server loads its tokenizer and connects to the router


def run_api_servers(deployment, served_model_name: list[str]) -> int:
    """Serves until SIGINT/SIGTERM or until an API server dies; returns the exit status."""
    from deepinfer_dp.cluster.data_plane import CLIENT
    from deepinfer_dp.cluster.dp_driver import per_rank_threads
    from deepinfer_dp.cluster.ray_launcher import RayDeployment

    server = deployment.server
    stop = threading.Event()  # from here on a signal stops everything cleanly, start-up included
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = RayDeployment(per_rank_threads(deployment.engine_config()), **deployment.dp_options())
    metrics_dir = tempfile.mkdtemp(prefix="deepinfer_dp_metrics_")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    sock = _listen(server.host, server.port)
    ctx = mp.get_context("spawn")
    all_ready = ctx.Barrier(server.api_server_count)  # nobody accepts before every server can
    key = cluster.key.for_role(CLIENT) if cluster.key is not None else None  # a client's secret only
    procs = [ctx.Process(target=_api_server, name=f"api-server-{i}", args=(
        sock, all_ready, cluster.frontend, cluster.infos[0], key, deployment.model, served_model_name,
        server.api_key, server.host, deployment.metrics.port if i == 0 else None, server.limits()))
        for i in range(server.api_server_count)]
    code = 0
    try:
        for proc in procs:
            proc.start()
        logger.info("%d API servers on %s:%d", len(procs), server.host, sock.getsockname()[1])
        while not stop.wait(0.5):
            ended = [proc for proc in procs if not proc.is_alive()]
            if ended:
                code = 1 if any(proc.exitcode for proc in ended) else 0
                logger.error("API server %s exited (status %s); stopping", ended[0].name, ended[0].exitcode)
                break
    finally:
        _stop_all(procs)
        failed = [(proc.name, proc.exitcode) for proc in procs if proc.exitcode not in (0, None)]
        if failed:
            logger.error("API servers that did not exit cleanly: %s", failed)
            code = code or 1
        sock.close()
        cluster.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def _stop_all(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # SIGTERM: uvicorn finishes its connections and exits
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _api_server(sock: socket.socket, all_ready, frontend: str, rank_info: dict, key, model: str | None,
                name: list[str], api_key: str | None, host: str, metrics_port: int | None, limits) -> None:
    """One API server process: a router client behind the OpenAI routes, on the shared socket.
    `key` (the data plane's client key, or None) comes through multiprocessing's pipe, not argv.
    The router connects back to this process's inbox on the data plane's host (the router's),
    not on the HTTP `host`: a server on 0.0.0.0 keeps its ZeroMQ socket on loopback.
    `limits` (a ServerLimits) applies per process: max_waiting_requests counts this server's."""
    signal.signal(signal.SIGTERM, _exit_cleanly)  # stopped while starting: still status 0
    from deepinfer_dp.cluster.data_plane import host_of
    from deepinfer_dp.cluster.dp_driver import connect
    from deepinfer_dp.entrypoints.openai.launcher import run_server

    client = connect(frontend, rank_info, model, name[0], host_of(frontend), key)
    try:
        all_ready.wait(START_TIMEOUT_S)
        code = run_server(client, name, api_key, host, metrics_port=metrics_port, sockets=[sock],
                          limits=limits)
    finally:
        client.close()
    raise SystemExit(code)


def _exit_cleanly(signum: int, frame) -> None:
    raise SystemExit(0)
