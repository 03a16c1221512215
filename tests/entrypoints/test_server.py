"""The OpenAI-compatible server over loopback, with the real `openai` client and httpx.

Greedy results must equal the offline LLM.generate / LLM.chat results token for token;
bad input gets OpenAI's error shape with the right status and the server keeps serving;
a client that disconnects mid-stream gets its request aborted and its KV blocks freed.
"""

import asyncio
import contextlib
import itertools
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from server_utils import (  # noqa: E402
    ENGINE_OPTIONS,
    MODEL_NAME,
    serve_command,
    served,
    stop_serve_command,
)

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Hello, world!", "The quick brown fox", "Data parallel ranks step", "What is the capital of"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(model_dir):
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL_NAME]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["ranks"][0]["dp_rank"] == 0 and health["ranks"][0]["up"]


def test_completions_equal_offline(oai, offline):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == MAX_TOKENS or r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == len(offline.get_tokenizer()(prompt).input_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completions_token_ids_and_batch_prompt(oai, offline):
    ids = [offline.get_tokenizer()(p).input_ids for p in PROMPTS]
    expected = offline.generate(prompt_token_ids=ids, sampling_params=greedy(), use_tqdm=False)
    r = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    r = oai.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == expected[0]


def test_streaming_completions_equal_offline(oai, offline):
    expected = offline.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        chunks = list(oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sse_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline_chat(oai, offline, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    want = offline.chat(messages, greedy(), use_tqdm=False)[0]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                    temperature=0, stream=stream)
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        text = r.choices[0].message.content
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == MAX_TOKENS
    assert text == want


def test_concurrent_requests_equal_offline(server, offline):
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = offline.generate(prompts, greedy(), use_tqdm=False)

    async def run():
        aoai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        rs = await asyncio.gather(*[aoai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS,
                                                            temperature=0) for p in prompts])
        await aoai.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(run()) == expected


def test_n_seed_and_sampling_knobs(oai):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=3,
              extra_body={"top_k": 20})
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 3 * 8


def test_stop_string_cuts_text_and_aborts(oai, offline, server):
    full = offline.generate([PROMPTS[0]], greedy(max_tokens=40), use_tqdm=False)[0]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = full[: full.index(stop)]
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                    stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want  # the stop string never leaks out
    _wait_idle(server)  # the stopped request was aborted on its rank


def test_logprobs(oai):
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=5, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert len(lp.tokens) == 5 and lp.text_offset[0] == 0  # per-token text: a byte may show as U+FFFD
    c = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=5, temperature=0, logprobs=True)
    assert len(c.choices[0].logprobs.content) == 5


def _post(server, body=None, content=None, headers=None):
    return httpx.post(server.url + "/v1/completions", json=body, content=content, headers=headers)


BAD_COMPLETIONS = [  # (body, status, words the message must hold)
    ({"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": MODEL_NAME, "prompt": [5, 400]}, 400, "outside the vocabulary"),
    ({"model": MODEL_NAME, "prompt": [-1, 5]}, 400, "outside the vocabulary"),
    ({"model": MODEL_NAME, "prompt": [5] * 600}, 400, "maximum context length"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 100000}, 400, "maximum context length"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "hi", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL_NAME, "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ({"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400, "n must be"),
    ({"model": MODEL_NAME, "prompt": "hi", "presence_penalty": 9}, 400, "presence_penalty"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": ""}, 400, "empty"),
    ({"model": MODEL_NAME, "prompt": []}, 400, "empty"),
    ({"model": MODEL_NAME, "prompt": "hi", "stop": [""]}, 400, "stop"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "status", "words"), BAD_COMPLETIONS)
def test_bad_input_matrix(server, body, status, words, stream):
    r = _post(server, {**body, "stream": stream})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_and_bad_chat(server, oai):
    json_header = {"content-type": "application/json"}
    r = _post(server, content=b'{"model": "tiny-llama", "prompt": ', headers=json_header)
    assert r.status_code == 400 and "Malformed JSON" in r.json()["error"]["message"]
    r = _post(server, content=b"[1, 2]", headers=json_header)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="messages"):
        oai.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi " * 600}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # ...and the server still serves afterwards
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def _wait_idle(server, since: dict | None = None):
    """The engine's stats once it is idle (no time limit: pytest's); with `since`, only stats
    published after more steps than those, so a snapshot from before a request never counts."""
    while True:
        s = server.client.rank_stats()[0]
        fresh = since is None or s["generate_step"] > since["generate_step"]
        if fresh and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        time.sleep(0.05)


@contextlib.contextmanager
def engine_paused_after(client, steps: int):
    """Holds the engine thread inside step() once `steps` steps ran, until the block exits; so a
    request is certainly in flight (holding KV blocks, unfinished) while the client leaves."""
    blocked, release = threading.Event(), threading.Event()
    real_step, count = client.engine.step, itertools.count()

    def step():
        if next(count) >= steps and not release.is_set():
            blocked.set()
            release.wait()
        return real_step()

    client.engine.step = step
    try:
        yield blocked
    finally:
        release.set()
        del client.engine.step  # back to the class's method


def _aborts(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(r'^deepinfer:requests_total{model_name="[^"]+",status="abort"} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _wait_for_abort(server, before: float) -> None:
    """Until the server has closed the request's stream (which queues the abort to the engine)."""
    while _aborts(server) == before:
        time.sleep(0.05)


LONG = {"model": MODEL_NAME, "prompt": [5] * 100, "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_kv_blocks(server):
    before, aborts = _wait_idle(server), _aborts(server)
    with engine_paused_after(server.client, steps=5) as blocked:
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200  # streaming began: the request produced its first token
            blocked.wait()  # the request is mid-generation, holding its KV blocks; now leave
        _wait_for_abort(server, aborts)
    after = _wait_idle(server, since=before)
    assert after["num_free_blocks"] == before["num_free_blocks"]
    assert after["generation_tokens"] - before["generation_tokens"] < 400  # aborted, not run to the end


def test_disconnect_without_streaming_aborts_too(server):
    before, aborts = _wait_idle(server), _aborts(server)
    body = json.dumps(LONG).encode()
    with engine_paused_after(server.client, steps=5) as blocked:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        blocked.wait()
        sock.close()  # the client leaves before the answer
        _wait_for_abort(server, aborts)
    after = _wait_idle(server, since=before)
    assert after["num_free_blocks"] == before["num_free_blocks"]
    assert after["generation_tokens"] - before["generation_tokens"] < 400


def test_api_key(model_dir):
    with served(model_dir, api_key="sekret") as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        r = good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open for probes


def test_503_when_no_rank_can_take_work(model_dir):
    with served(model_dir) as srv:
        srv.client.shutdown()  # the only rank is gone
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").json()["status"] == "down"


def test_serve_command_with_a_config_file(model_dir):
    """`python -m deepinfer_dp.entrypoints.openai.launcher --config ...` (what `deepinfer-dp serve`
    runs): a config file, flags on top, the server answering on 127.0.0.1."""
    root = Path(__file__).resolve().parents[2]
    proc, url = serve_command("--config", str(root / "configs" / "tiny_test.yaml"), "--model", model_dir,
                              "--dp-size", "1", "--served-model-name", "cli-model")
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = oai.completions.create(model="cli-model", prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]  # SIGTERM: a clean exit
