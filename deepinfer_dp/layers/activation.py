"""The gated activations between the gate/up and down products of an MLP: SiLU-and-multiply
(Llama) and tanh-GELU-and-multiply (GeGLU: Gemma).

On CPU in fp32 one C++ pass per row (`_C.silu_mul`, `_C.gelu_tanh_mul`) replaces torch's
split, activation and product; the CPU decode stack calls the same kernels, so the module
path and the stack give the same floats. Their e^x is Cephes' polynomial, within a couple of
ulp of torch's; elsewhere (CUDA, other dtypes) torch's own ops.
"""

import torch
import torch.nn.functional as F

from deepinfer_dp import _C
from deepinfer_dp.layers.cpu_threads import kernel_threads


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] (gate first), as [..., I]."""
    size = gate_up.shape[-1] // 2
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32:
        rows = gate_up.reshape(-1, 2 * size).contiguous()
        out = torch.empty(rows.shape[0], size)
        _C.silu_mul(rows.numpy(), out.numpy(), kernel_threads())
        return out.view(*gate_up.shape[:-1], size)
    gate, up = gate_up.split(size, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up [..., 2I] (gate first), as [..., I]."""
    size = gate_up.shape[-1] // 2
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32:
        rows = gate_up.reshape(-1, 2 * size).contiguous()
        out = torch.empty(rows.shape[0], size)
        _C.gelu_tanh_mul(rows.numpy(), out.numpy(), kernel_threads())
        return out.view(*gate_up.shape[:-1], size)
    gate, up = gate_up.split(size, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
