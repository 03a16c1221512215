"""External load-balancing mode (docs/lb_modes.md): two `deepinfer-dp serve --data-parallel-rank`
servers started separately on loopback, then one of them killed (SIGKILL to its process group:
the server and its rank). Reports how long the group took to answer /health, one greedy request
across the group, and after the kill: how long the survivor took to answer its next request
(a 503 naming the broken group) and to exit (status 1, for its supervisor to restart it).

    python benchmarks/lb_server_kill.py --model /path/to/hf_dir
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, rank: int, group: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "deepinfer_dp.entrypoints.openai.launcher", model, "--served-model-name", "m",
           "--torch-threads", "1", "--dp-size", "2", "--data-parallel-rank", str(rank), *group, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited while starting:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def timed_request(url: str) -> tuple[int, float, str]:
    body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    t = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    message = r.json()["error"]["message"] if r.status_code != 200 else ""
    return r.status_code, time.monotonic() - t, message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="Hugging Face directory or .gguf (default: the default model)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lb_server_kill_"))
    key = root / "dp.key"
    key.write_text(secrets.token_hex(32) + "\n")
    group = ["--data-parallel-rpc-port", str(free_port()), "--data-parallel-key-file", str(key),
             "--router-collective-timeout-s", "5"]
    model = args.model or "SmolLM2-135M-Instruct"
    t0 = time.monotonic()
    servers = [start(model, r, group, root / f"server{r}.log") for r in range(2)]
    try:
        for r, (proc, url) in enumerate(servers):
            wait_healthy(url, proc, root / f"server{r}.log")
        print(f"group healthy {time.monotonic() - t0:.1f}s after start")
        status, took, _ = timed_request(servers[0][1])
        print(f"one request across the group: {status} in {took:.2f}s")
        os.killpg(servers[1][0].pid, signal.SIGKILL)
        servers[1][0].wait()
        asked = time.monotonic()
        status, took, message = timed_request(servers[0][1])
        print(f"the survivor's next request: {status} in {took:.2f}s ({message[:100]}...)")
        code = servers[0][0].wait(timeout=60)
        print(f"the survivor exited with status {code} {time.monotonic() - asked:.2f}s after that request was sent")
    finally:
        for proc, _ in servers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


if __name__ == "__main__":
    main()
