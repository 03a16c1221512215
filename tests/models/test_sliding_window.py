"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window) against transformers:
the window limits what each query sees, not how long a sequence grows. Prompts and outputs
run well past the window, with chunked prefill and prefix-cache hits, greedy tokens equal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_utils import hf_greedy, prompts_of_lengths, token_ids, write_tiny_model
from transformers import MistralConfig, Qwen2Config

from deepinfer_dp import _C, LLM, SamplingParams
from deepinfer_dp.layers import attention as A
from deepinfer_dp.layers.packed import kernel_array

WINDOW = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)
COMMON = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-5,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def sliding_config(kind: str, vocab_size: int):
    if kind == "mistral":  # every layer slides
        return MistralConfig(vocab_size=vocab_size, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=2, sliding_window=WINDOW, **COMMON)
    # Qwen2: layers from max_window_layers on slide, the ones before attend to everything
    return Qwen2Config(vocab_size=vocab_size, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **COMMON)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def sliding_model(request, tmp_path_factory):
    kind = request.param
    path = write_tiny_model(lambda v: sliding_config(kind, v), tmp_path_factory.mktemp(f"sliding-{kind}"))
    return kind, path


def window_prompts(count: int) -> list[list[int]]:
    """16 prompts, most past the window; four share a 24-token head with the eighth (prefix-cache
    hits); or (count 4) the two longest and two that share their head."""
    prompts = prompts_of_lengths([5, 17, 40, 70, 9, 33, 52, 90, 21, 64, 12, 45])
    head = prompts[7][:24]
    prompts += [head + p[:n] for p, n in zip(prompts[:4], (3, 11, 20, 30), strict=True)]
    return prompts if count == 16 else [prompts[i] for i in (3, 7, 12, 13)]


# (prompts, new tokens): a quick case by default, all 16 prompts with the slow tests.
CASES = [(4, 24), pytest.param(16, 40, marks=pytest.mark.slow)]


def check_greedy(path, count: int, max_tokens: int, num_kv_blocks: int = 512, **options) -> LLM:
    """Greedy tokens of window_prompts(count) equal transformers', with chunked prefill (32
    tokens a step) and prefix-cache hits; returns the LLM for further checks."""
    prompts = window_prompts(count)
    llm = LLM(str(path), decode_sequence=False, max_num_batched_tokens=32, block_size=4,
              num_kv_blocks=num_kv_blocks, **options)
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert llm.llm_engine.scheduler.stats["prefix_hit_tokens"] > 0
    assert ours == hf_greedy(path, prompts, max_tokens)
    return llm


