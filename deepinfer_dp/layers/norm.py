"""RMSNorm, computed in fp32 and cast back, the way Llama-family checkpoints were trained.

On CPU in fp32 one C++ pass per row (`_C.rms_norm`) replaces torch's five ops, and folds in
the residual add before it; elsewhere the torch ops below. A norm whose rows go to a bf16
product (packed.takes_bf16_rows) is asked for them `rounded`: on CPU the kernel writes them
in bf16, the rounding the product would do itself, at half the bytes.
"""

import torch
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers.cpu_threads import kernel_threads
from deepinfer_dp.layers.packed import kernel_array


def _on_cpu_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self._weight_np = None  # NumPy view of the weight for the CPU kernel, made on first use

    def _weight_view(self):
        w = self.weight
        if self._weight_np is None or self._weight_np.ctypes.data != w.data_ptr():  # (re)loaded or moved
            self._weight_np = w.detach().numpy()
        return self._weight_np

    def forward(self, x: torch.Tensor, rounded: bool = False) -> torch.Tensor:
        """RMSNorm(x) * weight; rounded: in bf16 where the CPU kernel runs (else as x)."""
        if _on_cpu_kernel(x):
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            out = self._kernel_out(rows, rounded)
            _C.rms_norm(rows.numpy(), None, self._weight_view(), self.eps, kernel_array(out), kernel_threads())
            return out.view(x.shape)
        if x.dtype == torch.float32:  # one fused kernel, the same math as below
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same order as transformers: cast back to the activation dtype, then scale.
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, its norm; rounded as in forward). `x` must be a fresh tensor of the
        caller's: on CPU the sum is written into it."""
        if _on_cpu_kernel(x) and x.is_contiguous() and residual.is_contiguous():
            rows = x.view(-1, x.shape[-1])
            out = self._kernel_out(rows, rounded)
            _C.rms_norm(rows.numpy(), residual.view(rows.shape).numpy(), self._weight_view(), self.eps,
                        kernel_array(out), kernel_threads())
            return x, out.view(x.shape)
        total = x + residual
        return total, self(total)

    @staticmethod
    def _kernel_out(rows: torch.Tensor, rounded: bool) -> torch.Tensor:
        return torch.empty(rows.shape, dtype=torch.bfloat16) if rounded else torch.empty_like(rows)
