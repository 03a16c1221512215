"""Expert load balancing over Ray (LLM(dp_size=2)): the options reach the rank actors, the
ranks rebalance the skewed tiny Mixtral while serving round-robin prompts, the greedy tokens
equal DP=1's, and every rank reports the same switches and placement in rank_stats()."""

from __future__ import annotations

import time

import pytest
from dp_utils import EP_ENGINE, GREEDY, PROMPTS, token_ids
from eplb_utils import EPLB, dp1_token_ids, skewed_dir  # noqa: F401 (fixtures)


def _settled(llm, timeout_s: float = 20.0) -> list[dict]:
    """Every rank's stats once their step counts agree (a rank may run one step ahead)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.rank_stats()
        if len({s["generate_step"] for s in stats}) == 1 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


@pytest.mark.slow
def test_ray_eplb_equals_dp1(skewed_dir, dp1_token_ids, ray_cluster):  # noqa: F811
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(skewed_dir), decode_sequence=False, dp_size=2, enable_expert_parallel=True, enable_eplb=True,
              eplb_config=EPLB, dp_options={"collective_timeout_s": 10, "max_rank_restarts": 0}, **EP_ENGINE)
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
        rank0, rank1 = _settled(llm)
    finally:
        llm.shutdown()
    assert rank0["eplb_rebalances"] == rank1["eplb_rebalances"] >= 1
    assert rank0["eplb_switches"] == rank1["eplb_switches"]
    assert rank0["eplb_placement"] == rank1["eplb_placement"]
    assert rank0["eplb_balancedness_history"] == rank1["eplb_balancedness_history"]
    assert rank0["moe_local_experts"] == [0, 5] and rank1["moe_local_experts"] == [5, 10]
