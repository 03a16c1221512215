"""Expert parallelism through the whole engine on a tiny Qwen2-MoE (8 experts, top-4; rank 0
holds experts 0-3, rank 1 experts 4-7): DP=2 with EP gives the DP=1 outputs token for token
with all prompts on rank 0 and with uneven shards (chunked prefill, different token counts per
rank in one step), under torchrun and under Ray; the idle rank ran placeholder steps and its
experts computed tokens for its peer. Without placeholder steps (the test-only switch) the
busy rank fails with the named MoE collective error within the timeout; a rank killed during
MoE steps makes its peer fail its requests with that error, and the survivor, re-formed
alone with every expert reloaded, serves the DP=1 outputs again."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dp_utils import collect_outcomes
from moe_utils import build_tiny_moe

from deepinfer_dp.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.",
           "What is 2 + 2?", "List three colors.", "Once upon a time",
           "Explain data parallelism in one sentence, please, and be brief.", "Hi"]
MAX_TOKENS = 8
# A 12-token step budget: longer prompts are prefilled in chunks, beside other sequences.
ENGINE = dict(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=12, torch_threads=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _ids(results) -> list[list[int]]:
    return [[t for o in outs for t in o.token_ids] for outs in results]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe("qwen2-moe", tmp_path_factory.mktemp("ep") / "qwen2-moe")


@pytest.fixture(scope="module")
def dp1_token_ids(moe_dir) -> list[list[int]]:
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(moe_dir), decode_sequence=False, **ENGINE)
    ids = _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm.shutdown()
    return ids


def _expert_load(stats: dict) -> int:
    return sum(map(sum, stats["moe_expert_tokens"]))


# ---- torchrun ------------------------------------------------------------------------------
def _torchrun(model_dir: Path, shard_sizes: str, backend: str, out: Path, env: dict | None = None,
              timeout_s: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "launch" / "torchrun_generate.py"), "--model", str(model_dir), "--shard-sizes", shard_sizes,
           "--max-tokens", str(MAX_TOKENS), "--num-kv-blocks", "64", "--max-num-seqs", "2",
           "--max-num-batched-tokens", "12", "--enable-expert-parallel", "--all2all-backend", backend,
           "--output", str(out), "--prompts-file", str(out.with_suffix(".txt"))]
    out.with_suffix(".txt").write_text("\n".join(PROMPTS) + "\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.parametrize(("shard_sizes", "backend"), [("8,0", "all_to_all"), ("7,1", "allgather_reducescatter")])
def test_torchrun_ep_equals_dp1(moe_dir, dp1_token_ids, tmp_path, shard_sizes, backend):
    done = _torchrun(moe_dir, shard_sizes, backend, tmp_path / "out.json")
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
    done = _torchrun(moe_dir, "8,0", "all_to_all", tmp_path / "out.json", env=env, timeout_s=240)
    assert done.returncode != 0
    match = re.search(r"MoECollectiveError: DP rank 0 of 2: the MoE split-size exchange of layer 0 .*"
                      r"failed after ([\d.]+)s, collective timeout 5s: peer rank\(s\) \[1\]", done.stderr)
    assert match, done.stderr[-3000:]
    assert float(match.group(1)) < 5 + 3
    assert time.monotonic() - start < 240


# ---- Ray: one deployment for the tests below -------------------------------------------------
class FirstToRank0:
    def __init__(self, n: int) -> None:
        self.left = n

    def choose(self, prompt_token_ids, load) -> int:
        self.left -= 1
        return 0 if self.left >= 0 else 1


@pytest.fixture(scope="module")
def ray_ep(moe_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    from deepinfer_dp.entrypoints.llm import LLM

    llm = LLM(str(moe_dir), decode_sequence=False, dp_size=2, enable_expert_parallel=True,
              dp_options={"collective_timeout_s": 10}, **ENGINE)
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


@pytest.mark.parametrize("first_to_rank0", [8, 7])
def test_ray_ep_equals_dp1(ray_ep, dp1_token_ids, first_to_rank0):
    before = _settled(ray_ep)
    ray_ep.llm_engine.router.policy = FirstToRank0(first_to_rank0)
    assert _ids(ray_ep.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
    after = _settled(ray_ep)
    steps = [a["generate_step"] - b["generate_step"] for a, b in zip(after, before, strict=True)]
    placeholders = [a["placeholder_steps"] - b["placeholder_steps"] for a, b in zip(after, before, strict=True)]
    assert steps[0] == steps[1] > 0 and placeholders[1] > placeholders[0]
    if first_to_rank0 == 8:
        assert placeholders[1] == steps[1]
    assert _expert_load(after[1]) > _expert_load(before[1])  # rank 1's experts were used
    assert after[1]["moe_collective_s"] > 0 and 0 < after[1]["moe_collective_share"] < 1


def test_killed_rank_during_moe_steps(ray_ep, dp1_token_ids):
    """Runs last in this module: it kills rank 1. Rank 0's requests in flight either finish
    (its vote caught the death between steps) or fail naming the MoE collective (a MoE
    layer caught it mid-step); rank 1's fail as dead; the survivor reloads all experts."""
    from deepinfer_dp.cluster.policies import RoundRobin

    engine = ray_ep.llm_engine
    router = engine.router
    router.policy = RoundRobin()
    got: queue.Queue = queue.Queue()
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    ranks = [router.submit(f"kill-{i}", [5, 6, 7, 8], long, got.put) for i in range(4)]
    assert not isinstance(got.get(timeout=60), Exception)  # both ranks are in MoE steps
    engine.ranks.kill(1)
    failed, finished = collect_outcomes(got, 4, timeout=120)
    dead = [m for m in failed if "DP rank 1 died or stopped answering" in m]
    lost = [m for m in failed if "DP rank 0 lost it" in m]
    assert len(dead) == ranks.count(1) and len(dead) + len(lost) == len(failed)
    assert all(re.search(r"the MoE .* of layer \d+ .*collective timeout 10s", m) for m in lost)
    assert len(finished) + len(lost) == ranks.count(0)
    assert [h["up"] for h in router.health()] == [True, False]
    assert _ids(ray_ep.generate(PROMPTS, GREEDY, use_tqdm=False)) == dp1_token_ids
    (survivor,) = [s for s in ray_ep.rank_stats() if s.get("up")]
    assert survivor["moe_local_experts"] == [0, 8] and survivor["moe_dispatcher"] == "local"
