"""A DP rank that freezes (alive, but it stops stepping and answering): the survivor's vote
times out, the router's health check kills the frozen rank and fails its requests with
RankFailed, and the survivor re-forms a group of one and finishes its own requests."""

from __future__ import annotations

import os
import queue
import signal

import pytest
from dp_utils import collect_outcomes

from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture
def dp2(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(tiny_model_dir), dp_size=2, num_kv_blocks=64, torch_threads=1,
              dp_options={"collective_timeout_s": 5})
    yield llm
    llm.shutdown()


def test_frozen_rank_is_detected_killed_and_the_survivor_finishes(dp2):

    engine = dp2.llm_engine
    router = engine.router
    got: queue.Queue = queue.Queue()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    ranks = [router.submit(f"freeze-{i}", [5, 6, 7, 8], long, got.put) for i in range(4)]
    assert sorted(ranks) == [0, 0, 1, 1]
    assert not isinstance(got.get(timeout=60), Exception)  # both ranks are stepping
    frozen_pid = engine.ranks.infos[1]["pid"]
    os.kill(frozen_pid, signal.SIGSTOP)
    try:
        failed, finished = collect_outcomes(got, 4, timeout=180)
    finally:
        try:
            os.kill(frozen_pid, signal.SIGCONT)  # if the router did not kill it, let shutdown do
        except ProcessLookupError:
            pass
    assert len(failed) == 2 and all("DP rank 1 died or stopped answering" in m for m in failed)
    assert sorted(finished) == sorted(f"freeze-{i}" for i, r in enumerate(ranks) if r == 0)
    assert router.group_failures >= 1  # the survivor's vote timed out and said so
    assert [h["up"] for h in router.health()] == [True, False]
    out = dp2.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out) == 1
