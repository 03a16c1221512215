"""Data parallel: lockstep step counts, placeholder steps, DP outputs equal to DP=1 token for
token, under torchrun and under Ray; the wave protocol's race; a dead rank turning into a
clear error (the vote) and RankFailed (the router) while the survivors keep serving."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dp_utils import collect_outcomes

from deepinfer_dp.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# Eight prompts of different lengths; max_num_seqs=2 makes the busy rank take many steps.
PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.",
           "What is 2 + 2?", "List three colors.", "Once upon a time",
           "Explain data parallelism in one sentence, please, and be brief.", "Hi"]
MAX_TOKENS = 8
ENGINE = dict(num_kv_blocks=64, max_num_seqs=2, torch_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _ids(results) -> list[list[int]]:
    return [[t for o in outs for t in o.token_ids] for outs in results]


@pytest.fixture(scope="module")
def dp1_token_ids(tiny_model_dir) -> list[list[int]]:
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), decode_sequence=False, **ENGINE)
    ids = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.shutdown()
    return ids


# ---- the vote on its own: a dead or stuck peer -----------------------------------------
def _vote_then_fail(rank: int, port: int, mode: str, out, release) -> None:
    import torch

    from deepinfer_dp.distributed import Lockstep, LockstepError, init_dp_groups

    lockstep = Lockstep(init_dp_groups(rank, 2, "127.0.0.1", port, torch.device("cpu"), timeout_s=5))
    for i in range(1000):
        if rank == 1 and i == 3:
            if mode == "die":
                os._exit(1)
            release.wait(120)  # stuck: alive, but never votes again
            os._exit(0)
        try:
            lockstep.vote(rank == 0)
        except LockstepError as e:
            out.put(str(e))
            return
    out.put("no error")


@pytest.mark.parametrize("mode", ["die", "stuck"])
def test_dead_or_stuck_peer_makes_the_vote_raise(mode):
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_vote_then_fail, args=(r, store.port, mode, out, release)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        message = out.get(timeout=120)
    finally:
        release.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert "DP rank 0 of 2" in message and "peer rank(s) [1]" in message
    assert "collective timeout 5s" in message and "re-form" in message


# ---- torchrun -----------------------------------------------------------------------------
def _torchrun(model_dir: Path, shard_sizes: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "torchrun_generate.py"), "--model", str(model_dir),
           "--shard-sizes", shard_sizes, "--max-tokens", str(MAX_TOKENS), "--num-kv-blocks", "64",
           "--max-num-seqs", "2", "--output", str(out), "--prompts-file", str(out.with_suffix(".txt"))]
    out.with_suffix(".txt").write_text("\n".join(PROMPTS) + "\n")
    # Its own process group, so a timeout ends torchrun's rank processes too, not only torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("shard_sizes", ["8,0", "7,1"])
def test_torchrun_lockstep(tiny_model_dir, dp1_token_ids, tmp_path, shard_sizes):
    result = _torchrun(tiny_model_dir, shard_sizes, tmp_path / "out.json")
    assert result["token_ids"] == dp1_token_ids
    rank0, rank1 = result["rank_stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["placeholder_steps"] > rank0["placeholder_steps"]
    if shard_sizes == "8,0":
        assert rank1["prompt_tokens"] == 0
        assert rank1["placeholder_steps"] == rank1["generate_step"]


# ---- Ray: one cluster for the tests below (start-up is the slow part) -------------------------
class FirstToRank0:
    """The first `n` requests to rank 0, the rest to rank 1."""

    def __init__(self, n: int) -> None:
        self.left = n

    def choose(self, prompt_token_ids, load) -> int:
        self.left -= 1
        return 0 if self.left >= 0 else 1


@pytest.fixture(scope="module")
def ray_llm(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), decode_sequence=False, dp_size=2,
              dp_options={"collective_timeout_s": 10}, **ENGINE)
    yield llm
    llm.shutdown()


def _steps(llm, timeout_s: float = 20.0) -> list[tuple[int, int]]:
    """(steps, placeholder steps) of every rank once their step counts agree: a rank that has
    work may run one step ahead of its peer's vote, so right after the last output arrives
    one rank may not have taken its final step yet. A real mismatch never settles."""
    deadline = time.monotonic() + timeout_s
    while True:
        steps = [(s["generate_step"], s["placeholder_steps"]) for s in llm.rank_stats()]
        if len({n for n, _ in steps}) == 1 or time.monotonic() > deadline:
            return steps
        time.sleep(0.05)


@pytest.mark.parametrize("first_to_rank0", [8, 7])
def test_ray_lockstep(ray_llm, dp1_token_ids, first_to_rank0):
    before = _steps(ray_llm)
    ray_llm.llm_engine.router.policy = FirstToRank0(first_to_rank0)
    assert _ids(ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
    (steps0, ph0), (steps1, ph1) = [(s - s0, p - p0) for (s, p), (s0, p0) in zip(_steps(ray_llm), before,
                                                                                 strict=True)]
    assert steps0 == steps1 > 0
    assert ph1 > ph0
    if first_to_rank0 == 8:
        assert ph1 == steps1


def test_ray_round_robin_and_results_in_prompt_order(ray_llm, dp1_token_ids):
    from deepinfer_dp.cluster.policies import RoundRobin

    ray_llm.llm_engine.router.policy = RoundRobin()
    results = ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(results) == dp1_token_ids
    assert [outs[-1].dp_rank for outs in results] == [0, 1] * 4


def test_ray_bad_prompt_is_a_clear_error_and_n_and_text_work(ray_llm):
    from deepinfer_dp.cluster.policies import RoundRobin

    engine = ray_llm.llm_engine
    engine.router.policy = RoundRobin()
    with pytest.raises(ValueError, match=r"prompt 1: request \d+: token id 99999 outside the vocabulary"):
        ray_llm.generate(prompt_token_ids=[[5, 6], [5, 99999]], sampling_params=GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    both = ray_llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                            sampling_params=SamplingParams(n=2, temperature=0.0, max_tokens=4))
    assert len(both) == 1 and len(both[0]) == 2 and _ids(both[0])[0] == _ids(both[0])[1]
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
    from deepinfer_dp.cluster.policies import RoundRobin

    router = ray_llm.llm_engine.router
    router.policy = RoundRobin()
    failures = router.group_failures
    waves = _settled_waves(ray_llm)
    done: queue.Queue = queue.Queue()
    for i in range(60):
        params = SamplingParams(temperature=0.0, max_tokens=1 + i % 3)
        router.submit(f"race-{i}", [5, 6, 7], params, done.put)
        while True:
            item = done.get(timeout=60)
            assert not isinstance(item, Exception), item
            if item.finished:
                break
        if i % 4 == 3:
            time.sleep(0.001 * (i % 7))  # land in different phases of the wave's end
    stats = ray_llm.rank_stats()
    assert router.group_failures == failures
    assert all(s["up"] for s in stats)
    # The waves really ended between requests, and both ranks ran the same waves.
    after = _settled_waves(ray_llm)
    assert after[0] - waves[0] == after[1] - waves[1] > 5


def _settled_waves(llm, timeout_s: float = 20.0) -> list[int]:
    """Every rank's waves_run once the ranks agree. A rank counts a wave when it leaves it,
    after the final vote, so right after the last output arrives a rank may not have yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        waves = [s["waves_run"] for s in llm.rank_stats()]
        if len(set(waves)) == 1 or time.monotonic() > deadline:
            return waves
        time.sleep(0.05)


