"""vLLM's hybrid and external load-balancing modes (docs/lb_modes.md) on loopback: separately
started `deepinfer-dp serve` processes that form one lockstep group, each endpoint serving
only its own ranks. They answer the same requests as internal mode (one endpoint over Ray
ranks) with the same text, and the lockstep and waves span the servers: with every request
sent to one endpoint, every rank took the same number of steps and the idle ones' steps were
placeholders, visible at their own endpoint's /metrics."""

from __future__ import annotations

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


def _check_lockstep(servers, busy_rank: int) -> None:
    """Every rank stepped as often as the others; a rank that had no request stepped only
    placeholders, reported by its own endpoint (the busy rank's few are its waves' ends)."""
    steps, placeholders = {}, {}
    for s in servers:
        own_steps, own_placeholders = s.metric("engine_steps_total"), s.metric("placeholder_steps_total")
        assert set(own_steps) == set(own_placeholders) and not set(own_steps) & set(steps)  # its ranks only
        steps |= own_steps
        placeholders |= own_placeholders
    assert len(set(steps.values())) == 1 and next(iter(steps.values())) > 0, steps
    for rank, n in placeholders.items():
        assert n < steps[rank] if rank == busy_rank else n == steps[rank], placeholders


@pytest.mark.slow
def test_external_mode_serves_like_internal_and_steps_in_lockstep(model_dir, tmp_path, internal_texts):
    per_server = [["--data-parallel-size", "2", "--data-parallel-rank", str(r)] for r in range(2)]
    with server_group(model_dir, tmp_path, per_server) as servers:
        assert _texts(servers[0].url) == internal_texts  # everything to rank 0's endpoint
        _check_lockstep(servers, busy_rank=0)
        refused = _complete(servers[0].url, "hi", data_parallel_rank=1)  # rank 1 is the other endpoint's
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "data_parallel_rank"
        health = [httpx.get(s.url + "/health").json() for s in servers]
        assert [[r["dp_rank"] for r in h["ranks"]] for h in health] == [[0], [1]]


@pytest.mark.slow
def test_hybrid_mode_two_nodes_serves_like_internal_and_steps_in_lockstep(model_dir, tmp_path, internal_texts):
    per_server = [["--dp-size", "2", "--data-parallel-hybrid-lb", "--data-parallel-size-local", "1",
                   "--data-parallel-start-rank", str(node)] for node in range(2)]
    with server_group(model_dir, tmp_path, per_server) as servers:
        assert _texts(servers[1].url) == internal_texts  # everything to the second node's endpoint
        _check_lockstep(servers, busy_rank=1)
        pinned = _complete(servers[1].url, PROMPTS[0], data_parallel_rank=1)
        assert pinned.status_code == 200 and pinned.json()["choices"][0]["text"] == internal_texts[0]


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
