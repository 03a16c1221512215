"""The many-row packed kernel's rate as its products get deeper (K, the columns of a matrix).

One thread, 64 input rows, Q4_1 matrices of K = 576 (SmolLM2's hidden size) to 8192 (a 1B
model's intermediate size), each N x K about 1.8M values, four of them in turn so that the
weights come from memory as in a model; prints each K's GFLOP/s next to one core's 512-bit FMA
peak measured by a loop of register chains in the same process (`_C.dot_peak_gflops`), over
the thread's CPU time. Past K = 640 the kernel takes K in blocks that keep a tile's pairs in
L1 (docs/cpu_engine.md); to compare two builds, run this under each, alternating.

    python benchmarks/many_rows_depth.py [--cols 576 1536 4096 8192] [--rows 64] [--rounds 15]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from gguf import GGMLQuantizationType, quants

from deepinfer_dp import _C

VALUES = 3072 * 576  # SmolLM2's gate_up: the matrices' size at every K


def matrices(k: int, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    n = VALUES // k // 12 * 12
    return [np.ascontiguousarray(quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32),
                                                 GGMLQuantizationType.Q4_1)) for _ in range(count)]


def rate(k: int, rows: int, rounds: int) -> float:
    """GFLOP/s of the quarter-best call, CPU time of this thread."""
    rng = np.random.default_rng(k)
    mats = matrices(k, 4, rng)
    n = mats[0].shape[0]
    x, out = rng.standard_normal((rows, k)).astype(np.float32), np.empty((rows, n), np.float32)
    times = []
    for _ in range(rounds):
        for w in mats:
            start = time.thread_time()
            _C.packed_linear(x, w, "q4_1", k, None, out, 1)
            times.append(time.thread_time() - start)
    best = sorted(times)[len(times) // 4]
    return 2 * rows * n * k / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, nargs="+", default=[576, 1024, 1536, 2048, 4096, 8192])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    peak = max(_C.dot_peak_gflops(False) for _ in range(3))
    print(f"one core's 512-bit fp32 FMA peak: {peak:.1f} GFLOP/s; {args.rows} rows, Q4_1, one thread")
    for k in args.cols:
        gflops = rate(k, args.rows, args.rounds)
        print(f"K = {k:5d}: {gflops:6.1f} GFLOP/s, {gflops / peak:4.0%} of the peak")


if __name__ == "__main__":
    main()
