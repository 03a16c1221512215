"""guidellm, unmodified, against a tiny-model server (dp 1): a short synchronous run and a
short throughput run on synthetic prompts, tokenized with the model's own tokenizer. It sends
vLLM's `stream_options.continuous_usage_stats` and failed on every request before the server
took it. Slow: guidellm's start-up alone takes tens of seconds a run on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

GUIDELLM = Path(sys.executable).parent / "guidellm"
REQUESTS = 8


@pytest.fixture(scope="module")
def model_and_server(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("models"))
    with served(model, max_model_len=256) as srv:
        yield model, srv


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["kind=synchronous", "kind=throughput,max_concurrency=4"])
def test_guidellm_runs_without_errors(model_and_server, tmp_path, profile):
    model, srv = model_and_server
    report = tmp_path / "report.json"
    run = subprocess.run([str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={srv.url},model={MODEL_NAME}",
                          "--profile", profile, "--constraint", f"kind=max_requests,count={REQUESTS}",
                          "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                          "--tokenizer", f"kind=huggingface_auto,model={model}",
                          "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    state = json.loads(report.read_text())["benchmarks"][0]["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"]) == (REQUESTS, 0), state
