"""The vote interval (dp_vote_interval K) through whole engines: two ranks, each an LLMEngine
with its Lockstep and the StepLoop every front end runs, in two processes; requests arrive at
chosen passes of each wave (one mid-interval, one on a cluster that is idle between waves).
With K = 4 the outputs are those of K = 1 (and of DP=1), both ranks take the same steps in
every wave, a wave lasts a multiple of K steps and at most K-1 steps longer than at K = 1, and
the votes are one per K steps plus the wave's last; under expert parallelism the idle rank's
placeholder steps keep meeting its peer in every MoE layer."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import time
from pathlib import Path

import pytest
from dp_utils import ENGINE, EP_ENGINE, GREEDY, PROMPTS, token_ids

# Per wave, per rank: {pass of the wave: [(request id, prompt index)]}. Wave 0: rank 0 starts
# with three prompts, rank 1 gets one at pass 2 (between two votes at K = 4). Wave 1: the
# cluster was idle; one request on rank 1 only, rank 0 steps placeholders throughout.
WAVES = [
    ({0: [("a", 0), ("b", 1), ("c", 2)]}, {2: [("d", 3)]}),
    ({}, {0: [("e", 6)]}),
]


def _rank(rank: int, port: int, model: str, interval: int, engine_options: dict, out) -> None:
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.distributed import destroy_dp_groups, init_dp_groups
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.engine.step_loop import StepLoop

    config = EngineConfig(model=model, dp_size=2, dp_rank=rank, dp_vote_interval=interval, **engine_options)
    engine = LLMEngine(config)
    engine.join_dp_group(init_dp_groups(rank, 2, "127.0.0.1", port, engine.device, timeout_s=60))
    loop = StepLoop(engine)
    tokens: dict[str, list[int]] = {}
    steps = []
    for wave in WAVES:
        arrivals, passes = wave[rank], itertools.count()

        def take_work(arrivals=arrivals, passes=passes) -> None:
            for rid, prompt in arrivals.get(next(passes), []):
                engine.add_request(PROMPTS[prompt], GREEDY, request_id=rid)

        def on_outputs(outputs: list) -> None:
            for delta in engine.to_deltas(outputs):
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)

        before = engine.generate_step
        loop.run(on_outputs, take_work)
        steps.append(engine.generate_step - before)
    stats = loop.stats()
    engine.lockstep.close()
    engine.shutdown()
    destroy_dp_groups()
    out.put((rank, tokens, steps, stats))


def _run(model: Path, interval: int, engine_options: dict) -> list[tuple]:
    """Both ranks' (rank, tokens by request, steps per wave, stats), rank 0 first."""
    from deepinfer_dp.distributed.groups import serve_store

    store = serve_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, str(model), interval, engine_options, out))
             for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return sorted((out.get(timeout=240) for _ in procs), key=lambda r: r[0])
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def _check_interval(model: Path, engine_options: dict, expected: dict[str, list[int]] | None) -> None:
    k = 4
    base, spaced = _run(model, 1, engine_options), _run(model, k, engine_options)
    for ranks in (base, spaced):
        (_, tokens0, steps0, stats0), (_, tokens1, steps1, stats1) = ranks
        assert steps0 == steps1 and all(s > 0 for s in steps0)  # every wave, the same steps on both ranks
        assert stats0["lockstep_votes"] == stats1["lockstep_votes"]
        assert sorted(tokens0) == ["a", "b", "c"] and sorted(tokens1) == ["d", "e"]
        if expected is not None:
            assert {**tokens0, **tokens1} == expected
    assert {**base[0][1], **base[1][1]} == {**spaced[0][1], **spaced[1][1]}
    steps_k1, steps_k = base[0][2], spaced[0][2]
    for one, many in zip(steps_k1, steps_k, strict=True):
        assert many % k == 0 and 0 <= many - one <= k - 1, (steps_k1, steps_k)
    assert spaced[0][3]["lockstep_votes"] == sum(s // k + 1 for s in steps_k)
    assert base[0][3]["lockstep_votes"] == sum(s + 1 for s in steps_k1)
    assert spaced[0][3]["passes_without_vote"] == sum(s - s // k for s in steps_k)
    extra = sum(steps_k) - sum(steps_k1)  # after each wave's last work: placeholder steps on every rank
    for r in range(2):
        assert spaced[r][3]["placeholder_steps"] - base[r][3]["placeholder_steps"] == extra


@pytest.mark.slow
def test_vote_interval_dense(tiny_model_dir, dp1_token_ids):
    expected = {rid: dp1_token_ids[i] for wave in WAVES for side in wave for got in side.values()
                for rid, i in got}
    _check_interval(tiny_model_dir, ENGINE, expected)


@pytest.mark.slow
def test_vote_interval_expert_parallel(tmp_path_factory):
    """Rank 1 holds half the experts and is idle for most of wave 0: with K = 4 its
    placeholder steps between votes still enter every MoE exchange of rank 0's steps."""
    from moe_utils import build_tiny_moe

    model = build_tiny_moe("qwen2-moe", tmp_path_factory.mktemp("vote-ep") / "qwen2-moe")
    _check_interval(model, {**EP_ENGINE, "enable_expert_parallel": True}, None)


@pytest.mark.slow
def test_vote_interval_under_ray(tiny_model_dir, dp1_token_ids, ray_cluster):
    """The Ray ranks with K = 4: the DP=1 outputs over both ranks, then one request on an idle
    cluster (a new wave, one rank working); every wave ends at a voting step, so each rank's
    steps are a multiple of 4, the same on both ranks."""
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), decode_sequence=False, dp_size=2, dp_vote_interval=4,
              dp_options={"max_rank_restarts": 0}, **ENGINE)  # the default timeout: see test_dp_structured_output
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
        waves = _settled(llm)[0]["waves_run"]
        assert token_ids(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == dp1_token_ids[:1]
        stats = _settled(llm, waves + 1)
        assert stats[0]["generate_step"] == stats[1]["generate_step"] and stats[0]["generate_step"] % 4 == 0
        assert stats[0]["lockstep_votes"] == stats[1]["lockstep_votes"]
        assert [s["dp_vote_interval"] for s in stats] == [4, 4]
    finally:
        llm.shutdown()


def _settled(llm, waves: int = 0, timeout_s: float = 30.0) -> list[dict]:
    """Every rank's stats once both counted `waves` waves or more and their step counts agree
    (a rank counts a wave after its final vote, a moment after the last output arrives)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.rank_stats()
        if len({s["generate_step"] for s in stats}) == 1 and len({s["waves_run"] for s in stats}) == 1 \
                and stats[0]["waves_run"] >= waves or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
