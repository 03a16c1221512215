"""Serving a tiny random model over loopback for the server and metrics tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from model_utils import build_tiny_model

from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment, make_local_client

MODEL_NAME = "tiny-llama"
ENGINE_OPTIONS = {"kv_cache_memory_gb": 0.02, "block_size": 16, "seed": 0}


def tiny_model_dir(root: Path) -> str:
    return str(build_tiny_model("llama-gqa", root / "llama-gqa"))


@contextlib.contextmanager
def served(model_dir: str, api_key: str | None = None, dp_size: int = 1, limits=None,
           **options) -> Iterator[ServerThread]:
    """A real uvicorn server on a free 127.0.0.1 port over one in-process engine (dp_size 1) or
    the router process over dp_size Ray ranks (in the session's Ray: use the ray_cluster
    fixture); `limits` is a ServerLimits. Everything is stopped after. The server's `client` is
    the EngineClient; at dp_size > 1 its `deployment` is the DPDeployment (the processes)."""
    options = {**ENGINE_OPTIONS, **options}
    deployment = None
    if dp_size > 1:
        deployment = make_dp_deployment(model_dir, dp_size, MODEL_NAME, **options)
        client, stop = deployment.router, deployment.shutdown
    else:
        client = make_local_client(model_dir, MODEL_NAME, **options)
        stop = client.shutdown
    server = ServerThread(client, MODEL_NAME, api_key, limits=limits).start()
    server.client = client
    server.deployment = deployment
    try:
        yield server
    finally:
        server.stop()
        stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m deepinfer_dp.entrypoints.openai.launcher FLAGS --port P` (what `deepinfer-dp
    serve` runs) in its own session; returns it and its URL once /health answers (no time
    limit: pytest's). The caller stops it with SIGTERM and checks its exit status."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", *flags, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def stop_serve_command(proc: subprocess.Popen) -> int:
    """SIGTERM, as a supervisor stops it; the exit status (everything is killed if it hangs)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
