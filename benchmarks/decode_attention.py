"""Decode attention at long contexts against what the machine can read: one decode token of each
of 16 sequences over 2,100 cached positions (SmolLM2's heads: 9 query heads on 3 KV heads of
64; one layer of the long16 workload's decode, 52 MB of fp32 K/V, far beyond the caches)
through `_C.paged_attention`, on 1 and 2 threads, against

- the read rate of the same threads (the peers runner's read ceiling: torch's sum over 512 MB), and
- the same call with every sequence's block table pointing at one sequence's blocks (3.2 MB,
  held in L2/L3): the kernel's own work with the memory stream taken away.

If the kernel overlapped its arithmetic with reading, a layer would take about the longer of
"read" and "cached"; if not at all, their sum. Prints both next to the measured time.
`--layout sequential` puts each sequence's blocks one after another, as a fresh engine
allocates them (default: scattered, as in a server that has run a while). `--kv-dtype bf16`
holds the cache in bf16 (`kv_cache_dtype="bfloat16"`, and the bf16 compute path's cache).

    python benchmarks/decode_attention.py [--sequences 16] [--positions 2100] [--rounds 5]
        [--layout scattered|sequential] [--kv-dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from ceilings import read_gbs  # noqa: E402  (the peers runner's read ceiling, per thread count)

from deepinfer_dp import _C  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def layer_ms(args: tuple, threads: int, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        _C.paged_attention(*args, 0.125, threads)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--positions", type=int, default=2100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout", choices=["scattered", "sequential"], default="scattered",
                    help="each sequence's blocks anywhere in the cache (a long-running server's) or "
                         "one after another (a fresh engine's)")
    ap.add_argument("--kv-dtype", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    s, n = args.sequences, args.positions
    blocks = -(-n // BLOCK)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((s * blocks, BLOCK, KV_HEADS, DIM), dtype=np.float32)
    v = rng.standard_normal((s * blocks, BLOCK, KV_HEADS, DIM), dtype=np.float32)
    if args.kv_dtype == "bf16":  # the bits of bf16 values, as the cache holds them
        k, v = (torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for a in (k, v))
    order = rng.permutation(s * blocks) if args.layout == "scattered" else np.arange(s * blocks)
    tables = order.astype(np.int32).reshape(s, blocks)
    cached = np.ascontiguousarray(np.broadcast_to(tables[:1], tables.shape))
    lens = np.full(s, n, np.int32)
    q = rng.standard_normal((s, HEADS, DIM), dtype=np.float32)
    out = np.empty_like(q)
    mb = 2 * s * n * KV_HEADS * DIM * k.itemsize / 1e6
    print(f"{s} sequences x {n} positions: {mb:.1f} MB of K/V a layer; best of {args.rounds} rounds x 10 calls")
    for threads in (1, 2):
        for r in range(args.rounds):
            gbs = read_gbs(threads, 3)
            full = layer_ms((q, k, v, tables, lens, out), threads, 10)
            warm = layer_ms((q, k, v, cached, lens, out), threads, 10)
            read = mb / gbs
            print(f"threads {threads}, round {r + 1}: {full:.2f} ms a layer ({mb / full:.1f} GB/s, "
                  f"{100 * read / full:.0f}% of the read rate {gbs:.1f} GB/s); cached {warm:.2f} ms; "
                  f"read alone {read:.2f} ms: overlapped {max(read, warm):.2f}, one after the other "
                  f"{read + warm:.2f}")


if __name__ == "__main__":
    main()
