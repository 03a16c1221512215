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
from model_utils import build_metadata, step_positions, write_tiny_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from deepinfer_dp.layers.rotary import rope_parameters  # noqa: E402
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
    return write_tiny_model(lambda vocab_size: tiny_moe_config(kind, vocab_size=vocab_size), path, seed)


def load_oracle(model_dir: str | os.PathLike):
    """transformers' model on the same directory: eager attention, its default experts path
    (grouped matrix products, then the sum over the k slots)."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager").eval()


LOGITS_ATOL = 1e-3


def oracle_logits(oracle, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return oracle(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = LOGITS_ATOL) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max |logit difference| {diff:.2e} >= {atol}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "greedy tokens differ"


def check_batched_decode(loaded: LoadedModel, oracle) -> None:
    """Three prompts prefilled together, then six forced tokens decoded as one batch: every
    step's logits against transformers on the whole sequence."""
    prompts = random_prompts(loaded.hf_config.vocab_size, [3, 17, 40], seed=1)
    forced = random_prompts(loaded.hf_config.vocab_size, [6, 6, 6], seed=2)
    seqs = PagedSequences(loaded, seed=3)
    seqs.step(dict(enumerate(prompts)), is_prefill=True)
    refs = [oracle_logits(oracle, p + f) for p, f in zip(prompts, forced, strict=True)]
    for step in range(6):
        logits = seqs.step({i: [forced[i][step]] for i in range(3)}, is_prefill=False)
        for i, ours in enumerate(logits):
            assert_close(ours[0], refs[i][len(prompts[i]) + step])


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


# ---- GGUF files of the tiny models, written the way llama.cpp's converter lays them out ----------
GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
               "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
               "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
               "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GGUF_EXPERT = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
                "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_gguf(kind: str, hf_dir: Path, out: Path) -> Path:
    """A GGUF file (F32 tensors, metadata, tokenizer) of a tiny MoE model of `kind`."""
    import re

    import gguf
    from gguf_utils import add_tokenizer
    from safetensors.torch import load_file
    from transformers import AutoConfig

    arch, config = GGUF_ARCH[kind], AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(out, arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = rope_parameters(config)["rope_theta"]
    for add, value in ((w.add_context_length, config.max_position_embeddings), (w.add_vocab_size, config.vocab_size),
                       (w.add_embedding_length, config.hidden_size), (w.add_block_count, config.num_hidden_layers),
                       (w.add_feed_forward_length, config.intermediate_size), (w.add_rope_dimension_count, head_dim),
                       (w.add_head_count, config.num_attention_heads), (w.add_key_length, head_dim),
                       (w.add_head_count_kv, config.num_key_value_heads), (w.add_value_length, head_dim),
                       (w.add_layer_norm_rms_eps, config.rms_norm_eps), (w.add_rope_freq_base, theta),
                       (w.add_expert_used_count, config.num_experts_per_tok)):
        add(value)
    w.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
    if arch != "llama":
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_weights_norm(bool(config.norm_topk_prob))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    add_tokenizer(w, hf_dir)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if m := re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((int(m[1]), _GGUF_EXPERT[m[3]]), {})[int(m[2])] = t
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's RoPE row order
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
        if name.endswith("shared_expert_gate.weight"):  # llama.cpp keeps it as a vector
            t = t.squeeze(0)
        w.add_tensor(_gguf_name(name), t.numpy())
    for (layer, proj), per in experts.items():
        w.add_tensor(f"blk.{layer}.{proj}.weight", torch.stack([per[e] for e in sorted(per)]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}.{suffix}"
