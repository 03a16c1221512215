"""A Llama decode step on CPU as one lean loop of C++ kernel calls over NumPy buffers.

At one sequence a decode step's kernels take about 10 ms on 2 cores, but going through the
modules costs as much again: some 500 torch ops a step (reshapes, splits, fresh tensors,
`.numpy()` views, module calls), each a few microseconds. This path runs the same kernels
in the same order on the same weights: the q/k/v, o, gate/up and down products
(`_C.packed_linear` or `_C.linear`), `_C.rms_norm` with the residual add folded in,
`_C.rotary` in place on the fused qkv output, the K/V store and `_C.paged_attention`, and
torch's own silu and product between the MLP's two products. Every float is the one the
module path gives (a test holds them equal), so it is an implementation detail of
`LlamaForCausalLM.forward`: used for decode steps of plain Llama-family layers, and for
steps of a few tokens a sequence (speculative verification, short prefill chunks) that the
module path also gives to the attention kernel; the module path takes everything else
(longer prefill, Qwen3's q/k norms, MoE layers, other devices and dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_dp import _C
from deepinfer_dp.layers import attention, cpu_threads, packed
from deepinfer_dp.layers import linear as cpu_linear

ENABLED = True  # tests switch it off to compare against the module path


@dataclass
class _Linear:
    """One projection's kernel arguments, NumPy views made once."""

    packed: packed.PackedWeight | None
    weight: np.ndarray | None  # fp32 [out, in] when not packed
    bias: np.ndarray | None
    out_features: int

    @classmethod
    def of(cls, mod) -> _Linear | None:
        if type(mod) is packed.PackedLinear:
            bias = None if mod.bias is None else mod.bias.detach().numpy()
            return cls(mod.weight_packed, None, bias, mod.out_features)
        if type(mod) is cpu_linear.CpuLinear:
            return cls(None, mod._weight_np, mod._bias_np, mod.out_features)
        return None

    def max_rows(self) -> int:
        return packed.KERNEL_MAX_ROWS if self.packed is not None else cpu_linear.KERNEL_MAX_ROWS

    def __call__(self, x: np.ndarray, threads: int) -> np.ndarray:
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        w = self.packed
        if w is not None:
            _C.packed_linear(x, w.data, w.format, w.cols, self.bias, out, threads)
        else:
            _C.linear(x, self.weight, self.bias, out, threads)
        return out


@dataclass
class _Layer:
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    input_norm: np.ndarray
    post_norm: np.ndarray
    eps: float
    attn: attention.Attention
    cache_of: torch.Tensor | None = None  # the K cache tensor the views below were made of
    caches: tuple = ()  # K, V as NumPy [blocks, block_size, Hkv, D] and [slots, Hkv, D] views

    def kv_views(self) -> tuple:
        if self.cache_of is not self.attn.k_cache:  # bound (again) since the views were made
            k, v = self.attn.k_cache.numpy(), self.attn.v_cache.numpy()
            self.caches, self.cache_of = (k, v, k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])), \
                self.attn.k_cache
        return self.caches


