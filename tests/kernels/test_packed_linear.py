"""The packed-weight kernels (GGUF Q4_0/Q4_1/Q8_0, bf16): widening equals gguf's dequantize
and torch's bf16 cast bit for bit; the product equals `_C.linear` on the widened matrix bit
for bit, whatever the batch or the thread split; bad arguments raise ValueError by name; and
the modules that route small batches to the kernel and large ones to a widened GEMM."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from deepinfer_dp import _C
from deepinfer_dp.layers import packed as P

GGUF_TYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
              "q8_0": GGMLQuantizationType.Q8_0}
FORMATS = [*GGUF_TYPES, "bf16"]


def packed_matrix(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[P.PackedWeight, torch.Tensor]:
    """A random packed matrix and its fp32 widening by the reference (gguf / torch)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if fmt == "bf16":
        t = torch.from_numpy(w).bfloat16()
        return P.PackedWeight.from_bf16(t), t.float()
    data = quants.quantize(w, GGUF_TYPES[fmt])
    ref = np.asarray(quants.dequantize(data, GGUF_TYPES[fmt]), dtype=np.float32)
    return P.PackedWeight(np.ascontiguousarray(data), fmt, cols), torch.from_numpy(ref)


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Arbitrary bytes for every quant value, with finite fp16 scales (subnormals included)."""
    values, nbytes = P.FORMATS[fmt]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    scales = 2 if fmt != "q4_1" else 4
    data[..., 1:scales:2] &= 0xfb  # an exponent bit cleared: no inf/NaN scales
    return data.reshape(rows, -1)


def widen(w: P.PackedWeight) -> torch.Tensor:
    return w.widen(threads=2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_widening_equals_the_reference(fmt):
    w, ref = packed_matrix(fmt, 37, 96)
    assert torch.equal(widen(w), ref)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_widening_arbitrary_blocks_equals_gguf(fmt):
    data = random_blocks(fmt, 19, 64)
    ref = np.asarray(quants.dequantize(data, GGUF_TYPES[fmt]), dtype=np.float32)
    assert np.array_equal(widen(P.PackedWeight(data, fmt, 64)).numpy(), ref)


def test_bf16_with_columns_not_a_multiple_of_8():
    t = torch.randn(5, 13).bfloat16()
    assert torch.equal(widen(P.PackedWeight.from_bf16(t)), t.float())


def packed_kernel(x: torch.Tensor, w: P.PackedWeight, b: torch.Tensor | None, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], w.rows), float("nan"))
    _C.packed_linear(x.numpy(), w.data, w.format, w.cols, None if b is None else b.numpy(), out.numpy(), threads)
    return out


def fp32_kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    _C.linear(x.numpy(), w.contiguous().numpy(), None if b is None else b.numpy(), out.numpy(), 1)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
# 1-8 input rows take the fused kernel (blocks widened in registers, 1-4 weight rows per pass),
# 9 and up the buffered one.
@pytest.mark.parametrize("m,n,k,bias", [(1, 960, 576, False), (1, 37, 64, True), (2, 41, 576, True),
                                        (3, 9, 1536, False), (5, 66, 96, True), (6, 31, 576, False),
                                        (7, 20, 576, True), (4, 43, 576, True), (8, 19, 576, False),
                                        (9, 22, 96, True), (13, 50, 1536, True), (64, 7, 64, False)])
def test_product_equals_fp32_kernel_on_widened_weights(fmt, m, n, k, bias):
    w, ref = packed_matrix(fmt, n, k)
    g = torch.Generator().manual_seed(1)
    x, b = torch.randn(m, k, generator=g), (torch.randn(n, generator=g) if bias else None)
    assert torch.equal(packed_kernel(x, w, b, threads=2), fp32_kernel(x, ref, b))
    torch.testing.assert_close(packed_kernel(x, w, b), torch.nn.functional.linear(x, ref, b), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "bf16"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(fmt):
    w, _ = packed_matrix(fmt, 3001, 576)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(2))
    whole = packed_kernel(x, w, None, threads=1)
    for threads in (2, 3, 7):
        assert torch.equal(packed_kernel(x, w, None, threads=threads), whole)
    for i in (0, 5, 12):
        assert torch.equal(packed_kernel(x[i:i + 1].clone(), w, None), whole[i:i + 1])
        for rows in (2, 3, 4, 5, 6, 7, 8, 9):
            assert torch.equal(packed_kernel(x[i:i + rows].clone(), w, None, threads=2), whole[i:i + rows])


AVX2_ONLY = """
import sys, numpy as np
from deepinfer_dp import _C
x, w, fmt, cols, out = (np.load(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3], int(sys.argv[4]), np.load(sys.argv[5]))
_C.packed_linear(x, w, fmt, cols, None, out, 2)
np.save(sys.argv[5], out)
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx512_and_avx2_kernels_give_the_same_floats(fmt, tmp_path):
    """Where the CPU has AVX-512, the pair kernels (1-8 rows in registers, 9 and up through
    the pair buffer) give every float the AVX2 kernels give (forced by
    DEEPINFER_DP_PACKED_AVX512=0, read once per process, so in a child). 45 weight rows: the
    last row paired with itself, and groups and tiles left short."""
    w, _ = packed_matrix(fmt, 45, 576)
    for m in (*range(1, 11), 13, 16):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        here = packed_kernel(x, w, None, threads=2)
        paths = [tmp_path / n for n in ("x.npy", "w.npy", "out.npy")]
        for path, arr in zip(paths, (x.numpy(), w.data, np.full((m, 45), np.nan, np.float32)), strict=True):
            np.save(path, arr)
        env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
        subprocess.run([sys.executable, "-c", AVX2_ONLY, str(paths[0]), str(paths[1]), fmt, "576", str(paths[2])],
                       env=env, check=True, timeout=120)
        assert torch.equal(torch.from_numpy(np.load(paths[2])), here), m


