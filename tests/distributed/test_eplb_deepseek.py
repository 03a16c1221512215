"""Expert load balancing on DeepSeek end to end: the tiny DeepSeek-V3 (MLA, a shared expert,
noaux_tc routing over 4 groups of 2 experts, top-2; layer 0 dense) with its router skewed
onto experts 2 and 3 (rank 0's at start), DP=2 with EP under torchrun, 2 redundant slots,
rebalances forced at chosen steps (the first in the middle of a chunked prefill). The greedy
tokens equal those of the same run without the balancer and DP=1's; both ranks switched both
MoE layers at the same steps and agree on the placement; the balancedness rises clearly."""

from __future__ import annotations

import pytest
from deepseek_utils import build_tiny_deepseek
from dp_utils import EP_ENGINE
from eplb_utils import HOT, LONG, dp1_ids, skew_router, step_kinds, torchrun_traced

PROMPTS = [f"{LONG}, one.", "Hello, my name is", "What is 2 + 2?", "Hi",
           f"{LONG}, two.", "List three colors.", "Once upon a time", "The capital of France is"]
MAX_TOKENS = 8
FORCE = [3, 8, 12]
EPLB = {"window_size": 5, "step_interval": 10**6, "num_redundant_experts": 2, "force_steps": FORCE}
EP = {**EP_ENGINE, "enable_expert_parallel": True}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(the skewed tiny DeepSeek-V3, the DP=1 greedy token ids of PROMPTS)."""
    model_dir = build_tiny_deepseek("v3", tmp_path_factory.mktemp("eplb_ds") / "v3")
    skew_router(model_dir, HOT, 3.0, bias=1.0)
    return model_dir, dp1_ids(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.slow
def test_deepseek_with_eplb_equals_without_and_dp1(case, tmp_path):
    model_dir, dp1 = case
    off = torchrun_traced(model_dir, tmp_path / "off.json", PROMPTS, "4,4", EP, MAX_TOKENS, nproc=2)
    on = torchrun_traced(model_dir, tmp_path / "on.json", PROMPTS, "4,4",
                         {**EP, "enable_eplb": True, "eplb_config": EPLB}, MAX_TOKENS, nproc=2)
    assert off["token_ids"] == dp1
    assert on["token_ids"] == dp1
    rank0, rank1 = on["rank_stats"]
    assert rank0["moe_layers"] == [1, 2]
    assert rank0["eplb_switches"] == rank1["eplb_switches"]
    assert rank0["eplb_switches"][:2] == [[3, 1, 1], [4, 2, 1]], rank0["eplb_switches"]
    assert rank0["eplb_placement"] == rank1["eplb_placement"] != [list(range(8)) + [0, 1]] * 2
    assert rank0["eplb_moved_bytes"] + rank1["eplb_moved_bytes"] > 0
    assert all("chunk" in step_kinds(trace)[3] for trace in on["traces"])  # rank's first switch: mid-prefill
    history = rank0["eplb_balancedness_history"]
    assert history == rank1["eplb_balancedness_history"]
    assert history[0][1] < 0.8 and history[-1][1] > history[0][1] + 0.1, history


@pytest.mark.slow
def test_deepseek_mtp_drafting_with_eplb_equals_dp1(tmp_path_factory, tmp_path):
    """With MTP drafting (K = 2) the decoder's experts move while the next-n layer's stay in
    their static split, dispatched over the same group."""
    model_dir = build_tiny_deepseek("v3", tmp_path_factory.mktemp("eplb_ds_mtp") / "v3-nextn", with_nextn=True)
    skew_router(model_dir, HOT, 3.0, bias=1.0)
    dp1 = dp1_ids(model_dir, PROMPTS, MAX_TOKENS)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    on = torchrun_traced(model_dir, tmp_path / "on.json", PROMPTS, "4,4",
                         {**EP, "enable_eplb": True, "eplb_config": EPLB, "speculative_config": mtp},
                         MAX_TOKENS, nproc=2)
    assert on["token_ids"] == dp1
    rank0, rank1 = on["rank_stats"]
    assert rank0["eplb_switches"] == rank1["eplb_switches"] and rank0["eplb_rebalances"] >= 1
    assert rank0["eplb_placement"] == rank1["eplb_placement"]
    assert (rank0["mtp_local_experts"], rank1["mtp_local_experts"]) == ([0, 4], [4, 8])
    assert rank0["spec_decode_num_drafts"] + rank1["spec_decode_num_drafts"] > 0
    assert rank0["moe_collectives"] == rank1["moe_collectives"] > 0
