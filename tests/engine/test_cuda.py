"""The CUDA path: streams, pinned copies and events under ZOS, bf16, sampling on the device.

Skipped without a GPU (CI has none); run on a lent GPU machine with
`python3 -m pytest -q tests/engine/test_cuda.py`. fp32 on CUDA must still be token-identical to
transformers on CUDA; bf16 is checked against our own fp32 within bf16's precision.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_greedy, prompts_of_lengths, token_ids

from deepinfer_dp import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    # TF32 would change fp32 results between two implementations of the same model.
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("zos", [True, False])
def test_fp32_on_cuda_matches_transformers_on_cuda(tiny_models, kind, zos):
    prompts = prompts_of_lengths([3, 17, 40, 70, 9, 33])  # 40 and 70 are chunked (budget 32)
    llm = LLM(tiny_models[kind], decode_sequence=False, device="cuda", dtype="float32", zos=zos,
              max_num_batched_tokens=32, num_kv_blocks=64)
    ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=12, **GREEDY),
                                  use_tqdm=False))
    assert ours == hf_greedy(tiny_models[kind], prompts, 12, device="cuda")


def test_bf16_on_cuda_follows_fp32(tiny_model_dir):
    prompts = prompts_of_lengths([5, 12, 30, 7])
    params = SamplingParams(max_tokens=16, **GREEDY)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(tiny_model_dir, decode_sequence=False, device="cuda", dtype=dtype)
        assert next(llm.llm_engine.worker.runner.model.parameters()).dtype == getattr(torch, dtype)
        runs[dtype] = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert all(len(t) == 16 for t in runs["bfloat16"])
    # bf16 rounds differently, so later tokens may drift; the first ones must agree.
    assert [t[:2] for t in runs["bfloat16"]] == [t[:2] for t in runs["float32"]]


def test_batch_invariance_and_preemption_on_cuda(tiny_model_dir):
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = prompts_of_lengths([10, 14, 6, 20, 9, 12] * 5 + [11, 13])
    roomy = LLM(tiny_model_dir, decode_sequence=False, device="cuda", dtype="float32", block_size=4,
                num_kv_blocks=512)
    expected = token_ids(roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    alone = token_ids(roomy.generate(prompt_token_ids=prompts[3:4], sampling_params=params, use_tqdm=False))
    assert alone[0] == expected[3]
    tight = LLM(tiny_model_dir, decode_sequence=False, device="cuda", dtype="float32", block_size=4,
                num_kv_blocks=24)
    got = token_ids(tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert tight.llm_engine.scheduler.stats["num_preemptions"] > 0
    assert got == expected


def test_seeded_sampling_and_logprobs_on_cuda(tiny_model_dir):
    llm = LLM(tiny_model_dir, decode_sequence=False, device="cuda")
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=123, logprobs=0,
                            repetition_penalty=1.2, ignore_eos=True)
    prompts = prompts_of_lengths([6, 9])
    first = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert token_ids(first) == token_ids(again)
    assert all(o.logprob is not None and o.logprob <= 0.0 for outs in first for o in outs)
