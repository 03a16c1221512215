"""A fused projection whose parts are stored in different formats, each kept as stored.

A Q4_K_M file quantizes q, k and v (and gate and up) on their own: a Llama file's v is Q6_K
in some layers next to a Q4_K q and k, and where rows do not fit K-quant super-blocks the
fallbacks differ too (Gemma 3 270M: Q5_0 q/k, Q8_0 v). Fused into one projection, such parts
would otherwise have to share one format: widened to fp32 (4-8x the bytes a decode step
reads) or lifted to Q8_0 where that is exact. `PackedParts` keeps every part's blocks, and
`_C.PackedParts.linear` runs each part's rows through its own format's kernel against the
same block of inputs in one call, so the outputs are exactly those of the widened matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedLinear, PackedWeight


@dataclass(frozen=True)
class PackedParts:
    """The rows of `parts` one after another, each part in its own format."""

    parts: tuple[PackedWeight, ...]
    kernel: _C.PackedParts = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({p.cols for p in self.parts}) != 1:
            raise ValueError(f"want two or more packed parts with one column count, got "
                             f"{[(p.format, p.rows, p.cols) for p in self.parts]}")
        if any(p.format == "bf16_pairs" for p in self.parts):
            raise ValueError("bf16_pairs matrices cannot be parts (they compute in bf16)")
        kernel = _C.PackedParts([p.data for p in self.parts], [p.format for p in self.parts], self.cols)
        object.__setattr__(self, "kernel", kernel)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def format(self) -> str:
        """The parts' formats in row order, e.g. "q4_k+q6_k"."""
        return "+".join(p.format for p in self.parts)

    def linear(self, x: np.ndarray, bias: np.ndarray | None, out: np.ndarray, threads: int) -> None:
        """out = x @ W.T (+ bias), as PackedWeight.linear."""
        self.kernel.linear(x, bias, out, threads)

    def widen(self, begin: int = 0, end: int | None = None, out: torch.Tensor | None = None,
              threads: int = 1) -> torch.Tensor:
        """Rows [begin, end) as fp32 [end - begin, cols] (into `out` when given)."""
        end = self.rows if end is None else end
        if out is None:
            out = torch.empty(end - begin, self.cols)
        first = 0
        for p in self.parts:
            b, e = max(begin, first), min(end, first + p.rows)
            if b < e:
                p.widen(b - first, e - first, out[b - begin:e - begin], threads)
            first += p.rows
        return out

    def to_bf16_pairs(self) -> PackedWeight:
        """The whole matrix for bf16 arithmetic (its widened values rounded to bf16)."""
        return PackedWeight.from_bf16(self.widen().to(torch.bfloat16)).to_bf16_pairs()


class PackedPartsLinear(PackedLinear):
    """PackedLinear over a PackedParts matrix. Its own type, so that code taking a single
    format's bytes (`type(m) is PackedLinear`) passes it by; the one-call decode stack takes
    its parts (models/llama_cpu_decode.py)."""

    def __init__(self, weight: PackedParts, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)  # type: ignore[arg-type]
