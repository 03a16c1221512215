"""A DP rank that freezes (alive, but it stops stepping and answering): the survivor's vote
times out, the router's health check kills the frozen rank and fails its requests with
RankFailed, and the survivor re-forms a group of one and finishes its own requests."""

from __future__ import annotations

import os
import signal

import pytest
from dp_utils import first_ranks, outcome, submit_all

from deepinfer_dp.engine.client import RankFailed
from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture
def dp2(tiny_model_dir, ray_cluster):
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), dp_size=2, num_kv_blocks=64, torch_threads=1,
              dp_options={"collective_timeout_s": 5, "max_rank_restarts": 0})
    yield llm
    llm.shutdown()


def test_frozen_rank_is_detected_killed_and_the_survivor_finishes(dp2):
    router = dp2.dp.router
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    got = submit_all(router, "freeze", 4, long, [5, 6, 7, 8])
    ranks = first_ranks(got, timeout=60)  # both ranks are stepping
    assert sorted(ranks.values()) == [0, 0, 1, 1]
    frozen_pid = dp2.dp.deployment.infos[1]["pid"]
    os.kill(frozen_pid, signal.SIGSTOP)
    try:
        outcomes = {rid: outcome(q, timeout=180) for rid, q in got.items()}
    finally:
        try:
            os.kill(frozen_pid, signal.SIGCONT)  # if the router did not kill it, let shutdown do
        except ProcessLookupError:
            pass
    for rid, last in outcomes.items():
        if ranks[rid] == 1:
            assert isinstance(last, RankFailed) and "DP rank 1 died or stopped answering" in str(last)
        else:
            assert last.finished and last.output_len == 400
    assert [h["up"] for h in router.health()] == [True, False]
    assert router.group_failures >= 1  # the survivor's vote timed out and said so
    out = dp2.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1
