"""Gemma 3's KV groups (layers/kv_groups.py, the block manager's groups): the full-attention
layers keep every block, the sliding-window layers only their window's, and the blocks they
free serve other sequences; greedy tokens stay transformers' through chunked prefill, prefix
hits and preemption."""

from __future__ import annotations

import pytest
from model_utils import token_ids, write_tiny_model
from test_gemma3 import WINDOW, gemma3_config
from test_sliding_window import CASES, GREEDY, check_greedy, hf_greedy, run_one_and_watch, window_prompts

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.layers.kv_groups import plan_kv_groups

# The tiny model's layers: local, local, global, local, local, local (Gemma 3's 5:1).
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return write_tiny_model(lambda v: gemma3_config(v, num_hidden_layers=6, layer_types=LAYER_TYPES),
                            tmp_path_factory.mktemp("gemma3-hybrid"))


def test_groups_of_gemma3_270m_and_the_single_group_cases():
    # Gemma 3 270M: 18 layers, every 6th global, window 512 -> 1 full and 5 sliding groups of 3
    windows = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = plan_kv_groups(windows)
    assert (groups.num_groups, groups.num_full_groups, groups.group_size, groups.window) == (6, 1, 3, 512)
    assert [groups.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]
    assert sorted(zip(groups.layer_group, groups.layer_slot, strict=True)) == \
        [(g, j) for g in range(6) for j in range(3)]  # each (group, cache tensor) used once
    # 29 local and 5 global layers (Gemma 3 4B's 34): the last sliding group has 4 of 5 slots used
    windows = [0 if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    assert plan_kv_groups(windows).num_groups == 1 + 6
    # one group when nothing mixes, windows differ, or hybrid groups are switched off
    assert plan_kv_groups([16, 16]).num_groups == 1 and plan_kv_groups([16, 16]).window == 16
    assert plan_kv_groups([0, 0]).window == 0
    assert plan_kv_groups([0, 16, 8]).num_groups == 1
    assert plan_kv_groups([0, 16], hybrid=False).num_groups == 1


@pytest.mark.parametrize(("count", "max_tokens"), CASES)
def test_greedy_matches_transformers_in_groups(hybrid_dir, count, max_tokens):
    """Prompts past the window with chunked prefill and prefix-cache hits, read through the
    groups' tables."""
    llm = check_greedy(hybrid_dir, count, max_tokens, num_kv_blocks=6 * 128 + 1)
    config = llm.llm_engine.scheduler.config  # one full and five sliding groups of one layer
    assert (config.num_kv_groups, config.num_full_kv_groups, config.sliding_window) == (6, 1, WINDOW)
    assert llm.llm_engine.worker.runner.decode_stack_steps >= max_tokens - 1  # through the one-call C++ stack


def test_sliding_groups_keep_only_the_window(hybrid_dir):
    engine = LLM(str(hybrid_dir), decode_sequence=False, max_num_batched_tokens=32, block_size=4,
                 num_kv_blocks=6 * 128 + 1).llm_engine
    prompt = window_prompts(4)[1]  # 90 tokens, prefilled in chunks of 32
    tokens, (full, *sliding) = run_one_and_watch(engine, prompt, 30)
    total_blocks = -(-(len(prompt) + 29) // 4)
    assert full == total_blocks
    assert len(sliding) == 5 and max(sliding) <= WINDOW // 4 + 32 // 4 + 1 < total_blocks
    assert tokens == hf_greedy(hybrid_dir, [prompt], 30)[0]


def test_preemption_under_a_tight_pool_keeps_the_tokens(hybrid_dir):
    """Eight sequences in a pool too small for all of them at once: preempted and recomputed,
    their tokens still transformers'. Without the groups the same memory holds fewer at once."""
    prompts = window_prompts(16)[:8]
    params = SamplingParams(max_tokens=24, **GREEDY)
    preemptions, expected = {}, hf_greedy(hybrid_dir, prompts, 24)
    for hybrid in (True, False):
        # the same memory: 6 x 40 blocks of one layer, or 40 blocks of all six
        blocks = 6 * 40 + 1 if hybrid else 40 + 1
        llm = LLM(str(hybrid_dir), decode_sequence=False, max_num_batched_tokens=32, block_size=4,
                  num_kv_blocks=blocks, max_model_len=120, disable_hybrid_kv_cache_manager=not hybrid)
        ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
        assert ours == expected
        stats = llm.llm_engine.scheduler.stats
        preemptions[hybrid] = stats["num_preemptions"]
    assert preemptions[True] > 0  # the pool was tight
    assert preemptions[True] < preemptions[False]  # and the groups left it less so


def test_speculative_decoding_keeps_one_group(hybrid_dir):
    """A speculative step verifies drafts through the whole table (and a draft model or MTP
    head reads it): one group that keeps every block, tokens still transformers'."""
    prompts = window_prompts(4)[:2]
    llm = LLM(str(hybrid_dir), decode_sequence=False, max_num_batched_tokens=32, block_size=4, num_kv_blocks=300,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    config = llm.llm_engine.scheduler.config
    assert (config.num_kv_groups, config.sliding_window) == (1, 0)
    ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=24, **GREEDY),
                                  use_tqdm=False))
    assert ours == hf_greedy(hybrid_dir, prompts, 24)
