"""Elastic DP under Ray while it serves. A server with --enable-elastic-ep at DP=2 grows to 3
while streams run (a second change meanwhile gets 409), later streams reach the new rank,
then it shrinks to 1 with no drain time, which moves the leaving ranks' streams by recompute:
every stream completes equal to the DP=1 answer, none is lost, /health is ok and the lockstep
votes agree after each change, and /metrics shows the group's size and the changes. The same
offline with expert parallelism on a tiny MoE (LLM.scale_elastic_ep, generate running on
another thread): greedy tokens identical to DP=1, experts re-sharded at each size (moved over the
group where a staying rank holds them, read from the checkpoint only where none does)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from dp_utils import EP_ENGINE, PROMPTS, token_ids
from moe_utils import build_tiny_moe
from server_utils import ENGINE_OPTIONS, MODEL_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from server_proc import stream_completion  # noqa: E402  (the benchmark's reading of a stream)

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.entrypoints.openai.launcher import ServerThread, make_dp_deployment  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

NUM_STREAMS = 16  # per phase
MAX_TOKENS = 470  # long (a prompt is up to 33 tokens, the context 512): streams still run when the group changes
KV_GB = 0.06
STREAM_PROMPTS = [f"Request {i} asks about elastic data parallel serving" for i in range(2 * NUM_STREAMS)]
DP_OPTIONS = {"collective_timeout_s": 15}


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model_dir) -> list[str]:
    llm = LLM(model_dir, **{**ENGINE_OPTIONS, "kv_cache_memory_gb": KV_GB})
    texts = llm.generate(STREAM_PROMPTS, _greedy(), use_tqdm=False)
    llm.shutdown()
    return texts


@contextlib.contextmanager
def elastic_server(model_dir: str):
    # One sequence at a time per rank: a tiny model's stream takes a second or two, so the
    # streams queue on their ranks and a leaving rank still has some when the group shrinks.
    deployment = make_dp_deployment(model_dir, 2, MODEL_NAME, dp_options=DP_OPTIONS,
                                    **{**ENGINE_OPTIONS, "kv_cache_memory_gb": KV_GB, "max_num_seqs": 1})
    server = ServerThread(deployment.router, MODEL_NAME, scaler=deployment).start()
    try:
        yield server, deployment
    finally:
        server.stop()
        deployment.shutdown()


async def _streams(http: httpx.AsyncClient, indices: range, started: asyncio.Queue) -> list[asyncio.Task]:
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return [asyncio.create_task(stream_completion(http, {**body, "prompt": STREAM_PROMPTS[i]}, started))
            for i in indices]


async def _scale(http: httpx.AsyncClient, size: int, drain_timeout: float) -> httpx.Response:
    return await http.post("/scale_elastic_ep", json={"new_data_parallel_size": size, "drain_timeout": drain_timeout})


async def _phase(http: httpx.AsyncClient, indices: range, size: int, drain_timeout: float) -> tuple[list, dict, bool]:
    """Streams `indices`; once a few have their first token and every rank has some, the
    group changes to `size`, and a second change asked meanwhile must get 409. The streams'
    outcomes, the change's answer and whether /is_scaling_elastic_ep said so while it ran."""
    started: asyncio.Queue = asyncio.Queue()
    tasks = await _streams(http, indices, started)
    for _ in range(4):
        await started.get()
    while not all(r["inflight"] for r in (await http.get("/health")).json()["ranks"]):
        await asyncio.sleep(0.05)  # every rank has streams of its own when the group changes
    change = asyncio.create_task(_scale(http, size, drain_timeout))
    seen_scaling = False
    while not change.done():
        seen_scaling = seen_scaling or (await http.get("/is_scaling_elastic_ep")).json()["is_scaling_elastic_ep"]
        if seen_scaling:
            second = await _scale(http, size, 0)
            assert second.status_code in (200, 409), second.text  # 200 (nothing to do) when the first just ended
            assert second.status_code == 200 or "already in progress" in second.json()["error"]["message"]
            break
        await asyncio.sleep(0.05)
    answer = await change
    assert answer.status_code == 200, answer.text
    return await asyncio.gather(*tasks), answer.json(), seen_scaling


def _votes_agree(deployment, size: int) -> list[dict]:
    return _settled(deployment.router.query_stats, size)


def _settled(query, size: int) -> list[dict]:
    """Every rank's stats (`query()`) once the group is idle and its lockstep votes agree (a
    rank that has work may vote one step ahead, and reports its last vote a moment after the
    last token); a real mismatch never settles."""
    deadline = time.monotonic() + 30
    while True:
        stats = query()
        if len(stats) == size and len({s["lockstep_votes"] for s in stats}) == 1 or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@pytest.mark.slow
