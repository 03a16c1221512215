"""Data parallel under Ray: rank actors behind the router process. Lockstep step counts and
placeholder steps, outputs equal to DP=1 token for token and in prompt order, the wave
protocol's race, streaming and early close, and a dead rank turning into RankFailed for its
requests while the survivor keeps serving. The data plane authenticates its peers here (forced
on for loopback), so all of this also runs over CURVE and a peer without the key is refused.
(The router's logic on its own, without Ray, is tests/cluster/test_router.py.)"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from dp_utils import (
    ENGINE,
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    first_ranks,
    listening_off_loopback,
    outcome,
    submit_all,
    token_ids,
)

from deepinfer_dp.engine.client import RankFailed
from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ray_llm(tiny_model_dir, ray_cluster):
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), decode_sequence=False, dp_size=2,
              dp_options={"collective_timeout_s": 10, "max_rank_restarts": 0, "data_plane_auth": "on"}, **ENGINE)
    assert llm.llm_engine is None and llm.dp.dp_size == 2  # the engines are in the rank actors
    yield llm
    llm.shutdown()


def _settled(llm, key: str, timeout_s: float = 20.0) -> list:
    """Every rank's `key` counters once their step counts agree: a rank that has work may run
    one step ahead of its peer's vote, and counts a wave after its final vote, so right after
    the last output arrives a rank may not have taken its final step yet. A real mismatch
    never settles."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.rank_stats()
        if len({s["generate_step"] for s in stats}) == 1 and len({s["waves_run"] for s in stats}) == 1 \
                or time.monotonic() > deadline:
            return [s[key] if isinstance(key, str) else tuple(s[k] for k in key) for s in stats]
        time.sleep(0.05)


def test_ray_lockstep_and_results_in_prompt_order(ray_llm, dp1_token_ids):
    """Round robin spreads the prompts; both ranks take the same number of steps."""
    before = _settled(ray_llm, ("generate_step", "placeholder_steps"))
    results = ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert token_ids(results) == dp1_token_ids
    served_by = [outs[-1].dp_rank for outs in results]
    assert sorted(served_by) == [0, 0, 0, 0, 1, 1, 1, 1]
    after = _settled(ray_llm, ("generate_step", "placeholder_steps"))
    steps = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    assert steps[0] == steps[1] > MAX_TOKENS


def test_an_idle_rank_runs_placeholder_steps(ray_llm, dp1_token_ids):
    before = _settled(ray_llm, ("generate_step", "placeholder_steps"))
    (outs,) = ray_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert token_ids([outs]) == dp1_token_ids[:1]
    busy = outs[-1].dp_rank
    after = _settled(ray_llm, ("generate_step", "placeholder_steps"))
    (steps0, ph0), (steps1, ph1) = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    assert steps0 == steps1 >= MAX_TOKENS
    idle_steps, idle_placeholders = (steps1, ph1) if busy == 0 else (steps0, ph0)
    assert idle_placeholders == idle_steps  # the idle rank stepped along, every step a placeholder


def test_a_pinned_rank_serves_every_request_and_a_missing_one_is_refused(ray_llm, dp1_token_ids):
    results = ray_llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, data_parallel_rank=1)
    assert token_ids(results) == dp1_token_ids[:3]
    assert [outs[-1].dp_rank for outs in results] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"data_parallel_rank 2 does not exist here: this LLM's DP ranks are \[0, 1\]"):
        ray_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, data_parallel_rank=2)


def test_ray_bad_prompt_is_a_clear_error_and_n_and_text_work(ray_llm):
    with pytest.raises(ValueError, match=r"prompt 1: token id 99999 at position 1 is outside the vocabulary"):
        ray_llm.generate(prompt_token_ids=[[5, 6], [5, 99999]], sampling_params=GREEDY, use_tqdm=False)
    assert sum(h["inflight"] for h in ray_llm.dp.router.health()) == 0  # nothing was half-submitted
    both = ray_llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                            sampling_params=SamplingParams(n=2, temperature=0.0, max_tokens=4))
    assert len(both) == 1 and len(both[0]) == 2 and token_ids(both[0])[0] == token_ids(both[0])[1]
    ray_llm.decode_sequence = True
    try:
        text = ray_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    finally:
        ray_llm.decode_sequence = False
    assert all(isinstance(t, str) for t in text) and len(text) == 2


