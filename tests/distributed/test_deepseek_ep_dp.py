"""DeepSeekMoE under expert parallelism through the whole engine: tiny DeepSeek-V3 and
V2-Lite-style models at DP=2 with EP (rank 0 holds routed experts 0-3, rank 1 experts 4-7)
give the DP=1 outputs token for token with every prompt on rank 0 (torchrun, the idle rank
runs placeholder steps whose MoE collectives its peer waits on, and its experts compute rank
0's tokens), and with round-robin routing under Ray. With MTP drafting (K = 2) on a V3 whose
checkpoint stores a next-n layer, all prompts on rank 0: the outputs are still DP=1's, the
MTP layer's routed experts are split across the ranks like the decoder's, and the idle rank
runs the MTP layer on padding (K drafting passes and the placeholder's 1 + K tokens) every
step, so both ranks make the same MoE collective calls."""

from __future__ import annotations

import json

import pytest
from deepseek_utils import build_tiny_deepseek
from dp_utils import EP_ENGINE, GREEDY, PROMPTS, token_ids, torchrun_ep


@pytest.fixture(scope="module", params=["v3", "v2-lite"])
def ds_case(request, tmp_path_factory):
    """(model directory, the DP=1 greedy token ids of PROMPTS)."""
    from deepinfer_dp.entrypoints.llm import LLM

    path = build_tiny_deepseek(request.param, tmp_path_factory.mktemp("ds_ep") / request.param)
    llm = LLM(str(path), decode_sequence=False, **EP_ENGINE)
    try:
        ids = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    return path, ids


def test_torchrun_ep_all_prompts_on_one_rank_equals_dp1(ds_case, tmp_path):
    model_dir, dp1_ids = ds_case
    done = torchrun_ep(model_dir, tmp_path / "out.json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["token_ids"] == dp1_ids
    rank0, rank1 = result["rank_stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["prompt_tokens"] == 0 and rank1["placeholder_steps"] == rank1["generate_step"]
    assert (rank0["moe_local_experts"], rank1["moe_local_experts"]) == ([0, 4], [4, 8])
    assert rank0["moe_layers"] == rank1["moe_layers"] == [1, 2]  # layer 0 dense
    assert sum(map(sum, rank1["moe_expert_tokens"])) > 0  # the idle rank's experts served rank 0
    assert all(row[4:] == [0] * 4 for row in rank0["moe_expert_tokens"])


@pytest.mark.slow  # the Ray EP path itself runs by default in test_moe_ep_dp.py
def test_ray_ep_round_robin_equals_dp1(ds_case, ray_cluster):
    from deepinfer_dp.entrypoints.llm import LLM

    model_dir, dp1_ids = ds_case
    llm = LLM(str(model_dir), decode_sequence=False, dp_size=2, enable_expert_parallel=True,
              dp_options={"collective_timeout_s": 30, "max_rank_restarts": 0}, **EP_ENGINE)
    try:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_ids
        stats = llm.rank_stats()
    finally:
        llm.shutdown()
    assert [s["moe_local_experts"] for s in stats] == [[0, 4], [4, 8]]
    assert all(sum(map(sum, s["moe_expert_tokens"])) > 0 for s in stats)


# allgather_reducescatter also exchanges each MTP pass's token count (begin_step): slow only,
# the default run keeps all_to_all
@pytest.mark.parametrize("backend", ["all_to_all",
                                     pytest.param("allgather_reducescatter", marks=pytest.mark.slow)])
def test_torchrun_ep_with_mtp_all_prompts_on_one_rank_equals_dp1(tmp_path_factory, tmp_path, backend):
    from deepinfer_dp.entrypoints.llm import LLM

    path = build_tiny_deepseek("v3", tmp_path_factory.mktemp("ds_ep_mtp") / "v3-nextn", with_nextn=True)
    llm = LLM(str(path), decode_sequence=False, **EP_ENGINE)
    try:
        dp1_ids = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    done = torchrun_ep(path, tmp_path / "out.json", backend=backend,
                      extra_args=("--speculative-config", json.dumps(spec)))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["token_ids"] == dp1_ids
    rank0, rank1 = result["rank_stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["placeholder_steps"] == rank1["generate_step"] and rank0["spec_decode_num_drafts"] > 0
    assert sum(map(sum, rank1["moe_expert_tokens"])) > 0
    # The MTP layer's routed experts are split like the decoder's, and dispatched: the idle
    # rank's experts computed rank 0's drafting tokens, rank 0 never ran rank 1's experts.
    assert (rank0["mtp_local_experts"], rank1["mtp_local_experts"]) == ([0, 4], [4, 8])
    assert sum(rank1["mtp_expert_tokens"][4:]) > 0 and rank0["mtp_expert_tokens"][4:] == [0] * 4
    # Every idle step: K drafting passes and the placeholder's next-n pass, on padding rows.
    assert rank1["mtp_padding_passes"] == rank1["generate_step"] * (spec["num_speculative_tokens"] + 1)
    assert rank0["moe_collectives"] == rank1["moe_collectives"] > 0
