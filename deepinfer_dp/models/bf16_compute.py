"""dtype=bfloat16 on the CPU: the matrix products in bf16 arithmetic, the rest in fp32.

A packed model (packed_loader.py) has its matrices turned into the "bf16_pairs" format:
bf16 weights (a bf16 checkpoint's as stored; GGUF blocks or fp32 matrices rounded to bf16 as
torch rounds) laid out for `vdpbf16ps`, so each product rounds its input rows to bf16 and
accumulates bf16 pair products in fp32 (csrc/kernels/bf16_linear.h); a norm or activation
that feeds a product writes those rounded rows itself (packed.takes_bf16_rows). Otherwise
the hidden states stay fp32: RMSNorm, RoPE, softmax and the residual adds run in fp32, as
vLLM's CPU backend runs them, and the KV cache is bf16 (the runner allocates it in the
compute dtype). Where the CPU has AMX tiles or AVX512-BF16 attention computes in bf16 too
(csrc/kernels/paged_attention_bf16.h: the rounded query times the bf16 cache, the
probabilities rounded for the values' product, fp32 accumulation and softmax), as vLLM's CPU
backend does; elsewhere, or with DEEPINFER_DP_BF16_ATTENTION=0, the attention kernel widens
the cache to fp32 as it reads. The model is still an fp32 module
tree, so the one-call decode stack (llama_cpu_decode.py) takes it unchanged.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from deepinfer_dp.layers.attention import Attention
from deepinfer_dp.layers.packed import PackedEmbedding, PackedLinear, PackedWeight

# Attention in bf16 as well where the CPU allows (read at import; "0" compares against fp32 attention).
BF16_ATTENTION = os.environ.get("DEEPINFER_DP_BF16_ATTENTION", "1") != "0"


def to_bf16_compute(model: nn.Module) -> int:
    """Puts every linear layer of `model` (a packed CPU model) on bf16 arithmetic where its
    shape fits the pair layout (rows a multiple of 16, even columns); returns how many. An
    embedding that shares its matrix with the lm_head shares the new one. With BF16_ATTENTION
    its attention layers compute in bf16 as well (Attention.bf16_math)."""
    converted: dict[int, PackedWeight] = {}
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                w = child.weight_packed
                if PackedWeight.fits_pairs(w.rows, w.cols):
                    if id(w) not in converted:
                        converted[id(w)] = w.to_bf16_pairs()
                    if type(child) is PackedLinear:
                        child.weight_packed = converted[id(w)]
                    else:  # parts in different formats (PackedPartsLinear): now one bf16 matrix
                        bias = None if child.bias is None else child.bias.detach()
                        setattr(parent, name, PackedLinear(converted[id(w)], bias))
                    count += 1
            elif isinstance(child, nn.Linear) and PackedWeight.fits_pairs(*child.weight.shape):
                # a matrix widened at load (--no-packed-weights, or a format no kernel runs)
                bf16 = PackedWeight.from_bf16(child.weight.detach().to(torch.bfloat16)).to_bf16_pairs()
                setattr(parent, name, PackedLinear(bf16, None if child.bias is None else child.bias.detach()))
                count += 1
    for module in model.modules():
        if isinstance(module, PackedEmbedding) and id(module.weight_packed) in converted:
            module.weight_packed = converted[id(module.weight_packed)]
        elif isinstance(module, Attention):
            module.bf16_math = BF16_ATTENTION
    return count
