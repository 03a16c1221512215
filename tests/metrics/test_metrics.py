"""/metrics: every rank's series (dp_rank label) and the server's histograms, scraped by a real
Prometheus started from monitoring/prometheus.yml; promtool checks of the config and the
alert rules; every metric the Grafana dashboard and the alerts query is one the server exports.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from server_utils import MODEL_NAME, served, tiny_model_dir  # noqa: E402

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
METRIC_NAME = re.compile(r"deepinfer:[A-Za-z0-9_:]+")
PROMETHEUS_WAIT_S = 120  # a generous bound on start-up plus a few scrapes: a hang guard, not a check
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="Prometheus is not installed (Debian: apt-get install -y prometheus)")


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def server(request, tmp_path_factory):
    """A served tiny model after two requests (round robin: one per rank at DP=2)."""
    if request.param > 1:
        request.getfixturevalue("ray_cluster")
    with served(tiny_model_dir(tmp_path_factory.mktemp("models")), dp_size=request.param) as srv:
        srv.dp_size = request.param
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0)
        list(oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=6, temperature=0, stream=True))
        yield srv


def exported_names(server) -> set[str]:
    text = httpx.get(server.url + "/metrics").text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in samples}


def _samples(text: str, name: str) -> dict[str, float]:
    """dp_rank -> value of the series `name` (label sets with a dp_rank)."""
    found = re.findall(rf'^{re.escape(name)}{{(?:[^}}]*,)?dp_rank="(\d+)"[^}}]*}} (\S+)$', text, re.M)
    return {rank: float(value) for rank, value in found}


RANK_SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_steps_total",
               "placeholder_steps_total", "generation_tokens_total", "prompt_tokens_total", "rank_up",
               "step_time_seconds_total", "allreduce_time_seconds_total", "prefix_cache_hits_total",
               "num_preemptions_total", "placeholder_step_time_seconds_total", "device_busy_seconds_total",
               "lockstep_votes_total")


def test_metrics_carry_rank_series_and_server_histograms(server):
    text = httpx.get(server.url + "/metrics").text
    ranks = {str(r) for r in range(server.dp_size)}
    for name in RANK_SERIES:
        assert set(_samples(text, "deepinfer:" + name)) == ranks, name
    assert all(v > 0 for v in _samples(text, "deepinfer:generation_tokens_total").values())
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):  # one per request
        assert sum(_samples(text, f"deepinfer:{name}_count").values()) == 2.0, name
    assert sum(_samples(text, "deepinfer:inter_token_latency_seconds_count").values()) > 0
    routed = _samples(text, "deepinfer:requests_routed_total")
    assert set(routed) == ranks and sum(routed.values()) == 2.0
    assert f'deepinfer:requests_total{{model_name="{MODEL_NAME}",status="length"}} 2.0' in text


def _queried_names(exprs: list[str]) -> set[str]:
    return {name for e in exprs for name in METRIC_NAME.findall(e)}


def test_dashboard_and_alerts_query_only_exported_metrics(server):
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    # the MoE panels' series exist with a MoE model only (tests/metrics/test_moe_metrics.py checks them),
    # the expert balancer's with EPLB on (test_eplb_metrics.py), the image panels' with a vision model
    # only (tests/multimodal/test_server_images.py)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])
             if not any(f"deepinfer:{kind}_" in t["expr"] for kind in ("moe", "eplb", "mm"))]
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    exprs_alerts = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    exported = exported_names(server)
    for source, names in (("dashboard", _queried_names(exprs)), ("alerts", _queried_names(exprs_alerts))):
        assert names, source
        missing = sorted(names - exported)
        assert not missing, f"{source} queries metrics the server does not export: {missing}"


@needs_prometheus
def test_promtool_checks_config_and_rules(tmp_path):
    for args in (["check", "config", str(MONITORING / "prometheus.yml")],
                 ["check", "rules", str(MONITORING / "alerts.yml")]):
        r = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prometheus_config(tmp_path: Path, target: str) -> Path:
    """monitoring/prometheus.yml aimed at the test's server, scraping every second."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [target]
    shutil.copy(MONITORING / "alerts.yml", tmp_path / "alerts.yml")
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _query(prom_url: str, expr: str) -> list[dict]:
    r = httpx.get(prom_url + "/api/v1/query", params={"query": expr}).json()
    assert r["status"] == "success", r
    return r["data"]["result"]


def _wait_for(fn, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + PROMETHEUS_WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited early while waiting for {what}"
        try:
            result = fn()
        except httpx.TransportError:
            result = None
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"prometheus never showed {what}")


@needs_prometheus
def test_real_prometheus_reads_per_rank_series(server, tmp_path):
    config = _prometheus_config(tmp_path, f"127.0.0.1:{server.port}")
    port = _free_port()
    data = tmp_path / "data"
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = f"http://127.0.0.1:{port}"
    try:
        ranks = [str(r) for r in range(server.dp_size)]
        _wait_for(lambda: httpx.get(prom + "/-/ready").status_code == 200, proc, "ready")
        running = _wait_for(lambda: _query(prom, "deepinfer:num_requests_running"), proc, "the rank series")
        assert sorted(s["metric"]["dp_rank"] for s in running) == ranks
        assert all(s["metric"]["job"] == "deepinfer-dp" for s in running)
        tokens = _query(prom, "deepinfer:generation_tokens_total")
        assert sorted(s["metric"]["dp_rank"] for s in tokens) == ranks
        assert all(float(s["value"][1]) >= 6 for s in tokens)  # each rank served a request
        assert [float(s["value"][1]) for s in _query(prom, "deepinfer:rank_up")] == [1.0] * len(ranks)
        steps = _query(prom, "max(deepinfer:engine_steps_total) - min(deepinfer:engine_steps_total)")
        assert [float(s["value"][1]) for s in steps] == [0.0]  # idle ranks in lockstep: the same step count
        ttft = _query(prom, "sum(deepinfer:time_to_first_token_seconds_count)")
        assert float(ttft[0]["value"][1]) == 2.0
        rules = httpx.get(prom + "/api/v1/rules").json()["data"]["groups"]
        names = {r["name"] for g in rules for r in g["rules"]}
        assert names >= {"DeepinferRankDown", "DeepinferKVCacheUsageHigh"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
