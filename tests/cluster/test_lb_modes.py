"""vLLM's hybrid and external load-balancing modes (docs/lb_modes.md) on loopback: separately
started `deepinfer-dp serve` processes that form one lockstep group, each endpoint serving
only its own ranks. They answer the same requests as internal mode (one endpoint over Ray
ranks) with the same text, and the lockstep and waves span the servers: with every request
sent to one endpoint, every rank took the same number of steps and the idle ones' steps were
placeholders, visible at their own endpoint's /metrics."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from lb_utils import PROMPTS, check_lockstep, complete, internal_mode_texts, server_group, texts

from deepinfer_dp.config_file import ConfigError, parse_config


@pytest.fixture(scope="module")
def internal_texts(model_dir, ray_cluster) -> list[str]:
    return internal_mode_texts(model_dir)


@pytest.mark.slow
def test_external_mode_serves_like_internal_and_steps_in_lockstep(model_dir, tmp_path, internal_texts):
    per_server = [["--data-parallel-size", "2", "--data-parallel-rank", str(r)] for r in range(2)]
    with server_group(model_dir, tmp_path, per_server) as servers:
        assert texts(servers[0]) == internal_texts  # everything to rank 0's endpoint
        check_lockstep(servers, busy={0})
        refused = complete(servers[0], "hi", data_parallel_rank=1)  # rank 1 is the other endpoint's
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
        assert texts(servers[1]) == internal_texts
        second = set(range(local, 2 * local))
        check_lockstep(servers, busy=second)
        pinned = complete(servers[1], PROMPTS[0], data_parallel_rank=2 * local - 1)
        assert pinned.status_code == 200 and pinned.json()["choices"][0]["text"] == internal_texts[0]
        refused = complete(servers[1], PROMPTS[0], data_parallel_rank=0)  # the first node's
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
        failed = complete(servers[0], PROMPTS[0])
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
