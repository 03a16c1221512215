"""The lean CPU decode loop (models/llama_cpu_decode.py) gives every float the module path
gives: the hidden states of every step, compared bit for bit with the loop on and off, for
fp32 weights (CpuLinear), packed weights, q/k/v bias, Qwen3's q/k norms, tied embeddings,
GQA and a sliding window; and it stays out of the way of models it does not cover. (Gemma 3
and KV groups: test_gemma3_decode_stack.py.)"""

from __future__ import annotations

import pytest
import torch
from model_utils import build_tiny_model, prompts_of_lengths, tiny_config, token_ids, write_tiny_model
from moe_utils import build_tiny_moe
from test_packed_models import quantized_copy

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.models import llama_cpu_decode
from deepinfer_dp.models.llama_cpu_decode import LlamaCpuDecode

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def hidden_per_step(model_dir: str, monkeypatch, enabled: bool, threads: int, **engine) -> tuple[list, list, object]:
    """Token ids, and the hidden states handed to compute_logits at every step."""
    monkeypatch.setattr(llama_cpu_decode, "ENABLED", enabled)
    options = dict(decode_sequence=False, max_num_batched_tokens=64, num_kv_blocks=64, block_size=4,
                   max_model_len=128, torch_threads=threads) | engine
    llm = LLM(model_dir, **options)
    try:
        model = llm.llm_engine.worker.runner.model
        seen, logits = [], model.compute_logits
        monkeypatch.setattr(model, "compute_logits", lambda h: (seen.append(h.clone()), logits(h))[1])
        # A 40-token prompt is prefilled by the modules (longer than the kernel's chunks).
        prompts = prompts_of_lengths([5, 9, 3, 40])
        ids = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False))
        return ids, seen, model.cpu_decode
    finally:
        llm.shutdown()


def windowed_mistral(vocab_size: int):
    """The tiny Mistral with a sliding window of 8: the 40-token prompt and the outputs pass it."""
    config = tiny_config("mistral", vocab_size)
    config.sliding_window = 8
    return config


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qknorm", "mistral", "mistral-window",
                                  "q4_1"])
def test_decode_loop_equals_the_modules_bit_for_bit(kind, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("cpu_decode")
    if kind == "q4_1":
        model_dir = quantized_copy("llama-gqa", root, {"proj": "q4_1"})
    elif kind == "mistral-window":
        model_dir = str(write_tiny_model(windowed_mistral, root / kind))
    else:
        model_dir = str(build_tiny_model(kind, root / kind))
    threads = 2
    ids_on, hidden_on, loop = hidden_per_step(model_dir, monkeypatch, True, threads)
    ids_off, hidden_off, _ = hidden_per_step(model_dir, monkeypatch, False, threads)
    assert isinstance(loop, LlamaCpuDecode) and loop.steps >= 11  # the loop did run, every decode step
    assert ids_on == ids_off
    assert len(hidden_on) == len(hidden_off) > 10
    for a, b in zip(hidden_on, hidden_off, strict=True):
        assert torch.equal(a, b)


def test_speculative_verification_steps_equal_the_modules(tmp_path, monkeypatch):
    """n-gram drafts make steps of K + 1 tokens a sequence: the loop takes them too."""
    model_dir = str(build_tiny_model("llama-gqa", tmp_path / "llama"))
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 2, "disable_by_batch_size": None,
                                   "disable_by_acceptance": None}}
    ids_on, hidden_on, _ = hidden_per_step(model_dir, monkeypatch, True, 2, **spec)
    ids_off, hidden_off, _ = hidden_per_step(model_dir, monkeypatch, False, 2, **spec)
    assert ids_on == ids_off
    assert any(h.shape[0] > 4 for h in hidden_on)  # verification steps score several rows a sequence
    for a, b in zip(hidden_on, hidden_off, strict=True):
        assert torch.equal(a, b)


def test_models_it_does_not_cover_keep_the_module_path(tmp_path, monkeypatch):
    model_dir = str(build_tiny_moe("mixtral", tmp_path / "mixtral"))  # MoE layers
    _, _, loop = hidden_per_step(model_dir, monkeypatch, True, 1)
    assert loop is False
