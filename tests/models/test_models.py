"""Our paged-KV Llama-family models against Hugging Face transformers on the same weights.

For each tiny random model (tests/model_utils.py) and for the default SmolLM2-135M:
prefill logits, teacher-forced batched decode through a paged cache with shuffled blocks,
chunked prefill against one-shot prefill, the placeholder step, and greedy generation.
"""

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from model_utils import TINY_MODEL_KINDS, build_metadata, build_tiny_model, step_positions  # noqa: E402
from moe_utils import PagedSequences, assert_close, check_batched_decode, oracle_logits, random_prompts  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config  # noqa: E402

from deepinfer_dp.engine.sampling_defaults import sampling_defaults  # noqa: E402
from deepinfer_dp.models import (  # noqa: E402
    LoadedModel,
    allocate_kv_cache,
    convert_gguf,
    default_model_path,
    load_model,
)

BLOCK_SIZE = 4  # small, so sequences span many (shuffled) blocks
MODEL_NAMES = [*TINY_MODEL_KINDS, "smollm2"]
# The costlier SmolLM2 checks (many steps on a 135M model) run only with the slow tests.
SLOW_SMOLLM2 = [*TINY_MODEL_KINDS, pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="module", params=MODEL_NAMES)
def models(request, tiny_root):
    """(our LoadedModel, the transformers oracle on the same directory)."""
    name = request.param
    if name == "smollm2":
        loaded = load_model(None, torch.float32, "cpu")
    else:
        loaded = load_model(str(build_tiny_model(name, tiny_root / name)), torch.float32, "cpu")
    oracle = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    return loaded, oracle


def test_prefill_matches_transformers(models):
    loaded, oracle = models
    prompts = random_prompts(loaded.hf_config.vocab_size, [1, 7, 33, 100])
    logits = PagedSequences(loaded).step(dict(enumerate(prompts)), is_prefill=True)
    for ours, prompt in zip(logits, prompts, strict=True):
        assert_close(ours, oracle_logits(oracle, prompt))


def test_batched_decode_matches_transformers(models):
    check_batched_decode(*models)


@pytest.mark.parametrize("models", SLOW_SMOLLM2, indirect=True)
def test_decode_is_batch_invariant(models):
    """A sequence's logits don't depend on which other sequences share its decode step."""
    loaded, _ = models
    prompts = random_prompts(loaded.hf_config.vocab_size, [30, 5, 61, 12], seed=10)
    alone = PagedSequences(loaded, seed=11)
    alone.step({0: prompts[0]}, is_prefill=True)
    together = PagedSequences(loaded, seed=12)
    together.step(dict(enumerate(prompts)), is_prefill=True)
    for token in (7, 8, 9):
        solo = alone.step({0: [token]}, is_prefill=False)[0]
        batched = together.step({i: [token] for i in range(4)}, is_prefill=False)[0]
        assert (solo - batched).abs().max().item() < 5e-4
        assert torch.equal(solo.argmax(-1), batched.argmax(-1))


def test_chunked_prefill_equals_one_shot(models):
    loaded, _ = models
    long, short = random_prompts(loaded.hf_config.vocab_size, [37, 9], seed=4)
    one_shot = PagedSequences(loaded).step({0: long, 1: short}, is_prefill=True)
    chunked = PagedSequences(loaded, seed=5)
    # Chunk edges fall mid-block; the second step mixes a sequence with cached context and
    # a fresh one, the last a sequence whose whole chunk is one token.
    first = chunked.step({0: long[:10]}, is_prefill=True)[0]
    second = chunked.step({0: long[10:36], 1: short}, is_prefill=True)
    third = chunked.step({0: long[36:]}, is_prefill=True)[0]
    got_long = torch.cat([first, second[0], third])
    assert (got_long - one_shot[0]).abs().max().item() < 1e-4
    assert (second[1] - one_shot[1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("is_prefill", [False, True])
def test_placeholder_step_runs(models, is_prefill):
    loaded, _ = models
    model = loaded.model
    model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 4, BLOCK_SIZE, torch.float32, "cpu"))
    md = build_metadata([1], [1], [[0]], BLOCK_SIZE, is_prefill)
    with torch.inference_mode():
        hidden = model(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), md)
    assert hidden.shape == (1, loaded.hf_config.hidden_size)
    assert torch.isfinite(hidden).all()