def test_serving_through_grow_to_3_and_shrink_to_1(model_dir, expected, ray_cluster):
    with elastic_server(model_dir) as (srv, deployment):
        async def run() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=300,
                                         limits=httpx.Limits(max_connections=100)) as http:
                first, grown, seen = await _phase(http, range(0, NUM_STREAMS // 2), 3, 60)
                assert (grown["old_size"], grown["new_size"], seen) == (2, 3, True)
                print(f"grew: {grown}")
                later = await asyncio.gather(*await _streams(http, range(NUM_STREAMS // 2, NUM_STREAMS),
                                                             asyncio.Queue()))
                _check(first + later, expected[:NUM_STREAMS])
                stats = _votes_agree(deployment, 3)
                assert len({s["lockstep_votes"] for s in stats}) == 1, stats
                assert stats[2]["generation_tokens"] > 0  # the new rank served streams
                assert [r["state"] for r in (await http.get("/health")).json()["ranks"]] == ["ok"] * 3
                moved, shrunk, _ = await _phase(http, range(NUM_STREAMS, 2 * NUM_STREAMS), 1, 0)
                assert (shrunk["new_size"], shrunk["migrated"] > 0) == (1, True), shrunk
                print(f"shrank: {shrunk}")
                _check(moved, expected[NUM_STREAMS:])
                health = (await http.get("/health")).json()
                assert health["status"] == "ok" and len(health["ranks"]) == 1
                metrics = (await http.get("/metrics")).text
                assert re.search(r"^deepinfer:dp_group_size 1\.0$", metrics, re.M)
                assert re.search(r'^deepinfer:elastic_scale_events_total{direction="up"} 1\.0$', metrics, re.M)
                assert re.search(r'^deepinfer:elastic_scale_events_total{direction="down"} 1\.0$', metrics, re.M)
        asyncio.run(run())
        print(f"ranks' stats after shrinking: {_votes_agree(deployment, 1)[0]['lockstep_votes']} votes")


def _check(outcomes: list, want: list[str]) -> None:
    errors = [error for _, error, _ in outcomes if error is not None]
    assert not errors, errors[:3]
    texts = [text for text, _, _ in outcomes]
    assert texts == want, next(i for i, (a, b) in enumerate(zip(texts, want, strict=True)) if a != b)


# ---- expert parallelism, offline --------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe("qwen2-moe", tmp_path_factory.mktemp("elastic-ep") / "qwen2-moe")


EP_PROMPTS = PROMPTS * 3
EP_MAX_TOKENS = 48


def _generate_into(llm: LLM, got: list) -> None:
    got.append(token_ids(llm.generate(EP_PROMPTS, _greedy(EP_MAX_TOKENS), use_tqdm=False)))


@pytest.mark.slow
def test_expert_parallel_outputs_identical_through_grow_and_shrink(moe_dir, ray_cluster):
    reference = LLM(str(moe_dir), decode_sequence=False, **EP_ENGINE)
    want = token_ids(reference.generate(EP_PROMPTS, _greedy(EP_MAX_TOKENS), use_tqdm=False))
    reference.shutdown()
    llm = LLM(str(moe_dir), decode_sequence=False, dp_size=2, enable_expert_parallel=True,
              dp_options=DP_OPTIONS, **EP_ENGINE)
    try:
        for size, drain in ((3, 60), (1, 0)):
            got: list = []
            thread = threading.Thread(target=_generate_into, args=(llm, got))
            thread.start()
            while not any(s.get("num_running") for s in llm.rank_stats()):
                time.sleep(0.05)  # the change comes while the ranks generate
            done = llm.scale_elastic_ep(size, drain_timeout=drain)
            thread.join(timeout=600)
            assert done["new_size"] == size and got == [want], (done, size)
            stats = _settled(llm.rank_stats, size)
            assert len({s["lockstep_votes"] for s in stats}) == 1, stats
            shards = [s["moe_local_experts"] for s in stats]
            assert shards == ([[0, 2], [2, 5], [5, 8]] if size == 3 else [[0, 8]]), shards
            # (kept, received over the group, read) per rank, 2 MoE layers: growing reads nothing
            # (rank 2 started with its share); alone, rank 0 reads what it never held
            costs = [tuple(s["moe_regroups"][-1][k] for k in ("kept", "received", "loaded")) for s in stats[:2]]
            assert costs == ([(4, 0, 0), (2, 4, 0)] if size == 3 else [(4, 0, 12)]), costs
            print(f"EP scaled to {size}: {done}")
    finally:
        llm.shutdown()
