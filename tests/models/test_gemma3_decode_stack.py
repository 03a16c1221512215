"""Gemma 3, and any model with KV groups (Qwen2 with max_window_layers), through the one-call
C++ decode stack (models/llama_cpu_decode.py), with fused projections of packed parts too:
every step's hidden states equal the module path's bit for bit, and a sequence's tokens do
not depend on its batch. Each test reads the stack's count of steps, so it knows the stack
ran, not the modules. (Greedy tokens against transformers through the stack, with chunked
prefill, prefix hits and sequences past the window: test_gemma3.py, test_gemma3_hybrid.py
and test_sliding_window.py, which check that count too.)"""

from __future__ import annotations

import pytest
import torch
from model_utils import token_ids, write_tiny_model
from test_gemma3 import gemma3_config
from test_gemma3_hybrid import LAYER_TYPES
from test_gemma3_parts import write_quantized_gemma3
from test_llama_cpu_decode import hidden_per_step
from test_sliding_window import GREEDY, sliding_config, window_prompts

from deepinfer_dp import _C, LLM, SamplingParams
from deepinfer_dp.layers.packed import PackedLinear
from deepinfer_dp.models.llama_cpu_decode import LlamaCpuDecode

# (model, engine options): KV groups of one layer each (6 and 3), the same Gemma 3 in one group
# (window per layer, nothing freed), and Gemma 3 with a bf16 KV cache or in bf16 arithmetic.
CASES = {
    "gemma3-groups": ("gemma3", dict(num_kv_blocks=6 * 32 + 1)),
    "gemma3-one-group": ("gemma3", dict(num_kv_blocks=64, disable_hybrid_kv_cache_manager=True)),
    "gemma3-bf16-cache": ("gemma3", dict(num_kv_blocks=6 * 32 + 1, kv_cache_dtype="bfloat16")),
    # bf16 compute: on AMX the modules' MLP takes the one-pass gate/up and GELU product
    "gemma3-bf16-compute": ("gemma3", dict(num_kv_blocks=6 * 32 + 1, dtype="bfloat16")),
    "qwen2-max-window-layers": ("qwen2", dict(num_kv_blocks=3 * 32 + 1)),
    # fused projections of packed parts in different formats (Q4_K q/k with a Q6_K v, ...)
    "gemma3-packed-parts": ("gemma3-parts", dict(num_kv_blocks=4 * 32 + 1)),
}
KV_GROUPS = {"gemma3": 6, "qwen2": 3, "gemma3-parts": 4}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    return {"gemma3": write_tiny_model(lambda v: gemma3_config(v, num_hidden_layers=6, layer_types=LAYER_TYPES),
                                       root / "gemma3"),
            "qwen2": write_tiny_model(lambda v: sliding_config("qwen2", v), root / "qwen2"),
            "gemma3-parts": write_quantized_gemma3(root / "gemma3-parts")}


@pytest.mark.parametrize("case", list(CASES))
def test_stack_equals_the_modules_bit_for_bit(case, model_dirs, monkeypatch):
    kind, engine = CASES[case]
    passes = []
    one_pass = PackedLinear.gated
    monkeypatch.setattr(PackedLinear, "gated",
                        lambda self, x, act, *rest: passes.append(act) or one_pass(self, x, act, *rest))
    ids_on, hidden_on, stack = hidden_per_step(str(model_dirs[kind]), monkeypatch, True, 2, **engine)
    ids_off, hidden_off, _ = hidden_per_step(str(model_dirs[kind]), monkeypatch, False, 2, **engine)
    assert isinstance(stack, LlamaCpuDecode) and stack.steps >= 11  # every decode step went through it
    groups = 1 if engine.get("disable_hybrid_kv_cache_manager") else KV_GROUPS[kind]
    assert stack.stack.num_groups == groups
    assert ids_on == ids_off
    assert len(hidden_on) == len(hidden_off) > 10
    for a, b in zip(hidden_on, hidden_off, strict=True):
        assert torch.equal(a, b)
    one_pass_ran = engine.get("dtype") == "bfloat16" and _C.bf16_gated_fits(192, 64)  # Gemma's gate/up: 192 x 64
    assert set(passes) == ({"gelu_tanh"} if one_pass_ran else set())


def test_gemma3_tokens_do_not_depend_on_the_batch(model_dirs):
    prompts = window_prompts(16)[:8]
    params = SamplingParams(max_tokens=20, **GREEDY)
    llm = LLM(str(model_dirs["gemma3"]), decode_sequence=False, max_num_batched_tokens=32, block_size=4,
              num_kv_blocks=6 * 128 + 1, enable_prefix_caching=False)
    together = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False))
    runner = llm.llm_engine.worker.runner
    steps = runner.decode_stack_steps
    alone = [token_ids(llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False))[0]
             for p in prompts]
    assert steps >= 19 and runner.decode_stack_steps >= steps + 8 * 19  # batch 8 and batch 1 both on the stack
    assert together == alone