def test_engine_client_stream_and_early_close_aborts(ray_llm):
    router = ray_llm.llm_engine.router

    async def run() -> tuple[list, int]:
        deltas = [d async for d in router.generate("stream-1", [5, 6, 7], GREEDY)]
        stream = router.generate("stream-2", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        return deltas, sum(len(r.inflight) for r in router.ranks)

    deltas, inflight = asyncio.run(run())
    assert deltas[-1].finished and sum(len(d.token_ids) for d in deltas) == MAX_TOKENS
    assert inflight == 0
    assert [h["up"] for h in router.health()] == [True, True]


def test_killed_rank_fails_its_requests_and_the_survivor_keeps_serving(ray_llm, dp1_token_ids):
    """Runs last in this module: it kills rank 1 of the shared cluster."""
    from deepinfer_dp.cluster.policies import RoundRobin

    engine = ray_llm.llm_engine
    router = engine.router
    router.policy = RoundRobin()
    got: queue.Queue = queue.Queue()
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    ranks = [router.submit(f"kill-{i}", [5, 6, 7, 8], long, got.put) for i in range(4)]
    first = got.get(timeout=60)  # rank work has started
    assert not isinstance(first, Exception)
    engine.ranks.kill(1)
    failed, finished = collect_outcomes(got, 4, timeout=120)
    assert len(failed) == ranks.count(1) and all("DP rank 1 died or stopped answering" in m for m in failed)
    assert sorted(finished) == sorted(f"kill-{i}" for i, r in enumerate(ranks) if r == 0)
    assert [h["up"] for h in router.health()] == [True, False]
    # The survivor re-formed a group of one and serves new requests.
    assert _ids(ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids


# ---- small parts: policies and the wire format ------------------------------------------------
def test_policies_pick_among_the_ranks_that_are_up():
    from deepinfer_dp.cluster.policies import LeastLoaded, PrefixAffinity, RoundRobin, make_policy

    rr = RoundRobin()
    assert [rr.choose([1], {0: 0, 2: 0}) for _ in range(4)] == [0, 2, 0, 2]  # rank 1 is down
    assert LeastLoaded().choose([1], {0: 3, 1: 1, 2: 1}) == 1
    affinity = PrefixAffinity(prefix_len=4, slack=2)
    home = affinity.choose([9, 9, 9, 9, 1], {0: 0, 1: 0})
    assert affinity.choose([9, 9, 9, 9, 2], {0: 0, 1: 0}) == home  # same prefix, same rank
    assert affinity.choose([9, 9, 9, 9, 3], {home: 5, 1 - home: 0}) == 1 - home  # too busy: elsewhere
    with pytest.raises(ValueError, match="unknown router policy"):
        make_policy("fastest")


def test_wire_format_is_msgpack_structs_only():
    import msgspec

    from deepinfer_dp.cluster import protocol as p

    params = SamplingParams(temperature=0.5, top_k=3, stop=["x"], max_tokens=7)
    msg = p.rank_decoder.decode(p.encoder.encode(p.AddRequest("7", [1, 2], p.params_to_wire(params))))
    assert p.params_from_wire(msg.params) == params
    with pytest.raises(msgspec.ValidationError):  # anything but the declared messages is refused
        p.rank_decoder.decode(p.encoder.encode({"type": "Exec", "code": "import os"}))
    with pytest.raises(ValueError):  # the rank validates the params again
        p.params_from_wire({**p.params_to_wire(params), "temperature": -1.0})
