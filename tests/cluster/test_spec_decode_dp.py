"""Speculative decoding at DP=2 under Ray: both ranks draft and verify, the outputs equal
DP=1 without speculation token for token, and the ranks stay in lockstep (a speculative
step is one step; an idle rank's placeholder step carries the draft padding)."""

from __future__ import annotations

import time

import pytest
from dp_utils import ENGINE, PROMPTS, token_ids

from deepinfer_dp.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Drafting on every step (no auto-off of either kind): both ranks must verify drafts.
ALWAYS = {"disable_by_batch_size": None, "disable_by_acceptance": None}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2, **ALWAYS}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_dp2_speculation_on_both_ranks_matches_dp1(tiny_model_dir, ray_cluster, method):
    from deepinfer_dp.entrypoints.llm import LLM

    # draft_model: the target drafting for itself, each rank with its own draft cache
    spec = SPEC if method == "ngram" else {"method": "draft_model", "model": str(tiny_model_dir),
                                           "num_speculative_tokens": 3, **ALWAYS}

    dp1 = LLM(str(tiny_model_dir), decode_sequence=False, **ENGINE)
    want = token_ids(dp1.generate(PROMPTS, PARAMS, use_tqdm=False))
    dp1.shutdown()
    # The default collective timeout: no rank is killed here, and a group broken by a starved
    # rank would leave the step counts one apart (tests/cluster/test_dp_structured_output.py).
    llm = LLM(str(tiny_model_dir), decode_sequence=False, dp_size=2, speculative_config=spec, **ENGINE)
    try:
        results = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert token_ids(results) == want
        assert sorted(outs[-1].dp_rank for outs in results) == [0, 0, 0, 0, 1, 1, 1, 1]
        deadline = time.monotonic() + 20  # a rank may be one step ahead of its peer's vote
        while True:
            stats = llm.rank_stats()
            if len({s["generate_step"] for s in stats}) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats[0]["generate_step"] == stats[1]["generate_step"]
        for s in stats:
            assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_num_draft_tokens"] > 0
            if method == "draft_model":
                assert s["spec_decode_acceptance_rate"] == 1.0
        # (the random tiny model seldom continues its own n-grams, so few or no drafts are
        # accepted here: acceptance itself is checked at DP=1, tests/engine/test_spec_decode_engine.py)
    finally:
        llm.shutdown()
