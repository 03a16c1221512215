"""Prefill attention of one long prompt: the C++ paged kernel (AVX-512 with its default spans
of up to 16 queries, AVX-512 with spans of 3, and AVX2, in alternating child processes:
DEEPINFER_DP_PACKED_AVX512 and DEEPINFER_DP_PREFILL_SPAN are read once per process) against
torch's SDPA on the same K/V (causal, SmolLM2's heads: 9 query heads on 3 KV heads of 64).
The kernel gives each query the floats it gets attending alone (batch-invariant); SDPA's
depend on the chunk. Prints the best of each side per round and their ratios. At --threads 1
the times are the thread's CPU time (what a loaded machine's wall clock hides), else wall time.

    python benchmarks/prefill_attention.py [--tokens 2000] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
from harness import emit, in_turn, run_child, self_command

from deepinfer_dp import _C

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def case(tokens: int):
    g = torch.Generator().manual_seed(0)
    blocks = -(-tokens // BLOCK)
    k = torch.randn(blocks + 1, BLOCK, KV_HEADS, DIM, generator=g)
    v = torch.randn(blocks + 1, BLOCK, KV_HEADS, DIM, generator=g)
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    table = np.arange(1, blocks + 1, dtype=np.int32)[None]
    return q, k, v, table


def clock(threads: int) -> Callable[[], float]:
    return time.thread_time if threads == 1 else time.perf_counter


def time_kernel(tokens: int, threads: int, reps: int) -> float:
    now = clock(threads)
    q, k, v, table = case(tokens)
    lens = np.arange(1, tokens + 1, dtype=np.int32)
    rows = np.zeros(tokens, np.int32)
    out = np.empty(q.shape, np.float32)
    best = float("inf")
    for _ in range(reps):
        t = now()
        _C.paged_attention(q.numpy(), k.numpy(), v.numpy(), table, lens, out, DIM ** -0.5, threads, rows)
        best = min(best, now() - t)
    return best


def time_sdpa(tokens: int, threads: int, reps: int) -> float:
    torch.set_num_threads(threads)
    now = clock(threads)
    q, k, v, _ = case(tokens)
    keys = k[1:].flatten(0, 1)[:tokens].transpose(0, 1)[None]
    values = v[1:].flatten(0, 1)[:tokens].transpose(0, 1)[None]
    best = float("inf")
    for _ in range(reps):
        t = now()
        torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=True,
                                                         scale=DIM ** -0.5, enable_gqa=True)
        best = min(best, now() - t)
    return best


def child(side: str, tokens: int, threads: int) -> float:
    env = {"DEEPINFER_DP_PACKED_AVX512": "0" if side == "avx2" else "1",
           "DEEPINFER_DP_PREFILL_SPAN": "3" if side == "span3" else "16"}
    cmd = self_command(__file__, "--child", side, "--tokens", str(tokens), "--threads", str(threads))
    return run_child(cmd, side, env, timeout_s=600)["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["avx512", "span3", "avx2", "sdpa"])
    args = ap.parse_args()
    if args.child:
        fn = time_sdpa if args.child == "sdpa" else time_kernel
        emit({"seconds": fn(args.tokens, args.threads, 3)})
        return
    print(f"{args.tokens} tokens, {args.threads} threads: best of 3 per side, seconds")
    for r in range(args.rounds):
        t = {s: child(s, args.tokens, args.threads) for s in in_turn(["avx512", "span3", "avx2", "sdpa"], r)}
        print(f"round {r + 1}: avx512 {t['avx512']:.3f}  span3 {t['span3']:.3f}  avx2 {t['avx2']:.3f}  "
              f"sdpa {t['sdpa']:.3f}  span3/avx512 {t['span3'] / t['avx512']:.2f}x  "
              f"avx2/avx512 {t['avx2'] / t['avx512']:.2f}x  sdpa/avx512 {t['sdpa'] / t['avx512']:.2f}x")


if __name__ == "__main__":
    main()
