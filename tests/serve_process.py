"""`deepinfer-dp serve` as a separate process for the failure and stop tests: start it, stream
from it, find its processes, and leave none behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600.0


@contextlib.contextmanager
def serve_process(model: str, log: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """The tiny test config's server (dp 2 unless `flags` say otherwise) in a session of its
    own, its log in `log`; (process, URL) once /health answers. Afterwards every process it
    started is killed, whatever the test did."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", "--config",
           str(ROOT / "configs" / "tiny_test.yaml"), "--model", model, "--served-model-name", "tiny",
           "--port", str(port), *flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    url = f"http://127.0.0.1:{port}"
    seen: list[psutil.Process] = []
    try:
        _wait_healthy(proc, url, log)
        seen = descendants(proc.pid)
        yield proc, url
    finally:
        seen += descendants(proc.pid)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in seen:
            with contextlib.suppress(psutil.Error):
                p.kill()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"the server did not become healthy: {log.read_text()[-3000:]}")


def descendants(pid: int) -> list[psutil.Process]:
    """Every process below `pid` (its API servers, the private Ray instance, the ranks)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def live_descendants(pid: int, marker: str) -> list[psutil.Process]:
    """The processes below `pid` whose command line holds `marker` and that still run: one
    killed but not yet reaped by its parent is a zombie, which has no command line to read."""
    found = []
    for p in descendants(pid):
        with contextlib.suppress(psutil.Error):
            if marker in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def still_running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()}")
    return left


@dataclasses.dataclass
class Stream:
    """What one streamed completion gave: its text, finish reason, or the error event."""

    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False  # the [DONE] event came (or an error status ended the request)
    status: int = 0
    first_chunk: bool = False


def stream_completion(url: str, prompt: str, max_tokens: int, result: Stream, timeout_s: float = 120.0,
                      ignore_eos: bool = False) -> None:
    """Streams one greedy completion into `result` (an exception if the connection failed)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as r:
        result.status = r.status_code
        if r.status_code != 200:  # refused before the stream started: the error is the body
            result.error, result.done = json.loads(r.read())["error"]["message"], True
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]["message"]
                continue
            result.first_chunk = True
            choice = event["choices"][0]
            result.text += choice["text"]
            result.finish_reason = choice["finish_reason"] or result.finish_reason
