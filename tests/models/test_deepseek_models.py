"""DeepSeek-V3 and V2-Lite-style models (MLA on the paged latent cache, DeepSeekMoE) against
transformers on the same tiny random weights: prefill logits through both attention paths
(absorbed and up-projected), batched absorbed decode, chunked prefill against one shot, greedy
output token for token through the whole engine on 16 prompts with chunked prefill and prefix
cache hits, the latent cache's layout and size, and checkpoint loading (next-n layers skipped,
missing weights named, expert shards)."""

from __future__ import annotations

import shutil

import pytest
import torch
from deepseek_utils import DEEPSEEK_KINDS, build_tiny_deepseek
from moe_utils import PagedSequences, assert_close, check_batched_decode, load_oracle, oracle_logits, random_prompts
from safetensors.torch import load_file, save_file

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.layers import mla
from deepinfer_dp.models import allocate_kv_cache, kv_cache_bytes_per_block, load_model
from deepinfer_dp.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_deepseek")


@pytest.fixture(scope="module", params=DEEPSEEK_KINDS)
def ds_models(request, ds_root):
    """(kind, our LoadedModel, the transformers oracle on the same directory)."""
    path = build_tiny_deepseek(request.param, ds_root / request.param)
    return request.param, load_model(str(path), torch.float32, "cpu"), load_oracle(path)


@pytest.mark.parametrize("path", ["absorbed", "up_projected"])
def test_prefill_matches_transformers(ds_models, path, monkeypatch):
    """Prompts of up to 32 tokens take the absorbed path on the CPU kernel, longer ones the
    up-projected one; forcing each covers both at every length."""
    if path == "up_projected":
        monkeypatch.setattr(mla, "KERNEL_MAX_QUERY_LEN", 0)
    else:
        monkeypatch.setattr(mla, "KERNEL_MAX_QUERY_LEN", 10_000)
    _, loaded, oracle = ds_models
    prompts = random_prompts(loaded.hf_config.vocab_size, [1, 7, 33, 100])
    logits = PagedSequences(loaded).step(dict(enumerate(prompts)), is_prefill=True)
    for ours, prompt in zip(logits, prompts, strict=True):
        assert_close(ours, oracle_logits(oracle, prompt))


def test_batched_decode_matches_transformers(ds_models):
    _, loaded, oracle = ds_models
    check_batched_decode(loaded, oracle)


def test_chunked_prefill_equals_one_shot(ds_models):
    """Chunks over cached context through both paths: 40 tokens (up-projected over the latents
    read back from the cache) and short ones (absorbed)."""
    _, loaded, _ = ds_models
    long, short = random_prompts(loaded.hf_config.vocab_size, [90, 9], seed=4)
    one_shot = PagedSequences(loaded).step({0: long, 1: short}, is_prefill=True)
    chunked = PagedSequences(loaded, seed=5)
    first = chunked.step({0: long[:10]}, is_prefill=True)[0]
    second = chunked.step({0: long[10:50], 1: short}, is_prefill=True)
    third = chunked.step({0: long[50:]}, is_prefill=True)[0]
    assert (torch.cat([first, second[0], third]) - one_shot[0]).abs().max().item() < 1e-4
    assert (second[1] - one_shot[1]).abs().max().item() < 1e-4


def test_greedy_engine_output_matches_transformers(ds_models, ds_root):
    """16 prompts of 1 to 90 tokens through LLM.generate with a 32-token step budget (long
    prompts prefilled in chunks beside decode steps), then the same prompts again, which hit
    the prefix cache. Greedy output equals transformers' if at every position transformers'
    argmax is our next token."""
    kind, loaded, oracle = ds_models
    lengths = [1, 3, 90, 5, 17, 2, 64, 8, 33, 4, 45, 11, 6, 27, 70, 9]
    prompts = random_prompts(loaded.hf_config.vocab_size, lengths, seed=7)
    llm = LLM(str(ds_root / kind), decode_sequence=False, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=256, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    try:
        first = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=greedy)
        hits_before = llm.rank_stats()[0]["prefix_hit_tokens"]
        again = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=greedy)
        hits = llm.rank_stats()[0]["prefix_hit_tokens"] - hits_before
    finally:
        llm.shutdown()
    assert hits > 0
    eos = oracle.generation_config.eos_token_id
    for prompt, outs, outs_again in zip(prompts, first, again, strict=True):
        output = [t for o in outs for t in o.token_ids]
        assert [t for o in outs_again for t in o.token_ids] == output
        assert len(output) == 12 or output[-1] == eos
        ref = oracle_logits(oracle, prompt + output)[len(prompt) - 1:-1].argmax(-1)
        assert ref.tolist() == output


