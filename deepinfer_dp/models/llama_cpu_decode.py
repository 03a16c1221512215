"""A decode step on CPU as one C++ call over the whole decoder stack (Llama family, Gemma 3).

At one sequence a decode step's kernels take about 10 ms on 2 cores, but going through the
modules costs as much again: some 500 torch ops a step (reshapes, splits, fresh tensors,
`.numpy()` views, module calls), each a few microseconds. `_C.LlamaDecodeStack`
(csrc/kernels/llama_decode.h) runs the same kernels in the same order on the same weights
for every layer in one call: the q/k/v, o, gate/up and down products (packed or fp32),
RMSNorm with the residual add folded in, per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE in
place on the fused qkv output (one table per kind of layer: Gemma 3's local and global), the
K/V store and paged attention (each layer its sliding window and its KV group's block table
and slots), and `_C.silu_mul` or `_C.gelu_tanh_mul` between the MLP's two products (which
the module path also uses on CPU); Gemma 3's norms after each sublayer as `StackLayout`
says. Every float is the one the module path gives (a test holds them equal), so it is an
implementation detail of `LlamaForCausalLM.forward`: used for decode steps of the layers it
covers, and for steps of a few tokens a sequence (speculative verification, short prefill
chunks) that the module path also gives to the attention kernel; the module path takes
everything else (longer prefill, OLMoE's whole-vector q/k norms and clipping, MoE layers,
other devices and dtypes). The embedding scale stays here, a final soft-cap in the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers import attention, cpu_threads, packed
from deepinfer_dp.layers import linear as cpu_linear
from deepinfer_dp.layers.packed_parts import PackedParts, PackedPartsLinear

ENABLED = True  # tests switch it off to compare against the module path


def _projection(mod) -> tuple[tuple, int] | None:
    """(the stack's (weight, format, bias) for `mod`, the rows its kernel takes), or None
    when `mod` is not a CPU kernel's linear."""
    if type(mod) in (packed.PackedLinear, PackedPartsLinear):
        w = mod.weight_packed
        bias = None if mod.bias is None else mod.bias.detach().numpy()
        data = [p.data for p in w.parts] if isinstance(w, PackedParts) else w.data  # format "q4_k+q6_k"
        return (data, w.format, bias), packed.KERNEL_MAX_ROWS
    if type(mod) is cpu_linear.CpuLinear:
        return (mod._weight_np, "f32", mod._bias_np), cpu_linear.KERNEL_MAX_ROWS
    return None


@dataclass(frozen=True)
class StackLayout:
    """What a family's decoder layer looks like to the stack: Llama's (a norm before each
    sublayer, SiLU) by default; Gemma 3's adds a norm after each sublayer, GeGLU and scaled
    embeddings."""

    sandwich_norms: bool = False  # post_attention/pre_feedforward/post_feedforward_layernorm
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: float | None = None  # embeddings times this (in their dtype), as the modules do


LLAMA = StackLayout()


def _layer_norms(layer, layout: StackLayout) -> tuple:
    """(input, attention-output, pre-MLP, MLP-output) norms of a layer; None where it has none."""
    if layout.sandwich_norms:
        return (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                layer.post_feedforward_layernorm)
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


def _add_layer(stack: _C.LlamaDecodeStack, layer, spec: list, layout: StackLayout, rope: int) -> None:
    sa = layer.self_attn
    inp, attn_out, ffn, mlp_out = (None if n is None else n._weight_view() for n in _layer_norms(layer, layout))
    q_norm, k_norm = (sa.q_norm._weight_view(), sa.k_norm._weight_view()) if sa.qk_norm else (None, None)
    stack.add_layer(*spec, inp, ffn, sa.attn.scale, sa.attn.window, attn_out_norm=attn_out, mlp_out_norm=mlp_out,
                    q_norm=q_norm, k_norm=k_norm, rope=rope, group=sa.attn.kv_group)


def _same_eps(model, layout: StackLayout) -> bool:
    """Every norm of every layer (q/k norms included) has layer 0's epsilon: the stack takes one."""
    eps = model.layers[0].input_layernorm.eps
    for layer in model.layers:
        norms = [n for n in _layer_norms(layer, layout) if n is not None]
        if layer.self_attn.qk_norm:
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        if any(n.eps != eps for n in norms):
            return False
    return True


class LlamaCpuDecode:
    """The decode step over `model` (a LlamaModel, or a family's model of the same shape that
    `layout` describes); `build` returns None when the model has anything this path does not
    do exactly as the modules do."""

    def __init__(self, model, stack: _C.LlamaDecodeStack, max_rows: int, rotaries: list, layout: StackLayout):
        self.model = model
        self.stack = stack
        self.max_rows = max_rows
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.rotaries = rotaries  # the distinct RoPE tables, in the stack's order
        self.embed_scale = None if layout.embed_scale is None else np.float32(layout.embed_scale)
        self.steps = 0  # steps this stack ran (tests read it to know the stack, not the modules, ran)
        self._caches: list[torch.Tensor] = []  # the K caches the stack was given

    @classmethod
    def build(cls, model, layout: StackLayout = LLAMA) -> LlamaCpuDecode | None:
        """`model`'s layers must be plain decoder layers of `layout` with dense MLPs (the
        family's file checks the types before calling, since they are its own)."""
        specs, max_rows = [], cpu_linear.KERNEL_MAX_ROWS
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            if sa.qk_norm not in (None, "head") or sa.clip_qkv is not None:
                return None
            projs = [_projection(m) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in projs):
                return None
            max_rows = min([max_rows] + [rows for _, rows in projs])
            specs.append([spec for spec, _ in projs])
        if not specs or not _same_eps(model, layout):
            return None
        first = model.layers[0]
        if any(layer.mlp.intermediate_size != first.mlp.intermediate_size for layer in model.layers):
            return None
        rotaries = []  # one RoPE table a kind of layer (Gemma 3: local and global)
        for layer in model.layers:
            if not any(r is layer.self_attn.rotary_emb for r in rotaries):
                rotaries.append(layer.self_attn.rotary_emb)
        sa = first.self_attn
        stack = _C.LlamaDecodeStack(model.norm.weight.shape[0], sa.num_heads, sa.num_kv_heads, sa.head_dim,
                                    first.mlp.intermediate_size, first.input_layernorm.eps,
                                    model.norm._weight_view(), model.norm.eps, layout.activation)
        for layer, spec in zip(model.layers, specs, strict=True):
            rope = next(i for i, r in enumerate(rotaries) if r is layer.self_attn.rotary_emb)
            _add_layer(stack, layer, spec, layout, rope)
        return cls(model, stack, max_rows, rotaries, layout)

    def applies(self, input_ids: torch.Tensor, md: attention.AttentionMetadata) -> bool:
        attn = self.attns[0]
        # Prefill chunks of a few tokens a sequence (speculative verification, prefix-cache
        # hits) take the same attention kernel in the module path; longer ones do not.
        few = not md.is_prefill or md.max_query_len <= attention.KERNEL_MAX_QUERY_LEN
        # The step's KV groups (each layer reads its own table) must be the ones the layers were given.
        return (ENABLED and attention.CPU_KERNEL and few and not md.is_placeholder
                and md.num_kv_groups == self.stack.num_groups
                and input_ids.device.type == "cpu" and attn.k_cache is not None
                and attn.k_cache.dtype in (torch.float32, torch.bfloat16) and 0 < input_ids.numel() <= self.max_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 md: attention.AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], as the module path gives them."""
        caches = [a.k_cache for a in self.attns]
        if len(caches) != len(self._caches) or any(c is not d for c, d in zip(caches, self._caches, strict=True)):
            # (Re)bound since the stack last saw them.
            self.stack.set_caches([packed.kernel_array(c) for c in caches],
                                  [packed.kernel_array(a.v_cache) for a in self.attns],
                                  bf16_attention=self.attns[0].bf16_math)
            self._caches = caches
        threads = cpu_threads.kernel_threads()
        hidden = self.model.embed_tokens(input_ids).numpy()
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale  # float32 times float32: the modules' product
        cos, sin = self._rope_rows(positions)
        # Per query row: how many positions it sees, and its sequence's block-table row.
        lens, rows = (attention.prefill_queries(md)[::-1] if md.is_prefill else (md.seq_lens.numpy(), None))
        out = self.stack.run(hidden, cos, sin, md.slot_mapping.numpy(), md.block_tables.numpy(), lens, rows, threads)
        self.steps += 1
        return torch.from_numpy(out)

    def _rope_rows(self, positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of the step's rows: [T, D] for one table, [tables, T, D] for several."""
        rows = [r.rows(positions, torch.device("cpu"), torch.float32) for r in self.rotaries]
        if len(rows) == 1:
            return rows[0][0].numpy(), rows[0][1].numpy()
        return np.stack([c.numpy() for c, _ in rows]), np.stack([s.numpy() for _, s in rows])