@pytest.mark.parametrize("call,match", [
    (lambda w, x, o: _C.packed_linear(x, w, "iq4_xs", 64, None, o, 1), "unknown weight format"),
    (lambda w, x, o: _C.packed_linear(x, w, "q4_1", 32, None, o, 1), "bytes"),
    (lambda w, x, o: _C.packed_linear(x, w, "q4_1", 48, None, o, 1), "does not fit"),
    (lambda w, x, o: _C.packed_linear(x[:, :32].copy(), w, "q4_1", 64, None, o, 1), "K differs"),
    (lambda w, x, o: _C.packed_linear(x, w, "q4_1", 64, None, o[:, :3].copy(), 1), r"out must be \[M, N\]"),
    (lambda w, x, o: _C.packed_linear(x, w, "q4_1", 64, np.zeros(3, np.float32), o, 1), "bias"),
    (lambda w, x, o: _C.packed_linear(x, w, "q4_1", 64, None, o, 0), "num_threads"),
    (lambda w, x, o: _C.packed_widen(w, "q4_1", 64, 2, 9, np.empty((7, 64), np.float32), 1), "outside the matrix"),
    (lambda w, x, o: _C.packed_widen(w, "q4_1", 64, 0, 2, np.empty((3, 64), np.float32), 1), "out must be"),
    (lambda w, x, o: _C.packed_gather(w, "q4_1", 64, np.array([0, 5], np.int64), np.empty((2, 64), np.float32)),
     "id 5 outside"),
    (lambda w, x, o: _C.packed_gather(w, "q4_1", 64, np.array([-1], np.int64), np.empty((1, 64), np.float32)),
     "id -1 outside"),
])
def test_bad_arguments_raise_by_name(call, match):
    w, _ = packed_matrix("q4_1", 5, 64)
    x, out = np.zeros((2, 64), np.float32), np.zeros((2, 5), np.float32)
    with pytest.raises(ValueError, match=match):
        call(w.data, x, out)


def test_packed_weight_checks_its_layout():
    with pytest.raises(ValueError, match="unknown packed format"):
        P.PackedWeight(np.zeros((2, 20), np.uint8), "iq4_xs", 32)
    with pytest.raises(ValueError, match="want C-contiguous uint8"):
        P.PackedWeight(np.zeros((2, 21), np.uint8), "q4_1", 32)
    with pytest.raises(ValueError, match="differ in format"):
        P.PackedWeight.concat([packed_matrix("q4_1", 2, 64)[0], packed_matrix("q8_0", 2, 64)[0]])


@pytest.mark.parametrize("rows", [1, 64, 65, 200])
def test_linear_module_small_batches_on_the_kernel_large_on_a_widened_gemm(rows, monkeypatch):
    monkeypatch.setattr(P, "KERNEL_MAX_ROWS", 128)
    w, ref = packed_matrix("q4_1", 300, 128)
    bias = torch.randn(300)
    layer = P.PackedLinear(w, bias)
    x = torch.randn(2, rows, 128)
    out = layer(x)
    assert out.shape == (2, rows, 300)
    if 2 * rows <= P.KERNEL_MAX_ROWS:
        assert torch.equal(out.reshape(-1, 300), fp32_kernel(x.reshape(-1, 128), ref, bias))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, ref, bias), atol=1e-4, rtol=1e-5)


def test_widened_gemm_in_slices_equals_one_slice(monkeypatch):
    w, _ = packed_matrix("q8_0", 1000, 64)
    layer, x = P.PackedLinear(w), torch.randn(100, 64)
    whole = layer(x)
    monkeypatch.setattr(P, "WIDEN_CHUNK_FLOATS", 64 * 300)  # 4 slices, the last one short
    assert torch.equal(layer(x), whole)


@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding_lookup(fmt):
    w, ref = packed_matrix(fmt, 50, 64)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(P.PackedEmbedding(w)(ids), torch.nn.functional.embedding(ids, ref))
    with pytest.raises(ValueError, match="id 50 outside"):
        P.PackedEmbedding(w)(torch.tensor([50]))
