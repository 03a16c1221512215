"""/health tells the truth about a frozen rank (DP=2 over Ray): idle ranks are "ok" however long
they idle, and once a request is in flight a rank stopped with SIGSTOP is reported "stalled"
(503) after server.stall_timeout_s, before the router's liveness check (10 s) would kill it;
after SIGCONT the request finishes and /health is "ok" again."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from server_utils import MODEL_NAME, served, tiny_model_dir

from deepinfer_dp.entrypoints.openai.admission import ServerLimits
from deepinfer_dp.entrypoints.openai.server import _judged

STALL_S = 1.0
BODY = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def test_judged_states():
    assert _judged({"dp_rank": 0, "up": False, "step_age_s": None}, 1.0)["state"] == "down"
    assert _judged({"dp_rank": 0, "up": True, "step_age_s": None}, 1.0)["state"] == "ok"  # idle
    assert _judged({"dp_rank": 0, "up": True, "step_age_s": 0.5}, 1.0)["state"] == "ok"
    stalled = _judged({"dp_rank": 1, "up": True, "step_age_s": 2.5, "reason": ""}, 1.0)
    assert stalled["state"] == "stalled" and "DP rank 1" in stalled["reason"] and "2.5s" in stalled["reason"]
    assert _judged({"dp_rank": 0, "up": True}, 1.0)["state"] == "ok"  # a dp 1 engine reports no age


def _health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=None)
    return r.status_code, r.json()


@pytest.mark.slow
def test_sigstopped_rank_is_reported_stalled(tmp_path, ray_cluster):
    model = tiny_model_dir(tmp_path / "models")
    with served(model, dp_size=2, limits=ServerLimits(stall_timeout_s=STALL_S)) as srv:
        assert httpx.post(srv.url + "/v1/completions", json=BODY, timeout=None).status_code == 200
        time.sleep(2 * STALL_S)  # idle for longer than the limit: not a stall
        code, health = _health(srv.url)
        assert code == 200 and health["status"] == "ok"
        assert [r["step_age_s"] for r in health["ranks"]] == [None, None]

        pid = srv.deployment.rank_infos()[1]["pid"]
        result: dict = {}
        os.kill(pid, signal.SIGSTOP)
        try:
            worker = threading.Thread(target=lambda: result.setdefault(
                "r", httpx.post(srv.url + "/v1/completions", json=BODY, timeout=None)))
            worker.start()
            while (seen := _health(srv.url))[1]["status"] != "stalled":  # no time limit: pytest's
                assert seen[1]["status"] == "ok", seen  # never "down" meanwhile: the rank is alive
                time.sleep(0.05)
        finally:
            os.kill(pid, signal.SIGCONT)
        worker.join()
        code, health = seen
        assert code == 503
        frozen = health["ranks"][1]
        assert frozen["state"] == "stalled" and frozen["up"] and frozen["step_age_s"] > STALL_S
        assert f"limit {STALL_S:g}s" in frozen["reason"]
        r = result["r"]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        while (seen := _health(srv.url))[1]["status"] != "ok":
            time.sleep(0.05)
        assert seen[0] == 200 and [r["restarts"] for r in seen[1]["ranks"]] == [0, 0]  # nobody was killed
