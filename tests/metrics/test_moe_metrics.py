"""Expert parallelism online: the OpenAI server over two Ray ranks serving a tiny Qwen2-MoE
with EP answers exactly as the offline DP=1 engine; the rank without a request ran
placeholder steps and its experts computed its peer's tokens, which /metrics shows per (rank,
layer, expert) along with the MoE collective time; the Grafana panels' MoE queries (expert
imbalance max/mean, tokens per expert per step, collective share) name exported series and
are valid PromQL (promtool)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from moe_utils import build_tiny_moe
from server_utils import MODEL_NAME, served

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9, 30, 77, 12, 13, 90, 4, 5, 6, 7, 8, 200, 201], [300]]
ENGINE = dict(max_num_batched_tokens=8, max_num_seqs=2)  # chunked prefill of the longer prompts


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(build_tiny_moe("qwen2-moe", tmp_path_factory.mktemp("ep_server") / "qwen2-moe"))


@pytest.fixture(scope="module")
def ep_server(moe_dir):
    with served(moe_dir, dp_size=2, enable_expert_parallel=True, **ENGINE) as srv:
        yield srv


def test_ep_server_answers_like_offline_dp1(ep_server, moe_dir):
    llm = LLM(moe_dir, kv_cache_memory_gb=0.02, **ENGINE)
    try:
        expected = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(temperature=0, max_tokens=10),
                                use_tqdm=False)
    finally:
        llm.shutdown()
    oai = openai.OpenAI(base_url=ep_server.url + "/v1", api_key="unused", max_retries=0)
    got = [oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0).choices[0].text]
    # One request so far: the rank that did not get it ran only placeholder steps, and its
    # experts computed the other rank's tokens.
    idle = [s for s in ep_server.client.rank_stats() if s["prompt_tokens"] == 0]
    assert len(idle) == 1 and idle[0]["placeholder_steps"] > 0
    assert sum(map(sum, idle[0]["moe_expert_tokens"])) > 0
    got += [oai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=10, temperature=0).choices[0].text
            for p in PROMPTS[1:]]
    assert got == expected


def _series(text: str, name: str) -> list[tuple[dict, float]]:
    out = []
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def test_metrics_show_expert_load_per_rank_layer_and_expert(ep_server):
    oai = openai.OpenAI(base_url=ep_server.url + "/v1", api_key="unused", max_retries=0)
    oai.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    text = httpx.get(ep_server.url + "/metrics").text
    tokens = _series(text, "deepinfer:moe_expert_tokens_total")
    # layer 1 of this model is dense; each rank exports its own four experts of layers 0 and 2
    assert {(s["dp_rank"], s["layer"], s["expert"]) for s, _ in tokens} == {
        (str(r), str(layer), str(e)) for r in (0, 1) for layer in (0, 2) for e in range(4 * r, 4 * r + 4)}
    assert sum(v for s, v in tokens if s["dp_rank"] == "1") > 0  # the idle rank's experts worked
    assert all(v > 0 for _, v in _series(text, "deepinfer:moe_collective_time_seconds_total"))
    shares = [v for _, v in _series(text, "deepinfer:moe_collective_share")]
    assert len(shares) == 2 and all(0 < v < 1 for v in shares)
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "deepinfer:moe_" in t["expr"]]
    assert any("max by (layer)" in e for e in exprs), "no expert imbalance panel"
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line[0] == "#"}
    assert {n for e in exprs for n in re.findall(r"deepinfer:[A-Za-z0-9_:]+", e)} <= exported


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Prometheus is not installed")
def test_moe_panel_queries_are_valid_promql(tmp_path):
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "deepinfer:moe_" in t["expr"]]
    rules = {"groups": [{"name": "moe", "rules": [{"record": f"moe:check{i}", "expr": e}
                                                  for i, e in enumerate(exprs)]}]}
    path = tmp_path / "moe_rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
