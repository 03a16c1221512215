"""Llama-family decoder on a paged KV cache: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

The families differ only in small switches read from the config: q/k/v bias (Qwen2),
per-head q/k RMSNorm before RoPE (Qwen3), tied embeddings, rope scaling. The q/k/v and
gate/up projections are fused into one Linear each at load time (one matmul instead of
three or two); load_weights takes Hugging Face names and slices them in.
"""

from collections.abc import Iterable
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from deepinfer_dp.layers.activation import gated_product
from deepinfer_dp.layers.attention import Attention, AttentionMetadata, ForwardContext
from deepinfer_dp.layers.mla import allocate_mla_cache, is_mla, mla_bytes_per_block
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.packed import takes_bf16_rows
from deepinfer_dp.layers.rotary import RotaryEmbedding, make_rotary, rope_parameters
from deepinfer_dp.models.llama_cpu_decode import LlamaCpuDecode
from deepinfer_dp.utils.cpu_malloc import resident_zeros


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def num_layers(config) -> int:
    return config.num_hidden_layers


def kv_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """Shape of one layer's K (and of its V) cache tensor."""
    return (num_blocks, block_size, num_kv_heads(config), head_dim(config))


def kv_cache_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V: for sizing the cache to memory."""
    if is_mla(config):  # DeepSeek: one latent row per token and layer
        return mla_bytes_per_block(config, block_size, dtype)
    per_layer = block_size * num_kv_heads(config) * head_dim(config) * dtype.itemsize
    return 2 * num_layers(config) * per_layer


def allocate_kv_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                      layers: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]] | list[torch.Tensor]:
    """Per layer a (K, V) cache pair; for MLA models (DeepSeek) one latent cache tensor.
    `layers`: how many pairs (KV groups share them), default one per layer."""
    if is_mla(config):
        return allocate_mla_cache(config, num_blocks, block_size, dtype, device)
    layers = num_layers(config) if layers is None else layers
    shape = kv_cache_shape(config, num_blocks, block_size)
    if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        # One allocation for all layers, resident from the start as vLLM's is: written lazily,
        # its pages were faulted in inside decode steps (a fresh engine's first round of 64
        # prompts 10-20% slower). (bf16: zeroed uint16, viewed.)
        np_dtype = np.float32 if dtype == torch.float32 else np.uint16
        whole = torch.from_numpy(resident_zeros((layers, 2, *shape), np_dtype)).view(dtype)
        return [(layer[0], layer[1]) for layer in whole]
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]


def max_context_len(config) -> int:
    """Longest context this model computes exactly like transformers: its position limit (a
    sliding window limits what attention sees, not how long a sequence grows)."""
    return config.max_position_embeddings


def sliding_window(config, layer_index: int) -> int:
    """The sliding window of layer `layer_index`'s attention, 0 for none, as transformers
    reads it: `layer_types` where the config has them (Qwen2's max_window_layers, Gemma 3's
    pattern), else every layer when the window is in use (Mistral, Mixtral)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_index] == "sliding_attention" else 0
    uses_window = getattr(config, "use_sliding_window", config.model_type in ("mistral", "mixtral"))
    return int(window) if uses_window else 0


def attention_layout(config) -> tuple[bool, bool, str | None]:
    """(q/k/v bias, o_proj bias, q/k RMSNorm) of a family: the norm is None, "head" (Qwen3:
    each head before RoPE) or "full" (OLMoE: all heads of q, and of k, as one vector)."""
    model_type = config.model_type
    if model_type in ("qwen2", "qwen2_moe", "qwen2_vl_text", "qwen2_5_vl_text"):
        # q/k/v bias (qkv_bias in Qwen2-MoE), none on o_proj
        return bool(getattr(config, "qkv_bias", True)), False, None
    bias = bool(getattr(config, "attention_bias", False))
    norm = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmoe": "full"}.get(model_type)
    return bias, bias, norm


