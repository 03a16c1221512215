"""What the serving benchmarks share: `deepinfer-dp serve` started in a process of its own and
stopped again, waiting on /health, and one streamed completion read into its outcome.

    from server_proc import start_server, stop_server
    proc, url = start_server(["--model", path, "--dp-size", "2"])
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`deepinfer-dp serve` with `flags` on a free port of 127.0.0.1 (its own session, so that
    stop_server can end everything it started); returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server failed to start:\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """SIGTERM (a graceful stop), and SIGKILL to its whole session if it does not end in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def wait_for_ranks(http: httpx.AsyncClient, until: Callable[[list[dict]], bool], timeout_s: float,
                         every_s: float = 0.1) -> float:
    """Polls /health until `until(ranks)` holds; returns when it did (time.monotonic())."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = (await http.get("/health")).json()["ranks"]
        if until(ranks):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"/health did not reach the state within {timeout_s:.0f}s: {ranks}")
        await asyncio.sleep(every_s)


async def stream_completion(http: httpx.AsyncClient, body: dict,
                            started: asyncio.Queue | None = None) -> tuple[str, dict | None, float]:
    """One streamed /v1/completions request: its text, the error that ended it (an error event
    mid-stream, or the OpenAI-shaped body of a 503 before any token), and when it ended.
    `started` gets one item at the first event (or at the 503). Any other status raises."""
    text, error, first = "", None, True
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code == 503:  # failed before its first token
            if started is not None:
                started.put_nowait(None)
            return "", json.loads(await r.aread())["error"], time.monotonic()
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first and started is not None:
                started.put_nowait(None)
            first = False
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
    return text, error, time.monotonic()
