"""100 streams on a DP=2 server of a tiny MoE (Mixtral, 8 experts, top-2) with expert
parallelism while the group changes, then while a rank dies with nothing to replace it.

Phase 1: 100 streams, 16 at a time: the group grows to 3 under the first 50, the other 50
start once it has grown (the new rank's share of the experts moves over the group, nothing read
from the checkpoint), the new rank's work shows in /metrics, then it shrinks back to 2 with no
drain time (the leaving rank's streams move by recompute). Phase 2 (router.rank_loss: shrink):
100 more streams, rank 1's process is killed mid-way; the survivor re-forms alone, takes over
rank 1's experts and its streams. Every stream of both phases completes with exactly the
DP=1 text: none lost, none cut short, no token twice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from moe_utils import build_tiny_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stream_timing import run_streams, until  # noqa: E402

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

NAME = "tiny-moe"
NUM_STREAMS = 100
CONCURRENCY = 16
MAX_TOKENS = 24
PROMPTS = [f"Stream {i} asks about elastic expert parallel serving" for i in range(2 * NUM_STREAMS)]
ENGINE = {"kv_cache_memory_gb": 0.05, "block_size": 16, "seed": 0, "torch_threads": 1}
SERVED = {**ENGINE, "max_num_seqs": 2}  # streams queue on their ranks: they still run when the group changes
DP_OPTIONS = {"collective_timeout_s": 15, "rank_loss": "shrink"}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_tiny_moe("mixtral", tmp_path_factory.mktemp("elastic-streams") / "mixtral"))


@pytest.fixture(scope="module")
def expected(moe_dir) -> list[str]:
    llm = LLM(moe_dir, **ENGINE)
    texts = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    llm.shutdown()
    return texts


@contextlib.contextmanager
def ep_server(moe_dir: str):
    deployment = make_dp_deployment(moe_dir, 2, NAME, dp_options=DP_OPTIONS, enable_expert_parallel=True,
                                    **SERVED)
    server = ServerThread(deployment.router, NAME, scaler=deployment).start()
    try:
        yield server, deployment
    finally:
        server.stop()
        deployment.shutdown()


def _bodies(indices: range) -> list[dict]:
    return [{"model": NAME, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            for i in indices]


def _check(streams: list, want: list[str]) -> None:
    errors = [s.error for s in streams if s.error is not None]
    assert not errors, errors[:3]
    texts = [s.text for s in streams]
    assert texts == want, next(i for i, (a, b) in enumerate(zip(texts, want, strict=True)) if a != b)


def _generated(metrics: str, dp_rank: int) -> float:
    found = re.search(rf'^deepinfer:generation_tokens_total{{[^}}]*dp_rank="{dp_rank}"[^}}]*}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


async def _scale(http: httpx.AsyncClient, size: int, drain: float) -> dict:
    answer = await http.post("/scale_elastic_ep", json={"new_data_parallel_size": size, "drain_timeout": drain})
    assert answer.status_code == 200, answer.text
    return answer.json()


async def _grow_and_shrink(http: httpx.AsyncClient) -> tuple[list, dict, dict, float]:
    """The first half of the streams runs while the group grows, the second half starts once
    it has (so some surely reach the new rank) and runs while it shrinks back."""
    half = NUM_STREAMS // 2
    first = asyncio.create_task(run_streams(http, _bodies(range(half)), CONCURRENCY))

    async def every_rank_busy() -> bool:
        return all(r["inflight"] for r in (await http.get("/health")).json()["ranks"])

    await until(every_rank_busy, 120)
    grown = await _scale(http, 3, 60)
    second = asyncio.create_task(run_streams(http, _bodies(range(half, NUM_STREAMS)), CONCURRENCY))

    async def new_rank_worked() -> bool:
        return _generated((await http.get("/metrics")).text, 2) > 0

    await until(new_rank_worked, 120)
    new_rank_tokens = _generated((await http.get("/metrics")).text, 2)
    shrunk = await _scale(http, 2, 0)
    return await first + await second, grown, shrunk, new_rank_tokens


async def _kill_mid_way(http: httpx.AsyncClient, pid: int) -> tuple[list, float]:
    streams = asyncio.create_task(run_streams(http, _bodies(range(NUM_STREAMS, 2 * NUM_STREAMS)), CONCURRENCY))

    async def rank_1_busy() -> bool:
        ranks = (await http.get("/health")).json()["ranks"]
        return len(ranks) == 2 and all(r["inflight"] for r in ranks)

    await until(rank_1_busy, 120)
    await asyncio.sleep(0.5)  # some of its streams have tokens
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    return await streams, killed_at


@pytest.mark.slow
def test_100_streams_through_grow_shrink_and_a_lost_rank(moe_dir, expected, ray_cluster):
    with ep_server(moe_dir) as (srv, deployment):
        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=600,
                                         limits=httpx.Limits(max_connections=CONCURRENCY + 8)) as http:
                streams, grown, shrunk, new_rank_tokens = await _grow_and_shrink(http)
                print(f"grew {grown}, rank 2 generated {new_rank_tokens:.0f} tokens; shrank {shrunk}")
                _check(streams, expected[:NUM_STREAMS])
                assert (grown["new_size"], shrunk["new_size"]) == (3, 2)
                regroups = [s.get("moe_regroups") for s in deployment.router.query_stats()]
                print(f"experts moved at each change, per rank: {regroups}")
                pid = deployment.rank_infos()[1]["pid"]
                streams, killed_at = await _kill_mid_way(http, pid)
                _check(streams, expected[NUM_STREAMS:])
                stalls = [g for g in (s.stall_after(killed_at) for s in streams) if g is not None]
                print(f"kill: {len(stalls)} streams ran across it, longest gap {max(stalls, default=(0, 0))[0]:.2f}s")
                health = (await http.get("/health")).json()
                assert health["status"] == "ok" and [r["dp_rank"] for r in health["ranks"]] == [0], health
                metrics = (await http.get("/metrics")).text
                assert re.search(r"^deepinfer:dp_group_size 1\.0$", metrics, re.M)
        asyncio.run(run())
        stats = deployment.router.query_stats()
        assert len(stats) == 1 and stats[0]["moe_local_experts"] == [0, 8], stats
        print(f"the survivor's expert changes: {stats[0]['moe_regroups']}")