class LlamaAttention(nn.Module):
    def __init__(self, config, context: ForwardContext, rotary_emb: RotaryEmbedding, window: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = num_kv_heads(config)
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias, o_bias, self.qk_norm = attention_layout(config)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        if self.qk_norm:
            full = self.qk_norm == "full"
            self.q_norm = RMSNorm(self.q_size if full else self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size if full else self.head_dim, config.rms_norm_eps)
        self.clip_qkv = getattr(config, "clip_qkv", None)  # OLMoE: clamp q/k/v after the norm
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, context, window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # Qwen3 normalizes each head before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, rounded=takes_bf16_rows(self.o_proj)))


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        bias = getattr(config, "mlp_bias", False)
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_product(self.gate_up_proj, x, "silu", takes_bf16_rows(self.down_proj)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, context: ForwardContext, rotary_emb: RotaryEmbedding, layer_index: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, context, rotary_emb, sliding_window(config, layer_index))
        self.mlp = self.make_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream under it): the next layer's input norm
        (or the model's final one) adds the two as it normalizes, in the same pass, rather than
        a separate add over every row. `hidden` is the previous layer's MLP output, or with
        residual None the embeddings."""
        # A norm whose rows go to a bf16 product hands them over rounded (packed.takes_bf16_rows).
        attn_rounds = type(self.self_attn) is LlamaAttention and takes_bf16_rows(self.self_attn.qkv_proj)
        mlp_rounds = type(self.mlp) is LlamaMLP and takes_bf16_rows(self.mlp.gate_up_proj)
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden, attn_rounds)
        else:
            residual, normed = self.input_layernorm.add_and_norm(hidden, residual, attn_rounds)
        attn_out = self.self_attn(positions, normed)
        residual, normed = self.post_attention_layernorm.add_and_norm(attn_out, residual, mlp_rounds)
        return self.mlp(normed), residual

    def make_mlp(self, config, layer_index: int) -> nn.Module:
        """The layer's feed-forward block (mixture-of-experts models override this)."""
        return LlamaMLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config, context: ForwardContext, decoder_layer=LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # One RoPE table for all layers (it is the same for each, and not small).
        rotary_emb = make_rotary(head_dim(config), config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList(decoder_layer(config, context, rotary_emb, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm.add_and_norm(hidden, residual)[1]


# HF name of a separate projection -> (our fused parameter, shard index).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    # Holds routed experts (built with an expert shard; never packed): see models/registry.py.
    mixture_of_experts: ClassVar[bool] = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.context = ForwardContext()
        self.model = self.make_model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Decode steps on CPU through NumPy buffers (llama_cpu_decode.py); built at the first
        # forward, once the weights are loaded and in their kernels' formats. False: not usable.
        self.cpu_decode: LlamaCpuDecode | bool | None = None
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_model(self, config) -> nn.Module:
        return LlamaModel(config, self.context)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV cache pairs for {len(layers)} layers")
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            layer.self_attn.attn.k_cache = k_cache
            layer.self_attn.attn.v_cache = v_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the flattened tokens of this step; `inputs_embeds`
        (image rows spliced in) replaces the lookup of `input_ids`."""
        self.context.attn_metadata = attn_metadata
        try:
            if self.cpu_decode is None:
                self.cpu_decode = (self.stack_layers() and self.build_cpu_decode()) or False
            if inputs_embeds is None and self.cpu_decode and self.cpu_decode.applies(input_ids, attn_metadata):
                return self.cpu_decode(input_ids, positions, attn_metadata)
            if inputs_embeds is None:
                return self.model(input_ids, positions)
            return self.model(input_ids, positions, inputs_embeds)
        finally:
            self.context.attn_metadata = None

    def stack_layers(self) -> bool:
        """Every layer is one the one-call decode stack runs (this file's decoder layer with
        its dense MLP); a family with layers of its own (MoE, DeepSeek's) overrides this.
        The packed loader asks too: it joins Q4_0/Q5_0/Q8_0 parts into one Q8_0 matrix there."""
        return all(type(layer) is LlamaDecoderLayer and type(layer.mlp) is LlamaMLP for layer in self.model.layers)

    def build_cpu_decode(self) -> LlamaCpuDecode | None:
        """The one-call decode stack over this model's layers, or None where it does not apply."""
        return LlamaCpuDecode.build(self.model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        """Copies Hugging Face-named tensors in; raises ValueError naming missing weights.
        `loaded_elsewhere`: checkpoint names already in place (packed modules hold them)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set(loaded_elsewhere)
        for name, tensor in weights:
            self.load_weight(name, tensor, params, loaded)
        self._check_complete(params, loaded)

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    loaded: set[str]) -> None:
        """Copies one Hugging Face-named tensor into its place; records it in `loaded`."""
        if "rotary_emb.inv_freq" in name:
            return  # recomputed, never trained
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return  # some tied checkpoints still store it: same values as the embedding
        target, shard = _our_name(name)
        if target not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
        _copy_shard(name, params[target], tensor, shard, self._shard_sizes(target, params[target]))
        loaded.add(name if shard is None else f"{target}#{shard}")

    def _shard_sizes(self, target: str, param: nn.Parameter) -> list[int]:
        if "qkv_proj" in target:
            attn = self.model.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [param.shape[0] // 2] * 2  # gate_up_proj: gate rows, then up rows

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        if "lm_head.weight" not in loaded and not self.tie_word_embeddings:
            # A checkpoint without lm_head shares the embedding (tied in all but the config).
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tie_word_embeddings = True
            loaded.add("lm_head.weight")
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in name), None)
            if fused:  # report the Hugging Face names of the missing pieces
                missing += [name.replace(fused, hf) for hf, (target, shard) in _FUSED.items()
                            if target == fused and f"{name}#{shard}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:8])}"
                             + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _our_name(hf_name: str) -> tuple[str, int | None]:
    for proj, (fused, shard) in _FUSED.items():
        if f".{proj}." in hf_name:
            return hf_name.replace(proj, fused), shard
    return hf_name, None


def _copy_shard(name: str, param: nn.Parameter, tensor: torch.Tensor, shard: int | None,
                sizes: list[int]) -> None:
    with torch.no_grad():
        if shard is None:
            dst = param
        else:
            dst = param.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(dst.shape)}")
        dst.copy_(tensor)
