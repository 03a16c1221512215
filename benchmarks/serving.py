"""Serving benchmark: a load generator against a running deepinfer-dp (or any OpenAI) server.

Requests arrive as a Poisson process at --request-rate (inf: all at once), each the offline
workload's prompt "Write a short story about a robot number {i}." through the chat template
(the server applies it on /v1/chat/completions), streamed, greedy, --max-tokens new tokens.
Prints request throughput, output tokens/s, time to first token and inter-token latency
(gaps between streamed chunks) at p50 and p99.

    python -m deepinfer_dp.entrypoints.openai.launcher --port 8000 &      # dp 1, SmolLM2
    python benchmarks/serving.py --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res, start = RequestResult(), time.perf_counter()
    last = start
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e, res.ok = time.perf_counter() - start, True
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run(args: argparse.Namespace) -> list[RequestResult]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        model = args.model or (await http.get(args.url + "/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        tasks = []
        for i in range(args.num_prompts):
            prompt = f"Write a short story about a robot number {i}."
            body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
            tasks.append(asyncio.create_task(one_request(http, args.url, body)))
            if args.request_rate != float("inf") and i + 1 < args.num_prompts:
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        return await asyncio.gather(*tasks)


def report(results: list[RequestResult], duration: float, args: argparse.Namespace) -> None:
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"failed request: {r.error}")
    tokens = sum(r.output_tokens for r in ok)
    ttft = np.array([r.ttft for r in ok]) * 1000
    itl = np.array([x for r in ok for x in r.itl]) * 1000
    print(f"request rate          : {args.request_rate} req/s (Poisson), {len(ok)}/{len(results)} succeeded")
    print(f"duration              : {duration:.2f} s")
    print(f"request throughput    : {len(ok) / duration:.2f} req/s")
    print(f"output token throughput: {tokens / duration:.1f} tok/s ({tokens} tokens)")
    if len(ttft):
        print(f"TTFT  p50 / p99       : {np.percentile(ttft, 50):.1f} / {np.percentile(ttft, 99):.1f} ms")
    if len(itl):
        print(f"ITL   p50 / p99       : {np.percentile(itl, 50):.1f} / {np.percentile(itl, 99):.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends all at once")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    start = time.perf_counter()
    results = asyncio.run(run(args))
    report(results, time.perf_counter() - start, args)


if __name__ == "__main__":
    main()