def test_torch_paths_match_transformers(ds_models, monkeypatch):
    """With the C++ attention and experts kernels off, prefill and decode take the plain-torch
    paths CUDA and other dtypes use (gathered latent rows + SDPA, torch experts)."""
    from deepinfer_dp.layers import attention, moe

    monkeypatch.setattr(attention, "CPU_KERNEL", False)
    monkeypatch.setattr(moe, "CPU_KERNEL", False)
    _, loaded, oracle = ds_models
    prompts = random_prompts(loaded.hf_config.vocab_size, [5, 40], seed=11)
    forced = random_prompts(loaded.hf_config.vocab_size, [3, 3], seed=12)
    seqs = PagedSequences(loaded, seed=13)
    first = seqs.step(dict(enumerate(prompts)), is_prefill=True)
    refs = [oracle_logits(oracle, p + f) for p, f in zip(prompts, forced, strict=True)]
    for i, ours in enumerate(first):
        assert_close(ours, refs[i][:len(prompts[i])])
    for step in range(3):
        logits = seqs.step({i: [forced[i][step]] for i in range(2)}, is_prefill=False)
        for i, ours in enumerate(logits):
            assert_close(ours[0], refs[i][len(prompts[i]) + step])


def test_bf16_runs_close_to_fp32(ds_root):
    """bf16 weights, cache and activations: the torch paths (gathered latent rows, torch experts)."""
    from model_utils import build_metadata, step_positions

    path = str(build_tiny_deepseek("v3", ds_root / "v3"))
    prompt = random_prompts(400, [20], seed=8)[0]
    fp32 = PagedSequences(load_model(path, torch.float32, "cpu")).step({0: prompt}, True)[0]
    loaded = load_model(path, torch.bfloat16, "cpu")
    loaded.model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 16, 4, torch.bfloat16, "cpu"))
    md = build_metadata([20], [20], [[3, 1, 7, 2, 5]], 4, True)
    with torch.inference_mode():
        bf16 = loaded.model.compute_logits(loaded.model(torch.tensor(prompt), step_positions([20], [20]), md))
    # bf16 rounding flips a token's expert choice now and then (sigmoid scores near a tie), which
    # moves that row's logits a lot -- transformers' own bf16 run of this model is off its fp32
    # one by up to 2.5 -- so the typical row is what is checked.
    assert (bf16 - fp32).abs().max(dim=-1).values.median().item() < 0.5


def test_latent_cache_layout_and_size(ds_models):
    _, loaded, _ = ds_models
    config = loaded.hf_config
    caches = allocate_kv_cache(config, 8, 4, torch.float32, "cpu")
    entry = config.kv_lora_rank + config.qk_rope_head_dim
    assert len(caches) == config.num_hidden_layers
    assert all(c.shape == (8, 4, 1, entry) for c in caches)
    per_token = kv_cache_bytes_per_block(config, 4, torch.float32) // 4
    assert per_token == config.num_hidden_layers * entry * 4
    mha = mla.mha_equivalent_bytes_per_token(config, torch.float32)
    assert mha == config.num_hidden_layers * 4 * (16 + 16 + 24) * 4 and per_token < mha


