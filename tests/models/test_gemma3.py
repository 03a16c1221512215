"""Gemma 3 text (models/gemma3.py) against transformers on the same random weights: local
and global layers with their own RoPE bases (linear scaling on the global ones), q/k norms,
(1 + weight) norms before and after each sublayer, scaled embeddings, GeGLU, tied
embeddings and logit soft-capping; greedy tokens of 16 prompts with chunked prefill,
prefix-cache hits and sequences well past the sliding window."""

from __future__ import annotations

import pytest
import torch
from model_utils import write_tiny_model
from moe_utils import PagedSequences, assert_close, oracle_logits, random_prompts
from test_sliding_window import CASES, check_greedy
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from deepinfer_dp.models import load_model

WINDOW = 16


def gemma3_config(vocab_size: int, **overrides) -> Gemma3TextConfig:
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}}
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
                    sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                        "sliding_attention"],
                    rope_parameters=rope, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
                    final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                    tie_word_embeddings=True)
    settings.update(overrides)
    return Gemma3TextConfig(**settings)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_tiny_model(gemma3_config, tmp_path_factory.mktemp("gemma3"))


def test_prefill_logits_match_transformers(gemma3_dir):
    loaded = load_model(str(gemma3_dir), torch.float32, "cpu")
    oracle = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()
    prompts = random_prompts(loaded.hf_config.vocab_size, [1, 7, 33, 100])
    logits = PagedSequences(loaded).step(dict(enumerate(prompts)), is_prefill=True)
    for ours, prompt in zip(logits, prompts, strict=True):
        assert_close(ours, oracle_logits(oracle, prompt))


@pytest.mark.parametrize(("count", "max_tokens"), CASES)
def test_greedy_matches_transformers(gemma3_dir, count, max_tokens):
    # 4 KV groups (one a layer): a sequence of 512 positions holds 4 x 128 blocks at most
    llm = check_greedy(gemma3_dir, count, max_tokens, num_kv_blocks=4 * 128 + 1)
    assert llm.llm_engine.worker.runner.decode_stack_steps >= max_tokens - 1  # through the one-call C++ stack


@pytest.mark.parametrize(("setting", "message"), [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, setting, message):
    path = write_tiny_model(lambda v: gemma3_config(v, **setting), tmp_path / "m")
    with pytest.raises(ValueError, match=message):
        load_model(str(path), torch.float32, "cpu")
