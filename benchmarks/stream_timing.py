"""Streams that record when each event arrived: what a client sees of a change of the DP group
(a rank killed, a scale up or down). Shared by benchmarks/rank_loss_shrink.py and
tests/cluster/test_elastic_streams.py."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Stream:
    text: str = ""
    error: dict | None = None
    times: list[float] = field(default_factory=list)  # monotonic arrival of each token event

    def stall_after(self, t: float) -> tuple[float, float] | None:
        """For a stream with events on both sides of `t`: its longest gap between two events
        that ends after `t`, and when that gap ended (seconds after `t`); else None. (The first
        event after `t` may be a token made before it, still on its way.)"""
        if not self.times or self.times[0] > t or self.times[-1] <= t:
            return None
        return max((b - a, b - t) for a, b in zip(self.times, self.times[1:], strict=False) if b > t)

    def longest_gap_before(self, t: float) -> float:
        """The longest gap between two events before `t`: the jitter of an undisturbed stream."""
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False) if b <= t), default=0.0)


async def timed_stream(http: httpx.AsyncClient, body: dict) -> Stream:
    """One streamed /v1/completions request; an error event or a 503 ends it with `error`."""
    out = Stream()
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code == 503:
            out.error = json.loads(await r.aread())["error"]
            return out
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
            else:
                out.times.append(time.monotonic())
                out.text += event["choices"][0]["text"]
    return out


async def run_streams(http: httpx.AsyncClient, bodies: list[dict], concurrency: int) -> list[Stream]:
    """Every body streamed, at most `concurrency` at once (so later ones reach ranks that
    joined meanwhile), in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> Stream:
        async with gate:
            return await timed_stream(http, body)

    return await asyncio.gather(*(one(b) for b in bodies))


async def until(predicate, timeout_s: float, poll_s: float = 0.05) -> None:
    """Waits for the async `predicate()` to hold; TimeoutError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f}s")
        await asyncio.sleep(poll_s)
