"""Old against new `_C` builds on the AVX-512 products at 64 input rows (or --rows), one thread.

Each (shape, format) runs in a child process that loads one `_C` extension file (`--old`, then
`--new`, alternating, `--rounds` times) and times `_C.packed_linear` (Q4_1, Q8_0) or
`_C.linear` (fp32) at 64 input rows (--rows) on one thread, in thread CPU time (the time the
thread ran, not the time it waited for a core: this machine is shared), best of enough calls for
about `--seconds` of CPU. Weights are random bytes in the packed layout (sane fp16 scales),
the same in every child, so each product's SHA-1 shows whether the two builds give the
same floats. Prints, per round, each side's ms per call, GFLOP/s (2 * rows * N * K / time)
and its share of one core's 512-bit FMA peak (--peak, GFLOP/s), then the best per side.

    .venv/bin/python benchmarks/many_rows_reduce.py --old OLD.so [--new NEW.so] [--rounds 3]

`--new` defaults to the installed extension. Shapes: SmolLM2-135M's qkv [960, 576],
gate_up [3072, 576], down [576, 1536] and lm_head [49152, 576] (Q4_1 and fp32), and Gemma 3's
lm_head [262144, 640] (Q8_0; --no-gemma skips its 178 MB).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import subprocess
import sys
import time

import numpy as np

SMOL = [("qkv", 960, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
GEMMA = ("gemma_lm_head", 262144, 640)
BLOCK = {"q4_1": (20, 2), "q8_0": (34, 1)}  # bytes per 32 values, fp16 scales leading each block


def packed(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    nbytes, scales = BLOCK[fmt]
    blocks = rng.integers(0, 256, (n, k // 32, nbytes), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // 32, scales)) * 0.01).astype(np.float16)
    blocks[:, :, : 2 * scales] = halves.view(np.uint8)
    return blocks.reshape(n, -1)


def child(so: str, fmt: str, n: int, k: int, rows: int, seconds: float) -> None:
    spec = importlib.util.spec_from_file_location("_C", so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k), dtype=np.float32) * 0.05 if fmt == "f32" else packed(fmt, n, k, rng)
    x, bias = rng.standard_normal((rows, k), dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    out = np.empty((rows, n), np.float32)

    def call() -> float:
        start = time.thread_time()
        ext.linear(x, w, bias, out, 1) if fmt == "f32" else ext.packed_linear(x, w, fmt, k, bias, out, 1)
        return time.thread_time() - start

    best = call()  # warm-up: the thread's buffers, the pages of w
    for _ in range(max(3, int(seconds / max(best, 1e-4)))):
        best = min(best, call())
    print(json.dumps({"ms": best * 1e3, "sha1": hashlib.sha1(out.tobytes()).hexdigest()}), flush=True)


def run_child(so: str, fmt: str, n: int, k: int, rows: int, seconds: float) -> dict:
    cmd = [sys.executable, __file__, "--child", so, fmt, str(n), str(k), str(rows), str(seconds)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(ms: float, flop: float, peak: float) -> str:
    gflops = flop / ms / 1e6
    return f"{ms:9.3f} ms {gflops:7.1f} GF/s {100 * gflops / peak:5.1f}%"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        so, fmt, n, k, rows, seconds = sys.argv[2:8]
        return child(so, fmt, int(n), int(k), int(rows), float(seconds))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=None)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--peak", type=float, default=232.0)
    ap.add_argument("--no-gemma", action="store_true")
    ap.add_argument("--only", nargs="+", default=None, help="shape names to run (qkv, gate_up, ...)")
    args = ap.parse_args()
    new = args.new or importlib.util.find_spec("deepinfer_dp._C").origin
    cases = [(name, fmt, n, k) for name, n, k in SMOL for fmt in ("q4_1", "f32")]
    if not args.no_gemma:
        cases.append((*GEMMA[:1], "q8_0", *GEMMA[1:]))
    cases = [c for c in cases if args.only is None or c[0] in args.only]
    print(f"old {args.old}\nnew {new}\n{args.rows} rows, 1 thread, thread CPU time; peak {args.peak} GFLOP/s")
    for name, fmt, n, k in cases:
        flop, best, sums = 2.0 * args.rows * n * k, {"old": float("inf"), "new": float("inf")}, set()
        for r in range(args.rounds):
            sides = (("old", args.old), ("new", new))
            got = {side: run_child(so, fmt, n, k, args.rows, args.seconds) for side, so in sides}
            sums.update(g["sha1"] for g in got.values())
            for side in best:
                best[side] = min(best[side], got[side]["ms"])
            print(f"{name:>13} {fmt:>4} [{n}x{k}] round {r}: old {cell(got['old']['ms'], flop, args.peak)} | "
                  f"new {cell(got['new']['ms'], flop, args.peak)}", flush=True)
        print(f"{name:>13} {fmt:>4} best: old {cell(best['old'], flop, args.peak)} | new "
              f"{cell(best['new'], flop, args.peak)} | new/old {best['new'] / best['old']:.3f} | "
              f"{'same floats' if len(sums) == 1 else 'FLOATS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
