"""vLLM's utility routes (/v1/models/{id}, /tokenize, /detokenize, /version, /ping, /docs)
with the `openai` client and httpx, at dp 1 and behind the router (dp 2)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

import deepinfer_dp

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def server(model_dir):
    with served(model_dir) as srv:
        yield srv


def _check_routes(url: str) -> None:
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    card = oai.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        oai.models.retrieve("no-such/model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

    r = httpx.post(url + "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello, world!",
                                            "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0 and body["max_model_len"] > 0
    back = httpx.post(url + "/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello, world!"}

    # The chat form counts exactly the prompt tokens a chat completion runs.
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}).json()
    done = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    assert chat["count"] == done.usage.prompt_tokens

    assert httpx.get(url + "/version").json() == {"version": deepinfer_dp.__version__}
    for method in ("GET", "POST"):
        ping = httpx.request(method, url + "/ping")
        assert ping.status_code == 200 and ping.content == b""


def test_routes_at_dp1(server):
    _check_routes(server.url)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ x }}"}, 400, "chat_template"),
])
def test_utility_refusals_name_the_field(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_docs_is_fastapis_swagger_page(server):
    r = httpx.get(server.url + "/docs")
    assert r.status_code == 200 and "swagger-ui" in r.text and "/openapi.json" in r.text


def test_routes_behind_the_router(model_dir, ray_cluster):
    with served(model_dir, dp_size=2) as srv:
        _check_routes(srv.url)