def greedy_generate(loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None) -> list[list[int]]:
    """A minimal engine loop: one batched prefill, then batched decode steps."""
    seqs = PagedSequences(loaded, seed=6)
    logits = seqs.step(dict(enumerate(prompts)), is_prefill=True)
    outputs = {i: [int(lg[-1].argmax())] for i, lg in enumerate(logits)}
    running = [i for i in outputs if outputs[i][-1] != eos_token_id]
    while running:
        logits = seqs.step({i: [outputs[i][-1]] for i in running}, is_prefill=False)
        for i, lg in zip(running, logits, strict=True):
            outputs[i].append(int(lg[0].argmax()))
        running = [i for i in running
                   if len(outputs[i]) < max_new_tokens and outputs[i][-1] != eos_token_id]
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("models", SLOW_SMOLLM2, indirect=True)
def test_greedy_generation_matches_transformers(models):
    loaded, oracle = models
    prompts = random_prompts(loaded.hf_config.vocab_size, [4, 11, 26], seed=7)
    eos = oracle.generation_config.eos_token_id
    ours = greedy_generate(loaded, prompts, 16, eos)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            ref = oracle.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=oracle.generation_config.pad_token_id)
        assert got == ref[0, len(prompt):].tolist()


# ---- loading --------------------------------------------------------------------------


def test_bf16_model_runs_close_to_fp32(tiny_root):
    path = str(build_tiny_model("qwen3-qknorm", tiny_root / "qwen3-qknorm"))
    prompt = random_prompts(400, [20], seed=8)[0]
    fp32 = PagedSequences(load_model(path, torch.float32, "cpu")).step({0: prompt}, True)[0]
    loaded = load_model(path, torch.bfloat16, "cpu")
    loaded.model.bind_kv_cache(allocate_kv_cache(loaded.hf_config, 16, BLOCK_SIZE,
                                                 torch.bfloat16, "cpu"))
    md = build_metadata([20], [20], [[3, 1, 7, 2, 5]], BLOCK_SIZE, True)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(prompt), step_positions([20], [20]), md)
        bf16 = loaded.model.compute_logits(hidden)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.5


def test_sharded_checkpoint_loads_like_unsharded(tiny_root, tmp_path):
    path = build_tiny_model("llama-gqa", tiny_root / "llama-gqa")
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    oracle.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = random_prompts(400, [12], seed=9)[0]
    sharded = PagedSequences(load_model(str(tmp_path), torch.float32, "cpu")).step({0: prompt}, True)
    whole = PagedSequences(load_model(str(path), torch.float32, "cpu")).step({0: prompt}, True)
    assert torch.equal(sharded[0], whole[0])


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"), torch.float32, "cpu")


def test_directory_without_weights_is_named(tiny_root, tmp_path):
    build_tiny_model("llama-tied", tiny_root / "llama-tied")
    shutil.copy(tiny_root / "llama-tied" / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_missing_weight_is_named(tiny_root, tmp_path):
    src = build_tiny_model("llama-gqa", tiny_root / "llama-gqa")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_architecture_is_named(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_failed_gguf_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_DP_CACHE", str(tmp_path / "cache"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        load_model(str(bogus), torch.float32, "cpu")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_default_model_cache_is_a_hf_directory():
    gguf_file = default_model_path()
    assert gguf_file.suffix == ".gguf"
    cache_dir = convert_gguf(gguf_file)  # converted once, then reused
    assert convert_gguf(gguf_file) == cache_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cache_dir.iterdir()}
    tokenizer = AutoTokenizer.from_pretrained(cache_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    # its GGUF metadata recommends no sampling: the model card's settings stand in
    assert sampling_defaults("auto", cache_dir) == {"temperature": 0.2, "top_p": 0.9}


def test_tiny_model_has_a_working_tokenizer(tiny_root):
    path = build_tiny_model("llama-gqa", tiny_root / "llama-gqa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "Hello, world! The capital of France is Paris."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert max(ids) < AutoConfig.from_pretrained(path).vocab_size
    assert tokenizer.eos_token_id == 2
