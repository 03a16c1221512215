"""`deepinfer-dp serve org/name`, as a vLLM user starts it: the model found in the local Hugging
Face cache (HF_HUB_CACHE), at a revision, served under the id as given; a repo id that is not
in the cache stops the command with the cache it looked in and how to fetch the model."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
from hub_cache import add_snapshot
from model_utils import build_tiny_model, tiny_config, write_tiny_model
from server_utils import serve_command, stop_serve_command

REPO = "tiny-org/tiny-qwen2"


def _short_qwen2(vocab_size: int):
    config = tiny_config("qwen2-bias", vocab_size)
    config.max_position_embeddings = 256  # tells this snapshot from main's in /v1/models
    return config


@pytest.mark.slow
def test_serve_takes_a_repo_id_and_revision(tmp_path):
    add_snapshot(tmp_path / "hub", REPO, build_tiny_model("llama-gqa", tmp_path / "llama"), "a" * 40)
    add_snapshot(tmp_path / "hub", REPO, write_tiny_model(_short_qwen2, tmp_path / "qwen2"), "b" * 40, refs=("v2",))
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "DEEPINFER_DP_CACHE": str(tmp_path / "converted")}
    proc, url = serve_command(REPO, "--revision", "v2", "--kv-cache-memory-gb", "0.02", env=env)
    try:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        cards = [(m.id, m.model_extra["root"], m.model_extra["max_model_len"]) for m in oai.models.list().data]
        assert cards == [(REPO, REPO, 256)]
        done = oai.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert done.model == REPO and done.usage.completion_tokens == 3
    finally:
        code = stop_serve_command(proc)
    assert code == 0, proc.stderr.read()[-3000:]


def test_serve_names_a_missing_repo_id(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run([sys.executable, "-m", "deepinfer_dp.entrypoints.cli", "serve", "tiny-org/not-downloaded"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert str(tmp_path / "hub") in done.stderr and "hf download tiny-org/not-downloaded" in done.stderr
