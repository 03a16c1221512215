"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache.

Per token the cache holds one vector per layer: the compressed latent c (kv_lora_rank, after
kv_a_layernorm) followed by the rotary key k_pe (qk_rope_head_dim) that all heads share --
not per-head keys and values. Its blocks are the same blocks the C++ block manager hands out
for any model (block 0 the placeholder's, prefix caching and preemption unchanged); one layer's
cache is [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim].

Keys and values are up-projections of c by kv_b_proj: per head k_nope = W_uk c, v = W_uv c.
Two ways to attend:
  * absorbed (decode, and short prefill chunks on the CPU kernel): q_nope is moved into latent
    space (W_uk^T q_nope), so every head attends over the cached [c, k_pe] rows directly as
    multi-query attention with head size kv_lora_rank + qk_rope_head_dim; the output, still in
    latent space, is brought back per head by W_uv. Nothing is up-projected per cached token.
  * up-projected (long prefill chunks): the chunk's context latents are expanded into per-head
    K/V once and attended with SDPA, cheaper when the queries are many.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_dp.layers.attention import (
    KERNEL_MAX_QUERY_LEN,
    AttentionMetadata,
    ForwardContext,
    _use_cpu_kernel,
    decode_attention,
    paged_attention_cpu,
    prefill_queries,
)
from deepinfer_dp.layers.norm import RMSNorm
from deepinfer_dp.layers.rotary import RotaryEmbedding, rope_parameters, yarn_softmax_scale


def is_mla(config) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None


def mla_entry_size(config) -> int:
    """Floats one token takes in one layer's latent cache."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def mla_cache_shape(config, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, 1, mla_entry_size(config))


def mla_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    return config.num_hidden_layers * block_size * mla_entry_size(config) * dtype.itemsize


def mha_equivalent_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What one token would take with per-head K and V of MLA's head sizes (no latent): the
    multi-head model MLA replaces."""
    heads = config.num_attention_heads
    per_layer = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    return config.num_hidden_layers * per_layer * dtype.itemsize


def allocate_mla_cache(config, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """One latent cache tensor per layer (zeroed: block 0 is read by the placeholder step)."""
    shape = mla_cache_shape(config, num_blocks, block_size)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]


class MLAttention(nn.Module):
    """DeepSeek's attention block: q (optionally through a low-rank q_a/q_b pair), the joint
    KV latent, RoPE on the decoupled rope part, attention over the paged latent cache, o_proj."""

    def __init__(self, config, context: ForwardContext, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = self.nope_dim + self.rope_dim
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = rotary_emb
        self.scale = yarn_softmax_scale(rope_parameters(config), qk_head_dim ** -0.5)
        self.context = context
        self.cache: torch.Tensor | None = None  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        md = self.context.attn_metadata
        if md is None or self.cache is None:
            raise RuntimeError("MLA needs bind_kv_cache() and attention metadata first")
        num_tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # The rotary kernel works in place on contiguous heads.
        k_pe = k_pe.reshape(num_tokens, 1, self.rope_dim).contiguous()
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe)
        entries = torch.cat([latent, k_pe.view(num_tokens, self.rope_dim)], dim=-1)
        flat = self.cache.view(-1, self.cache.shape[-1])
        flat.index_copy_(0, md.slot_mapping, entries.to(flat.dtype))
        if not md.is_prefill or (_use_cpu_kernel(q_pe, self.cache) and md.max_query_len <= KERNEL_MAX_QUERY_LEN):
            out = self._absorbed(q_nope, q_pe, md)
        else:
            out = self._up_projected(q_nope, q_pe, latent, k_pe, md)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))

    def _kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, R] and W_uv [H, v, R]: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Attention in latent space over the cache: [T, H, v_head_dim]."""
        w_uk, w_uv = self._kv_b_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        query = torch.cat([q_latent, q_pe], dim=-1)
        # Keys are the whole cached rows; values their latent part. The kernels take one
        # cache for both, so the values come back with the rope part too, dropped below.
        if md.is_prefill:
            rows, lens = prefill_queries(md)
            out = paged_attention_cpu(query, self.cache, self.cache, md.block_tables, lens, rows, self.scale)
        else:
            out = decode_attention(query, self.cache, self.cache, md, self.scale)
        out_latent = out[..., :self.kv_lora_rank]
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _up_projected(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      md: AttentionMetadata) -> torch.Tensor:
        """Per sequence: expand the context's latents into per-head K/V, then SDPA."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        query = torch.cat([q_nope, q_pe], dim=-1)
        block_size, start = self.cache.shape[1], 0
        for i, (qlen, slen) in enumerate(zip(md.query_lens_host, md.seq_lens_host, strict=True)):
            end = start + qlen
            if qlen == slen:  # no cached context: this step's latents are all of it
                ctx_latent, ctx_pe = latent[start:end], k_pe[start:end].view(qlen, self.rope_dim)
            else:
                blocks = md.block_tables[i, :-(-slen // block_size)].long()
                rows = self.cache.index_select(0, blocks).view(-1, self.cache.shape[-1])[:slen]
                ctx_latent, ctx_pe = rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:]
            kv = self.kv_b_proj(ctx_latent.to(q_nope.dtype)).view(slen, self.num_heads, -1)
            k_nope, value = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
            key = torch.cat([k_nope, ctx_pe.to(q_nope.dtype)[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            out[start:end] = _causal_with_context(query[start:end], key, value, self.scale)
            start = end
        return out


def _causal_with_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [L, H, Dk] at the last L of S positions, k [S, H, Dk], v [S, H, Dv] -> [L, H, Dv]."""
    qlen, slen = q.shape[0], k.shape[0]
    # [1, H, L, D]: with a batch dimension SDPA takes its flash kernel on CPU; 3-D inputs fall
    # back to the math one, which builds the whole score matrix.
    q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if qlen == slen:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(slen - qlen, slen, device=q.device)
        mask = torch.arange(slen, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)
