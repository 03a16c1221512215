"""Expert parallelism on CUDA (skipped without a GPU): two torchrun ranks with EP give the DP=1
outputs token for token, fp32 without TF32, under both dispatchers. On one GPU both ranks
share it, so the rows go through host memory over Gloo (NCCL refuses two ranks on one GPU);
with two GPUs they go over NCCL. Run on a lent GPU machine with
`python3 -m pytest -q tests/distributed/test_moe_cuda.py` (or benchmarks/cuda_check.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dp_utils import ROOT, run_torchrun
from moe_utils import build_tiny_moe

from deepinfer_dp import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about the sea.", "Hi"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return build_tiny_moe("qwen3-moe", tmp_path_factory.mktemp("ep_cuda") / "qwen3-moe")


def _torchrun(model_dir: Path, device: str, backend: str, out: Path) -> dict:
    out.with_suffix(".txt").write_text("\n".join(PROMPTS) + "\n")
    proc = run_torchrun([str(ROOT / "launch" / "torchrun_generate.py"), "--model", str(model_dir), "--device", device,
                         "--dtype", "float32", "--shard-sizes", "3,1", "--max-tokens", str(MAX_TOKENS),
                         "--enable-expert-parallel", "--all2all-backend", backend, "--output", str(out),
                         "--prompts-file", str(out.with_suffix(".txt"))], env={"NVIDIA_TF32_OVERRIDE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["all_to_all", "allgather_reducescatter"])
@pytest.mark.parametrize("device", ["cuda:0", pytest.param("auto", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL between two GPUs needs two"))])
def test_ep_on_cuda_equals_dp1(moe_dir, tmp_path, device, backend):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        llm = LLM(str(moe_dir), decode_sequence=False, device="cuda:0", dtype="float32")
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        llm.shutdown()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    dp1 = [[t for o in per for t in o.token_ids] for per in outs]
    result = _torchrun(moe_dir, device, backend, tmp_path / "out.json")
    assert result["token_ids"] == dp1
    rank0, rank1 = result["rank_stats"]
    assert rank1["moe_local_experts"] == [4, 8] and sum(map(sum, rank1["moe_expert_tokens"])) > 0
