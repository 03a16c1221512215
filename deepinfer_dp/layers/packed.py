"""Weights kept in the format they are stored in, widened to fp32 inside the CPU kernels.

The default model is a GGUF file with Q4_1 layers and a Q8_0 embedding, most downloaded GGUF
files mix K-quants (Q4_K, Q5_K, Q6_K) with Q5_0 and Q8_0, and most Hugging Face checkpoints
are bf16. Widening them to fp32 at load makes every decode step read 2-6x
more bytes than the file holds; here they stay packed and `_C.packed_linear` widens each
group of weight rows in the L1 cache right before using it. Widening is exact (gguf's
dequantize and a bf16 -> fp32 cast give the same values), and the fp32 arithmetic after it
is `_C.linear`'s, so outputs equal those of the widened fp32 model: transformers on the
dequantized checkpoint stays the oracle.

The kernel takes its inputs a block of rows at a time (cache-blocked), and every row's floats
are the same at any row count. Outside batch-invariant steps (cpu_threads.batch_invariant)
chunks of more than KERNEL_MAX_ROWS rows widen the matrix into a reused fp32 buffer, a slice
of rows at a time, and use torch's GEMM instead, whose floats depend on the row count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads, large_outputs

# format -> (values per block, bytes per block), as ggml lays them out. "bf16_pairs" is bf16
# computed in bf16 (`_C.bf16_linear`'s layout: rows interleaved by 16, columns by pairs).
FORMATS = {"bf16": (1, 2), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
           "q8_0": (32, 34), "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144), "q5_k": (256, 176),
           "q6_k": (256, 210), "bf16_pairs": (2, 4)}
PAIR_ROWS = 16  # a bf16_pairs matrix's rows come in blocks of this many

# Formats whose every value is its block's fp16 scale times an integer in [-128, 127], in
# blocks of 32: Q8_0 holds their values exactly (see PackedWeight.as_q8_0).
EXACT_IN_Q8_0 = {"q4_0": 8, "q5_0": 16, "q8_0": 0}  # format -> the offset its quants carry

# Rows up to which the packed kernel runs; larger batches widen and use torch's GEMM.
# benchmarks/kernel_crossover.py on SmolLM2's Q4_1 layers, 2 threads: the kernel is 4-8x
# faster up to 128 rows (widening a whole matrix costs more than the product there), 2.1x
# at 512, and the GEMM wins from about 1024 on.
KERNEL_MAX_ROWS = 512
# Floats widened at once for a GEMM (16 MB): a whole layer of a small model, a slice of a
# large vocabulary's lm_head.
WIDEN_CHUNK_FLOATS = 4 << 20

_scratch = threading.local()  # one widening buffer per thread (DP ranks may share a process)


@dataclass(frozen=True)
class PackedWeight:
    """A [rows, cols] matrix in nn.Linear's layout, stored as `format`'s bytes per row."""

    data: np.ndarray  # uint8 [rows, bytes per row], C-contiguous
    format: str
    cols: int

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown packed format {self.format!r}; known: {sorted(FORMATS)}")
        values, nbytes = FORMATS[self.format]
        if self.cols % values or self.data.ndim != 2 or self.data.dtype != np.uint8 \
                or self.data.shape[1] != self.cols // values * nbytes or not self.data.flags.c_contiguous:
            raise ValueError(f"{self.format} matrix of {self.cols} columns: want C-contiguous uint8 "
                             f"[rows, {self.cols // max(values, 1) * nbytes}], got {self.data.dtype} "
                             f"{list(self.data.shape)}")
        if self.format == "bf16_pairs" and self.rows % PAIR_ROWS:
            raise ValueError(f"bf16_pairs matrix of {self.rows} rows: want a multiple of {PAIR_ROWS}")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @classmethod
    def from_bf16(cls, tensor: torch.Tensor) -> PackedWeight:
        if tensor.dtype != torch.bfloat16 or tensor.dim() != 2:
            raise ValueError(f"want a 2-D bf16 tensor, got {tensor.dtype} {list(tensor.shape)}")
        raw = tensor.contiguous().view(torch.int16).numpy().view(np.uint8)
        return cls(np.ascontiguousarray(raw), "bf16", tensor.shape[1])

    @staticmethod
    def fits_pairs(rows: int, cols: int) -> bool:
        """Whether a [rows, cols] matrix can take the bf16_pairs layout."""
        return rows % PAIR_ROWS == 0 and cols % 2 == 0 and cols > 0

    def to_bf16_pairs(self) -> PackedWeight:
        """This matrix for bf16 arithmetic: its bf16 values (other formats widened, then
        rounded to bf16 as torch rounds) in the pair layout, 64-byte aligned."""
        if self.format == "bf16_pairs":
            return self
        if self.format == "bf16":
            bits = self.data.view(np.uint16)
        else:
            bits = self.widen().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        out = _aligned_bytes(self.rows, 2 * self.cols)
        _C.bf16_pairs_pack(bits, out)
        return PackedWeight(out, "bf16_pairs", self.cols)

    @classmethod
    def concat(cls, parts: list[PackedWeight]) -> PackedWeight:
        """The rows of `parts` one after another (q, k, v fused into one projection)."""
        if len({(p.format, p.cols) for p in parts}) != 1:
            raise ValueError("packed matrices to concatenate differ in format or columns")
        return cls(np.concatenate([p.data for p in parts]), parts[0].format, parts[0].cols)

    def as_q8_0(self) -> PackedWeight:
        """The same values as Q8_0 blocks: exact for Q4_0 and Q5_0, whose d * (q - 8) and
        d * (q - 16) are d times an int8 (a fused projection mixing them with Q8_0, as
        Q4_K_M files do where rows don't fit K-quant blocks, then runs as one matrix)."""
        if self.format not in EXACT_IN_Q8_0:
            raise ValueError(f"{self.format} values are not exact in q8_0")
        if self.format == "q8_0":
            return self
        _, nbytes = FORMATS[self.format]
        blocks = self.data.reshape(self.rows, -1, nbytes)
        qs = blocks[..., nbytes - 16:]  # the 16 nibble bytes: values j (low) and j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
        if self.format == "q5_0":  # bit j of the 4 bytes after d is value j's fifth bit
            q |= np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").astype(np.int16) << 4
        q8 = (q - EXACT_IN_Q8_0[self.format]).astype(np.int8).view(np.uint8)
        data = np.concatenate([blocks[..., :2], q8], axis=-1).reshape(self.rows, -1)
        return PackedWeight(np.ascontiguousarray(data), "q8_0", self.cols)

    def linear(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray, threads: int) -> None:
        """out [M, rows] = x [M, cols] @ W.T (+ bias) in the packed kernel."""
        _C.packed_linear(x, self.data, self.format, self.cols, bias, out, threads)

    def widen(self, begin: int = 0, end: int | None = None, out: torch.Tensor | None = None,
              threads: int = 1) -> torch.Tensor:
        """Rows [begin, end) as fp32 [end - begin, cols] (into `out` when given)."""
        end = self.rows if end is None else end
        if out is None:
            out = torch.empty(end - begin, self.cols)
        _C.packed_widen(self.data, self.format, self.cols, begin, end, out.numpy(), threads)
        return out


def _aligned_bytes(rows: int, cols: int) -> np.ndarray:
    """uint8 [rows, cols] starting on a 64-byte boundary (one cache line a kernel load)."""
    raw = np.empty(rows * cols + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + rows * cols].reshape(rows, cols)


def _widen_buffer(floats: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < floats:
        buf = _scratch.buf = torch.empty(floats)
    return buf


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W packed; x and y fp32 on CPU. (PackedPartsLinear, packed_parts.py,
    runs this over a matrix whose parts differ in format.)"""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_packed = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        if bias is not None and tuple(bias.shape) != (weight.rows,):
            raise ValueError(f"bias of shape {list(bias.shape)} for {weight.rows} outputs")
        # A parameter, so that a model's load_weights fills it in like any other.
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features).contiguous()
        # bf16 rows: a producer rounded them for this product (takes_bf16_rows), bf16_pairs only.
        if x2.dtype == torch.bfloat16 and not takes_bf16_rows(self):
            raise ValueError(f"bf16 rows into a {self.weight_packed.format} matrix (bf16_pairs only)")
        # bf16_pairs always takes its kernel: a widened GEMM would compute in fp32, not bf16.
        if rows > KERNEL_MAX_ROWS and not cpu_threads.batch_invariant() and self.weight_packed.format != "bf16_pairs":
            out = self._widened_gemm(x2)
        else:
            out = large_outputs.empty(rows, self.out_features)
            bias = None if self.bias is None else self.bias.detach().numpy()
            self.weight_packed.linear(kernel_array(x2), bias, out.numpy(), cpu_threads.kernel_threads())
        return out.reshape(*x.shape[:-1], self.out_features)

    def fuses_gate(self) -> bool:
        """Whether gated() below runs: this is an MLP's gate/up matrix (gate rows, then up rows)
        in bf16 pairs without a bias, on a CPU with AMX-BF16."""
        w = self.weight_packed
        return self.bias is None and w.format == "bf16_pairs" and _C.bf16_gated_fits(w.rows, w.cols)

    def gated(self, x: torch.Tensor, activation: str, rounded: bool = False) -> torch.Tensor:
        """act(gate) * up of this gate/up product in one pass (fuses_gate; activation "silu" or
        "gelu_tanh"): the floats of activation.silu_and_mul(self(x)) or gelu_tanh_and_mul,
        without writing the [rows, 2I] product out. x fp32 or bf16 rows (takes_bf16_rows);
        rounded: the result rounded to bf16 for a bf16 product after it."""
        rows, size = x.numel() // self.in_features, self.out_features // 2
        out = torch.empty(rows, size, dtype=torch.bfloat16) if rounded else large_outputs.empty(rows, size)
        x2 = x.reshape(rows, self.in_features).contiguous()
        _C.bf16_gated_linear(kernel_array(x2), self.weight_packed.data, self.in_features, kernel_array(out),
                             cpu_threads.kernel_threads(), activation)
        return out.reshape(*x.shape[:-1], size)

    def _widened_gemm(self, x: torch.Tensor) -> torch.Tensor:
        w, threads = self.weight_packed, cpu_threads.kernel_threads()
        step = max(1, WIDEN_CHUNK_FLOATS // w.cols)
        with cpu_threads.wide():
            if step >= w.rows:
                return F.linear(x, self._widened(0, w.rows, threads), self.bias)
            out = torch.empty(x.shape[0], w.rows)
            for begin in range(0, w.rows, step):
                end = min(w.rows, begin + step)
                bias = None if self.bias is None else self.bias[begin:end]
                out[:, begin:end] = F.linear(x, self._widened(begin, end, threads), bias)
            return out

    def _widened(self, begin: int, end: int, threads: int) -> torch.Tensor:
        """Rows [begin, end) widened into this thread's reused buffer."""
        w, floats = self.weight_packed, (end - begin) * self.weight_packed.cols
        return w.widen(begin, end, _widen_buffer(floats)[:floats].view(end - begin, w.cols), threads)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight_packed.format}, bias={self.bias is not None}")


def takes_bf16_rows(module: nn.Module) -> bool:
    """Whether `module` is a product that rounds its input rows to bf16 first (a bf16_pairs
    PackedLinear), so that whoever makes those rows may hand them over rounded: the same
    floats, half the bytes, no rounding pass."""
    return isinstance(module, PackedLinear) and module.weight_packed.format == "bf16_pairs"


def kernel_array(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's NumPy view for a kernel (same memory): fp32 as is, bf16 (rows, a KV
    cache) as its uint16 bits."""
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


class PackedEmbedding(nn.Module):
    """Embedding lookup from a packed [vocab, hidden] table (rows widened as looked up)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.weight_packed = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), self.embedding_dim)
        w = self.weight_packed
        _C.packed_gather(w.data, w.format, w.cols, flat.numpy(), out.numpy())
        return out.reshape(*ids.shape, self.embedding_dim)
