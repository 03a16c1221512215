"""Sampling defaults from the model's generation_config.json (EngineConfig.generation_config):
"auto" takes the fields the file sets, "vllm" none, a folder that folder's file; a request
that leaves a field unset gets the model's value, offline, over HTTP and in the CLI."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL_NAME, served

from deepinfer_dp import LLM
from deepinfer_dp.engine.sampling_defaults import checked_sampling_defaults, sampling_defaults
from deepinfer_dp.entrypoints.cli import GENERATE_MAX_TOKENS, _sampling_params
from deepinfer_dp.sampling_params import SamplingParams

OPTIONS = {"kv_cache_memory_gb": 0.02, "seed": 0}
MODEL_DEFAULTS = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 5, "do_sample": True, "num_beams": 1}


def _with_generation_config(src: Path, dst: Path, values: dict) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, **values}))
    return str(dst)


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory) -> str:
    return _with_generation_config(tiny_model_dir, tmp_path_factory.mktemp("gen") / "m", MODEL_DEFAULTS)


def test_only_the_sampling_fields_the_file_sets_are_taken(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**MODEL_DEFAULTS, "top_p": None}))
    assert sampling_defaults("auto", tmp_path) == {"temperature": 0.0, "top_k": 7, "max_tokens": 5}
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults(str(tmp_path), "/elsewhere") == {"temperature": 0.0, "top_k": 7, "max_tokens": 5}
    assert sampling_defaults("auto", tmp_path / "none") == {}  # no file: neutral
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path / "none"), tmp_path)


def test_a_default_no_request_may_have_is_refused_at_start(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 5.0}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        checked_sampling_defaults("auto", tmp_path)


def test_offline_defaults_come_from_the_model(model_with_defaults):
    llm = LLM(model_with_defaults, decode_sequence=False, **OPTIONS)
    try:
        params = llm.get_default_sampling_params()
        assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 7, 5)
        runs = [llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False)[0] for _ in range(2)]
        assert len(runs[0]) == 5 or runs[0][-1].finish_reason == "stop"
        tokens = [[t for o in run for t in o.token_ids] for run in runs]
        assert tokens[0] == tokens[1]  # the model's temperature 0
    finally:
        llm.shutdown()
    neutral = LLM(model_with_defaults, generation_config="vllm", **OPTIONS)
    try:
        assert neutral.get_default_sampling_params() == SamplingParams()
    finally:
        neutral.shutdown()


def test_fields_a_client_does_not_send_take_the_models_defaults(model_with_defaults):
    base = {"model": MODEL_NAME, "prompt": [1, 2, 3], "ignore_eos": True}
    with served(model_with_defaults, **OPTIONS) as server:
        r = httpx.post(server.url + "/v1/completions", json=base, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 5  # max_new_tokens, not the API's 16
        again = httpx.post(server.url + "/v1/completions", json=base, timeout=120).json()
        assert again["choices"][0]["text"] == r["choices"][0]["text"]  # the model's temperature 0
        sent = httpx.post(server.url + "/v1/completions", json={**base, "max_tokens": 2}, timeout=120).json()
        assert sent["usage"]["completion_tokens"] == 2
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).json()
        assert r["usage"]["completion_tokens"] == 5


class _FakeLLM:
    def __init__(self, defaults: dict) -> None:
        self.sampling_defaults = defaults

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)


def _cli_args(**given) -> argparse.Namespace:
    fields = ("max_tokens", "temperature", "top_p", "top_k", "sampling_seed", "stop")
    return argparse.Namespace(**{f: given.get(f) for f in fields})


def test_the_cli_starts_from_the_models_defaults_and_applies_its_flags():
    params = _sampling_params(_cli_args(), _FakeLLM({"temperature": 0.3, "top_p": 0.8}))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.3, 0.8, GENERATE_MAX_TOKENS)
    params = _sampling_params(_cli_args(temperature=0.0, max_tokens=9), _FakeLLM({"temperature": 0.3,
                                                                                 "max_tokens": 40}))
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 1.0, 9)
    assert _sampling_params(_cli_args(), _FakeLLM({"max_tokens": 40})).max_tokens == 40