def test_placeholder_step_runs_and_is_not_counted(ds_models):
    from model_utils import build_metadata

    _, loaded, _ = ds_models
    model = loaded.model
    model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 4, 4, torch.float32, "cpu"))
    md = build_metadata([2], [2], [[0]], 4, True)
    md.is_placeholder = True
    before = model.expert_tokens.copy()
    with torch.inference_mode():
        hidden = model(torch.zeros(2, dtype=torch.int64), torch.arange(2), md)
    assert torch.isfinite(hidden).all()
    assert (model.expert_tokens == before).all()


# ---- loading ----------------------------------------------------------------------------
def test_checkpoint_names_and_dense_first_layer(ds_root):
    path = build_tiny_deepseek("v3", ds_root / "v3")
    weights = load_file(path / "model.safetensors")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in weights
    assert "model.layers.0.mlp.gate_proj.weight" in weights  # first_k_dense_replace = 1
    model = load_model(str(path), torch.float32, "cpu").model
    assert model.moe_layer_indices == [1, 2]


def test_nextn_layer_in_checkpoint_is_not_loaded_into_the_decoder(ds_root, tmp_path):
    plain = load_model(str(build_tiny_deepseek("v3", ds_root / "v3")), torch.float32, "cpu").model
    path = build_tiny_deepseek("v3", tmp_path / "v3-nextn", with_nextn=True)
    assert "model.layers.3.eh_proj.weight" in load_file(path / "model.safetensors")
    model = load_model(str(path), torch.float32, "cpu").model
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_missing_weight_is_named(ds_root, tmp_path):
    src = build_tiny_deepseek("v2-lite", ds_root / "v2-lite")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.self_attn.kv_b_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.kv_b_proj\.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_expert_shard_loads_only_its_experts(ds_root):
    path = str(build_tiny_deepseek("v3", ds_root / "v3"))
    whole = load_model(path, torch.float32, "cpu").model
    half = load_model(path, torch.float32, "cpu", expert_shard=(1, 2)).model
    for full_block, half_block in zip(whole.moe_blocks, half.moe_blocks, strict=True):
        assert half_block.experts.first_expert == 4
        assert torch.equal(half_block.experts.w13, full_block.experts.w13[4:])
        assert torch.equal(half_block.shared_experts.gate_up_proj.weight, full_block.shared_experts.gate_up_proj.weight)
        assert torch.equal(half_block.gate.e_score_correction_bias, full_block.gate.e_score_correction_bias)
    assert not half.wants_weight("model.layers.1.mlp.experts.3.up_proj.weight")
    assert half.wants_weight("model.layers.1.mlp.experts.4.up_proj.weight")


def test_experts_with_no_rows_return_no_rows():
    """Under EP a rank may receive no token at all in a layer (top-2 of 8 experts, all on its
    peer): the kernel path must hand back an empty result, not fail on NumPy's empty strides."""
    from deepinfer_dp.layers.moe import FusedMoE

    moe = FusedMoE(8, 2, 64, 32, 1, shard=(1, 2))
    moe.w13.data.normal_()
    moe.w2.data.normal_()
    wide = torch.zeros(0, 69)
    out = moe.compute(wide[:, :64], torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2))
    assert out.shape == (0, 64)


def test_preemption_keeps_greedy_output(ds_root):
    """A latent cache too small for every sequence at once: sequences are preempted (their
    blocks freed) and recomputed, and the outputs are those of a roomy cache."""
    path = str(build_tiny_deepseek("v2-lite", ds_root / "v2-lite"))
    prompts = random_prompts(400, [30, 25, 28, 22, 26, 31], seed=9)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs, preemptions = [], []
    for blocks in (256, 30):
        llm = LLM(path, decode_sequence=False, max_num_batched_tokens=64, max_num_seqs=6, num_kv_blocks=blocks,
                  block_size=4, max_model_len=64)
        try:
            outputs.append([[t for o in outs for t in o.token_ids]
                            for outs in llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                                                     sampling_params=greedy)])
            preemptions.append(llm.rank_stats()[0]["num_preemptions"])
        finally:
            llm.shutdown()
    assert preemptions[0] == 0 and preemptions[1] > 0
    assert outputs[0] == outputs[1]
