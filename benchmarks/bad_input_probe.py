"""What bad input and overload do to a running server, in numbers.

Starts the server in-process (default model: SmolLM2-135M-Instruct) and measures:
  1. a 10 MB prompt: its answer and time, and meanwhile the worst /health latency and the
     longest gap between chunks of a concurrent stream, against the same stream alone;
  2. a 100,000-item prompt list: status and time (refused at the prompt-list cap);
  3. a body over the size limit: status and time;
  4. overload: requests beyond max_waiting_requests while the engine is held: their status,
     Retry-After, and that the held ones then finish.

    python benchmarks/bad_input_probe.py [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import httpx

from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.launcher import ServerThread, default_model_name, make_local_client


async def _poll_health(c: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await c.get("/health")
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.02)


async def _stream_gaps(c: httpx.AsyncClient, model: str, out: list[float]) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    last = None
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            if last is not None:  # (the first chunk's wait is time to first token, not a gap)
                out.append(now - last)
            last = now


async def baseline(url: str, model: str) -> None:
    health, gaps, stop = [], [], asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=None) as c:
        poller = asyncio.create_task(_poll_health(c, stop, health))
        await _stream_gaps(c, model, gaps)
        stop.set()
        await poller
    print(f"baseline (the stream alone): /health worst {max(health) * 1e3:.0f} ms, stream's longest chunk gap "
          f"{max(gaps) * 1e3:.0f} ms (median {statistics.median(gaps) * 1e3:.0f} ms)")


async def huge_prompt(url: str, model: str, which: str) -> None:
    health, gaps, stop = [], [], asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=None) as c:
        poller = asyncio.create_task(_poll_health(c, stop, health))
        streamer = asyncio.create_task(_stream_gaps(c, model, gaps))
        await asyncio.sleep(0.5)  # the stream is running
        t = time.perf_counter()
        r = await c.post("/v1/completions", json={"model": model, "prompt": "word " * 2_000_000, "max_tokens": 4})
        took = time.perf_counter() - t
        stop.set()
        await asyncio.gather(poller, streamer)
    print(f"10 MB prompt ({which}): {r.status_code} ({r.json()['error']['message'][:60]}...) after {took:.2f} s; "
          f"meanwhile /health worst {max(health) * 1e3:.0f} ms (median {statistics.median(health) * 1e3:.1f} ms, "
          f"{len(health)} probes), stream's longest chunk gap {max(gaps) * 1e3:.0f} ms")


def timed_post(url: str, body=None, content=None) -> tuple[int, float]:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, content=content, timeout=None,
                   headers=None if body is not None else {"content-type": "application/json"})
    return r.status_code, time.perf_counter() - t


def overload(server: ServerThread, model: str, limit: int) -> None:
    release, real_step = threading.Event(), server.client.engine.step

    def held_step():
        release.wait()
        return real_step()

    async def run():
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        async with httpx.AsyncClient(base_url=server.url, timeout=None) as c:
            held = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(limit)]
            while server.app.state.ctx.admission.waiting < limit:
                await asyncio.sleep(0.01)
            t = time.perf_counter()
            extra = await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(20)])
            took = time.perf_counter() - t
            release.set()
            done = await asyncio.gather(*held)
        codes = sorted({r.status_code for r in extra})
        print(f"overload: 20 requests past max_waiting_requests={limit}: status {codes}, Retry-After "
              f"{extra[0].headers.get('retry-after')}, all 20 answered in {took * 1e3:.0f} ms; the {limit} held "
              f"ones then finished with {sorted({r.status_code for r in done})}")

    server.client.engine.step = held_step
    try:
        asyncio.run(run())
    finally:
        del server.client.engine.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = default_model_name(args.model)
    limits = ServerLimits(max_waiting_requests=64)
    client = make_local_client(args.model, model)
    server = ServerThread(client, model, limits=limits).start()
    server.client = client
    try:
        asyncio.run(baseline(server.url, model))
        for i in range(2):
            asyncio.run(huge_prompt(server.url, model, f"round {i + 1}"))
        status, took = timed_post(server.url, {"model": model, "prompt": ["hi"] * 100_000, "max_tokens": 1})
        print(f"100,000-item prompt list: {status} after {took * 1e3:.0f} ms")
        status, took = timed_post(server.url, content=b'{"prompt": "' + b"x" * (20 * 2**20) + b'"}')
        print(f"20 MiB body: {status} after {took * 1e3:.0f} ms")
        overload(server, model, limits.max_waiting_requests)
    finally:
        server.stop()
        client.shutdown()


if __name__ == "__main__":
    main()
