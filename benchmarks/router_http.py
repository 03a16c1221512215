"""router_throughput.py's http mode: API server processes over the router and fake ranks,
driven by closed-loop HTTP load processes (each --concurrency connections sending
non-streamed /v1/completions with max_tokens 1 for --seconds)."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time

from router_throughput import VOCAB, Cluster, _processor, cpu_s

SECONDS = 10.0


def _api_server(sock: socket.socket, frontend: str, key) -> None:
    from model_utils import build_tiny_tokenizer

    from deepinfer_dp.cluster.router_client import RouterClient
    from deepinfer_dp.entrypoints.openai.http_server import run_server

    client = RouterClient(frontend, build_tiny_tokenizer(VOCAB), "fake", 64, _processor(), key=key)
    try:
        run_server(client, "fake", host="127.0.0.1", sockets=[sock], shutdown_grace_s=0.5)
    finally:
        client.close()


def _load(url: str, concurrency: int, ready, start, results) -> None:
    import httpx

    async def worker(http: httpx.AsyncClient, deadline: float, counts: dict) -> None:
        body = {"model": "fake", "prompt": "hello world", "max_tokens": 1, "temperature": 0.0}
        while time.perf_counter() < deadline:
            try:
                r = await http.post(url + "/v1/completions", json=body)
                counts["ok" if r.status_code == 200 else "failed"] += 1
            except httpx.HTTPError:
                counts["failed"] += 1

    async def run() -> dict:
        counts = {"ok": 0, "failed": 0}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            while True:  # the API servers may still be starting
                try:
                    if (await http.get(url + "/v1/models")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            ready.put(os.getpid())
            start.wait()
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(http, t0 + SECONDS, counts) for _ in range(concurrency)))
            return {**counts, "wall": time.perf_counter() - t0}

    cpu0 = time.process_time()
    got = asyncio.run(run())
    results.put({**got, "cpu": time.process_time() - cpu0})


def run_http(servers: int, args: argparse.Namespace) -> dict:
    cluster = Cluster(2, args.policy)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ctx = cluster.ctx
    api = [ctx.Process(target=_api_server, args=(sock, cluster.router.frontend_address, cluster.client_key()))
           for _ in range(servers)]
    ready, start, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    try:
        for p in api:
            p.start()
        loads = [ctx.Process(target=_load, args=(url, args.concurrency, ready, start, results))
                 for _ in range(args.load_procs)]
        for p in loads:
            p.start()
        for _ in loads:
            ready.get(timeout=300)
        time.sleep(2.0)  # every API server process has started (the loads saw one answer)
        api_cpu0, router_cpu0, t0 = [cpu_s(p.pid) for p in api], time.process_time(), time.perf_counter()
        start.set()
        got = [results.get(timeout=120) for _ in loads]
        wall = time.perf_counter() - t0
        api_cpu = [(cpu_s(p.pid) - c) / wall for p, c in zip(api, api_cpu0, strict=True)]
        router_cpu = (time.process_time() - router_cpu0) / wall
        for p in loads:
            p.join(30)
    finally:
        for p in api:
            p.terminate()
            p.join(30)
        sock.close()
        cluster.close()
    span, ok = max(g["wall"] for g in got), sum(g["ok"] for g in got)
    return {"req_s": ok / span, "failed": sum(g["failed"] for g in got),
            "api_server_us_per_req": 1e6 * sum(api_cpu) * wall / max(1, ok),
            "api_server_cpu": sum(api_cpu) / len(api_cpu), "router_cpu": router_cpu,
            "load_cpu": sum(g["cpu"] for g in got) / len(got) / span}
