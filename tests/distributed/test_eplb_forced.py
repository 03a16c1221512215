"""Rebalances forced at chosen steps (eplb_config.force_steps), DP=3 with EP under torchrun,
on a tiny Mixtral of 10 experts (top-2) whose router is skewed onto experts 2 and 3 (both on
rank 0 at start), with 2 redundant slots (12 slots, 4 a rank) and n-gram speculative
decoding. Every rank's first prompt is long and prefilled in chunks of the 12-token step
budget: the first forced rebalance switches the two MoE layers at steps 3 and 4, while every
rank is in the middle of that chunk sequence; later ones switch while ranks verify drafts.
The greedy tokens equal DP=1's; every rank switched every layer at the same step, the
forced ones; each layer's balancedness rises clearly from the first reading to the last."""

from __future__ import annotations

import pytest
from dp_utils import EP_ENGINE
from eplb_utils import LONG, NGRAM, build_skewed_mixtral, dp1_ids, step_kinds, torchrun_traced

PROMPTS = [f"{LONG}, one.", "Hello, my name is", "What is 2 + 2?",
           f"{LONG}, two.", "List three colors.", "Once upon a time",
           f"{LONG}, three.", "The capital of France is", "Hi"]
MAX_TOKENS = 12
FORCE = [3, 9, 13, 17, 21]
EPLB = {"window_size": 6, "step_interval": 10**6, "num_redundant_experts": 2, "force_steps": FORCE}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(the skewed 10-expert Mixtral, the DP=1 greedy token ids of PROMPTS)."""
    model_dir = build_skewed_mixtral(tmp_path_factory.mktemp("eplb3") / "mixtral10", num_experts=10)
    return model_dir, dp1_ids(model_dir, PROMPTS, MAX_TOKENS)


@pytest.mark.slow
def test_forced_rebalances_at_dp3_keep_the_dp1_tokens(case, tmp_path):
    model_dir, dp1 = case
    options = {**EP_ENGINE, "enable_expert_parallel": True, "enable_eplb": True, "eplb_config": EPLB,
               "speculative_config": NGRAM}
    result = torchrun_traced(model_dir, tmp_path / "out.json", PROMPTS, "3,3,3", options, MAX_TOKENS, nproc=3)
    assert result["token_ids"] == dp1
    stats = result["rank_stats"]
    # the balancer's clock is the engine's step count: one forward pass a step
    assert all(s["eplb_passes"] == s["generate_step"] for s in stats)
    switches = stats[0]["eplb_switches"]
    for s in stats[1:]:
        assert s["eplb_switches"] == switches
        assert s["eplb_placement"] == stats[0]["eplb_placement"]
        assert s["eplb_balancedness_history"] == stats[0]["eplb_balancedness_history"]
    # one layer a pass from each forced step on, nowhere else
    assert switches[:2] == [[3, 0, 1], [4, 1, 1]], switches
    assert all((p in FORCE and layer == 0) or (p - 1 in FORCE and layer == 1) for p, layer, _ in switches)
    kinds = [step_kinds(trace) for trace in result["traces"]]
    assert all("chunk" in k[3] and "chunk" in k[4] for k in kinds), kinds  # mid-prefill on every rank
    under_speculation = [p for p, _, _ in switches if any("verify" in k.get(p, ()) for k in kinds)]
    assert under_speculation, (switches, kinds)
    assert sum(s["spec_decode_num_drafts"] for s in stats) > 0
    history = stats[0]["eplb_balancedness_history"]
    assert [h[0] for h in history] == [p for p in FORCE if p <= stats[0]["generate_step"]]
    before, after = history[0][2], history[-1][2]
    for b, a in zip(before, after, strict=True):  # per MoE layer
        assert b < 0.8 and a > b + 0.1, history
