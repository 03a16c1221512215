"""Expert parallelism through the whole engine on a tiny Qwen2-MoE (8 experts, top-4; rank 0
holds experts 0-3, rank 1 experts 4-7): DP=2 with EP gives the DP=1 outputs token for token
with all prompts on rank 0 and with uneven shards (chunked prefill, different token counts per
rank in one step) under torchrun, and round-robin under Ray; the idle rank ran placeholder steps and its
experts computed tokens for its peer. Without placeholder steps (the test-only switch) the
busy rank fails with the named MoE collective error within the timeout; a rank killed during
MoE steps makes its peer fail its requests with that error, and the survivor, re-formed
alone with every expert reloaded, serves the DP=1 outputs again."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from dp_utils import EP_ENGINE, GREEDY, PROMPTS, first_ranks, outcome, submit_all, token_ids, torchrun_ep
from moe_utils import build_tiny_moe

from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe("qwen2-moe", tmp_path_factory.mktemp("ep") / "qwen2-moe")


@pytest.fixture(scope="module")
def dp1_token_ids(moe_dir) -> list[list[int]]:
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(moe_dir), decode_sequence=False, **EP_ENGINE)
    ids = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.shutdown()
    return ids


def _expert_load(stats: dict) -> int:
    return sum(map(sum, stats["moe_expert_tokens"]))


# ---- torchrun ------------------------------------------------------------------------------
@pytest.mark.parametrize(("shard_sizes", "backend"), [("8,0", "all_to_all"), ("7,1", "allgather_reducescatter")])
def test_torchrun_ep_equals_dp1(moe_dir, dp1_token_ids, tmp_path, shard_sizes, backend):
    done = torchrun_ep(moe_dir, tmp_path / "out.json", shard_sizes, backend)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["token_ids"] == dp1_token_ids
    rank0, rank1 = result["rank_stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["placeholder_steps"] > rank0["placeholder_steps"]
    assert (rank0["moe_local_experts"], rank1["moe_local_experts"]) == ([0, 4], [4, 8])
    assert rank0["moe_dispatcher"] == rank1["moe_dispatcher"] == backend
    assert _expert_load(rank1) > 0  # the idle rank's experts served rank 0's tokens
    assert all(row[4:] == [0] * 4 for row in rank0["moe_expert_tokens"])  # and only it held them
    if shard_sizes == "8,0":
        assert rank1["prompt_tokens"] == 0 and rank1["placeholder_steps"] == rank1["generate_step"]


def test_without_placeholder_steps_the_busy_rank_fails_with_the_collective_error(moe_dir, tmp_path):
    """The test-only switch skips the placeholder's forward pass: the idle rank then never
    enters the MoE layers, and rank 0's first one fails -- named, within the timeout."""
    env = {"DEEPINFER_DP_TEST_SKIP_PLACEHOLDER_FORWARD": "1", "DEEPINFER_DP_COLLECTIVE_TIMEOUT_S": "5"}
    start = time.monotonic()
    done = torchrun_ep(moe_dir, tmp_path / "out.json", env=env, timeout_s=240)
    assert done.returncode != 0
    match = re.search(r"MoECollectiveError: DP rank 0 of 2: the MoE split-size exchange of layer 0 .*"
                      r"failed after ([\d.]+)s, collective timeout 5s: peer rank\(s\) \[1\]", done.stderr)
    assert match, done.stderr[-3000:]
    assert float(match.group(1)) < 5 + 3
    assert time.monotonic() - start < 240


# ---- Ray: one deployment for the tests below -------------------------------------------------
@pytest.fixture(scope="module")
def ray_ep(moe_dir, ray_cluster):
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(moe_dir), decode_sequence=False, dp_size=2, enable_expert_parallel=True,
              dp_options={"collective_timeout_s": 10, "max_rank_restarts": 0}, **EP_ENGINE)
    yield llm
    llm.shutdown()


def _settled(llm, timeout_s: float = 20.0) -> list[dict]:
    """Every rank's stats once their step counts agree (a rank may run one step ahead)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = llm.rank_stats()
        if len({s["generate_step"] for s in stats}) == 1 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_ray_ep_equals_dp1(ray_ep, dp1_token_ids):
    """Round-robin shards (4 and 4, of different lengths): the ranks' steps pair up, and each
    rank's experts computed tokens for both (the uneven 8/0 and 7/1 shards run under torchrun)."""
    before = _settled(ray_ep)
    assert token_ids(ray_ep.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
    after = _settled(ray_ep)
    steps = [a["generate_step"] - b["generate_step"] for a, b in zip(after, before, strict=True)]
    assert steps[0] == steps[1] > 0
    assert all(_expert_load(a) > _expert_load(b) for a, b in zip(after, before, strict=True))
    assert all(a["moe_collective_s"] > 0 and 0 < a["moe_collective_share"] < 1 for a in after)


def test_killed_rank_during_moe_steps(ray_ep, dp1_token_ids):
    """Runs last in this module: it kills rank 1. Rank 0's requests in flight either finish
    (its vote caught the death between steps) or fail naming the MoE collective (a MoE
    layer caught it mid-step); rank 1's fail as dead; the survivor reloads all experts."""
    router = ray_ep.dp.router
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    got = submit_all(router, "kill", 4, long, [5, 6, 7, 8])
    ranks = first_ranks(got, timeout=60)  # both ranks are in MoE steps
    ray_ep.dp.deployment.kill_rank(1)
    ends = {rid: outcome(q, timeout=120) for rid, q in got.items()}
    failed = [str(e) for e in ends.values() if isinstance(e, Exception)]
    dead = [m for m in failed if "DP rank 1 died or stopped answering" in m]
    lost = [m for m in failed if "DP rank 0 lost it" in m]
    on_rank1 = sum(r == 1 for r in ranks.values())
    assert len(dead) == on_rank1 and len(dead) + len(lost) == len(failed)
    assert all(re.search(r"the MoE .* of layer \d+ .*collective timeout 10s", m) for m in lost)
    finished = [e for e in ends.values() if not isinstance(e, Exception)]
    assert all(e.output_len == 480 for e in finished)
    assert len(finished) + len(lost) == len(ranks) - on_rank1
    assert [h["up"] for h in router.health()] == [True, False]
    assert token_ids(ray_ep.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
    (survivor,) = [s for s in ray_ep.rank_stats() if s.get("up")]
    assert survivor["moe_local_experts"] == [0, 8] and survivor["moe_dispatcher"] == "local"
