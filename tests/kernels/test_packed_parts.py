"""A fused matrix whose parts are packed in different formats (`PackedParts`, a Q4_K_M file's
Q4_K q/k next to a Q6_K v): one kernel call runs each part's rows in its own format, and the
product equals `_C.linear` (the fp32 kernel) on the parts' gguf-dequantized rows stacked, bit
for bit, at every sampled row count 1-512, whatever the thread split, on the AVX-512 and the
forced AVX2 paths; widening gives gguf's values."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from kquant_ref import dequantize, quantize

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads
from deepinfer_dp.layers import packed as P
from deepinfer_dp.layers.packed_parts import PackedParts, PackedPartsLinear

K = 512
# Part row counts that are no multiple of the kernels' groups (2, 4, 12 rows), so groups and
# AVX-512 pairs end inside a part and the next part starts on an odd row.
LAYOUT = [("q4_k", 37), ("q6_k", 21), ("q5_0", 9), ("q8_0", 5), ("q4_k", 3)]
ROW_COUNTS = [*range(1, 17), 23, 31, 33, 64, 100, 129, 255, 257, 511, 512]


def parts_matrix(layout, seed: int = 0) -> tuple[PackedParts, torch.Tensor]:
    rng = np.random.default_rng(seed)
    parts, ref = [], []
    for fmt, rows in layout:
        data = np.ascontiguousarray(quantize(rng.standard_normal((rows, K)).astype(np.float32), fmt))
        parts.append(P.PackedWeight(data, fmt, K))
        ref.append(dequantize(data, fmt))
    return PackedParts(tuple(parts)), torch.from_numpy(np.concatenate(ref))


def parts_kernel(x: torch.Tensor, w: PackedParts, bias: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
    out = torch.full((x.shape[0], w.rows), float("nan"))
    w.linear(x.numpy(), None if bias is None else bias.numpy(), out.numpy(), threads)
    return out


def fp32_kernel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], w.shape[0])
    _C.linear(x.numpy(), w.contiguous().numpy(), None if bias is None else bias.numpy(), out.numpy(), 1)
    return out


def inputs(rows: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(seed))


def check_row_counts(row_counts) -> None:
    w, ref = parts_matrix(LAYOUT)
    x = inputs(max(row_counts))
    whole = parts_kernel(x, w)
    for m in row_counts:
        got = parts_kernel(x[:m].clone(), w, threads=2)
        assert torch.equal(got, fp32_kernel(x[:m], ref)), m
        assert torch.equal(got, whole[:m]), m
        assert torch.equal(parts_kernel(x[m - 1:m].clone(), w), whole[m - 1:m]), m  # the row alone


def test_product_equals_fp32_kernel_at_sampled_row_counts():
    check_row_counts(ROW_COUNTS)
    w, ref = parts_matrix(LAYOUT)
    x = inputs(64)
    bias = torch.randn(w.rows, generator=torch.Generator().manual_seed(5))
    for m in (1, 7, 9, 64):
        assert torch.equal(parts_kernel(x[:m].clone(), w, bias, threads=2), fp32_kernel(x[:m], ref, bias)), m


@pytest.mark.slow
def test_product_equals_fp32_kernel_at_every_row_count():
    check_row_counts(range(1, 513))


def test_each_part_equals_its_own_packed_kernel():
    """The parts' outputs are exactly what each part gives through `_C.packed_linear` alone."""
    w, _ = parts_matrix(LAYOUT, seed=2)
    x = inputs(13, seed=3)
    got, first = parts_kernel(x, w, threads=2), 0
    for p in w.parts:
        alone = torch.empty(13, p.rows)
        _C.packed_linear(x.numpy(), p.data, p.format, K, None, alone.numpy(), 1)
        assert torch.equal(got[:, first:first + p.rows], alone), p.format
        first += p.rows


def test_rows_do_not_depend_on_the_thread_split():
    # 350 KB of rows: the kernel splits them across all 7 threads, the splits falling in
    # different parts for each thread count.
    w, _ = parts_matrix([("q4_k", 600), ("q6_k", 301), ("q8_0", 101)], seed=6)
    for m in (1, 3, 8, 13, 64):
        x = inputs(m, seed=m)
        whole = parts_kernel(x, w, threads=1)
        for threads in (2, 3, 7):
            assert torch.equal(parts_kernel(x, w, threads=threads), whole), (m, threads)


