"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) on the paged
latent cache.

Attention is multi-head latent attention (layers/mla.py). The feed-forward block is dense in
the first `first_k_dense_replace` layers and DeepSeekMoE after them: shared experts (one SwiGLU
of n_shared_experts x moe_intermediate_size) plus routed experts through the MoE layer and its
expert-parallel dispatch (layers/moe.py), routed the way transformers routes each version:
  * V2: softmax; top-k over all experts ("greedy") or over the best topk_group groups by
    their best expert ("group_limited_greedy"); times routed_scaling_factor. (transformers
    does not renormalize V2's top-k weights even with norm_topk_prob; neither do we.)
  * V3 (noaux_tc): sigmoid scores; experts chosen by score + e_score_correction_bias within
    the topk_group groups of best top-2 sum; weighted by the plain scores, renormalized with
    norm_topk_prob, times routed_scaling_factor.

Checkpoints load with their real names. DeepSeek's rotary part is laid out in interleaved
pairs; the rope rows of q_proj/q_b_proj and kv_a_proj_with_mqa are permuted at load time into
the rotate-half layout our RoPE kernel applies (q.k is unchanged by permuting both). The
next-n (MTP) layers a checkpoint stores after the last decoder layer are not read here
(models/deepseek_mtp.py reads them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial

import torch
from torch import nn

from deepinfer_dp.layers.attention import ForwardContext
from deepinfer_dp.layers.mla import MLAttention
from deepinfer_dp.layers.moe import FusedMoE
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.rotary import RotaryEmbedding
from deepinfer_dp.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from deepinfer_dp.models.moe_models import MoeForCausalLM

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def routing_method(config) -> str:
    if config.model_type == "deepseek_v3":
        return "noaux_tc"
    method = getattr(config, "topk_method", None) or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r} (greedy, group_limited_greedy)")
    return method


def grouped_mask(choice: torch.Tensor, num_groups: int, topk_group: int, group_score: str) -> torch.Tensor:
    """bool [T, E]: the experts in each token's best `topk_group` groups, groups ranked by
    their best score ("max") or the sum of their best two ("top2")."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    if group_score == "max":
        scores = grouped.max(dim=-1).values
    else:
        scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(scores, k=topk_group, dim=-1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand_as(grouped).reshape(choice.shape)


class DeepseekRouter(nn.Module):
    """mlp.gate of a DeepSeekMoE layer: the router weight (and V3's score-correction bias)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.method = routing_method(config)
        self.num_groups, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = bool(config.norm_topk_prob) and self.method == "noaux_tc"
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size), requires_grad=False)
        if self.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int32 [T, k], weights fp32 [T, k]); router math in fp32 as transformers."""
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            if self.num_groups and self.num_groups > 1:
                choice = choice.masked_fill(~grouped_mask(choice, self.num_groups, self.topk_group, "top2"),
                                            float("-inf"))
            ids = torch.topk(choice, k=self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                scores = scores.masked_fill(~grouped_mask(scores, self.num_groups, self.topk_group, "max"), 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1)
        return ids.to(torch.int32), weights * self.scaling


class DeepseekMoE(nn.Module):
    """Routed experts (this rank's share under EP) plus the always-on shared experts."""

    def __init__(self, config, layer_index: int, shard: tuple[int, ...]) -> None:
        super().__init__()
        self.gate = DeepseekRouter(config)
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, layer_index, shard)
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * config.n_shared_experts)
        self.counted = True  # set per step by the model: False for the placeholder's dummy token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights, self.counted) + self.shared_experts(x)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, context: ForwardContext, rotary_emb: RotaryEmbedding, layer_index: int,
                 shard: tuple[int, ...]) -> None:
        nn.Module.__init__(self)  # the Llama layer's attention is not built: MLA replaces it
        self.self_attn = MLAttention(config, context, rotary_emb)
        if layer_index >= config.first_k_dense_replace:
            self.mlp = DeepseekMoE(config, layer_index, shard)
        else:
            self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def rope_rows_to_rotate_half(cfg, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Reorders the rope rows of an attention projection from interleaved pairs (x0, x1),
    (x2, x3), ... to halves (x0, x2, ...; x1, x3, ...); other tensors pass unchanged."""
    rope = cfg.qk_rope_head_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        heads = tensor.view(cfg.num_attention_heads, cfg.qk_nope_head_dim + rope, -1)
        rope_rows = heads[:, cfg.qk_nope_head_dim:][:, order]
        return torch.cat([heads[:, :cfg.qk_nope_head_dim], rope_rows], dim=1).reshape(tensor.shape)
    if ".kv_a_proj_with_mqa." in name:
        return torch.cat([tensor[:cfg.kv_lora_rank], tensor[cfg.kv_lora_rank:][order]])
    return tensor


def interleaved_rope(config) -> bool:
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


class DeepseekForCausalLM(MoeForCausalLM):
    # The MTP layer drafting for this model (spec_decode/mtp.py attaches it; a tuple, so not a
    # submodule): its MoE dispatches over the same EP group as the decoder's.
    nextn: tuple = ()

    def bind_ep_group(self, ep, backend: str, eplb=None) -> None:
        super().bind_ep_group(ep, backend, eplb)
        for mtp in self.nextn:
            mtp.bind_dispatcher(self.dispatcher, self.expert_shard[:2], self.source_dir)  # its experts do not move

    def make_model(self, config) -> nn.Module:
        # One rotary table of qk_rope_head_dim (config.head_dim in transformers' DeepSeek configs).
        return LlamaModel(config, self.context, partial(DeepseekDecoderLayer, shard=self.expert_shard))

    @property
    def interleaved_rope(self) -> bool:
        return interleaved_rope(self.config)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor]) -> None:
        """One latent cache tensor per layer (layers/mla.py allocate_mla_cache)."""
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} latent caches for {len(layers)} layers")
        for layer, cache in zip(layers, kv_caches, strict=True):
            layer.self_attn.cache = cache

    # ---- loading -----------------------------------------------------------------------
    def is_nextn_weight(self, name: str) -> bool:
        """The next-n (MTP) layers DeepSeek stores as model.layers.<num_hidden_layers + i>."""
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match.group(1)) >= self.config.num_hidden_layers

    def wants_weight(self, name: str) -> bool:
        return not self.is_nextn_weight(name) and super().wants_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((n, t) for n, t in weights if not self.is_nextn_weight(n))

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    loaded: set[str]) -> None:
        if ".self_attn." not in name:
            super().load_weight(name, tensor, params, loaded)  # norms, MLPs (fused gate/up), router
            return
        if name not in params:
            raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
        if self.interleaved_rope:
            tensor = rope_rows_to_rotate_half(self.config, name, tensor)
        if params[name].shape != tensor.shape:
            raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor)
        loaded.add(name)

