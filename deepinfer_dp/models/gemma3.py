"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text) on the paged KV cache.

What sets it apart from the Llama layout, each as transformers computes it:
- local (sliding-window) and global attention layers interleaved (`layer_types`), each kind
  with its own RoPE base (`rope_local_base_freq` for local layers, `rope_theta` and any
  rope scaling for global ones: `rope_parameters` per layer type in transformers 5);
- per-head q/k RMSNorm before RoPE, and the attention scale `query_pre_attn_scalar ** -0.5`;
- RMSNorm as x * (1 + weight): the checkpoint stores weight, we load 1 + weight (fp32, the
  sum transformers forms at every call) so the norm kernels run unchanged;
- a norm after attention and after the feed-forward block as well as before each;
- embeddings scaled by sqrt(hidden_size) (in the weights' dtype), GeGLU (tanh GELU) in the
  feed-forward block, tied embeddings, and optional final logit soft-capping.

The q/k/v and gate/up projections are fused as in llama.py (its loader and the packed
loader build them alike). On CPU, decode steps (and short prefill chunks) run through the
one-call C++ decode stack (llama_cpu_decode.py) with this layer's layout: the norms after
each sublayer, GeGLU (`_C.gelu_tanh_mul`, which the modules call too), a RoPE table per
layer kind and each layer's KV group; the embedding scale and the soft-cap stay here.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_dp.layers.activation import gated_product
from deepinfer_dp.layers.attention import ForwardContext
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.packed import takes_bf16_rows
from deepinfer_dp.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer_dp.models.llama import LlamaAttention, LlamaForCausalLM, head_dim
from deepinfer_dp.models.llama_cpu_decode import LlamaCpuDecode, StackLayout

_LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(config) -> list[str]:
    """Each layer's kind; configs without `layer_types` give a pattern (every
    `sliding_window_pattern`-th layer global, the rest local)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_hidden_layers)]


def rope_for(config, layer_type: str) -> dict:
    """RoPE settings of one kind of layer: transformers 5 keeps them per layer type; older
    configs give rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for local."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return rope_parameters(_Rope(params[layer_type]))
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return rope_parameters(config)


class _Rope:
    """A config-like view of one layer type's RoPE dict, for rope_parameters."""

    def __init__(self, params: dict):
        self.rope_parameters = params


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r} (only gelu_pytorch_tanh)")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_product(self.gate_up_proj, x, "gelu_tanh", takes_bf16_rows(self.down_proj)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, context: ForwardContext, rotary: dict[str, RotaryEmbedding], layer_index: int):
        super().__init__()
        kind = layer_types(config)[layer_index]
        window = int(config.sliding_window or 0) if kind == "sliding_attention" else 0
        self.self_attn = LlamaAttention(config, context, rotary[kind], window)
        self.self_attn.attn.scale = config.query_pre_attn_scalar ** -0.5
        self.mlp = Gemma3MLP(config)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # The norms before the two first products hand their rows over rounded where those
        # products round them to bf16 anyway (packed.takes_bf16_rows).
        attn_out = self.self_attn(positions, self.input_layernorm(hidden, takes_bf16_rows(self.self_attn.qkv_proj)))
        hidden = hidden + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden, takes_bf16_rows(self.mlp.gate_up_proj)))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3Model(nn.Module):
    def __init__(self, config, context: ForwardContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # transformers keeps sqrt(hidden) as a tensor and casts it to the weights' dtype.
        self.embed_scale = math.sqrt(config.hidden_size)
        rotary = {kind: RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope_for(config, kind))
                  for kind in _LAYER_TYPES}
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, context, rotary, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; loading, tying and the paged cache as in LlamaForCausalLM."""

    def __init__(self, config):
        _check_config(config)
        super().__init__(config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def make_model(self, config) -> nn.Module:
        return Gemma3Model(config, self.context)

    def stack_layers(self) -> bool:
        return all(type(layer) is Gemma3DecoderLayer and type(layer.mlp) is Gemma3MLP for layer in self.model.layers)

    def build_cpu_decode(self) -> LlamaCpuDecode | None:
        model = self.model
        layout = StackLayout(sandwich_norms=True, activation="gelu_tanh", embed_scale=model.embed_scale)
        return LlamaCpuDecode.build(model, layout)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    loaded: set[str]) -> None:
        if name.endswith("norm.weight"):  # Gemma's RMSNorm scales by (1 + weight)
            tensor = 1.0 + tensor.float()
        super().load_weight(name, tensor, params, loaded)


def _check_config(config) -> None:
    """Refuses, by name, what this implementation does not compute."""
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported (the attention kernels do not cap)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (a decoder attends causally)")
    bad = sorted(set(layer_types(config)) - set(_LAYER_TYPES))
    if bad:
        raise ValueError(f"Gemma 3 layer types {bad} are not supported (only {list(_LAYER_TYPES)})")
