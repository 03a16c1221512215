"""A DP rank frozen with SIGSTOP while a request runs on it: what /health says, and when.

Serves a model over DP=2 Ray ranks (the router process and the OpenAI server in this process),
starts one long greedy completion (the second request, so round robin puts it on rank 1),
stops rank 1's process with SIGSTOP, and polls /health every 0.1 s, printing each change of
(status, rank 1's state, rank 1 up, its restarts) with the seconds since the stop; it stops
watching once rank 1 is back, or after --watch-s, then sends SIGCONT if the process is still
there and prints how the request ended.

    python benchmarks/rank_freeze.py                          # SmolLM2-135M-Instruct
    python benchmarks/rank_freeze.py --model /path/to/hf_dir --stall-timeout-s 2
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import httpx

from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment


def watch(url: str, pid: int, watch_s: float) -> None:
    stopped, seen = time.monotonic(), set()
    while time.monotonic() - stopped < watch_s:
        health = httpx.get(url + "/health", timeout=None).json()
        rank = health["ranks"][1]
        key = (health["status"], rank["state"], rank["up"], rank.get("restarts", 0))
        if key not in seen:
            seen.add(key)
            print(f"{time.monotonic() - stopped:6.2f} s  status {key[0]:8}  rank 1 {key[1]:7} up={key[2]} "
                  f"restarts={key[3]}  {rank.get('reason', '')[:100]}", flush=True)
        if key[3] and key[0] == "ok":
            return
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--stall-timeout-s", type=float, default=ServerLimits().stall_timeout_s)
    parser.add_argument("--watch-s", type=float, default=120.0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    deployment = make_dp_deployment(args.model, 2, "default", torch_threads=1)
    limits = ServerLimits(stall_timeout_s=args.stall_timeout_s)
    server = ServerThread(deployment.router, "default", limits=limits).start()
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=None)  # to rank 0
        pid = deployment.rank_infos()[1]["pid"]
        result: dict = {}
        worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            server.url + "/v1/completions", json=body, timeout=None)))
        worker.start()
        time.sleep(0.5)  # the request is stepping on rank 1
        os.kill(pid, signal.SIGSTOP)
        try:
            watch(server.url, pid, args.watch_s)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        worker.join()
        r = result["r"]
        print(f"the request on rank 1: {r.status_code} {r.text[:160]}")
    finally:
        server.stop()
        deployment.shutdown()


if __name__ == "__main__":
    main()
