"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for tests,
written as Hugging Face directories that our loader and transformers both read offline, and
a small paged-cache harness that runs our model step by step.

`build_tiny_moe(kind, path)` is seeded: the same kind always gives the same weights. The
checkpoints carry the real families' tensor names (transformers saves the per-expert names
Mixtral's and Qwen's released checkpoints use).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from model_utils import build_metadata, build_tiny_tokenizer, step_positions  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from deepinfer_dp.models import LoadedModel, allocate_kv_cache  # noqa: E402

MOE_KINDS = ("mixtral", "qwen2-moe", "qwen3-moe", "olmoe")
BLOCK_SIZE = 4


def tiny_moe_config(kind: str, vocab_size: int) -> PretrainedConfig:
    common = dict(vocab_size=vocab_size, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-5,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if kind == "mixtral":  # top-2 of 8, always renormalized
        return MixtralConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                             intermediate_size=48, sliding_window=None, **common)
    if kind == "qwen2-moe":  # shared expert with a sigmoid gate; layer 1 dense; top-4 unnormalized
        return Qwen2MoeConfig(num_hidden_layers=3, num_experts=8, num_experts_per_tok=4,
                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                              intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False, **common)
    if kind == "qwen3-moe":  # per-head q/k norm, head_dim 32 != hidden / heads, normalized top-k
        return Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, head_dim=32,
                              moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True, **common)
    if kind == "olmoe":  # whole-vector q/k norm and clip_qkv
        return OlmoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                           clip_qkv=3.0, norm_topk_prob=False, **common)
    raise ValueError(f"unknown tiny MoE kind {kind!r}; choose from {MOE_KINDS}")


def build_tiny_moe(kind: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Writes a tiny random MoE model of `kind` (weights + tokenizer) to `path`, once."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    tokenizer = build_tiny_tokenizer()
    config = tiny_moe_config(kind, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # transformers zeroes biases and sets norm weights to one; randomize them so that
        # the bias and norm paths are really tested.
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_oracle(model_dir: str | os.PathLike):
    """transformers' model on the same directory: eager attention, its default experts path
    (grouped matrix products, then the sum over the k slots)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


class PagedSequences:
    """A KV cache plus block tables for a few sequences, blocks handed out in random order."""

    def __init__(self, loaded: LoadedModel, num_blocks: int = 256, seed: int = 0):
        self.model = loaded.model
        self.kv_cache = allocate_kv_cache(loaded.hf_config, num_blocks, BLOCK_SIZE, torch.float32,
                                          torch.device("cpu"))
        self.free = list(range(1, num_blocks))  # block 0 is the reserved dummy block
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new_tokens: dict[int, list[int]], is_prefill: bool) -> list[torch.Tensor]:
        """One forward over the new tokens of each sequence; logits per sequence."""
        seq_ids = list(new_tokens)
        query_lens = [len(new_tokens[s]) for s in seq_ids]
        seq_lens = []
        for s, qlen in zip(seq_ids, query_lens, strict=True):
            self.lens[s] = self.lens.get(s, 0) + qlen
            table = self.tables.setdefault(s, [])
            while len(table) * BLOCK_SIZE < self.lens[s]:
                table.append(self.free.pop())
            seq_lens.append(self.lens[s])
        md = build_metadata(query_lens, seq_lens, [self.tables[s] for s in seq_ids], BLOCK_SIZE, is_prefill)
        input_ids = torch.tensor([t for s in seq_ids for t in new_tokens[s]], dtype=torch.int64)
        self.model.bind_kv_cache(self.kv_cache)
        with torch.inference_mode():
            hidden = self.model(input_ids, step_positions(query_lens, seq_lens), md)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
