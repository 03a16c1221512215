"""No request can break the server's engine: a value the engine cannot use is refused before
anything is queued (400, the server keeps serving), a failure while processing one request
fails that request only (500, the other requests finish token-identical), and a failure of
the engine loop itself stops the server, so a supervisor sees the process end."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
from server_utils import ENGINE_OPTIONS, MODEL_NAME, served  # noqa: E402

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Hello, world!", "The quick brown fox", "Data parallel ranks step", "What is the capital of"]
BAD_SEED = {"model": MODEL_NAME, "prompt": "hi", "seed": 18446744073709551616, "temperature": 0.5}


def test_a_seed_past_64_bits_is_refused_and_the_engine_keeps_serving(model_dir):
    """Before the fix the sequence was queued in C++, make_generator raised, and the next
    step's KeyError ended the engine thread: every later request got 503."""
    with served(model_dir) as srv:
        for _ in range(2):
            r = httpx.post(srv.url + "/v1/completions", json=BAD_SEED)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "seed" and "9223372036854775807" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/completions", json={**BAD_SEED, "seed": 2**63 - 1, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        assert srv.client.rank_stats()[0]["num_running"] == 0


def test_a_failure_in_one_requests_post_processing_fails_that_request_only(model_dir):
    offline = LLM(model_dir, **ENGINE_OPTIONS)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    offline.shutdown()
    with served(model_dir) as srv:
        engine = srv.client.engine
        real = engine._check_stop_strings

        def failing_for_the_poisoned_prompt(out):
            if engine.requests[out.request_id].params.seed == 4242:
                raise RuntimeError("injected post-processing failure")
            return real(out)

        engine._check_stop_strings = failing_for_the_poisoned_prompt

        async def run():
            aoai = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            poisoned = aoai.completions.create(model=MODEL_NAME, prompt="poison", max_tokens=12, seed=4242,
                                               extra_body={"ignore_eos": True})
            good = [aoai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0)
                    for p in PROMPTS]
            results = await asyncio.gather(poisoned, *good, return_exceptions=True)
            await aoai.close()
            return results

        bad, *good = asyncio.run(run())
        assert isinstance(bad, openai.InternalServerError) and "injected post-processing failure" in str(bad)
        assert [r.choices[0].text for r in good] == expected
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        stats = srv.client.rank_stats()[0]
        assert stats["requests_failed"] == 1 and stats["num_running"] == 0
        assert stats["num_free_blocks"] == stats["num_usable_blocks"]  # its blocks were freed


def test_a_dead_engine_loop_fails_its_requests_and_stops_the_server(model_dir):
    with served(model_dir) as srv:
        def broken_step():
            raise RuntimeError("injected step failure")

        srv.client.engine.step = broken_step
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 503 and "injected step failure" in r.json()["error"]["message"]
        srv._thread.join(timeout=30)  # the server stops by itself: `serve` then exits with status 1
        assert not srv._thread.is_alive() and "injected step failure" in str(srv.died[0])
