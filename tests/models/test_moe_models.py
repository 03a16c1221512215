"""Our paged-KV mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against
transformers on the same tiny random weights: prefill and batched decode logits within 1e-3,
chunked prefill against one shot, greedy output token for token through the whole engine on
16 prompts of mixed lengths (chunked prefill on), and loading of expert shards."""

from __future__ import annotations

import shutil

import pytest
import torch
from moe_utils import (
    MOE_KINDS,
    PagedSequences,
    assert_close,
    build_tiny_moe,
    check_batched_decode,
    load_oracle,
    oracle_logits,
    random_prompts,
)
from safetensors.torch import load_file, save_file

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.models import load_model
from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_moe")


@pytest.fixture(scope="module", params=MOE_KINDS)
def moe_models(request, moe_root):
    """(kind, our LoadedModel, the transformers oracle on the same directory)."""
    path = build_tiny_moe(request.param, moe_root / request.param)
    return request.param, load_model(str(path), torch.float32, "cpu"), load_oracle(path)


def test_prefill_matches_transformers(moe_models):
    _, loaded, oracle = moe_models
    prompts = random_prompts(loaded.hf_config.vocab_size, [1, 7, 33, 100])
    logits = PagedSequences(loaded).step(dict(enumerate(prompts)), is_prefill=True)
    for ours, prompt in zip(logits, prompts, strict=True):
        assert_close(ours, oracle_logits(oracle, prompt))


def test_batched_decode_matches_transformers(moe_models):
    _, loaded, oracle = moe_models
    check_batched_decode(loaded, oracle)


def test_chunked_prefill_equals_one_shot(moe_models):
    _, loaded, _ = moe_models
    long, short = random_prompts(loaded.hf_config.vocab_size, [37, 9], seed=4)
    one_shot = PagedSequences(loaded).step({0: long, 1: short}, is_prefill=True)
    chunked = PagedSequences(loaded, seed=5)
    first = chunked.step({0: long[:10]}, is_prefill=True)[0]
    second = chunked.step({0: long[10:36], 1: short}, is_prefill=True)
    third = chunked.step({0: long[36:]}, is_prefill=True)[0]
    assert (torch.cat([first, second[0], third]) - one_shot[0]).abs().max().item() < 1e-4
    assert (second[1] - one_shot[1]).abs().max().item() < 1e-4


def test_greedy_engine_output_matches_transformers(moe_models, moe_root):
    """16 prompts of 1 to 90 tokens through LLM.generate with a 32-token step budget, so
    long prompts are prefilled in chunks beside other sequences' decode steps. Greedy output
    equals transformers' if at every position of prompt + output transformers' argmax is our
    next token (one teacher-forced forward per prompt instead of a generate loop)."""
    kind, loaded, oracle = moe_models
    lengths = [1, 3, 90, 5, 17, 2, 64, 8, 33, 4, 45, 11, 6, 27, 70, 9]
    prompts = random_prompts(loaded.hf_config.vocab_size, lengths, seed=7)
    llm = LLM(str(moe_root / kind), decode_sequence=False, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=256, block_size=4)
    try:
        results = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                               sampling_params=SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        llm.shutdown()
    eos = oracle.generation_config.eos_token_id
    for prompt, outs in zip(prompts, results, strict=True):
        output = [t for o in outs for t in o.token_ids]
        assert len(output) == 12 or output[-1] == eos
        ref = oracle_logits(oracle, prompt + output)[len(prompt) - 1:-1].argmax(-1)
        assert ref.tolist() == output


def test_placeholder_step_runs_and_is_not_counted(moe_models):
    from model_utils import build_metadata

    from deepinfer_dp.models import allocate_kv_cache

    _, loaded, _ = moe_models
    model = loaded.model
    model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 4, 4, torch.float32, "cpu"))
    md = build_metadata([1], [1], [[0]], 4, True)
    md.is_placeholder = True
    before = model.expert_tokens.copy()
    with torch.inference_mode():
        hidden = model(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), md)
    assert torch.isfinite(hidden).all()
    assert (model.expert_tokens == before).all()


# ---- loading ----------------------------------------------------------------------------
def test_mixtral_checkpoint_uses_block_sparse_moe_names(moe_root):
    weights = load_file(build_tiny_moe("mixtral", moe_root / "mixtral") / "model.safetensors")
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in weights
    assert "model.layers.0.block_sparse_moe.gate.weight" in weights


def test_expert_shard_loads_only_its_experts(moe_root):
    path = str(build_tiny_moe("qwen2-moe", moe_root / "qwen2-moe"))
    whole = load_model(path, torch.float32, "cpu").model
    half = load_model(path, torch.float32, "cpu", expert_shard=(1, 2)).model
    for full_block, half_block in zip(whole.moe_blocks, half.moe_blocks, strict=True):
        assert half_block.experts.w13.shape[0] == 4 and half_block.experts.first_expert == 4
        assert torch.equal(half_block.experts.w13, full_block.experts.w13[4:])
        assert torch.equal(half_block.experts.w2, full_block.experts.w2[4:])
        # everything but the routed experts is replicated
        assert torch.equal(half_block.shared_expert.gate_up_proj.weight, full_block.shared_expert.gate_up_proj.weight)
    assert not half.wants_weight("model.layers.0.mlp.experts.3.up_proj.weight")
    assert half.wants_weight("model.layers.0.mlp.experts.4.up_proj.weight")


def test_missing_expert_weight_is_named(moe_root, tmp_path):
    src = build_tiny_moe("olmoe", moe_root / "olmoe")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.mlp.experts.5.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")
    # another rank's shard does not need it
    load_model(str(tmp_path), torch.float32, "cpu", expert_shard=(0, 2))


def test_bf16_moe_runs_close_to_fp32(moe_root):
    from model_utils import build_metadata, step_positions

    from deepinfer_dp.models import allocate_kv_cache

    path = str(build_tiny_moe("qwen3-moe", moe_root / "qwen3-moe"))
    prompt = random_prompts(400, [20], seed=8)[0]
    fp32 = PagedSequences(load_model(path, torch.float32, "cpu")).step({0: prompt}, True)[0]
    loaded = load_model(path, torch.bfloat16, "cpu")  # the torch experts path
    loaded.model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 16, 4, torch.bfloat16, "cpu"))
    md = build_metadata([20], [20], [[3, 1, 7, 2, 5]], 4, True)
    with torch.inference_mode():
        bf16 = loaded.model.compute_logits(loaded.model(torch.tensor(prompt), step_positions([20], [20]), md))
    assert (bf16 - fp32).abs().max().item() < 0.5
