"""Where the packed decode kernel and "widen the matrix, then torch's GEMM" cross over.

For SmolLM2's layer shapes in Q4_1 (and its Q8_0 lm_head), times `_C.packed_linear` and the
widened GEMM path of PackedLinear at several row counts, alternating the two in every round
(this machine's speed drifts), and prints the best time of each and their ratio. The row
count where the GEMM starts winning is what `layers/packed.py` KERNEL_MAX_ROWS should be (it
applies only with batch_invariant off: batch-invariant steps take the kernel at every row
count). The last two columns are torch's GEMM and `_C.linear` (the fp32 kernel, which
CpuLinear runs) on matrices widened once (a model widened at load, or stored in fp32).

    python benchmarks/kernel_crossover.py [--rows 8 16 32 48 64 96 128 256] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedLinear, PackedWeight

# (name, rows, cols, format): one decoder layer's matrices, and the lm_head.
SHAPES = [("qkv", 960, 576, "q4_1"), ("o", 576, 576, "q4_1"), ("gate_up", 3072, 576, "q4_1"),
          ("down", 576, 1536, "q4_1")]
TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def layers(count: int) -> list[PackedWeight]:
    """`count` decoder layers' worth of packed matrices (more than the caches hold)."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        for _, rows, cols, fmt in SHAPES:
            w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
            out.append(PackedWeight(np.ascontiguousarray(quants.quantize(w, TYPES[fmt])), fmt, cols))
    return out


def time_kernel(mats: list[PackedWeight], xs: dict[int, torch.Tensor], threads: int) -> float:
    t = time.perf_counter()
    for w in mats:
        x = xs[w.cols]
        out = torch.empty(x.shape[0], w.rows)
        _C.packed_linear(x.numpy(), w.data, w.format, w.cols, None, out.numpy(), threads)
    return time.perf_counter() - t


def time_gemm(mods: list[PackedLinear], xs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for m in mods:
        m._widened_gemm(xs[m.in_features])
    return time.perf_counter() - t


def time_fp32(dense: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> float:
    t = time.perf_counter()
    for w in dense:
        torch.nn.functional.linear(xs[w.shape[1]], w)
    return time.perf_counter() - t


def time_fp32_kernel(dense: list[torch.Tensor], xs: dict[int, torch.Tensor], threads: int) -> float:
    t = time.perf_counter()
    for w in dense:
        x = xs[w.shape[1]]
        _C.linear(x.numpy(), w.numpy(), None, torch.empty(x.shape[0], w.shape[0]).numpy(), threads)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mats = layers(8)
    mods = [PackedLinear(w) for w in mats]
    dense = [w.widen() for w in mats]  # what a model widened at load multiplies with
    print(f"{'rows':>5} {'kernel ms':>10} {'widen+GEMM ms':>14} {'GEMM / kernel':>14} {'fp32 GEMM ms':>13}"
          f" {'fp32 kernel ms':>15}   (8 layers, {args.threads} threads)")
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        kernel = gemm = fp32 = fp32_kernel = float("inf")
        for _ in range(args.rounds):
            kernel = min(kernel, time_kernel(mats, xs, args.threads))
            gemm = min(gemm, time_gemm(mods, xs))
            fp32 = min(fp32, time_fp32(dense, xs))
            fp32_kernel = min(fp32_kernel, time_fp32_kernel(dense, xs, args.threads))
        print(f"{m:>5} {kernel * 1e3:>10.2f} {gemm * 1e3:>14.2f} {gemm / kernel:>13.2f}x {fp32 * 1e3:>13.2f}"
              f" {fp32_kernel * 1e3:>15.2f}")


if __name__ == "__main__":
    main()
