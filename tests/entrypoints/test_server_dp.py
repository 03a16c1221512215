"""The OpenAI-compatible server over a DP=2 cluster of a tiny model: the router process of
deepinfer_dp.cluster over two lockstep Ray ranks, hit with the real `openai` client.
Greedy results equal the offline DP=1 LLM results; concurrent requests land on both ranks; a
client that disconnects mid-stream gets its request aborted on its rank, which frees its blocks.
"""

import asyncio
import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from dp_utils import assert_actors_exited_cleanly  # noqa: E402
from server_utils import (  # noqa: E402
    ENGINE_OPTIONS,
    MODEL_NAME,
    served,
)

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Hello, world!", "The quick brown fox", "Data parallel ranks step", "What is the capital of"]
MAX_TOKENS = 12


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_server(model_dir, ray_cluster):
    with served(model_dir, dp_size=2) as srv:
        deployment = srv.deployment
        yield srv
    # shut down: the router and both ranks left on their own, status 0
    assert_actors_exited_cleanly([deployment.router_pid] + [i["pid"] for i in deployment.infos])


@pytest.fixture
def dp_oai(dp_server):
    return openai.OpenAI(base_url=dp_server.url + "/v1", api_key="unused", max_retries=0)


def _dp_idle(srv) -> list[dict]:
    """Every rank's stats once no rank holds a request (no time limit: pytest's)."""
    while True:
        stats = srv.client.rank_stats()
        if all(s.get("up") and s["num_running"] == 0 and s["num_waiting"] == 0 for s in stats):
            return stats
        time.sleep(0.05)


def _routed(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    pattern = r'^deepinfer:requests_routed_total{dp_rank="(\d)",model_name="[^"]+"} (\S+)$'
    return {rank: float(v) for rank, v in re.findall(pattern, text, re.M)}


def test_dp2_health_and_models(dp_server, dp_oai):
    health = httpx.get(dp_server.url + "/health").json()
    assert health["status"] == "ok" and [r["dp_rank"] for r in health["ranks"]] == [0, 1]
    assert [m.id for m in dp_oai.models.list().data] == [MODEL_NAME]


@pytest.mark.parametrize("stream", [False, True])
def test_dp2_completions_and_chat_equal_offline(dp_oai, offline, stream):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        r = dp_oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      stream=stream)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == want
    messages = [{"role": "user", "content": "Tell me a story."}]
    want = offline.chat(messages, greedy(), use_tqdm=False)[0]
    r = dp_oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=stream)
    text = "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
    assert text == want


def test_dp2_concurrent_requests_land_on_both_ranks(dp_server, offline):
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    expected = offline.generate(prompts, greedy(), use_tqdm=False)
    before = _routed(dp_server)

    async def run():
        aoai = openai.AsyncOpenAI(base_url=dp_server.url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*[aoai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS,
                                                            temperature=0, stream=False) for p in prompts])
        await aoai.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == expected
    after = _routed(dp_server)
    served = {rank: after.get(rank, 0) - before.get(rank, 0) for rank in ("0", "1")}
    assert served["0"] > 0 and served["1"] > 0 and sum(served.values()) == len(prompts)
    stats = _dp_idle(dp_server)
    assert [s["dp_rank"] for s in stats] == [0, 1] and all(s["generation_tokens"] > 0 for s in stats)


def test_dp2_disconnect_mid_stream_frees_kv_blocks(dp_server):
    before = _dp_idle(dp_server)
    body = {"model": MODEL_NAME, "prompt": [5] * 100, "max_tokens": 400, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.stream("POST", dp_server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: {") for _ in range(6))
    after = _dp_idle(dp_server)
    assert [s["num_free_blocks"] for s in after] == [s["num_free_blocks"] for s in before]
    generated = sum(a["generation_tokens"] - b["generation_tokens"] for a, b in zip(after, before, strict=True))
    assert generated < 400  # aborted on its rank, not run to the end


def test_dp2_a_seed_past_64_bits_is_a_json_400_and_leaves_nothing_in_flight(dp_server):
    """It used to reach msgspec in the router (a plain-text 500) and leave a phantom request."""
    body = {"model": MODEL_NAME, "prompt": "hi", "seed": 18446744073709551616, "temperature": 0.5}
    r = httpx.post(dp_server.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    health = httpx.get(dp_server.url + "/health").json()
    assert health["status"] == "ok" and [h["inflight"] for h in health["ranks"]] == [0, 0]
