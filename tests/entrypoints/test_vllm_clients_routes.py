"""vLLM's utility routes (/v1/models/{id}, /tokenize, /detokenize, /version, /ping, /docs)
with the `openai` client and httpx, at dp 1 and behind the router (dp 2), and the names a
model is served under (--served-model-name, default: the model argument as given)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import httpx
import openai
import pytest
from hub_cache import add_snapshot
from server_utils import ENGINE_OPTIONS, MODEL_NAME, served

import deepinfer_dp
from deepinfer_dp.config_file import load_config
from deepinfer_dp.entrypoints.openai.launcher import (
    DEFAULT_MODEL_NAMES,
    ServerThread,
    add_serve_args,
    make_local_client,
    model_root,
    served_names,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


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
    ("/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"num_crops": 4}}, 400, "mm_processor_kwargs"),
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


def test_several_served_model_names(model_dir):
    client = make_local_client(model_dir, "first", **ENGINE_OPTIONS)
    with _serve(client, ["first", "second/alias"]) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in oai.models.list().data] == ["first", "second/alias"]
        assert oai.models.retrieve("second/alias").id == "second/alias"
        done = oai.completions.create(model="second/alias", prompt="Hi", max_tokens=2)
        assert done.model == "first"  # answers carry the first name, as vLLM's
        with pytest.raises(openai.NotFoundError):
            oai.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)


def test_the_model_argument_as_given_is_its_name(model_dir, tmp_path, monkeypatch):
    """A model given as a Hugging Face repo id (found in the local Hugging Face cache) is served
    under that id, as vLLM does; no --served-model-name needed. Its /v1/models cards name it
    as their root, with or without served names."""
    repo_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    add_snapshot(tmp_path / "hub", repo_id, Path(model_dir), "0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    names = served_names(None, repo_id)
    assert names == [repo_id]
    client = make_local_client(repo_id, names[0], **ENGINE_OPTIONS)
    with _serve(client, names + ["alias"], model_root(repo_id)) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert oai.chat.completions.create(model=repo_id, messages=CHAT, max_tokens=2).model == repo_id
        cards = [(m.id, m.model_extra["root"], m.model_extra["parent"]) for m in oai.models.list().data]
        assert cards == [(repo_id, repo_id, None), ("alias", repo_id, None)]
        assert oai.models.retrieve("alias").model_extra["root"] == repo_id


@pytest.mark.parametrize("argv, names", [
    ([], DEFAULT_MODEL_NAMES),
    (["some/dir"], ["some/dir"]),
    (["some/dir", "--served-model-name", "a", "b"], ["a", "b"]),
])
def test_served_model_name_flag(argv, names):
    args = add_serve_args(argparse.ArgumentParser()).parse_args(argv)
    deployment = load_config(args, model=args.model_path)
    assert served_names(deployment.server.served_model_name, deployment.model) == names
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in DEFAULT_MODEL_NAMES
    assert model_root(deployment.model) == (deployment.model or "HuggingFaceTB/SmolLM2-135M-Instruct")


@contextlib.contextmanager
def _serve(client, names: list[str], root: str | None = None):
    server = ServerThread(client, names, model_root=root).start()
    try:
        yield server.url
    finally:
        server.stop()
        client.shutdown()
