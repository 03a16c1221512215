"""Batch-invariant greedy output: a prompt's tokens do not depend on what it is batched with.

64 prompts of mixed lengths (four past 512 tokens, so long prefill chunks and many-row
products run) generate the same tokens all together, in shuffled batches of 1, 7 and 64,
and under a smaller max_num_batched_tokens (long prompts prefilled in chunks of other
sizes). The tiny model is random, with its lm_head's rows in pairs a rounding error apart, so
that near-ties between the top two logits are common: with batch_invariant=False (torch's
GEMMs and SDPA past the kernels' limits) this comparison finds prompts whose continuation
changes."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import prompts_of_lengths, token_ids, write_tiny_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from deepinfer_dp import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LENGTHS = [520, 700, 601, 530] + [5 + (i * 53) % 240 for i in range(60)]
# SmolLM2 (30 layers) gets shorter prompts, two of them still past 512 tokens.
SMOLLM2_LENGTHS = [520, 600] + [5 + (i * 29) % 60 for i in range(62)]


def tiny_long_config(vocab_size: int) -> LlamaConfig:
    """Head size 64 (the kernels' fast path), positions for the long prompts."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                       rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def near_tie_model(path) -> str:
    """The tiny model with every odd lm_head row its even neighbour plus noise of about 1e-7:
    the two logits differ by a few ulp, so which wins depends on the last bits of the hidden
    state."""
    path = write_tiny_model(tiny_long_config, path)
    if not (path / "near-ties").exists():
        weights = load_file(path / "model.safetensors")
        head = weights["lm_head.weight"]
        noise = torch.randn(head[1::2].shape, generator=torch.Generator().manual_seed(0)) * 1e-7
        head[1::2] = head[0::2] + noise
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        (path / "near-ties").touch()
    return str(path)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> str:
    return near_tie_model(tmp_path_factory.getbasetemp() / "tiny-llama-near-ties")


def in_batches(llm: LLM, prompts: list[list[int]], size: int, seed: int) -> list[list[int]]:
    """Each prompt's tokens, the prompts generated `size` at a time in a shuffled order."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    out: dict[int, list[int]] = {}
    for start in range(0, len(order), size):
        part = order[start:start + size]
        results = token_ids(llm.generate(prompt_token_ids=[prompts[i] for i in part], sampling_params=GREEDY,
                                         use_tqdm=False))
        out.update(zip(part, results, strict=True))
    return [out[i] for i in range(len(prompts))]


def differing(reference: list[list[int]], other: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(reference, other, strict=True)) if a != b]


def check_invariance(model: str | None, prompts: list[list[int]], max_model_len: int, invariant: bool = True,
                     ) -> list[int]:
    """The prompts whose tokens changed with the batching, over every batching tried."""
    changed: set[int] = set()
    opts = dict(max_model_len=max_model_len, max_num_seqs=64, batch_invariant=invariant, enable_prefix_caching=False)
    llm = LLM(model, decode_sequence=False, **opts)
    try:
        together = in_batches(llm, prompts, len(prompts), seed=0)
        for size, seed in ((1, 1), (7, 2), (64, 3)):
            changed.update(differing(together, in_batches(llm, prompts, size, seed)))
    finally:
        llm.shutdown()
    llm = LLM(model, decode_sequence=False, max_num_batched_tokens=300, **opts)
    try:
        changed.update(differing(together, in_batches(llm, prompts, 7, seed=4)))
    finally:
        llm.shutdown()
    return sorted(changed)


def test_tiny_model_tokens_do_not_depend_on_the_batch(long_model_dir):
    prompts = prompts_of_lengths(LENGTHS)
    assert check_invariance(long_model_dir, prompts, max_model_len=1024) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)  # five passes over the 64 prompts; minutes on a loaded 2-core machine
def test_smollm2_tokens_do_not_depend_on_the_batch():
    prompts = prompts_of_lengths(SMOLLM2_LENGTHS, vocab=49152, offset=100)
    assert check_invariance(None, prompts, max_model_len=1024) == []
