"""Load test: `deepinfer-dp serve --dp-size 2` (started here) under many concurrent streams, with
every result checked against offline LLM.generate on the same prompts (greedy).

Modes:
  load        --num-requests (500) streams at once, half chat and half completions, for
              --rounds (3) rounds. Prints req/s, output tok/s, TTFT and ITL p50/p99, the peak RSS
              of the server and everything it started (router, ranks, Ray) per round, and the
              ranks' free KV blocks after each round. Fails when a result differs, a request
              gets a 5xx, the RSS peak grows from round to round, or the free blocks do not
              return to their idle value.
  disconnect  --num-requests (200) streams, half of them dropped by the client after a random
              number of chunks: the free KV blocks return to idle and the survivors are correct.
  kv-pressure a server with --num-kv-blocks (small), --num-requests (64) long requests at once:
              preemptions happen (deepinfer:num_preemptions_total > 0), and every result equals
              offline generation with a roomy cache.

    python benchmarks/load_test.py                                  # SmolLM2-135M-Instruct
    python benchmarks/load_test.py --mode disconnect --num-requests 200
    python benchmarks/load_test.py --mode kv-pressure --num-requests 64 --max-tokens 256 --num-kv-blocks 64
    python benchmarks/load_test.py --model /path/to/hf_dir --num-requests 200 --rounds 1

Exit status 0 when every check passed, 1 otherwise (the failures are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import threading
import time

import httpx
import numpy as np
import psutil
from server_proc import start_server, stop_server

NAME = "load-test"


def prompts_of(n: int) -> list[str]:
    return [f"Write a short story about a robot number {i}." for i in range(n)]


def offline_reference(args, prompts: list[str]) -> list[str]:
    """What offline LLM.generate gives: chat for even indices, plain completion for odd."""
    from deepinfer_dp.entrypoints.llm import LLM
    from deepinfer_dp.sampling_params import SamplingParams

    llm = LLM(args.model, torch_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    chats = llm.chat([[{"role": "user", "content": p}] for p in prompts[0::2]], params, use_tqdm=False)
    plain = llm.generate(prompts[1::2], params, use_tqdm=False)
    llm.shutdown()
    out = [""] * len(prompts)
    out[0::2], out[1::2] = chats, plain
    return out


def server_flags(args) -> list[str]:
    flags = ["--dp-size", str(args.dp_size), "--torch-threads", "1", "--served-model-name", NAME,
             "--max-waiting-requests", str(max(1024, 2 * args.num_requests))]
    flags += ["--model", args.model] if args.model else []
    flags += ["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else []
    return flags


class PeakRss:
    """Samples the RSS of a process and all its descendants every 0.2 s; peak() since reset()."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self._peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            total = 0
            for proc in [self.root, *self.root.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self._peak = max(self._peak, total)

    def reset(self) -> int:
        peak, self._peak = self._peak, 0
        return peak

    def stop(self) -> None:
        self._stop.set()


async def one_stream(http: httpx.AsyncClient, i: int, prompt: str, args, drop_after: int | None) -> dict:
    """One streamed request (chat for even i); its text, TTFT, ITLs, status; dropped after
    `drop_after` chunks when given (the client goes away)."""
    common = {"model": NAME, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
              "ignore_eos": args.ignore_eos, "stream_options": {"include_usage": True}}
    if i % 2 == 0:
        path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {**common, "prompt": prompt}
    res = {"text": "", "ttft": None, "itl": [], "status": 0, "error": None, "dropped": False, "chunks": 0,
           "tokens": 0}
    start = last = time.perf_counter()
    async with http.stream("POST", path, json=body) as r:
        res["status"] = r.status_code
        if r.status_code != 200:
            res["error"] = (await r.aread()).decode()[:300]
            return res
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                res["error"] = event["error"]["message"]
                continue
            if event.get("usage"):
                res["tokens"] = event["usage"]["completion_tokens"]
            if not event["choices"]:
                continue
            choice = event["choices"][0]
            piece = choice["delta"].get("content") or "" if i % 2 == 0 else choice["text"]
            now = time.perf_counter()
            if piece:
                if res["ttft"] is None:
                    res["ttft"] = now - start
                else:
                    res["itl"].append(now - last)
                last = now
            res["text"] += piece
            res["chunks"] += 1
            if drop_after is not None and res["chunks"] >= drop_after:
                res["dropped"] = True
                return res  # leaving the block closes the connection mid-stream
    return res


async def run_round(url: str, prompts: list[str], args, drops: list[int | None]) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(prompts) + 10, max_keepalive_connections=len(prompts) + 10)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*[one_stream(http, i, p, args, d)
                                         for i, (p, d) in enumerate(zip(prompts, drops, strict=True))])
        return results, time.perf_counter() - start


