"""/openapi.json tells the truth (statuses, content types, integer bounds, Allow on 405), and
schemathesis with every check finds nothing against a tiny-model server (dp 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai.protocol import INT64_MAX, INT64_MIN

CONFIG = Path(__file__).parent / "schemathesis.toml"
ST = Path(sys.executable).parent / "st"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tiny_model_dir(tmp_path_factory.mktemp("models")), max_model_len=256) as srv:
        yield srv


def test_the_schema_documents_what_the_routes_answer(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses) and "422" not in responses
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
    seed = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["type"], seed["minimum"], seed["maximum"]) == ("integer", INT64_MIN, INT64_MAX)
    model = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert model["enum"] == [MODEL_NAME]


@pytest.mark.parametrize("method, path, allow", [("TRACE", "/v1/models", "GET"), ("PUT", "/ping", "GET, POST"),
                                                 ("GET", "/v1/completions", "POST")])
def test_405_says_which_methods_are_allowed(server, method, path, allow):
    r = httpx.request(method, server.url + path)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    assert r.json()["error"]["message"]


def test_schemathesis_finds_nothing(server):
    """Every check, a bounded number of examples per route (about a minute here). The response
    time limit only catches a hang (schemathesis's 10 s default fails on a loaded machine, and
    the first grammar build imports llguidance's torch helpers, seconds once)."""
    run = subprocess.run([str(ST), "--config-file", str(CONFIG), "run", server.url + "/openapi.json",
                          "--checks", "all", "--max-response-time", "120", "--request-timeout", "120",
                          "--max-examples", "10", "--generation-deterministic", "--no-color"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert httpx.get(server.url + "/health").status_code == 200
