"""guidellm, unmodified, against a tiny-model server (dp 1): a short synchronous benchmark, then
a short throughput benchmark (4 streams), on synthetic prompts tokenized with the model's own
tokenizer. It sends vLLM's `stream_options.continuous_usage_stats` and failed on every request
before the server took it.

Both benchmarks run in one guidellm process (its `sweep` profile with two steps is exactly
synchronous, then throughput) and with one worker process each: each guidellm start-up
imports torch, transformers and datasets (about 9 s here under load), and each benchmark
spawns a manager and its workers, each of which imports guidellm again (about 5 s each; a
throughput run at concurrency 4 spawned 4 workers). Two runs with the default workers took
over 3 minutes on this machine."""

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


def test_guidellm_synchronous_then_throughput_without_errors(model_and_server, tmp_path):
    model, srv = model_and_server
    report = tmp_path / "report.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    run = subprocess.run([str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={srv.url},model={MODEL_NAME}",
                          "--profile", "kind=sweep,sweep_size=2,max_concurrency=4",
                          "--constraint", f"kind=max_requests,count={REQUESTS}",
                          "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
                          "--tokenizer", f"kind=huggingface_auto,model={model}",
                          "--output", f"kind=json,path={report}", "--disable-console-interactive"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmarks = json.loads(report.read_text())["benchmarks"]
    strategies = [(b["config"]["strategy"]["type_"], b["config"]["strategy"]["max_concurrency"]) for b in benchmarks]
    assert strategies == [("synchronous", 1), ("throughput", 4)], strategies
    for b in benchmarks:
        state = b["scheduler_state"]
        assert (state["successful_requests"], state["errored_requests"]) == (REQUESTS, 0), state
