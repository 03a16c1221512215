"""`deepinfer-dp serve --api-server-count 2`: two API server processes on one port in front of
the router process, as a user starts it. Both answer (the kernel spreads the connections),
greedy results equal offline ones, /metrics adds up both processes' series, and SIGTERM ends
every process with status 0."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from server_utils import ENGINE_OPTIONS, serve_command, stop_serve_command, tiny_model_dir  # noqa: E402

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"Request number {i} says" for i in range(12)]


@pytest.mark.slow
def test_two_api_servers_share_a_port_and_the_router(tmp_path):
    model = tiny_model_dir(tmp_path / "models")
    offline = LLM(model, **ENGINE_OPTIONS)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    offline.shutdown()
    proc, url = serve_command("--config", str(ROOT / "configs" / "tiny_test.yaml"), "--model", model,
                              "--dp-size", "1", "--api-server-count", "2", "--served-model-name", "tiny",
                              "--kv-cache-memory-gb", "0.02", env={"RAY_AUTH_MODE": "disabled"})
    try:
        async def run() -> list[str]:
            aoai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            rs = await asyncio.gather(*[aoai.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0)
                                        for p in PROMPTS])
            await aoai.close()
            return [r.choices[0].text for r in rs]

        assert asyncio.run(run()) == expected
        assert httpx.get(url + "/v1/models").json()["data"][0]["root"] == model  # vLLM's card: the model argument
        text = httpx.get(url + "/metrics").text  # either process answers, with both processes' counts
        found = re.findall(r'^deepinfer:requests_total{model_name="tiny",status="length"} (\S+)$', text, re.M)
        assert [float(v) for v in found] == [len(PROMPTS)]
        assert re.search(r'^deepinfer:rank_up{dp_rank="0"} 1.0$', text, re.M)
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]
