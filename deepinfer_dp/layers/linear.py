"""fp32 linear layers on CPU: small batches through the C++ kernel, large ones through torch.

A decode step is a matrix product with few rows (M = running sequences). There torch's
GEMMs (MKL, or oneDNN with a pre-packed weight) either stream the weights without keeping
the cores busy or pay an OpenMP fork and join per call; `_C.linear` reads each weight row
once against all M rows, prefetches the next ones, and splits the columns over a pool of
threads that stays awake between the layers. Measured in one engine process, interleaved
(SmolLM2, decode steps): 8 sequences on 2 threads 71 ms against 112 ms with oneDNN packed,
64 on 2 threads 261 against 288, 32 on 1 thread 216 against 230. Prefill chunks have many
more rows, where torch's blocked GEMMs are faster; they keep using F.linear, except in
batch-invariant steps (cpu_threads.batch_invariant): there every row count takes the kernel,
which gives each row the same floats whatever the row count (its many-row form is
cache-blocked, and uses AVX-512 where the CPU has it).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads, large_outputs

# Rows up to which the kernel is used (it ties with MKL near 64 rows on 2 threads and loses
# from 128 on).
KERNEL_MAX_ROWS = 64


class CpuLinear(nn.Module):
    """Drop-in for an fp32 nn.Linear on CPU, sharing its weight and bias tensors."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)
        # NumPy views made once: a .numpy() call costs a few microseconds, ~600 of them a step.
        self._weight_np = self.weight.numpy()
        self._bias_np = None if bias is None else bias.numpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > KERNEL_MAX_ROWS and not cpu_threads.batch_invariant():
            with cpu_threads.wide():
                return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, self.in_features).contiguous()
        out = large_outputs.empty(rows, self.out_features)
        _C.linear(x2.numpy(), self._weight_np, self._bias_np, out.numpy(),
                  cpu_threads.kernel_threads())
        return out.reshape(*x.shape[:-1], self.out_features)


def replace_linears(model: nn.Module) -> int:
    """Replaces every fp32 CPU nn.Linear in `model` by a CpuLinear; returns how many. Tied
    weights stay one tensor. A module that sets `keep_torch_linears` (a vision tower, whose
    floats must be transformers') is left as it is, with everything under it."""
    kept = {id(m) for top in model.modules() if getattr(top, "keep_torch_linears", False) for m in top.modules()}
    count = 0
    for parent in list(model.modules()):
        if id(parent) in kept:
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32 and child.weight.is_contiguous():
                setattr(parent, name, CpuLinear(child))
                count += 1
    return count
