"""Groups of `deepinfer-dp serve` processes started separately on loopback, as the hybrid and
external load-balancing modes run them (docs/lb_modes.md): each server is its own process
group, started together, waited for, and stopped (killed if it hangs) whatever happens."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from netns_utils import in_netns
from server_utils import MODEL_NAME, free_port

ENGINE_FLAGS = ["--kv-cache-memory-gb", "0.02", "--block-size", "16", "--seed", "0", "--torch-threads", "1",
                "--served-model-name", MODEL_NAME]
START_TIMEOUT_S = 300.0


class Server:
    """A started server; `ns`: the network namespace its clients must be in (None: this one)."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path, ns: str | None = None) -> None:
        self.proc, self.url, self.log, self.ns = proc, url, log, ns

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """An HTTP request to this server, from its clients' namespace."""
        kwargs.setdefault("timeout", 30)
        if self.ns is None:
            return httpx.request(method, self.url + path, **kwargs)
        return in_netns(self.ns, httpx.request, method, self.url + path, **kwargs)

    def metric(self, name: str) -> dict[int, float]:
        """A per-rank series of this server's /metrics: {dp_rank: value}."""
        text = self.request("GET", "/metrics").text
        pattern = rf'^deepinfer:{name}{{dp_rank="(\d+)"}} (\S+)$'
        return {int(m[1]): float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


@contextlib.contextmanager
def server_group(model_dir: str, tmp_path: Path, per_server: list[list[str]],
                 expected_codes: list[int] | None = None) -> Iterator[list[Server]]:
    """One server per flag list, all in one group (the same key file and store port); yields
    once every one answers /health with 200; stops them all after (SIGTERM, then SIGKILL to
    the process group of one that has not exited in 60 s) and checks that nothing is left and
    that they exited with `expected_codes` (default: all 0)."""
    group = group_flags(tmp_path, free_port())
    servers: list[Server] = []
    try:
        for i, flags in enumerate(per_server):
            port = free_port()
            log = tmp_path / f"server{i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen(serve_argv(model_dir, *group, *flags, "--port", str(port)), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            servers.append(Server(proc, f"http://127.0.0.1:{port}", log))
        wait_healthy(servers)
        yield servers
    finally:
        codes = stop_all(servers)
    check_codes(servers, codes, expected_codes)


def group_flags(tmp_path: Path, rpc_port: int) -> list[str]:
    """The flags every server of one group shares: its store's port and a fresh key file."""
    key_file = tmp_path / "dp.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    return ["--data-parallel-rpc-port", str(rpc_port), "--data-parallel-key-file", str(key_file)]


def serve_argv(model_dir: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", model_dir, *ENGINE_FLAGS, *flags]


def check_codes(servers: list[Server], codes: list[int | None], expected: list[int] | None) -> None:
    logs = [s.log.read_text()[-3000:] for s in servers]
    assert codes == (expected or [0] * len(servers)), list(zip(codes, logs, strict=True))


def wait_healthy(servers: list[Server]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(servers)
    while waiting:
        assert time.monotonic() < deadline, "the group did not start in time"
        for s in list(waiting):
            assert s.proc.poll() is None, s.log.read_text()[-3000:]
            try:
                if s.request("GET", "/health", timeout=5).status_code == 200:
                    waiting.remove(s)
            except httpx.TransportError:
                pass
        time.sleep(0.3)


def stop_all(servers: list[Server]) -> list[int | None]:
    """SIGTERM to every server still running, then their exit statuses; a server's whole process
    group (its rank processes) is gone after."""
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    codes = []
    for s in servers:
        try:
            s.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        codes.append(s.proc.returncode)
        assert _group_gone(s.proc.pid), f"processes of server {s.url} were left behind"
    return codes


def _group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    return False


PROMPTS = ["Hello, world!", "The quick brown fox", "Data parallel ranks step", "What is the capital of"]
MAX_TOKENS = 8


def complete(server: Server, prompt: str, **extra) -> httpx.Response:
    """A greedy completion of MAX_TOKENS at `server` (`extra`: more body fields)."""
    return server.request("POST", "/v1/completions", timeout=120,
                          json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                **extra})


def texts(server: Server) -> list[str]:
    """PROMPTS' greedy texts at `server`, one request after another."""
    answers = [complete(server, prompt) for prompt in PROMPTS]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    return [r.json()["choices"][0]["text"] for r in answers]


def internal_mode_texts(model_dir: str) -> list[str]:
    """The reference: internal mode, one endpoint whose router places requests on 2 Ray ranks
    (in the session's Ray: the ray_cluster fixture)."""
    from server_utils import served

    with served(model_dir, dp_size=2) as srv:
        return texts(Server(None, srv.url, Path()))


def _rank_counters(servers: list[Server]) -> tuple[dict[int, float], dict[int, float]]:
    """(steps, placeholder steps) per rank, each read at the endpoint that serves it."""
    steps, placeholders = {}, {}
    for s in servers:
        own_steps, own_placeholders = s.metric("engine_steps_total"), s.metric("placeholder_steps_total")
        assert set(own_steps) == set(own_placeholders) and not set(own_steps) & set(steps)  # its ranks only
        steps |= own_steps
        placeholders |= own_placeholders
    return steps, placeholders


def check_lockstep(servers: list[Server], busy: set[int], settle_s: float = 20.0) -> dict[int, float]:
    """Every rank stepped as often as the others; a rank that had no request stepped only
    placeholders, reported by its own endpoint (the busy ranks' few are their waves' ends).
    Right after the last answer a rank may not have taken the wave's final step yet: the
    counts are read until they agree (a real mismatch never does). Returns the steps."""
    deadline = time.monotonic() + settle_s
    steps, placeholders = _rank_counters(servers)
    while len(set(steps.values())) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        steps, placeholders = _rank_counters(servers)
    assert len(set(steps.values())) == 1 and next(iter(steps.values())) > 0, steps
    for rank, n in placeholders.items():
        assert n < steps[rank] if rank in busy else n == steps[rank], placeholders
    return steps
