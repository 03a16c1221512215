"""The packed kernels on GGUF's 5-bit and K-quant formats (Q5_0, Q5_1, Q2_K-Q6_K):
widening equals gguf's dequantize bit for bit, on arbitrary blocks and on quantized matrices
(K-quant blocks written by tests/kquant_ref.py, checked here against gguf's reader); the
product equals `_C.linear` (cpu_linear's fp32 chains: the reduction order the packed kernels
promise) on the dequantized matrix bit for bit at every row count 1-512, and each row's
floats do not depend on the batch, the thread split, or the AVX-512 / AVX2 path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from kquant_ref import dequantize, quantize

from deepinfer_dp import _C
from deepinfer_dp.layers import packed as P

FORMATS = ["q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# Byte offsets (within a block) of the high bytes of each block's fp16 scales.
SCALE_HIGH_BYTES = {"q4_0": [1], "q5_0": [1], "q5_1": [1, 3], "q8_0": [1], "q2_k": [81, 83], "q3_k": [109],
                    "q4_k": [1, 3], "q5_k": [1, 3], "q6_k": [209]}
K, N = 512, 45  # two super-blocks a row; an odd row count leaves the last AVX-512 pair short
# All of 1-16 (the fused kernels' every width, then the tiles' remainders), then a spread to
# 512 across the tiles of 8 inputs and the cache blocks of inputs; the slow test runs them all.
ROW_COUNTS = [*range(1, 17), 23, 31, 33, 64, 100, 129, 255, 257, 511, 512]


def packed_matrix(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[P.PackedWeight, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data = np.ascontiguousarray(quantize(w, fmt))
    return P.PackedWeight(data, fmt, cols), torch.from_numpy(dequantize(data, fmt))


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Arbitrary bytes for every quant and scale, with finite fp16 scales (subnormals included)."""
    values, nbytes = P.FORMATS[fmt]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for b in SCALE_HIGH_BYTES[fmt]:
        data[..., b] &= 0xfb  # an exponent bit cleared: no inf/NaN scales
    return data.reshape(rows, -1)


def packed_kernel(x: torch.Tensor, w: P.PackedWeight, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], w.rows), float("nan"))
    _C.packed_linear(x.numpy(), w.data, w.format, w.cols, None, out.numpy(), threads)
    return out


def fp32_kernel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    _C.linear(x.numpy(), w.contiguous().numpy(), None if bias is None else bias.numpy(), out.numpy(), 1)
    return out


def inputs(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt,rel_rms", [("q2_k", 0.4), ("q3_k", 0.22), ("q4_k", 0.12), ("q5_k", 0.06),
                                          ("q6_k", 0.03)])
def test_reference_quantizer_round_trips_through_gguf(fmt, rel_rms):
    """gguf reads the blocks back as the matrix, to within the format's precision."""
    w = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    w[3] *= 40  # super-blocks of very different scales
    w[5, :256] = 0  # an all-zero super-block
    back = dequantize(quantize(w, fmt), fmt)
    assert back.shape == w.shape and np.all(back[5, :256] == 0)
    assert np.sqrt(np.mean((back - w) ** 2, axis=1) / np.mean(w ** 2, axis=1)).max() < rel_rms
    with pytest.raises(ValueError, match="multiples of 256"):
        quantize(w[:, :640], fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_widening_arbitrary_blocks_equals_gguf(fmt):
    data = random_blocks(fmt, 19, K)
    ref = dequantize(data, fmt)
    w = P.PackedWeight(data, fmt, K)
    assert np.array_equal(w.widen(threads=2).numpy(), ref)
    ids = torch.tensor([18, 0, 7])
    assert np.array_equal(P.PackedEmbedding(w)(ids).numpy(), ref[ids.numpy()])


@pytest.mark.parametrize("fmt", FORMATS)
def test_arbitrary_blocks_product_equals_fp32_kernel(fmt):
    data = random_blocks(fmt, N, K, seed=4)
    w, ref = P.PackedWeight(data, fmt, K), torch.from_numpy(dequantize(data, fmt))
    for m in (1, 2, 5, 8, 9, 20):
        x = inputs(m)
        assert torch.equal(packed_kernel(x, w, threads=2), fp32_kernel(x, ref)), m


def check_row_counts(fmt: str, row_counts) -> None:
    w, ref = packed_matrix(fmt, N, K)
    x = inputs(max(row_counts))
    whole = packed_kernel(x, w)
    for m in row_counts:
        got = packed_kernel(x[:m].clone(), w, threads=2)
        assert torch.equal(got, fp32_kernel(x[:m], ref)), m
        assert torch.equal(got, whole[:m]), m
        assert torch.equal(packed_kernel(x[m - 1:m].clone(), w), whole[m - 1:m]), m  # the row alone


@pytest.mark.parametrize("fmt", FORMATS)
def test_product_equals_fp32_kernel_at_sampled_row_counts(fmt):
    check_row_counts(fmt, ROW_COUNTS)
    w, ref = packed_matrix(fmt, N, K)
    x, bias = inputs(7), torch.randn(N, generator=torch.Generator().manual_seed(5))
    out = torch.empty(7, N)
    _C.packed_linear(x.numpy(), w.data, fmt, K, bias.numpy(), out.numpy(), 2)
    assert torch.equal(out, fp32_kernel(x, ref, bias))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, ref, bias), atol=1e-3, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_product_equals_fp32_kernel_at_every_row_count(fmt):
    check_row_counts(fmt, range(1, 513))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_do_not_depend_on_the_thread_split(fmt):
    w, _ = packed_matrix(fmt, 1001, K)  # enough bytes for the kernel to split across 7 threads
    for m in (1, 3, 8, 13, 64):
        x = inputs(m, seed=m)
        whole = packed_kernel(x, w, threads=1)
        for threads in (2, 3, 7):
            assert torch.equal(packed_kernel(x, w, threads=threads), whole), (m, threads)