@pytest.mark.parametrize(("count", "max_tokens"), CASES)
def test_sliding_window_matches_transformers(sliding_model, count, max_tokens):
    llm = check_greedy(sliding_model[1], count, max_tokens)
    assert llm.llm_engine.max_model_len == 512  # not capped at the window
    # Decode steps ran the one-call C++ stack (Qwen2: each layer reading its KV group's table).
    assert llm.llm_engine.worker.runner.decode_stack_steps >= max_tokens - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_kernel_equals_masked_torch(dtype):
    """The paged kernel (decode and prefill rows) against the gather + SDPA path with the
    window's mask; blocks before every query's window hold NaN, which must never be read."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim, window = 4, 4, 2, 64, 7
    k_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(40, block_size, kv_heads, dim, generator=gen).to(dtype)
    seq_lens = [3, 7, 8, 30, 57]
    tables = torch.zeros(len(seq_lens), 16, dtype=torch.int32)
    next_block = 1
    for i, n in enumerate(seq_lens):
        for b in range(-(-n // block_size)):
            if (b + 1) * block_size <= n - window:  # wholly before the window: freed (NaN in block 39)
                tables[i, b] = 39
            else:
                tables[i, b], next_block = next_block, next_block + 1
    k_cache[39], v_cache[39] = float("nan"), float("nan")
    q = torch.randn(len(seq_lens), heads, dim, generator=gen)
    md = A.AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
                             block_tables=tables, query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_lens_host=[1] * len(seq_lens), seq_lens_host=seq_lens, max_query_len=1,
                             max_seq_len=max(seq_lens))
    got = A.paged_attention_cpu(q, k_cache, v_cache, tables, md.seq_lens.numpy(), None, 0.125, window)
    clean_k, clean_v = k_cache.clone(), v_cache.clone()
    clean_k[39], clean_v[39] = 0.0, 0.0  # the torch path multiplies masked positions by zero
    expected = A._gathered_decode_attention(q, clean_k, clean_v, md, 0.125, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Prefill rows of the longest sequence: each query its own window, floats as alone.
    rows = np.full(3, 4, dtype=np.int32)
    lens = np.arange(55, 58, dtype=np.int32)  # the earliest reads from position 48 on
    q6 = torch.randn(3, heads, dim, generator=gen)
    together = A.paged_attention_cpu(q6, k_cache, v_cache, tables, lens, rows, 0.125, window)
    assert torch.isfinite(together).all()
    for j in range(3):
        alone = A.paged_attention_cpu(q6[j:j + 1], k_cache, v_cache, tables, lens[j:j + 1], rows[j:j + 1], 0.125,
                                      window)
        assert torch.equal(alone[0], together[j])
    with pytest.raises(ValueError, match="window must be >= 0"):
        _C.paged_attention(q.numpy(), kernel_array(k_cache), kernel_array(v_cache), tables.numpy(),
                           md.seq_lens.numpy(), torch.empty_like(q).numpy(), 0.125, 1, None, -1)


def held_blocks(seq, groups: int) -> list[int]:
    """Blocks `seq` holds in each KV group (its table interleaves them; 0: freed or never held)."""
    table = list(seq.block_table)
    return [sum(1 for b in table[g::groups] if b != 0) for g in range(groups)]


def run_one_and_watch(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Runs one request alone; returns its tokens and the most blocks it held in each KV group
    at once, checking after every step that the pool's free count is what it does not hold."""
    sched = engine.scheduler
    groups = sched.config.num_kv_groups
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens, **GREEDY))
    most_held, tokens = [0] * groups, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += list(out.token_ids) if out.request_id == rid else []
        seq = sched.get_sequence(rid)
        if seq is not None and seq.block_table:
            held = held_blocks(seq, groups)
            assert sched.num_free_blocks == sched.num_usable_blocks - sum(held)
            most_held = [max(m, h) for m, h in zip(most_held, held, strict=True)]
    return tokens, most_held


def test_blocks_out_of_the_window_are_freed(sliding_model):
    """A sequence keeps only the blocks its window reaches, the rest go back to the pool as it
    grows, and its tokens stay transformers'. Mistral: every layer slides, one group. Qwen2
    here has one layer that sees everything: three KV groups of one layer, the full one keeps
    every block, the two sliding ones only their window's."""
    kind, path = sliding_model
    engine = LLM(str(path), decode_sequence=False, max_num_batched_tokens=32, block_size=4,
                 num_kv_blocks=512).llm_engine
    config = engine.scheduler.config
    assert config.sliding_window == WINDOW
    assert (config.num_kv_groups, config.num_full_kv_groups) == ((1, 0) if kind == "mistral" else (3, 1))
    prompt = window_prompts(4)[1]  # 90 tokens: prefilled in chunks of 32
    tokens, most_held = run_one_and_watch(engine, prompt, 30)
    total_blocks = -(-(len(prompt) + 29) // 4)  # the last sampled token is never stored
    window_bound = WINDOW // 4 + 32 // 4 + 1  # the window's blocks plus one 32-token chunk's
    for g, held in enumerate(most_held):
        if g < config.num_full_kv_groups:
            assert held == total_blocks
        else:
            assert held <= window_bound < total_blocks
    assert tokens == hf_greedy(path, [prompt], 30)[0]
