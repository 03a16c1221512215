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
from server_utils import MODEL_NAME, free_port

ENGINE_FLAGS = ["--kv-cache-memory-gb", "0.02", "--block-size", "16", "--seed", "0", "--torch-threads", "1",
                "--served-model-name", MODEL_NAME]
START_TIMEOUT_S = 300.0


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def metric(self, name: str) -> dict[int, float]:
        """A per-rank series of this server's /metrics: {dp_rank: value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        pattern = rf'^deepinfer:{name}{{dp_rank="(\d+)"}} (\S+)$'
        return {int(m[1]): float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


@contextlib.contextmanager
def server_group(model_dir: str, tmp_path: Path, per_server: list[list[str]],
                 expected_codes: list[int] | None = None) -> Iterator[list[Server]]:
    """One server per flag list, all in one group (the same key file and store port); yields
    once every one answers /health with 200; stops them all after (SIGTERM, then SIGKILL to
    the process group of one that has not exited in 60 s) and checks that nothing is left and
    that they exited with `expected_codes` (default: all 0)."""
    key_file = tmp_path / "dp.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    group = ["--data-parallel-rpc-port", str(free_port()), "--data-parallel-key-file", str(key_file)]
    servers: list[Server] = []
    try:
        for i, flags in enumerate(per_server):
            port = free_port()
            log = tmp_path / f"server{i}.log"
            cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", model_dir, *ENGINE_FLAGS,
                   *group, *flags, "--port", str(port)]
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            servers.append(Server(proc, f"http://127.0.0.1:{port}", log))
        _wait_healthy(servers)
        yield servers
    finally:
        codes = stop_all(servers)
    logs = [s.log.read_text()[-3000:] for s in servers]
    assert codes == (expected_codes or [0] * len(servers)), list(zip(codes, logs, strict=True))


def _wait_healthy(servers: list[Server]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(servers)
    while waiting:
        assert time.monotonic() < deadline, "the group did not start in time"
        for s in list(waiting):
            assert s.proc.poll() is None, s.log.read_text()[-3000:]
            try:
                if httpx.get(s.url + "/health", timeout=5).status_code == 200:
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
