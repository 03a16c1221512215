"""The gated activations between the gate/up and down products of an MLP: SiLU-and-multiply
(Llama) and tanh-GELU-and-multiply (GeGLU: Gemma).

On CPU in fp32 one C++ pass per row (`_C.silu_mul`, `_C.gelu_tanh_mul`) replaces torch's
split, activation and product; the CPU decode stack calls the same kernels, so the module
path and the stack give the same floats. Their e^x is Cephes' polynomial, within a couple of
ulp of torch's; elsewhere (CUDA, other dtypes) torch's own ops. `gated_product` is an MLP's
gate/up product and its activation: for a bf16 matrix on AMX one pass (PackedLinear.gated),
with the same floats.
"""

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers.cpu_threads import kernel_threads
from deepinfer_dp.layers.packed import PackedLinear


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


def gated_product(gate_up: nn.Module, x: torch.Tensor, activation: str, rounded: bool = False) -> torch.Tensor:
    """act(x Gᵀ) * (x Uᵀ) for gate_up = [G; U] and activation "silu" or "gelu_tanh": one pass
    where the matrix takes it (PackedLinear.fuses_gate), else the product then the activation.
    rounded: the product after this one rounds its input to bf16 (packed.takes_bf16_rows), so
    the one pass may hand its result over rounded (the other way stays fp32: the same floats)."""
    if isinstance(gate_up, PackedLinear) and gate_up.fuses_gate():
        return gate_up.gated(x, activation, rounded)
    return (silu_and_mul if activation == "silu" else gelu_tanh_and_mul)(gate_up(x))