class LlamaCpuDecode:
    """The decode loop over `model` (a LlamaModel); `build` returns None when the model has
    anything this path does not do exactly as the modules do."""

    def __init__(self, model, layers: list[_Layer]):
        self.model = model
        self.layers = layers
        first = model.layers[0].self_attn
        self.rotary = first.rotary_emb
        self.q_size, self.kv_size = first.q_size, first.kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.intermediate = model.layers[0].mlp.intermediate_size
        self.max_rows = min(min(lin.max_rows() for lin in (la.qkv, la.o, la.gate_up, la.down)) for la in layers)

    @classmethod
    def build(cls, model) -> LlamaCpuDecode | None:
        from deepinfer_dp.models.llama import LlamaDecoderLayer, LlamaMLP  # (llama imports this module)

        layers = []
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            if type(layer) is not LlamaDecoderLayer or type(mlp) is not LlamaMLP or sa.qk_norm \
                    or sa.clip_qkv is not None:
                return None
            lins = [_Linear.of(m) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(lin is None for lin in lins) or layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
                return None
            layers.append(_Layer(*lins, layer.input_layernorm._weight_view(),
                                 layer.post_attention_layernorm._weight_view(), layer.input_layernorm.eps, sa.attn))
        return cls(model, layers) if layers else None

    def applies(self, input_ids: torch.Tensor, md: attention.AttentionMetadata) -> bool:
        attn = self.layers[0].attn
        # Prefill chunks of a few tokens a sequence (speculative verification, prefix-cache
        # hits) take the same attention kernel in the module path; longer ones do not.
        few = not md.is_prefill or md.max_query_len <= attention.KERNEL_MAX_QUERY_LEN
        return (ENABLED and attention.CPU_KERNEL and few and not md.is_placeholder
                and input_ids.device.type == "cpu" and attn.k_cache is not None
                and attn.k_cache.dtype == torch.float32 and 0 < input_ids.numel() <= self.max_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 md: attention.AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], as the module path gives them."""
        threads = cpu_threads.wide_threads() or torch.get_num_threads()
        hidden = self.model.embed_tokens(input_ids).numpy()
        cos_table, sin_table = self.rotary._cos_sin(torch.device("cpu"), torch.float32)
        pos = positions.numpy()
        cos, sin = cos_table.numpy()[pos], sin_table.numpy()[pos]
        # Per query row: how many positions it sees, and its sequence's block-table row.
        lens, rows = (attention.prefill_queries(md)[::-1] if md.is_prefill else (md.seq_lens.numpy(), None))
        step = (md.slot_mapping.numpy(), md.block_tables.numpy(), lens, rows, threads)
        normed = np.empty_like(hidden)
        _C.rms_norm(hidden, None, self.layers[0].input_norm, self.layers[0].eps, normed)
        for i, layer in enumerate(self.layers):
            attn_out = self._attention(layer, normed, cos, sin, step)
            # attn_out += hidden (the residual stream now), normed = its norm.
            _C.rms_norm(attn_out, hidden, layer.post_norm, layer.eps, normed)
            hidden = attn_out
            mlp_out = self._mlp(layer, normed, threads)
            last = self.layers[i + 1] if i + 1 < len(self.layers) else None
            norm_w, eps = (last.input_norm, last.eps) if last else (self.model.norm._weight_view(), self.model.norm.eps)
            _C.rms_norm(mlp_out, hidden, norm_w, eps, normed)
            hidden = mlp_out
        return torch.from_numpy(normed)

    def _attention(self, layer: _Layer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, step) -> np.ndarray:
        slots, block_tables, lens, rows, threads = step
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        # [T, heads of q, k and v, D]: a view, so the rotations below land in the qkv output.
        qkv = layer.qkv(x, threads).reshape(t, nh + 2 * nkv, self.head_dim)
        q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
        _C.rotary(q, cos, sin)
        _C.rotary(k, cos, sin)
        k_cache, v_cache, k_slots, v_slots = layer.kv_views()
        k_slots[slots] = k
        v_slots[slots] = v
        out = np.empty((t, self.num_heads, self.head_dim), dtype=np.float32)
        _C.paged_attention(np.ascontiguousarray(q), k_cache, v_cache, block_tables, lens, out,
                           layer.attn.scale, threads, rows)
        return layer.o(out.reshape(t, self.q_size), threads)

    def _mlp(self, layer: _Layer, x: np.ndarray, threads: int) -> np.ndarray:
        gate_up, i = layer.gate_up(x, threads), self.intermediate
        # Sliced in NumPy (a torch slice costs a few microseconds), then torch's own silu and
        # product, as the module computes them.
        act = torch.mul(F.silu(torch.from_numpy(gate_up[:, :i])), torch.from_numpy(gate_up[:, i:]))
        return layer.down(act.numpy(), threads)
