"""bf16 attention (bf16_math: AMX tiles, or vdpbf16ps on a CPU with AVX512-BF16 and no AMX) against
fp32 arithmetic over the same bf16 cache, one layer of SmolLM2's shape (9 query heads, 3 KV
heads, head size 64, blocks of 16 slots scattered over the cache), milliseconds a call.

    .venv/bin/python benchmarks/bf16_attention.py [--threads 2] [--rounds 3] [--cases decode prefill]
        [--bf16-only] [--seconds 0.5] [--handover]

Cases: decode steps (one token a sequence) at 1, 16 and 64 sequences of 2,000 and 200
positions, and one 2,000-token prompt's prefill (every position a query). The two kernels
alternate round by round in one process, so the machine's drift hits both alike. --handover:
the prefill's attention and its output projection, the attention's output handed to the
product in fp32 or, as the model does, already rounded to bf16 by the kernel.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedWeight

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_case(seqs: int, ctx: int, prefill: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    per_seq = -(-ctx // BLOCK)
    blocks = seqs * per_seq
    k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16().view(torch.uint16).numpy() for _ in range(2))
    table = rng.permutation(blocks).reshape(seqs, per_seq).astype(np.int32)
    if prefill:
        rows = np.repeat(np.arange(seqs, dtype=np.int32), ctx)
        lens = np.tile(np.arange(1, ctx + 1, dtype=np.int32), seqs)
    else:
        rows, lens = None, np.full(seqs, ctx, np.int32)
    q = rng.standard_normal((len(lens), HEADS, HEAD_DIM), dtype=np.float32)
    return q, k, v, table, lens, rows


def time_call(case, bf16_math: bool, threads: int, seconds: float = 0.5) -> float:
    q, k, v, table, lens, rows = case
    out = np.empty_like(q)

    def call():
        _C.paged_attention(q, k, v, table, lens, out, HEAD_DIM ** -0.5, threads, rows, 0, bf16_math=bf16_math)

    call()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def handover_times(threads: int, rounds: int, seconds: float) -> None:
    """One 2,000-token prompt's attention followed by its output projection (576 x 576 bf16,
    SmolLM2's), the attention's output handed over in fp32 (the product rounds it) or already
    rounded by the kernel (uint16 out, the model's path): the same floats, checked."""
    q, k, v, table, lens, rows = make_case(1, 2000, True)
    width = HEADS * HEAD_DIM
    weight = PackedWeight.from_bf16((torch.randn(576, width) * 0.05).bfloat16()).to_bf16_pairs()
    y = np.empty((len(q), 576), np.float32)
    outs = {"fp32": np.empty(q.shape, np.float32), "bf16": np.empty(q.shape, np.uint16)}

    def call(kind: str) -> None:
        out = outs[kind]
        _C.paged_attention(q, k, v, table, lens, out, HEAD_DIM ** -0.5, threads, rows, 0, bf16_math=True)
        _C.packed_linear(out.reshape(len(q), width), weight.data, "bf16_pairs", width, None, y, threads)

    results = {}
    for kind in outs:
        call(kind)
        results[kind] = y.copy()
    assert np.array_equal(results["fp32"], results["bf16"]), "the two handovers gave different floats"
    times = {kind: [] for kind in outs}
    for _ in range(rounds):
        for kind in outs:
            call(kind)
            calls, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                call(kind)
                calls += 1
            times[kind].append((time.perf_counter() - start) / calls * 1e3)
    spread = {kind: f"{min(t):.3f}-{max(t):.3f} ms" for kind, t in times.items()}
    print(f"prefill 1 x 2000, attention + output projection, threads {threads}: output handed over in fp32 "
          f"{spread['fp32']}, in bf16 {spread['bf16']} (same floats)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    ap.add_argument("--bf16-only", action="store_true", help="time the bf16 kernel alone (e.g. to compare two builds)")
    ap.add_argument("--seconds", type=float, default=0.5, help="calls a reading runs for")
    ap.add_argument("--handover", action="store_true",
                    help="the prefill's attention and output projection, its output handed over in fp32 or bf16")
    args = ap.parse_args()
    form = _C.bf16_attention_form(HEAD_DIM)
    if not form:
        raise SystemExit("this CPU has neither AMX-BF16 nor AVX512-BF16: bf16_math would widen, the same kernel")
    if args.handover:
        return handover_times(args.threads, args.rounds, args.seconds)
    cases = [("decode", s, c) for s in (1, 16, 64) for c in (2000, 200)] + [("prefill", 1, 2000)]
    cases = [c for c in cases if c[0] in args.cases]
    print(f"bf16 form: {form}")
    print(f"{'case':<28} {'fp32 ms':>18} {'bf16 ms':>18} {'fp32 / bf16':>12}")
    for kind, seqs, ctx in cases:
        case = make_case(seqs, ctx, kind == "prefill")
        fp32, amx = [], []
        for _ in range(args.rounds):
            if not args.bf16_only:
                fp32.append(time_call(case, False, args.threads, args.seconds))
            amx.append(time_call(case, True, args.threads, args.seconds))
        name = f"{kind} {seqs} x {ctx}"
        spread = f"{min(fp32):>8.3f}-{max(fp32):<9.3f}" if not args.bf16_only else f"{'-':>18}"
        ratios = "-" if args.bf16_only else ", ".join(f"{a / b:.2f}" for a, b in zip(fp32, amx, strict=True))
        print(f"{name:<28} {spread} {min(amx):>8.3f}-{max(amx):<9.3f} {ratios}")


if __name__ == "__main__":
    main()
