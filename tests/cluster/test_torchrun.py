"""Offline DP under torchrun: lockstep step counts and placeholder steps, outputs equal to
DP=1 token for token, and a clean exit (status 0, no abort) every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_utils import GREEDY, MAX_TOKENS, PROMPTS, ROOT, run_torchrun


def _torchrun(model_dir: Path, shard_sizes: str, out: Path, check: bool = True,
              torchrun_args: tuple[str, ...] = (), args: tuple[str, ...] = ()) -> tuple[int, str]:
    out.with_suffix(".txt").write_text("\n".join(PROMPTS) + "\n")
    proc = run_torchrun([*torchrun_args, str(ROOT / "launch" / "torchrun_generate.py"), "--model", str(model_dir),
                         "--shard-sizes", shard_sizes, "--max-tokens", str(MAX_TOKENS), "--num-kv-blocks", "64",
                         "--max-num-seqs", "2", "--output", str(out), "--prompts-file",
                         str(out.with_suffix(".txt")), *args])
    return proc.returncode, proc.stderr


def _clean_exit(returncode: int, stderr: str) -> None:
    assert returncode == 0, stderr[-3000:]
    for sign in ("terminate called", "Aborted", "core dumped", "Fatal Python error"):
        assert sign not in stderr, stderr[-3000:]


@pytest.mark.parametrize("shard_sizes", ["8,0", "7,1"])
def test_torchrun_lockstep(tiny_model_dir, dp1_token_ids, tmp_path, shard_sizes):
    out = tmp_path / "out.json"
    _clean_exit(*_torchrun(tiny_model_dir, shard_sizes, out))
    result = json.loads(out.read_text())
    assert result["token_ids"] == dp1_token_ids
    rank0, rank1 = result["rank_stats"]
    assert rank0["generate_step"] == rank1["generate_step"]
    assert rank1["placeholder_steps"] > rank0["placeholder_steps"]
    if shard_sizes == "8,0":
        assert rank1["prompt_tokens"] == 0
        assert rank1["placeholder_steps"] == rank1["generate_step"]


@pytest.mark.slow
def test_torchrun_max_restarts_reruns_the_job_after_a_rank_dies(tiny_model_dir, dp1_token_ids, tmp_path):
    """Rank 1 dies on the first attempt; torchrun's elastic restart starts both ranks again
    and the job's results are complete and equal to DP=1."""
    out = tmp_path / "out.json"
    returncode, stderr = _torchrun(tiny_model_dir, "4,4", out, torchrun_args=("--max-restarts", "1"),
                                   args=("--fail-rank", "1"))
    _clean_exit(returncode, stderr)
    assert "(exitcode: 1) local_rank: 1" in stderr  # the first attempt did fail: the job was restarted
    assert json.loads(out.read_text())["token_ids"] == dp1_token_ids


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 20 launches of two ranks each
def test_torchrun_exits_cleanly_twenty_times_in_a_row(tiny_model_dir, tmp_path):
    """Each rank tears its DP group down in LLM.shutdown(); nothing keeps it alive into
    interpreter teardown, where Gloo's threads would abort the process."""
    for i in range(20):
        out = tmp_path / f"out{i}.json"
        returncode, stderr = _torchrun(tiny_model_dir, "4,4", out)
        assert returncode == 0 and "terminate called" not in stderr, f"run {i}: {stderr[-3000:]}"
        assert len(json.loads(out.read_text())["token_ids"]) == len(PROMPTS)


EXIT_WITHOUT_SHUTDOWN = """
import sys
from deepinfer_dp import LLM, SamplingParams
llm = LLM(sys.argv[1], torch_threads=1, num_kv_blocks=64)
print(llm.generate(["hello"] * (1 + llm.dp.dp_rank), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
# no llm.shutdown(): the group is torn down at exit all the same
"""


@pytest.mark.slow
def test_torchrun_exits_cleanly_without_shutdown(tiny_model_dir, tmp_path):
    script = tmp_path / "no_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    for _ in range(5):
        proc = run_torchrun([str(script), str(tiny_model_dir)])
        _clean_exit(proc.returncode, proc.stderr)


def test_shutdown_frees_the_dp_group_at_once(tiny_model_dir):
    """No reference cycle keeps the group alive after shutdown(), even with the garbage
    collector off: what aborted torchrun runs at interpreter teardown (Gloo threads of a group
    destroyed during finalization)."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from deepinfer_dp.cluster.torchrun import TorchrunRank
    from deepinfer_dp.config import EngineConfig
    from deepinfer_dp.distributed import Lockstep, init_dp_groups
    from deepinfer_dp.distributed.groups import serve_store
    from deepinfer_dp.engine.llm_engine import LLMEngine
    from deepinfer_dp.engine.step_loop import StepLoop

    store = serve_store()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), torch_threads=1, num_kv_blocks=16, max_model_len=240))
    groups = init_dp_groups(0, 1, "127.0.0.1", store.port, torch.device("cpu"), timeout_s=10)
    engine.lockstep = Lockstep(groups)
    rank = TorchrunRank(groups, StepLoop(engine))
    engine.add_request(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY)
    rank.loop.run(lambda outs: None)
    assert rank.all_gather({"x": 1}) == [{"x": 1}]
    alive = [weakref.ref(groups), weakref.ref(engine.lockstep), weakref.ref(engine.worker)]
    del groups
    gc.disable()
    try:
        rank.shutdown()
        assert [ref() for ref in alive[:2]] == [None, None] and not dist.is_initialized()
        del engine, rank
        assert alive[2]() is None  # the worker was not held by a cycle through its engine
    finally:
        gc.enable()