AVX2_ONLY = """
import sys, numpy as np
from deepinfer_dp import _C
x, w, fmt, cols, out = np.load(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
results = {}
for m in map(int, sys.argv[6].split(",")):
    results[str(m)] = np.full((m, w.shape[0]), np.nan, np.float32)
    _C.packed_linear(np.ascontiguousarray(x[:m]), w, fmt, cols, None, results[str(m)], 2)
np.savez(out, **results)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx512_and_avx2_kernels_give_the_same_floats(fmt, tmp_path):
    """The AVX2 kernels (forced by DEEPINFER_DP_PACKED_AVX512=0, read once per process, so in
    a child) give every float the AVX-512 pair kernels give, fused and buffered."""
    w, _ = packed_matrix(fmt, N, K)
    counts = [*range(1, 11), 13, 16, 64]
    x = inputs(max(counts))
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "w.npy", w.data)
    env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
    subprocess.run([sys.executable, "-c", AVX2_ONLY, str(tmp_path / "x.npy"), str(tmp_path / "w.npy"), fmt, str(K),
                    str(tmp_path / "out.npz"), ",".join(map(str, counts))], env=env, check=True, timeout=120)
    avx2 = np.load(tmp_path / "out.npz")
    for m in counts:
        assert torch.equal(torch.from_numpy(avx2[str(m)]), packed_kernel(x[:m].clone(), w, threads=2)), m


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "q8_0"])
def test_q4_0_and_q5_0_values_are_exact_in_q8_0(fmt):
    data = random_blocks(fmt, 7, 96)  # every quant value, subnormal scales too
    w = P.PackedWeight(data, fmt, 96)
    q8 = w.as_q8_0()
    assert q8.format == "q8_0" and torch.equal(q8.widen(), w.widen())
    assert np.array_equal(dequantize(q8.data, "q8_0"), dequantize(data, fmt))
    with pytest.raises(ValueError, match="q4_k values are not exact in q8_0"):
        packed_matrix("q4_k", 2, 256)[0].as_q8_0()


@pytest.mark.parametrize("fmt,cols", [("q4_k", 288), ("q6_k", 640), ("q5_0", 48)])
def test_columns_that_do_not_fit_the_blocks_are_refused_by_name(fmt, cols):
    x, out = np.zeros((1, cols), np.float32), np.zeros((1, 2), np.float32)
    with pytest.raises(ValueError, match=f"cols={cols} does not fit {fmt}'s blocks"):
        _C.packed_linear(x, np.zeros((2, 144), np.uint8), fmt, cols, None, out, 1)
    with pytest.raises(ValueError, match=f"{fmt} matrix of {cols} columns"):
        P.PackedWeight(np.zeros((2, 144), np.uint8), fmt, cols)

