"""A Llama decode step on CPU as one C++ call over the whole decoder stack.

At one sequence a decode step's kernels take about 10 ms on 2 cores, but going through the
modules costs as much again: some 500 torch ops a step (reshapes, splits, fresh tensors,
`.numpy()` views, module calls), each a few microseconds. `_C.LlamaDecodeStack`
(csrc/kernels/llama_decode.h) runs the same kernels in the same order on the same weights
for every layer in one call: the q/k/v, o, gate/up and down products (packed or fp32),
RMSNorm with the residual add folded in, RoPE in place on the fused qkv output, the K/V
store and paged attention, and `_C.silu_mul` between the MLP's two products (which the
module path also uses on CPU). Every float is the one the module path gives (a test holds
them equal), so it is an implementation detail of `LlamaForCausalLM.forward`: used for
decode steps of plain Llama-family layers, and for steps of a few tokens a sequence
(speculative verification, short prefill chunks) that the module path also gives to the
attention kernel; the module path takes everything else (longer prefill, Qwen3's q/k norms,
MoE layers, other devices and dtypes).
"""

from __future__ import annotations

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers import attention, cpu_threads, packed
from deepinfer_dp.layers import linear as cpu_linear

ENABLED = True  # tests switch it off to compare against the module path


def _projection(mod) -> tuple[tuple, int] | None:
    """(the stack's (weight, format, bias) for `mod`, the rows its kernel takes), or None
    when `mod` is not a CPU kernel's linear."""
    if type(mod) is packed.PackedLinear:
        w = mod.weight_packed
        bias = None if mod.bias is None else mod.bias.detach().numpy()
        return (w.data, w.format, bias), packed.KERNEL_MAX_ROWS
    if type(mod) is cpu_linear.CpuLinear:
        return (mod._weight_np, "f32", mod._bias_np), cpu_linear.KERNEL_MAX_ROWS
    return None


class LlamaCpuDecode:
    """The decode step over `model` (a LlamaModel); `build` returns None when the model has
    anything this path does not do exactly as the modules do."""

    def __init__(self, model, stack: _C.LlamaDecodeStack, max_rows: int):
        self.model = model
        self.stack = stack
        self.max_rows = max_rows
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.rotary = model.layers[0].self_attn.rotary_emb
        self._caches: list[torch.Tensor] = []  # the K caches the stack was given

    @classmethod
    def build(cls, model) -> LlamaCpuDecode | None:
        """`model`'s layers must be plain Llama decoder layers with dense MLPs (llama.py checks
        that before calling, since the types are its own)."""
        specs, max_rows = [], cpu_linear.KERNEL_MAX_ROWS
        for layer in model.layers:
            sa, mlp = layer.self_attn, layer.mlp
            if sa.qk_norm or sa.clip_qkv is not None:
                return None
            projs = [_projection(m) for m in (sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(p is None for p in projs):
                return None
            max_rows = min([max_rows] + [rows for _, rows in projs])
            specs.append([spec for spec, _ in projs])
        if not specs:
            return None
        first, norm0 = model.layers[0], model.layers[0].input_layernorm
        if any(layer.input_layernorm.eps != norm0.eps or layer.post_attention_layernorm.eps != norm0.eps
               or layer.mlp.intermediate_size != first.mlp.intermediate_size for layer in model.layers):
            return None
        sa = first.self_attn
        stack = _C.LlamaDecodeStack(model.norm.weight.shape[0], sa.num_heads, sa.num_kv_heads, sa.head_dim,
                                    first.mlp.intermediate_size, norm0.eps, model.norm._weight_view(), model.norm.eps)
        for layer, spec in zip(model.layers, specs, strict=True):
            stack.add_layer(*spec, layer.input_layernorm._weight_view(), layer.post_attention_layernorm._weight_view(),
                            layer.self_attn.attn.scale, layer.self_attn.attn.window)
        return cls(model, stack, max_rows)

    def applies(self, input_ids: torch.Tensor, md: attention.AttentionMetadata) -> bool:
        attn = self.attns[0]
        # Prefill chunks of a few tokens a sequence (speculative verification, prefix-cache
        # hits) take the same attention kernel in the module path; longer ones do not.
        few = not md.is_prefill or md.max_query_len <= attention.KERNEL_MAX_QUERY_LEN
        # One block table for every layer: KV groups (a hybrid model's) go through the modules.
        return (ENABLED and attention.CPU_KERNEL and few and not md.is_placeholder and md.num_kv_groups == 1
                and input_ids.device.type == "cpu" and attn.k_cache is not None
                and attn.k_cache.dtype in (torch.float32, torch.bfloat16) and 0 < input_ids.numel() <= self.max_rows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 md: attention.AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], as the module path gives them."""
        caches = [a.k_cache for a in self.attns]
        if len(caches) != len(self._caches) or any(c is not d for c, d in zip(caches, self._caches, strict=True)):
            # (Re)bound since the stack last saw them.
            self.stack.set_caches([attention.cache_array(c) for c in caches],
                                  [attention.cache_array(a.v_cache) for a in self.attns])
            self._caches = caches
        threads = cpu_threads.kernel_threads()
        hidden = self.model.embed_tokens(input_ids).numpy()
        cos, sin = self.rotary.rows(positions, torch.device("cpu"), torch.float32)  # [T, D] each
        # Per query row: how many positions it sees, and its sequence's block-table row.
        lens, rows = (attention.prefill_queries(md)[::-1] if md.is_prefill else (md.seq_lens.numpy(), None))
        out = self.stack.run(hidden, cos.numpy(), sin.numpy(), md.slot_mapping.numpy(),
                             md.block_tables.numpy(), lens, rows, threads)
        return torch.from_numpy(out)

