"""vLLM's hybrid and external load-balancing modes (docs/lb_modes.md) on loopback: separately
started `deepinfer-dp serve` processes that form one lockstep group, each endpoint serving
only its own ranks. They answer the same requests as internal mode (one endpoint over Ray
ranks) with the same text, and the lockstep and waves span the servers: with every request
sent to one endpoint, every rank took the same number of steps and the idle ones' steps were
placeholders, visible at their own endpoint's /metrics."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from lb_utils import server_group
from server_utils import MODEL_NAME, served

from deepinfer_dp.config_file import ConfigError, parse_config

PROMPTS = ["Hello, world!", "The quick brown fox", "Data parallel ranks step", "What is the capital of"]
MAX_TOKENS = 8


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, **extra}, timeout=120)


def _texts(url: str) -> list[str]:
    answers = [_complete(url, prompt) for prompt in PROMPTS]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    return [r.json()["choices"][0]["text"] for r in answers]


@pytest.fixture(scope="module")
def internal_texts(model_dir, ray_cluster) -> list[str]:
    """The reference: internal mode, one endpoint whose router places requests on 2 Ray ranks."""
    with served(model_dir, dp_size=2) as srv:
        return _texts(srv.url)


def _rank_counters(servers) -> tuple[dict[int, float], dict[int, float]]:
    """(steps, placeholder steps) per rank, each read at the endpoint that serves it."""
    steps, placeholders = {}, {}
    for s in servers:
        own_steps, own_placeholders = s.metric("engine_steps_total"), s.metric("placeholder_steps_total")
        assert set(own_steps) == set(own_placeholders) and not set(own_steps) & set(steps)  # its ranks only
        steps |= own_steps
        placeholders |= own_placeholders
    return steps, placeholders


def _check_lockstep(servers, busy: set[int], settle_s: float = 20.0) -> None:
    """Every rank stepped as often as the others; a rank that had no request stepped only
    placeholders, reported by its own endpoint (the busy rank's few are its waves' ends).
    Right after the last answer a rank may not have taken the wave's final step yet: the
    counts are read until they agree (a real mismatch never does)."""
    deadline = time.monotonic() + settle_s
    steps, placeholders = _rank_counters(servers)
    while len(set(steps.values())) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        steps, placeholders = _rank_counters(servers)
    assert len(set(steps.values())) == 1 and next(iter(steps.values())) > 0, steps
    for rank, n in placeholders.items():
        assert n < steps[rank] if rank in busy else n == steps[rank], placeholders


@pytest.mark.slow
def test_external_mode_serves_like_internal_and_steps_in_lockstep(model_dir, tmp_path, internal_texts):
    per_server = [["--data-parallel-size", "2", "--data-parallel-rank", str(r)] for r in range(2)]
    with server_group(model_dir, tmp_path, per_server) as servers:
        assert _texts(servers[0].url) == internal_texts  # everything to rank 0's endpoint
        _check_lockstep(servers, busy={0})
        refused = _complete(servers[0].url, "hi", data_parallel_rank=1)  # rank 1 is the other endpoint's
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "data_parallel_rank"
        health = [httpx.get(s.url + "/health").json() for s in servers]
        assert [[r["dp_rank"] for r in h["ranks"]] for h in health] == [[0], [1]]


@pytest.mark.slow
@pytest.mark.parametrize("local", [1, 2], ids=["2x1", "2x2"])
def test_hybrid_mode_two_nodes_serves_like_internal_and_steps_in_lockstep(model_dir, tmp_path, internal_texts,
                                                                          local):
    """Two "nodes" of `local` ranks each; every request goes to the second node's endpoint,
    whose router spreads them over its own ranks only."""
    per_server = [["--dp-size", str(2 * local), "--data-parallel-hybrid-lb", "--data-parallel-size-local",
                   str(local), "--data-parallel-start-rank", str(node * local)] for node in range(2)]
    with server_group(model_dir, tmp_path, per_server) as servers:
        assert _texts(servers[1].url) == internal_texts
        second = set(range(local, 2 * local))
        _check_lockstep(servers, busy=second)
        pinned = _complete(servers[1].url, PROMPTS[0], data_parallel_rank=2 * local - 1)
        assert pinned.status_code == 200 and pinned.json()["choices"][0]["text"] == internal_texts[0]
        refused = _complete(servers[1].url, PROMPTS[0], data_parallel_rank=0)  # the first node's
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "data_parallel_rank"


@pytest.mark.slow
def test_a_server_that_dies_breaks_the_group_and_the_others_stop_with_a_clear_error(model_dir, tmp_path):
    """A group of separately started servers cannot re-form without a member: the survivor's
    next wave fails its request with a 503 that says so, and it exits with status 1 for its
    supervisor to restart the group."""
    per_server = [["--dp-size", "2", "--data-parallel-rank", str(r), "--router-collective-timeout-s", "5"]
                  for r in range(2)]
    with server_group(model_dir, tmp_path, per_server, expected_codes=[1, -signal.SIGKILL]) as servers:
        os.killpg(servers[1].proc.pid, signal.SIGKILL)  # the server and its rank
        servers[1].proc.wait()
        failed = _complete(servers[0].url, PROMPTS[0])
        assert failed.status_code == 503, failed.text
        assert "the DP group broke" in failed.json()["error"]["message"]
        assert servers[0].proc.wait(timeout=60) == 1


@pytest.mark.parametrize(("flags", "words"), [
    ({"data_parallel": {"rank": 2}, "dp_size": 2}, "below dp_size=2"),
    ({"data_parallel": {"rank": 0, "hybrid_lb": True, "size_local": 1, "start_rank": 0}}, "exclude each other"),
    ({"data_parallel": {"hybrid_lb": True, "size_local": 1}}, "needs size_local and start_rank"),
    ({"data_parallel": {"start_rank": 1}}, "hybrid_lb's"),
    ({"data_parallel": {"hybrid_lb": True, "size_local": 2, "start_rank": 1}, "dp_size": 2}, "below dp_size=2"),
])
def test_impossible_layouts_are_refused_by_name(flags, words):
    with pytest.raises(ConfigError, match="data_parallel") as e:
        parse_config(flags)
    assert words in str(e.value)


def test_the_servers_of_a_group_need_its_shared_secret(tmp_path):
    from deepinfer_dp.cluster.lb_node import group_key

    with pytest.raises(ValueError, match="--data-parallel-key-file"):
        group_key(None, "auto")
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        group_key(str(short), "auto")
    secret = tmp_path / "dp.key"
    secret.write_text("0123456789abcdef0123\n")
    a, b = group_key(str(secret), "auto"), group_key(str(secret), "on")
    assert a.publics == b.publics and a.secrets == b.secrets  # two servers, the same keys
    assert len(set(a.publics.values())) == 3 and group_key(None, "off") is None
