"""The many-row products give each row the floats it gets alone, at any row count.

`_C.packed_linear` (every packed format) and `_C.linear` (fp32 weights) take their inputs a
block of rows at a time (`input_row_block`: 408 rows at K = 640) and run AVX-512 pair tiles
where the CPU has them; every output must still be the 1-row kernel's float, whatever the
row count (1 to 2,048, sampled across block boundaries), the offset in the batch, the thread
split, and whether AVX-512 is used (DEEPINFER_DP_PACKED_AVX512=0 forces AVX2 in a child)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from deepinfer_dp import _C

K, N, ALL_ROWS = 640, 45, 2048  # 45 outputs: the last weight row paired with itself
ROW_COUNTS = [1, 2, 5, 8, 9, 16, 24, 63, 200, 407, 408, 409, 817, 1000, 1500, 2048]
FORMATS = ["q4_0", "q4_1", "q8_0", "bf16", "f32"]
GGUF = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def weight(fmt: str) -> np.ndarray:
    w = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    if fmt == "f32":
        return w
    if fmt == "bf16":
        return torch.from_numpy(w).bfloat16().view(torch.int16).numpy().view(np.uint8).copy()
    return np.ascontiguousarray(quants.quantize(w, GGUF[fmt]))


def product(fmt: str, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None, threads: int) -> np.ndarray:
    out = np.full((x.shape[0], N), np.nan, np.float32)
    if fmt == "f32":
        _C.linear(x, w, bias, out, threads)
    else:
        _C.packed_linear(x, w, fmt, K, bias, out, threads)
    return out


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((ALL_ROWS, K)).astype(np.float32), rng.standard_normal(N).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_count_gives_each_row_its_own_floats(fmt):
    w, (x, bias) = weight(fmt), inputs()
    whole = product(fmt, w, x, bias, threads=2)
    assert not np.isnan(whole).any()
    for i in (0, 1, 407, 408, 1000, 2047):  # alone: the 1-row kernel
        assert np.array_equal(product(fmt, w, x[i:i + 1].copy(), bias, 1), whole[i:i + 1]), i
    rng = np.random.default_rng(2)
    for rows in ROW_COUNTS:
        start = int(rng.integers(0, ALL_ROWS - rows + 1))
        threads = int(rng.integers(1, 4))
        part = product(fmt, w, x[start:start + rows].copy(), bias, threads)
        assert np.array_equal(part, whole[start:start + rows]), (rows, start, threads)


@pytest.mark.parametrize("fmt", ["q4_1", "bf16"])
def test_packed_equals_the_fp32_product_of_the_widened_weights(fmt):
    w, (x, bias) = weight(fmt), inputs()
    widened = np.empty((N, K), np.float32)
    _C.packed_widen(w, fmt, K, 0, N, widened, 1)
    assert np.array_equal(product(fmt, w, x, bias, 2), product("f32", widened, x, bias, 2))


AVX2_ONLY = """
import sys, numpy as np
from deepinfer_dp import _C
fmt, k, x, w, bias, out = sys.argv[1], int(sys.argv[2]), *(np.load(p) for p in sys.argv[3:6]), sys.argv[6]
y = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
_C.linear(x, w, bias, y, 2) if fmt == "f32" else _C.packed_linear(x, w, fmt, k, bias, y, 2)
np.save(out, y)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_and_avx512_give_the_same_floats_at_many_rows(fmt, tmp_path):
    w, (x, bias) = weight(fmt), inputs()
    x = x[:1100].copy()  # three input blocks, the last one short
    paths = [tmp_path / f"{n}.npy" for n in ("x", "w", "bias", "out")]
    for path, arr in zip(paths, (x, w, bias), strict=False):
        np.save(path, arr)
    env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
    subprocess.run([sys.executable, "-c", AVX2_ONLY, fmt, str(K), *map(str, paths)], env=env, check=True, timeout=300)
    assert np.array_equal(np.load(paths[3]), product(fmt, w, x, bias, 2))


def test_layers_take_the_kernels_in_batch_invariant_steps():
    """Past their row limits the linear modules use torch's GEMMs, except in a batch-invariant
    step (the runner's thread plan with batch_invariant), where they give the kernels' floats."""
    from torch import nn

    from deepinfer_dp.layers import cpu_threads
    from deepinfer_dp.layers.linear import KERNEL_MAX_ROWS, CpuLinear
    from deepinfer_dp.layers.packed import PackedLinear, PackedWeight

    x, _ = inputs()
    dense = nn.Linear(K, N, bias=False)
    layers = {"q4_1": PackedLinear(PackedWeight(weight("q4_1"), "q4_1", K)), "f32": CpuLinear(dense)}
    arrays = {"q4_1": weight("q4_1"), "f32": dense.weight.detach().numpy()}
    rows = 600  # past both KERNEL_MAX_ROWS (512 packed, 64 fp32)
    assert rows > KERNEL_MAX_ROWS
    for fmt, layer in layers.items():
        with cpu_threads.narrow_step(2, rows, invariant=True):
            assert cpu_threads.batch_invariant()
            got = layer(torch.from_numpy(x[:rows])).detach().numpy()
        assert not cpu_threads.batch_invariant()
        assert np.array_equal(got, product(fmt, arrays[fmt], x[:rows].copy(), None, 1)), fmt


# 1536: the pair tiles take K in three blocks of 512, their chains carried from block to block;
# 2336: in five, the last one shorter.
@pytest.mark.parametrize("k", [576, 640, 1536, 2336])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "f32"])
def test_every_row_of_a_many_row_product_is_its_one_row_product(fmt, k):
    """All rows, not a sample, at the row counts whose tiles end in a partial group of
    accumulators (9 = 8 + 1, 17), at full tiles (64) and at the few-row path's grouped sums
    (4 to 8 rows), with a bias and an odd output count."""
    rng = np.random.default_rng(3)
    n = 45
    w = rng.standard_normal((n, k)).astype(np.float32)
    if fmt != "f32":
        w = np.ascontiguousarray(quants.quantize(w, GGUF[fmt]))
    x, bias = rng.standard_normal((64, k)).astype(np.float32), rng.standard_normal(n).astype(np.float32)

    def run(rows: np.ndarray, threads: int) -> np.ndarray:
        out = np.full((rows.shape[0], n), np.nan, np.float32)
        if fmt == "f32":
            _C.linear(rows, w, bias, out, threads)
        else:
            _C.packed_linear(rows, w, fmt, k, bias, out, threads)
        return out

    alone = np.concatenate([run(x[i:i + 1].copy(), 1) for i in range(64)])
    assert not np.isnan(alone).any()
    for m in (4, 6, 7, 8, 9, 17, 64):
        for threads in (1, 2):
            assert np.array_equal(run(x[:m].copy(), threads), alone[:m]), (m, threads)
