"""How fast the packed kernel reads weights at one input row (batch-1 decode), against how
fast the machine streams memory on the same threads.

Runs `_C.packed_linear` with one input row over SmolLM2's layer matrices in Q4_1 (the default
model's format) and over its Q8_0 lm_head, and prints GB/s of weights read: a matrix that stays
in L2 (gate_up, 1.1 MB, repeated), all 30 layers (66 MB, far past L2), the lm_head (30 MB),
each on 1 and 2 threads, next to torch's sum over 512 MB on as many threads (the peers runner's
read ceiling). Where the rates in L2 and past it agree, the kernel's instructions bound it, not
the memory; the gap to the streaming sum is what a faster kernel could still take.

    python benchmarks/one_row_rate.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedWeight

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))
from ceilings import read_gbs  # noqa: E402
from kernel_crossover import layers  # noqa: E402


def lm_head() -> PackedWeight:
    w = (np.random.default_rng(1).standard_normal((49152, 576)) * 0.05).astype(np.float32)
    return PackedWeight(np.ascontiguousarray(quants.quantize(w, GGMLQuantizationType.Q8_0)), "q8_0", 576)


def gbs(mats: list[PackedWeight], threads: int, rounds: int) -> float:
    """Weights' GB/s over the matrices, one input row, the best of `rounds` passes."""
    xs = {c: np.random.default_rng(c).standard_normal((1, c)).astype(np.float32) for c in {w.cols for w in mats}}
    outs = [np.empty((1, w.rows), np.float32) for w in mats]
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for w, out in zip(mats, outs, strict=True):
            _C.packed_linear(xs[w.cols], w.data, w.format, w.cols, None, out, threads)
        best = min(best, time.perf_counter() - t)
    return sum(w.data.nbytes for w in mats) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    all_layers = layers(30)
    cases = {"Q4_1 in L2 (gate_up x 60)": [all_layers[2]] * 60, "Q4_1, 30 layers (past L2)": all_layers,
             "Q8_0 lm_head": [lm_head()]}
    for threads in (1, 2):
        stream = read_gbs(threads)
        print(f"{threads} thread(s): torch sum over 512 MB {stream:.1f} GB/s")
        for name, mats in cases.items():
            rate = gbs(mats, threads, args.rounds)
            print(f"  {name:<28} {rate:5.1f} GB/s  ({rate / stream:.0%} of the sum)")


if __name__ == "__main__":
    main()
