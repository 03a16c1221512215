"""The packed product per GGUF format, Q4_1 (the default model's) beside the others.

For each format, 12 matrices of [1536, 1024] (19M weights, more than the L2 caches hold; the
K-quants need columns in multiples of 256), quantized from the same random weights, go
through `_C.packed_linear` at 1, 8 and 64 input rows on one thread. Formats alternate within
every round (this machine's speed drifts and is shared), each timed in thread CPU time (time
the thread ran, not time it waited for the CPU), and the best round counts. Prints GFLOP/s
(2 * rows * weights / time), the packed bytes per weight, and the speed relative to Q4_1.

    python benchmarks/kquant_kernels.py [--rows 1 8 64] [--rounds 7] [--formats q4_1 q4_k ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kquant_ref import quantize  # noqa: E402  (the K-quant writer the tests check against gguf)

from deepinfer_dp import _C  # noqa: E402
from deepinfer_dp.layers.packed import PackedWeight  # noqa: E402

ROWS, COLS, MATRICES = 1536, 1024, 12
FORMATS = ["q4_1", "q4_0", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "bf16"]


def matrices(fmt: str) -> list[PackedWeight]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(MATRICES):
        w = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
        if fmt == "bf16":
            out.append(PackedWeight.from_bf16(torch.from_numpy(w).bfloat16()))
        else:
            out.append(PackedWeight(np.ascontiguousarray(quantize(w, fmt)), fmt, COLS))
    return out


def pass_time(mats: list[PackedWeight], x: np.ndarray, out: np.ndarray) -> float:
    t = time.thread_time()
    for w in mats:
        _C.packed_linear(x, w.data, w.format, w.cols, None, out, 1)
    return time.thread_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--formats", nargs="+", default=FORMATS)
    args = ap.parse_args()
    formats = ["q4_1", *[f for f in args.formats if f != "q4_1"]]
    mats = {f: matrices(f) for f in formats}
    best = {(f, m): float("inf") for f in formats for m in args.rows}
    for m in args.rows:
        x = np.random.default_rng(m).standard_normal((m, COLS)).astype(np.float32)
        out = np.empty((m, ROWS), np.float32)
        for f in formats:
            pass_time(mats[f], x, out)  # warm-up
        for _ in range(args.rounds):
            for f in formats:
                best[f, m] = min(best[f, m], pass_time(mats[f], x, out))
    flops = 2 * ROWS * COLS * MATRICES
    print(f"{'format':>6} {'bits/w':>6}" + "".join(f" {f'{m} rows GFLOP/s':>17} {'vs q4_1':>7}" for m in args.rows)
          + f"   ({MATRICES} x [{ROWS}, {COLS}], 1 thread, best of {args.rounds})")
    for f in formats:
        bits = 8 * mats[f][0].nbytes / (ROWS * COLS)
        line = f"{f:>6} {bits:>6.2f}"
        for m in args.rows:
            line += f" {m * flops / best[f, m] / 1e9:>17.2f} {best['q4_1', m] / best[f, m]:>6.2f}x"
        print(line)


if __name__ == "__main__":
    main()
