"""Serving through a lost rank with no spare (router.rank_loss: shrink): the interruption that
streaming clients see, without and with redundant experts.

The random MoE of benchmarks/moe_ep.py (by default at benchmarks/eplb.py's scale: 2 MoE
layers, hidden 512, 64 experts of 256, top-8) on DP=2 with expert parallelism behind an
in-process server, one torch thread per rank, no warm spare. --streams streams of
--max-tokens tokens, 16 at a time; once both ranks have streams and a moment passed, rank 1's
process gets SIGKILL. The survivor re-forms alone, takes over rank 1's experts and its streams
(by recompute). Two sides, each in a fresh deployment, alternating over --runs runs:

- "no replicas": plain EP; each rank holds 32 experts, the survivor reads the other 32 per
  layer from the checkpoint;
- "replicas": EPLB with num_redundant_experts 64 (no rebalance during the run), so every
  rank holds a copy of every expert; the survivor reads nothing.

Per run, over the streams running at the kill: the longest gap between two tokens that ended
after the kill (the interruption), the median of those, when the last of them got its token
after the gap (all serving again, from the kill), the longest gap any stream saw before the
kill (the jitter without one), the survivor's expert change (slots kept, received, experts
read from the checkpoint, and its seconds, from rank_stats' moe_regroups), and the streams
that ended in an error (there must be none).

    python benchmarks/rank_loss_shrink.py [--runs 2] [--streams 48] [--max-tokens 48] [--layers 2]
        [--hidden 512] [--moe-intermediate 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
from moe_ep import model_dir  # noqa: E402
from stream_timing import run_streams, until  # noqa: E402

NAME = "moe-bench"
SIDES = {"no replicas": 0, "replicas": 64}


async def kill_under_streams(url: str, deployment, args) -> dict:
    bodies = [{"model": NAME, "prompt": f"Stream {i} asks how a cluster survives a lost rank",
               "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True} for i in range(args.streams)]
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=24)) as http:
        streams = asyncio.create_task(run_streams(http, bodies, 16))

        async def both_busy() -> bool:
            return all(r["inflight"] for r in (await http.get("/health")).json()["ranks"])

        await until(both_busy, 300)
        await asyncio.sleep(1.0)
        os.kill(deployment.rank_infos()[1]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        done = await streams
    stalls = [g for g in (s.stall_after(killed_at) for s in done) if g is not None]
    regroup = deployment.router.query_stats()[0]["moe_regroups"][-1]
    return {"errors": sum(s.error is not None for s in done), "across": len(stalls),
            "longest_gap_s": max((g for g, _ in stalls), default=0.0),
            "median_gap_s": statistics.median(g for g, _ in stalls) if stalls else 0.0,
            "all_resumed_s": max((end for _, end in stalls), default=0.0),
            "gap_before_s": max(s.longest_gap_before(killed_at) for s in done),
            "kept": regroup["kept"], "received": regroup["received"], "loaded": regroup["loaded"],
            "regroup_s": regroup["seconds"]}


def one_run(path: str, redundant: int, args) -> dict:
    from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment

    options = {"enable_expert_parallel": True, "torch_threads": 1, "kv_cache_memory_gb": 0.25, "max_num_seqs": 8}
    if redundant:
        options |= {"enable_eplb": True, "eplb_config": {"num_redundant_experts": redundant,
                                                         "step_interval": 10**9, "window_size": 16}}
    deployment = make_dp_deployment(path, 2, NAME, dp_options={"collective_timeout_s": 60, "rank_loss": "shrink",
                                                               "spare_rank": False}, **options)
    server = ServerThread(deployment.router, NAME).start()
    try:
        return asyncio.run(kill_under_streams(server.url, deployment, args))
    finally:
        server.stop()
        deployment.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--streams", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    args = ap.parse_args()
    path = str(model_dir(args))
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for run in range(args.runs):
        for side, redundant in SIDES.items():
            got = one_run(path, redundant, args)
            results[side].append(got)
            print(f"run {run + 1}, {side}: {got}", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.streams} streams x {args.max_tokens} tokens, rank 1 killed")
    for side, runs in results.items():
        def span(key: str, runs: list = runs) -> str:
            values = [r[key] for r in runs]
            return f"{min(values):.2f}-{max(values):.2f}"
        print(f"{side:12s} longest gap {span('longest_gap_s')} s, median gap {span('median_gap_s')} s, "
              f"all serving again {span('all_resumed_s')} s after the kill, longest gap before it "
              f"{span('gap_before_s')} s, experts read {span('loaded')}, slots kept {span('kept')}, regroup "
              f"{span('regroup_s')} s, errors {sum(r['errors'] for r in runs)}")


if __name__ == "__main__":
    main()