def rank_metric(url: str, name: str) -> list[float]:
    text = httpx.get(url + "/metrics").text
    return [float(v) for v in re.findall(rf'^deepinfer:{name}{{dp_rank="\d"[^}}]*}} (\S+)$', text, re.M)]


def settled_free_blocks(url: str, idle: list[float] | None, timeout_s: float = 30.0) -> list[float]:
    """The ranks' free KV blocks once no request runs (and, given `idle`, once back to it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = sum(rank_metric(url, "num_requests_running")) + sum(rank_metric(url, "num_requests_waiting"))
        free = rank_metric(url, "num_free_kv_blocks")
        if (running == 0 and (idle is None or free == idle)) or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def check_round(results: list[dict], expected: list[str], drops: list[int | None]) -> list[str]:
    problems = []
    for i, (res, want, drop) in enumerate(zip(results, expected, drops, strict=True)):
        if res["status"] >= 500 or res["status"] != 200:
            problems.append(f"request {i}: HTTP {res['status']} {res['error']}")
        elif res["error"] is not None:
            problems.append(f"request {i}: error event: {res['error']}")
        elif drop is None and res["text"] != want:
            problems.append(f"request {i}: text differs from offline generation")
        elif drop is not None and not want.startswith(res["text"]):
            problems.append(f"request {i} (dropped): its prefix differs from offline generation")
    return problems


def report(results: list[dict], wall_s: float) -> str:
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    itl = [g for r in results for g in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return (f"{len(results) / wall_s:.2f} req/s, {tokens / wall_s:.1f} output tok/s, "
            f"TTFT p50/p99 {pct(ttft, 50):.0f}/{pct(ttft, 99):.0f} ms, "
            f"ITL p50/p99 {pct(itl, 50):.1f}/{pct(itl, 99):.1f} ms")


def run(args) -> list[str]:
    prompts = prompts_of(args.num_requests)
    print(f"offline reference: {len(prompts)} prompts, {args.max_tokens} tokens each", flush=True)
    expected = offline_reference(args, prompts)
    proc, url = start_server(server_flags(args))
    rss = PeakRss(proc.pid)
    problems: list[str] = []
    try:
        idle = settled_free_blocks(url, None)
        print(f"server up; idle free KV blocks per rank: {idle}", flush=True)
        rng = random.Random(0)
        peaks = []
        for rnd in range(args.rounds):
            drops = [None] * len(prompts)
            if args.mode == "disconnect":  # half of them, each after a random number of chunks
                for i in rng.sample(range(len(prompts)), len(prompts) // 2):
                    drops[i] = rng.randint(1, max(1, args.max_tokens - 1))
            preempted = sum(rank_metric(url, "num_preemptions_total"))
            rss.reset()
            results, wall = asyncio.run(run_round(url, prompts, args, drops))
            free = settled_free_blocks(url, idle)
            peaks.append(rss.reset())
            found = check_round(results, expected, drops)
            problems += [f"round {rnd + 1}: {p}" for p in found]
            if free != idle:
                problems.append(f"round {rnd + 1}: free KV blocks {free} did not return to idle {idle}")
            line = (f"round {rnd + 1}: {report([r for r in results if not r['dropped']], wall)}; "
                    f"peak RSS {peaks[-1] / 2**20:.0f} MiB; free KV blocks after {free} (idle {idle}); "
                    f"{len(found)} problem(s)")
            if args.mode == "disconnect":
                line += f"; dropped {sum(r['dropped'] for r in results)}"
            if args.mode == "kv-pressure":
                preempted = sum(rank_metric(url, "num_preemptions_total")) - preempted
                line += f"; preemptions {preempted:.0f}"
                if preempted <= 0:
                    problems.append(f"round {rnd + 1}: no preemption: the KV cache was not under pressure")
            print(line, flush=True)
        # Growth is a leak: the first round warms allocators and caches, the later ones may not grow.
        for rnd in range(2, len(peaks)):
            if peaks[rnd] > peaks[1] * (1 + args.rss_tolerance):
                problems.append(f"round {rnd + 1}: peak RSS {peaks[rnd] / 2**20:.0f} MiB grew past round 2's "
                                f"{peaks[1] / 2**20:.0f} MiB")
    finally:
        rss.stop()
        stop_server(proc)
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["load", "disconnect", "kv-pressure"], default="load")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dp-size", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="per rank (kv-pressure: make it small)")
    ap.add_argument("--ignore-eos", action="store_true", help="always --max-tokens tokens")
    ap.add_argument("--rss-tolerance", type=float, default=0.05, help="allowed peak RSS growth after round 2")
    args = ap.parse_args()
    problems = run(args)
    for p in problems[:50]:
        print("FAIL", p)
    print("OK: every check passed" if not problems else f"{len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
