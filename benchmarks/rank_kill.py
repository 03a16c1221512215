"""A DP rank killed under load, and how long the cluster takes to be whole again.

Serves a model over DP=2 Ray ranks (the router process and the OpenAI server, in this
process), answers --num-streams greedy completions once without streaming (the reference),
streams them again and kills rank 1's process (SIGKILL) once every stream has its first token.
Reports: how many streams failed and how long after the kill their error came, whether every
survivor equals the reference, the times from the kill until /health shows rank 1 down and
until it shows both ranks up again (watched while the streams still run: the restarted rank
loaded and taken back at full size), and how a second wave is spread over the ranks.
--no-spare measures a restart without the warm spare rank process (a new process imports and
loads everything).

    python benchmarks/rank_kill.py                      # SmolLM2-135M-Instruct (the default model)
    python benchmarks/rank_kill.py --no-spare           # the same without the warm spare
    python benchmarks/rank_kill.py --model /path/to/hf_dir --num-streams 100 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import time

import httpx
from server_proc import stream_completion, wait_for_ranks

from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment

BACK_TIMEOUT_S = 600.0


async def completions(url: str, prompts: list[str], max_tokens: int, stream: bool, kill_pid: int | None = None):
    """Every prompt's (text, error, end time). With kill_pid, that process is killed once every
    stream has its first event, and /health is watched from then on: also returns the kill
    time, when rank 1 was first seen down and when both ranks were up again."""
    started: asyncio.Queue = asyncio.Queue()

    async def one(http: httpx.AsyncClient, prompt: str):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "model": "default"}
        if stream:
            return await stream_completion(http, body, started)
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"], None, time.monotonic()

    limits = httpx.Limits(max_connections=len(prompts) + 10)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        tasks = [asyncio.create_task(one(http, p)) for p in prompts]
        times = {}
        if kill_pid is not None:
            for _ in prompts:
                await started.get()
            os.kill(kill_pid, signal.SIGKILL)
            times["killed"] = time.monotonic()
            times["down"] = await wait_for_ranks(http, lambda ranks: not ranks[1]["up"], BACK_TIMEOUT_S, 0.05)
            times["back"] = await wait_for_ranks(http, lambda ranks: all(r["up"] for r in ranks), BACK_TIMEOUT_S)
        return await asyncio.gather(*tasks), times


def routed(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {r: float(v) for r, v in re.findall(r'^deepinfer:requests_routed_total{dp_rank="(\d)"[^}]*} (\S+)$', text,
                                               re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--num-streams", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-spare", action="store_true", help="no warm spare rank: a new process replaces the dead one")
    args = ap.parse_args()
    prompts = [f"Question {i}: explain in a few sentences why the sky looks blue." for i in range(args.num_streams)]
    deployment = make_dp_deployment(args.model, 2, "default", dp_options={"spare_rank": not args.no_spare},
                                    torch_threads=1)
    server = ServerThread(deployment.router, "default").start()
    try:
        url = server.url
        reference, _ = asyncio.run(completions(url, prompts, args.max_tokens, stream=False))
        victim = deployment.rank_infos()[1]["pid"]
        outcomes, t = asyncio.run(completions(url, prompts, args.max_tokens, True, kill_pid=victim))
        failed = [o for o in outcomes if o[1] is not None]
        survivors = [(o, ref) for o, ref in zip(outcomes, reference, strict=True) if o[1] is None]
        before = routed(url)
        second, _ = asyncio.run(completions(url, prompts, args.max_tokens, stream=False))
        after = routed(url)
        print(f"warm spare rank: {not args.no_spare}")
        print(f"streams: {len(outcomes)}; failed with an error: {len(failed)} "
              f"(all naming DP rank 1: {all('DP rank 1' in o[1]['message'] for o in failed)})")
        if failed:
            delays = sorted(o[2] - t["killed"] for o in failed)
            print(f"error after the kill: first {delays[0]:.2f}s, last {delays[-1]:.2f}s")
        print(f"survivors equal to the reference: {sum(o[0] == ref[0] for o, ref in survivors)} of {len(survivors)}")
        print(f"kill -> /health shows rank 1 down: {t['down'] - t['killed']:.2f}s; "
              f"kill -> both ranks up (full size): {t['back'] - t['killed']:.1f}s")
        same = sum(s[0] == r[0] for s, r in zip(second, reference, strict=True))
        print(f"second wave: equal to the reference {same} of {len(second)}; "
              f"routed per rank {[after[r] - before.get(r, 0) for r in sorted(after)]}")
    finally:
        server.stop()
        deployment.shutdown()


if __name__ == "__main__":
    main()