def test_requests_arriving_while_a_wave_ends(ray_llm):
    """Each request is sent the moment the previous one finished, i.e. while the ranks are
    leaving the wave: with the wrong protocol a rank steps into a wave alone and the vote
    times out. Every request must finish and no vote may fail."""
    router = ray_llm.dp.router
    router.health()
    failures = router.group_failures
    waves = _settled(ray_llm, "waves_run")
    for i in range(60):
        got = submit_all(router, f"race{i}", 1, SamplingParams(temperature=0.0, max_tokens=1 + i % 3), [5, 6, 7])
        last = outcome(got[f"race{i}-0"], timeout=60)
        assert not isinstance(last, Exception), last
        if i % 4 == 3:
            time.sleep(0.001 * (i % 7))  # land in different phases of the wave's end
    assert all(h["up"] for h in router.health())
    assert router.group_failures == failures
    after = _settled(ray_llm, "waves_run")  # the waves really ended between requests, on both ranks
    assert after[0] - waves[0] == after[1] - waves[1] > 5


def test_engine_client_stream_and_early_close_aborts(ray_llm):
    router = ray_llm.dp.router

    async def run() -> list:
        deltas = [d async for d in router.generate("stream-1", [5, 6, 7], GREEDY)]
        stream = router.generate("stream-2", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        return deltas

    deltas = asyncio.run(run())
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == MAX_TOKENS
    deadline = time.monotonic() + 20
    while sum(h["inflight"] for h in router.health()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(h["up"], h["inflight"]) for h in router.health()] == [(True, 0), (True, 0)]


def test_ray_ranks_and_router_refuse_a_peer_without_the_cluster_key(ray_llm, dp1_token_ids):
    """A plain ZeroMQ peer sends a request and a Shutdown to each rank actor and to the
    router: the handshake fails, nothing arrives, and the cluster serves on at full size."""
    import zmq

    from deepinfer_dp.cluster import protocol as p

    deployment = ray_llm.dp.deployment
    assert deployment.key is not None
    ctx = zmq.Context()
    socks = []
    try:
        for address in [deployment.frontend, *(i["address"] for i in deployment.rank_infos())]:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(address)
            for msg in (p.AddRequest("intruder", [5, 6], {}, "intruder"), p.Shutdown()):
                sock.send(p.encoder.encode(msg))
            socks.append(sock)
        time.sleep(2)
        assert token_ids(ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
        assert [(h["up"], h["inflight"]) for h in ray_llm.dp.router.health()] == [(True, 0), (True, 0)]
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


def test_ray_and_the_deployment_listen_on_loopback_only(ray_llm):
    """GCS, raylet, agents, workers (the router and the ranks among them) and this driver:
    no listening socket on another address (the psutil view of `ss -ltnp`). The private Ray
    instance was started by this process, so all of them descend from it."""
    import ray

    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray_llm.dp.router is not None  # the deployment is up: router and rank actors
    assert listening_off_loopback([os.getpid()]) == []


def test_killed_rank_fails_its_requests_and_the_survivor_keeps_serving(ray_llm, dp1_token_ids):
    """Runs last in this module: it kills rank 1 of the shared cluster."""
    router = ray_llm.dp.router
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    got = submit_all(router, "kill", 4, long, [5, 6, 7, 8])
    ranks = first_ranks(got, timeout=60)  # every request is running
    assert sorted(ranks.values()) == [0, 0, 1, 1]
    ray_llm.dp.deployment.kill_rank(1)
    for rid, q in got.items():
        last = outcome(q, timeout=120)
        if ranks[rid] == 1:
            assert isinstance(last, RankFailed) and "DP rank 1 died or stopped answering" in str(last)
        else:
            assert last.finished and last.finish_reason == "length" and last.output_len == 300
    assert [h["up"] for h in router.health()] == [True, False]
    # The survivor re-formed a group of one and serves new requests.
    assert token_ids(ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids


EXIT_WITHOUT_SHUTDOWN = """
import sys
from deepinfer_dp import LLM, SamplingParams
llm = LLM(sys.argv[1], dp_size=2, torch_threads=1, num_kv_blocks=64)
print(llm.generate(["hello", "world"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
# no llm.shutdown(): the router and the ranks are stopped at exit all the same
"""


@pytest.mark.slow
def test_a_driver_that_exits_without_shutdown_exits_cleanly(tiny_model_dir, tmp_path):
    script = tmp_path / "no_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
