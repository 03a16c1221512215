"""Tiny random Llama-family models (and a tiny tokenizer) for fast tests, plus a helper to
build AttentionMetadata by hand.

`build_tiny_model(kind, path)` writes a Hugging Face directory (config.json,
model.safetensors, tokenizer files with a ChatML chat template) that both our loader and
transformers' AutoModelForCausalLM / AutoTokenizer read offline. Everything is seeded, so
the same kind always gives the same weights and tokenizer.
"""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from deepinfer_dp.layers.attention import AttentionMetadata  # noqa: E402

TINY_MODEL_KINDS = ("llama-gqa", "llama-tied", "qwen2-bias", "qwen3-qknorm", "mistral")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Data parallel ranks step in lockstep until every rank is done.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, world! Tell me a story about a small model that could.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
    "user assistant system: answer briefly and clearly, please.",
]


def build_tiny_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences: any text encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def tiny_config(kind: str, vocab_size: int) -> PretrainedConfig:
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama-gqa":
        return LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, rope_theta=10000.0, **common)
    if kind == "llama-tied":  # multi-head (no GQA), tied, Llama 3.1 rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
        return LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           tie_word_embeddings=True, rope_scaling=rope, **common)
    if kind == "qwen2-bias":
        return Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           tie_word_embeddings=False, rope_theta=1000000.0, **common)
    if kind == "qwen3-qknorm":  # head_dim 32 != hidden / heads
        return Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, tie_word_embeddings=True, **common)
    if kind == "mistral":
        return MistralConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                             sliding_window=None, tie_word_embeddings=False, **common)
    raise ValueError(f"unknown tiny model kind {kind!r}; choose from {TINY_MODEL_KINDS}")


def build_tiny_model(kind: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Writes a tiny random model of `kind` (weights + tokenizer) to `path`, once."""
    return write_tiny_model(lambda vocab_size: tiny_config(kind, vocab_size=vocab_size), path, seed)


def write_tiny_model(make_config, path: str | os.PathLike, seed: int = 0) -> Path:
    """Writes a random model of `make_config(vocab_size)` with the tiny tokenizer to `path`, once."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    config = make_config(len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_biases_and_norms(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int, is_prefill: bool,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for sequences whose newest query_lens[i] tokens (of seq_lens[i]) are
    computed this step; block_tables[i] lists the sequence's blocks in order."""
    slots = []
    for qlen, slen, table in zip(query_lens, seq_lens, block_tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(slen - qlen, slen)]
    width = max(len(t) for t in block_tables)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for qlen in query_lens:
        starts.append(starts[-1] + qlen)
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens_host=list(query_lens), seq_lens_host=list(seq_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def step_positions(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """Flattened positions of the tokens computed this step."""
    pos = [p for qlen, slen in zip(query_lens, seq_lens, strict=True) for p in range(slen - qlen, slen)]
    return torch.tensor(pos, dtype=torch.int64)


def prompts_of_lengths(lengths: list[int], vocab: int = 400, offset: int = 3) -> list[list[int]]:
    """Deterministic prompts of the given lengths whose token ids fit the tiny vocabulary."""
    return [[offset + (i * 37 + j * 11) % (vocab - offset) for j in range(n)] for i, n in enumerate(lengths)]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, fp32, exactly `max_new_tokens`
    long (no EOS stop, like ignore_eos): the reference our engine must equal token for token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def token_ids(results) -> list[list[int]]:
    """Per prompt, the token ids of LLM.generate(..., decode_sequence=False) outputs."""
    return [[o.token_id for o in outs] for outs in results]


def randomize_biases_and_norms(model: torch.nn.Module) -> None:
    """transformers zeroes biases and sets norm weights to one; randomize them so that the
    bias and norm-weight paths are actually tested."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
