"""Linear layers with weights pre-packed for oneDNN on CPU.

A decode batch is a small-M matrix multiply (M = running sequences), where MKL's sgemm on
a plain row-major weight runs at a fraction of the machine's speed. oneDNN with the weight
reordered once into its blocked layout is 1.3-2x faster at M = 8..64 here (measured in
benchmarks/offline_throughput.py's workload), with the same fp32 math up to rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_dp.layers import cpu_threads


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """Drop-in for an fp32 nn.Linear on CPU; keeps only the packed weight."""

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        with cpu_threads.wide():
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed_weight, self.bias,
                                                     "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def pack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Replaces every fp32 CPU nn.Linear in `model` by a PackedLinear; returns how many.
    Tied weights stay tied where they are also used as a tensor (the embedding keeps its
    own weight; the packed lm_head is a copy)."""
    if not packing_available():
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child, batch_hint))
                count += 1
    return count
