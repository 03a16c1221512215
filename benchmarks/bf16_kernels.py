"""The bf16 product's kernels against the machine: one thread, SmolLM2-135M's matrices, in
GFLOP/s over the thread's CPU time, next to one core's peaks measured by a loop of register
chains in the same process (`_C.dot_peak_gflops`: vdpbf16ps, and 512-bit fp32 FMA) and AMX's
tile products on tiles loaded once (`_C.amx_peak_gflops`; and `_C.amx_fma_overlap`: whether
the tiles and the vector units multiply side by side or take turns), and next
to our fp32 path on the same bf16 weights (format "bf16", widened in registers). Paths: AMX
tiles (the default where the CPU has AMX-BF16; its columns read "-" on a CPU without AMX) and
vdpbf16ps ("native").

    .venv/bin/python benchmarks/bf16_kernels.py [--rows 1 8 64 512] [--rounds 3]

Thread CPU time, best of the rounds, keeps the numbers readable on a shared machine (time the
core spent on other processes is not counted); cache sharing with them is still felt.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedWeight

# SmolLM2-135M's products: (name, outputs, inputs)
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def thread_seconds(fn, reps: int) -> float:
    fn()
    t = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t) / reps


def product_times(rows: int, n: int, k: int, rounds: int, amx: bool) -> tuple[float, float, float]:
    """Best seconds of one call: (AMX or inf without it, vdpbf16ps, fp32 on the widened bf16 weights)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).numpy()
    plain, pairs = PackedWeight.from_bf16(w), PackedWeight.from_bf16(w).to_bf16_pairs()
    out = np.empty((rows, n), dtype=np.float32)
    reps = max(1, int(2e8 // (rows * n * k)))
    best = [float("inf")] * 3
    calls = [(lambda: _C.bf16_linear(x, pairs.data, k, None, out, 1, "amx")) if amx else None,
             lambda: _C.bf16_linear(x, pairs.data, k, None, out, 1, "native"),
             lambda: _C.packed_linear(x, plain.data, "bf16", k, None, out, 1)]
    for _ in range(rounds):
        best = [min(b, thread_seconds(call, reps)) if call else b for b, call in zip(best, calls, strict=True)]
    return best[0], best[1], best[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if "native" not in _C.bf16_dot_paths():
        raise SystemExit(f"this CPU's bf16 paths are {_C.bf16_dot_paths()}: no vdpbf16ps to measure")
    has_amx = "amx" in _C.bf16_dot_paths()
    peak16 = max(_C.dot_peak_gflops(True) for _ in range(args.rounds))
    peak32 = max(_C.dot_peak_gflops(False) for _ in range(args.rounds))
    peak_amx = max(_C.amx_peak_gflops() for _ in range(args.rounds))
    print(f"one core's peaks (thread CPU time): vdpbf16ps {peak16:.1f} GFLOP/s, 512-bit fp32 FMA {peak32:.1f}, "
          f"AMX {peak_amx:.1f}")
    if has_amx:
        tiles, fmas, both = min((_C.amx_fma_overlap() for _ in range(args.rounds)), key=lambda t: t[2])
        print(f"tile products and 512-bit FMAs in one loop: {1e3 * both:.1f} ms against {1e3 * tiles:.1f} and "
              f"{1e3 * fmas:.1f} alone ({both / (tiles + fmas):.0%} of their sum; side by side would be "
              f"{max(tiles, fmas) / (tiles + fmas):.0%})")
    print("GFLOP/s per path and % of its own peak; AMX's speed-up over fp32")
    print(f"{'matrix':<8} {'rows':>5} {'AMX':>8} {'(% peak)':>8} {'AMX wt GB/s':>11} {'vdpbf16ps':>10} {'(% peak)':>8} "
          f"{'fp32':>8} {'(% peak)':>8} {'AMX/fp32':>8}")
    for rows in args.rows:
        for name, n, k in SHAPES:
            amx, dot, f32 = (2.0 * rows * n * k / t / 1e9 for t in product_times(rows, n, k, args.rounds, has_amx))
            amx_cols = (f"{amx:>8.1f} {amx / peak_amx:>8.0%} {amx / rows:>11.1f}" if has_amx
                        else f"{'-':>8} {'-':>8} {'-':>11}")
            ratio = f"{amx / f32:>7.2f}x" if has_amx else f"{'-':>8}"
            print(f"{name:<8} {rows:>5} {amx_cols} {dot:>10.1f} {dot / peak16:>8.0%} "
                  f"{f32:>8.1f} {f32 / peak32:>8.0%} {ratio}")


if __name__ == "__main__":
    main()