AVX2_ONLY = """
import sys, numpy as np
from deepinfer_dp import _C
x, out, counts = np.load(sys.argv[1]), sys.argv[2], sys.argv[3]
parts = np.load(sys.argv[4])
kernel = _C.PackedParts([parts[f"p{i}"] for i in range(len(parts.files))], sys.argv[5].split(","), int(sys.argv[6]))
results = {}
for m in map(int, counts.split(",")):
    results[str(m)] = np.full((m, kernel.rows), np.nan, np.float32)
    kernel.linear(np.ascontiguousarray(x[:m]), None, results[str(m)], 2)
np.savez(out, **results)
"""


def test_avx512_and_avx2_kernels_give_the_same_floats(tmp_path):
    """The AVX2 kernels (forced by DEEPINFER_DP_PACKED_AVX512=0, read once per process, so in
    a child) give every float the AVX-512 pair kernels give, fused and buffered."""
    w, _ = parts_matrix(LAYOUT, seed=4)
    counts = [*range(1, 11), 13, 16, 64]
    x = inputs(max(counts))
    np.save(tmp_path / "x.npy", x.numpy())
    np.savez(tmp_path / "parts.npz", **{f"p{i}": p.data for i, p in enumerate(w.parts)})
    env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
    subprocess.run([sys.executable, "-c", AVX2_ONLY, str(tmp_path / "x.npy"), str(tmp_path / "out.npz"),
                    ",".join(map(str, counts)), str(tmp_path / "parts.npz"), ",".join(p.format for p in w.parts),
                    str(K)], env=env, check=True, timeout=120)
    avx2 = np.load(tmp_path / "out.npz")
    for m in counts:
        assert torch.equal(torch.from_numpy(avx2[str(m)]), parts_kernel(x[:m].clone(), w, threads=2)), m


def test_widening_and_the_module():
    w, ref = parts_matrix(LAYOUT, seed=7)
    assert w.format == "q4_k+q6_k+q5_0+q8_0+q4_k" and w.rows == ref.shape[0]
    assert torch.equal(w.widen(threads=2), ref)
    assert torch.equal(w.widen(30, 70), ref[30:70])  # across four parts
    bias = torch.randn(w.rows)
    layer = PackedPartsLinear(w, bias)
    x = torch.randn(2, 5, K)
    assert torch.equal(layer(x).reshape(10, -1), fp32_kernel(x.reshape(10, K), ref, bias))
    w16, ref16 = parts_matrix([("q4_k", 16), ("q6_k", 32)])  # bf16_pairs takes rows in sixteens
    assert torch.equal(w16.to_bf16_pairs().widen(), ref16.to(torch.bfloat16).float())


def test_widened_gemm_over_parts(monkeypatch):
    """Outside batch-invariant steps a long chunk takes the widened GEMM, a slice at a time."""
    monkeypatch.setattr(P, "KERNEL_MAX_ROWS", 16)
    monkeypatch.setattr(P, "WIDEN_CHUNK_FLOATS", K * 20)  # slices that end inside parts
    monkeypatch.setattr(cpu_threads, "batch_invariant", lambda: False)
    w, ref = parts_matrix(LAYOUT, seed=8)
    x = torch.randn(40, K)
    torch.testing.assert_close(PackedPartsLinear(w)(x), torch.nn.functional.linear(x, ref), atol=1e-4, rtol=1e-5)


def test_bad_parts_and_calls_raise_by_name():
    w, _ = parts_matrix(LAYOUT[:2])
    one = w.parts[0]
    with pytest.raises(ValueError, match="two or more packed parts with one column count"):
        PackedParts((one,))
    other = P.PackedWeight(np.ascontiguousarray(quantize(np.ones((2, 256), np.float32), "q4_k")), "q4_k", 256)
    with pytest.raises(ValueError, match="two or more packed parts with one column count"):
        PackedParts((one, other))
    with pytest.raises(ValueError, match="PackedParts.linear: out must be"):
        w.linear(np.zeros((2, K), np.float32), None, np.zeros((2, w.rows - 1), np.float32), 1)
    with pytest.raises(ValueError, match="PackedParts.linear: x's K differs"):
        w.linear(np.zeros((2, K - 32), np.float32), None, np.zeros((2, w.rows), np.float32), 1)
    with pytest.raises(ValueError, match="PackedParts: weight rows hold"):
        _C.PackedParts([one.data, w.parts[1].data], ["q4_k", "q4_k"], K)
