"""kv_cache_dtype="bfloat16": a bf16 KV cache under fp32 compute on the CPU.

Exact where it can be: the kernels widen each bf16 element to the fp32 it stands for, so
attention over a bf16 cache equals attention over an fp32 cache holding those values, bit
for bit; the one-call decode stack rounds K/V into the cache exactly as torch's
.to(torch.bfloat16) does, so it still equals the module path bit for bit. Against an fp32
cache the difference is the rounding of K/V to 8 bits of mantissa, bounded here by a stated
tolerance. fp32 stays the default (token identity with transformers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepseek_utils import build_tiny_deepseek
from model_utils import build_tiny_model, prompts_of_lengths, token_ids

from deepinfer_dp import _C, LLM, SamplingParams
from deepinfer_dp.layers.packed import kernel_array
from deepinfer_dp.models import llama_cpu_decode

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Largest |logit difference| allowed between a bf16 and an fp32 cache at the first decode
# steps of the tiny model, relative to the largest |logit|: bf16 keeps K/V to a relative 2^-9,
# and what attention mixes from them moved the logits by 0.7-1.0% of the largest (|logits| up
# to ~6, differences 0.04-0.055).
LOGIT_REL_TOL = 0.03


def bf16_case(head_dim: int, seed: int = 0):
    """A random paged cache in bf16, the same values widened to fp32, and queries over it."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, heads = 32, 16, 3, 9
    k16 = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v16 = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    lens = np.array([1, 17, 40, 95, 96, 96, 96], dtype=np.int32)
    tables = np.stack([np.random.default_rng(i).permutation(num_blocks - 1)[:6] + 1 for i in range(3)]).astype(np.int32)
    rows = np.array([0, 0, 1, 2, 2, 2, 2], dtype=np.int32)  # consecutive tokens of one row share its K/V
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return q, k16, v16, tables, lens, rows


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the AVX2 paths and the portable loop
def test_kernel_on_a_bf16_cache_equals_it_widened_to_fp32(head_dim):
    q, k16, v16, tables, lens, rows = bf16_case(head_dim)
    widened, on_bf16 = torch.empty_like(q), torch.empty_like(q)
    _C.paged_attention(q.numpy(), k16.float().numpy(), v16.float().numpy(), tables, lens, widened.numpy(), 0.125, 2,
                       rows)
    _C.paged_attention(q.numpy(), kernel_array(k16), kernel_array(v16), tables, lens, on_bf16.numpy(), 0.125, 2,
                       rows)
    assert torch.equal(on_bf16, widened)


def test_kernel_refuses_mixed_cache_types():
    q, k16, v16, tables, lens, rows = bf16_case(64)
    out = torch.empty_like(q)
    with pytest.raises(TypeError):
        _C.paged_attention(q.numpy(), kernel_array(k16), v16.float().numpy(), tables, lens, out.numpy(), 0.125, 1,
                           rows)


def run(model_dir: str, monkeypatch, kv_cache_dtype: str, stack: bool = True) -> tuple[list, list, LLM]:
    """Token ids and the logits of every step (compute_logits' results)."""
    monkeypatch.setattr(llama_cpu_decode, "ENABLED", stack)
    llm = LLM(model_dir, decode_sequence=False, max_num_batched_tokens=64, kv_cache_memory_gb=0.01, block_size=4,
              max_model_len=128, torch_threads=2, kv_cache_dtype=kv_cache_dtype)
    try:
        model = llm.llm_engine.worker.runner.model
        seen, logits = [], model.compute_logits
        monkeypatch.setattr(model, "compute_logits", lambda h: seen.append(logits(h)) or seen[-1])
        ids = token_ids(llm.generate(prompt_token_ids=prompts_of_lengths([5, 9, 3, 40]), sampling_params=GREEDY,
                                     use_tqdm=False))
        return ids, seen, llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(build_tiny_model("llama-gqa", tmp_path_factory.mktemp("kv_bf16") / "llama"))


def test_decode_stack_equals_the_modules_on_a_bf16_cache(llama_dir, monkeypatch):
    ids_on, logits_on, _ = run(llama_dir, monkeypatch, "bfloat16", stack=True)
    ids_off, logits_off, _ = run(llama_dir, monkeypatch, "bfloat16", stack=False)
    assert ids_on == ids_off
    assert len(logits_on) == len(logits_off) > 10
    for a, b in zip(logits_on, logits_off, strict=True):
        assert torch.equal(a, b)


def test_bf16_cache_against_fp32_within_tolerance_and_twice_the_blocks(llama_dir, monkeypatch):
    _, logits32, llm32 = run(llama_dir, monkeypatch, "auto")
    _, logits16, llm16 = run(llama_dir, monkeypatch, "bfloat16")
    # Step 0 is the prefill, step 1 the first decode step (the same input tokens on both);
    # each reads K/V back from the cache (the prefill too, in the kernel: a small step).
    for step in (0, 1, 2, 3):  # the steps before the greedy paths could part
        diff = (logits16[step] - logits32[step]).abs().max().item()
        assert 0 < diff <= LOGIT_REL_TOL * logits32[step].abs().max().item(), (step, diff)
    blocks32 = llm32.rank_stats()[0]["num_usable_blocks"]
    blocks16 = llm16.rank_stats()[0]["num_usable_blocks"]
    assert abs(blocks16 - 2 * blocks32) <= 2, (blocks16, blocks32)  # half the bytes a block


def test_unsupported_mixes_are_refused_by_name(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 with dtype=torch.bfloat16 on cpu"):
        LLM(llama_dir, dtype="bfloat16", kv_cache_dtype="float32", kv_cache_memory_gb=0.01)
    deepseek = str(build_tiny_deepseek("v2-lite", tmp_path / "deepseek"))
    with pytest.raises(ValueError, match="kv_cache_dtype=bfloat16 is not supported for MLA models"):
        LLM(deepseek, kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.01)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(llama_dir, kv_cache_dtype="fp8")
