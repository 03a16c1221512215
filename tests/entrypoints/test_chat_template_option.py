"""A chat template from the user for a model without one (a base GGUF file, a base checkpoint):
`LLM.chat(chat_template=...)` and `serve --chat-template`, a Jinja file or the template itself
as vLLM takes them; a clear error where there is neither."""

from __future__ import annotations

import argparse
import json
import shutil

import httpx
import pytest
from model_utils import CHAT_TEMPLATE, token_ids
from server_utils import ENGINE_OPTIONS, MODEL_NAME, served

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.config_file import ServerLimits
from deepinfer_dp.entrypoints.openai.launcher import add_serve_args, run_serve
from deepinfer_dp.utils.chat_template import load_chat_template

CHAT = [{"role": "user", "content": "Hello, world!"}]
# Another template than the model's: its prompt ids differ, so using it shows.
OTHER = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}assistant:"
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with its chat template taken out, as a base model comes."""
    path = tmp_path_factory.mktemp("base") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_a_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(OTHER)
    assert load_chat_template(str(path)) == OTHER
    assert load_chat_template(path) == OTHER
    assert load_chat_template(OTHER) == OTHER
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path, but it cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def base_llm(base_model_dir):
    llm = LLM(base_model_dir, decode_sequence=False, **ENGINE_OPTIONS)
    yield llm
    llm.shutdown()


def test_llm_chat_takes_a_template_for_a_model_without_one(base_llm, tmp_path):
    with pytest.raises(ValueError, match="has no chat template.*chat_template="):
        base_llm.chat(CHAT, GREEDY, use_tqdm=False)
    tok = base_llm.get_tokenizer()
    ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, chat_template=OTHER,
                                       return_dict=True)["input_ids"])
    expected = base_llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
    path = tmp_path / "chat.jinja"
    path.write_text(OTHER)
    for template in (OTHER, str(path)):
        out = base_llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=template)[0]
        assert out[-1].prompt_len == len(ids)
        assert token_ids([out]) == token_ids([expected])


def _chat(server) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2, "temperature": 0})


def test_server_chat_template_serves_a_model_without_one(base_model_dir):
    with served(base_model_dir) as server:
        r = _chat(server)
        assert r.status_code == 400 and "--chat-template" in r.text
    with served(base_model_dir, limits=ServerLimits(chat_template=CHAT_TEMPLATE)) as server:
        r = _chat(server)
        assert r.status_code == 200, r.text
        tokenized = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "messages": CHAT}).json()
        assert r.json()["usage"]["prompt_tokens"] == tokenized["count"]


def test_serve_refuses_an_unreadable_template_before_loading(base_model_dir, tmp_path):
    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--model", base_model_dir, "--chat-template", str(tmp_path / "missing.jinja")])
    with pytest.raises(SystemExit, match="looks like a file path"):
        run_serve(args)
