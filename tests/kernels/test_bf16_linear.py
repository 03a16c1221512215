"""The bf16 product (csrc/kernels/bf16_linear.h): bf16 weights in the pair layout, inputs
rounded to bf16 as torch rounds, fp32 accumulation in one fixed order per output. Checked
bit for bit against a NumPy reference that adds in that order, on every path this CPU has
that adds so (vdpbf16ps, its 512-bit widened equal, scalar code); a child process with the
bf16 instructions (or AVX-512) switched off gets the same floats. AMX tiles (bf16_amx.h) add
in an order of their own: close to the reference, and each row's floats its own at any row
count and thread split, as on every path."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import PackedLinear, PackedWeight

# The paths that add in vdpbf16ps's order (AMX has its own: test_amx_*).
PATHS = [p for p in ("native", "widen512", "widen256", "scalar") if p in _C.bf16_dot_paths()]
AMX = "amx" in _C.bf16_dot_paths()
FLT_MIN = np.float32(np.finfo(np.float32).tiny)


def bf16_values(t: torch.Tensor) -> np.ndarray:
    """fp32 -> bf16 as torch rounds, subnormals made zeros (vdpbf16ps reads them so), as fp32."""
    v = t.to(torch.bfloat16).to(torch.float32).numpy()
    return np.where(np.abs(v) < FLT_MIN, np.copysign(np.float32(0), v), v).astype(np.float32)


def flush(a: np.ndarray) -> np.ndarray:
    return np.where(np.abs(a) < FLT_MIN, np.copysign(np.float32(0), a), a).astype(np.float32)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
    """Each output's chain: pair p adds w[2p+1]x[2p+1], then w[2p]x[2p], each sum rounded to
    fp32 once and a subnormal sum flushed. The bf16 products and their sums with an fp32 are
    exact in fp64 here (the data's exponents lie close), so fp64 then one rounding is fma's."""
    xb, wb = bf16_values(x).astype(np.float64), bf16_values(w).astype(np.float64)
    acc = np.zeros((xb.shape[0], wb.shape[0]), dtype=np.float32)
    for p in range(xb.shape[1] // 2):
        for k in (2 * p + 1, 2 * p):
            acc = flush((acc + np.outer(xb[:, k], wb[:, k])).astype(np.float32))
    return acc if bias is None else acc + bias.numpy()


def pairs(w: torch.Tensor) -> np.ndarray:
    return PackedWeight.from_bf16(w.to(torch.bfloat16)).to_bf16_pairs().data


def run(x: torch.Tensor, data: np.ndarray, bias: torch.Tensor | None, threads: int = 1,
        path: str = "auto") -> np.ndarray:
    out = np.empty((x.shape[0], data.shape[0]), dtype=np.float32)
    _C.bf16_linear(x.numpy(), data, x.shape[1], None if bias is None else bias.numpy(), out, threads, path)
    return out


def test_rounding_is_torchs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 333, generator=g) * torch.logspace(-40, 38, 333)
    ties = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 2.0 ** -130, -(2.0 ** -127),
                         float("inf"), float("-inf"), float("nan"), 3.4e38, 0.0, -0.0])
    x[0, :ties.numel()] = ties
    out = np.empty(x.shape, dtype=np.uint16)
    _C.bf16_round(x.numpy(), out)
    want = torch.from_numpy(bf16_values(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x.numpy())
    assert np.array_equal(out[~nan], want[~nan])
    assert (out[nan] == 0x7FC0).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [160, 176])  # groups of 6 blocks of 16 and a last group of 4 or 5
def test_product_is_the_reference_bit_for_bit(path, m, bias, n):
    g = torch.Generator().manual_seed(m)
    k = 96
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    assert np.array_equal(run(x, pairs(w), b, path=path), reference(x, w, b))


@pytest.mark.parametrize("path", PATHS)
def test_tiny_sums_are_flushed_alike_on_every_path(path):
    """Products near fp32's smallest normal: the sums cross it both ways."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g) * 1e-19, torch.randn(32, 64, generator=g) * 1e-19
    want = reference(x, w, None)
    assert (want == 0).any() and (np.abs(want) > FLT_MIN).any()
    assert np.array_equal(run(x, pairs(w), None, path=path), want)


@pytest.mark.parametrize("path", ["auto", *PATHS[:1]])
def test_rows_do_not_depend_on_the_batch_or_the_threads(path):
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(70, 576, generator=g), torch.randn(960, 576, generator=g), torch.randn(960, generator=g)
    data = pairs(w)
    whole = run(x, data, b, path=path)
    for threads in (2, 3, 7):  # 3 and 7 cut blocks of 16 rows in two
        assert np.array_equal(run(x, data, b, threads, path=path), whole)
    for m in (1, 7, 9, 17, 33, 64):
        assert np.array_equal(run(x[m:m + 1], data, b, path=path), whole[m:m + 1])
        assert np.array_equal(run(x[:m], data, b, path=path), whole[:m])


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_amx_is_close_to_the_reference_and_deterministic(m):
    g = torch.Generator().manual_seed(m)
    x, w, b = torch.randn(m, 512, generator=g), torch.randn(96, 512, generator=g) * 0.1, torch.randn(96, generator=g)
    data = pairs(w)
    got, want = run(x, data, b, path="amx"), reference(x, w, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(run(x, data, b, path="amx"), got)


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_chunks_of_columns_give_each_block_its_own_floats(with_bias):
    """A thread takes its columns in chunks of about 512 KB of weights (28 blocks of 16 at 576
    columns), every row pair against a whole chunk: 65 blocks make two whole chunks and one of
    9, an odd count. Each 16-row block's outputs equal that block multiplied alone, at any
    thread split and with rows past a whole tile."""
    g = torch.Generator().manual_seed(21)
    x, w = torch.randn(45, 576, generator=g), torch.randn(65 * 16, 576, generator=g) * 0.1
    b = torch.randn(65 * 16, generator=g) if with_bias else None
    data = pairs(w)
    want = np.concatenate([run(x, data[i:i + 16], None if b is None else b[i:i + 16], path="amx")
                           for i in range(0, 65 * 16, 16)], axis=1)
    for threads in (1, 2, 3):
        assert np.array_equal(run(x, data, b, threads, path="amx"), want), threads


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU")
def test_amx_leaves_columns_not_a_multiple_of_32_to_the_next_path():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 48, generator=g), torch.randn(32, 48, generator=g)
    assert np.array_equal(run(x, pairs(w), None, path="amx"), run(x, pairs(w), None, path=PATHS[0]))


def test_engine_entry_and_module_give_the_same_floats():
    """`packed_linear` (the engine's and the decode stack's entry, its own thread split and
    input blocks) and PackedLinear equal the direct call."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(600, 128, generator=g), torch.randn(48, 128, generator=g)
    pw = PackedWeight.from_bf16(w.to(torch.bfloat16)).to_bf16_pairs()
    want = run(x, pw.data, None)
    out = np.empty_like(want)
    _C.packed_linear(x.numpy(), pw.data, "bf16_pairs", 128, None, out, 2)
    assert np.array_equal(out, want)
    assert np.array_equal(PackedLinear(pw)(x).numpy(), want)


def test_pairs_layout_widens_to_the_bf16_values():
    w = torch.randn(32, 40).to(torch.bfloat16)
    pw = PackedWeight.from_bf16(w).to_bf16_pairs()
    assert pw.data.ctypes.data % 64 == 0
    assert torch.equal(pw.widen(), w.float())
    assert torch.equal(pw.widen(5, 9), w.float()[5:9])
    q8 = np.random.default_rng(0).integers(0, 256, (16, 34), dtype=np.uint8)
    q8[:, :2] = np.frombuffer(np.float16(0.0123).tobytes(), np.uint8)  # each block's scale
    quant = PackedWeight(q8, "q8_0", 32)  # another format: widened, then rounded to bf16
    assert torch.equal(quant.to_bf16_pairs().widen(), quant.widen().to(torch.bfloat16).float())


CHILD = """
import sys, numpy as np, torch
from deepinfer_dp import _C
x = torch.from_numpy(np.load(sys.argv[1])); data = np.load(sys.argv[2])
print(_C.bf16_dot_path())
out = np.empty((x.shape[0], data.shape[0]), dtype=np.float32)
_C.packed_linear(x.numpy(), data, "bf16_pairs", x.shape[1], None, out, 2)
np.save(sys.argv[3], out)
"""


@pytest.mark.parametrize("env, path", [({"DEEPINFER_DP_BF16_AMX": "0"}, "native"),
                                       ({"DEEPINFER_DP_BF16_AMX": "0", "DEEPINFER_DP_BF16_DOT": "0"}, "widen512"),
                                       ({"DEEPINFER_DP_PACKED_AVX512": "0"}, "widen256")])
def test_cpu_without_the_instructions_gives_the_same_floats(env, path, tmp_path):
    """The switches are read once per process, so each runs in a child; its default path
    gives the floats of that path here."""
    if path not in _C.bf16_dot_paths():
        pytest.skip(f"no {path} path on this CPU")
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(19, 256, generator=g), torch.randn(64, 256, generator=g)
    data = pairs(w)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "w.npy", data)
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "x.npy"), str(tmp_path / "w.npy"),
                           str(tmp_path / "y.npy")], env={**os.environ, **env}, check=True, timeout=120,
                          capture_output=True, text=True)
    assert done.stdout.strip() == path
    assert np.array_equal(np.load(tmp_path / "y.npy"), run(x, data, None, path=path))


def test_amx_peak_is_measured_where_amx_runs_and_zero_where_it_does_not():
    """The peers runner reads our bf16 products against this peak on an AMX CPU; a CPU (or a
    process, DEEPINFER_DP_BF16_AMX=0) without AMX gets 0, never a crash on a tile op."""
    peak = _C.amx_peak_gflops(20000)
    if AMX:
        assert np.isfinite(peak) and peak > 0
    else:
        assert peak == 0.0
    done = subprocess.run([sys.executable, "-c", "from deepinfer_dp import _C; print(_C.amx_peak_gflops(20000))"],
                          env={**os.environ, "DEEPINFER_DP_BF16_AMX": "0"}, check=True, timeout=120,
                          capture_output=True, text=True)
    assert float(done.stdout) == 0.0


def test_amx_fma_overlap_is_measured_where_amx_runs_and_zero_where_it_does_not():
    """bf16_kernels.py reads whether the tiles and the vector units work side by side from
    these three CPU times: each loop measured where AMX runs, zeros (no tile op) where not."""
    times = _C.amx_fma_overlap(2000)
    assert len(times) == 3
    if AMX:
        assert all(np.isfinite(t) and t > 0 for t in times)
    else:
        assert times == (0.0, 0.0, 0.0)
    done = subprocess.run([sys.executable, "-c", "from deepinfer_dp import _C; print(*_C.amx_fma_overlap(2000))"],
                          env={**os.environ, "DEEPINFER_DP_BF16_AMX": "0"}, check=True, timeout=120,
                          capture_output=True, text=True)
    assert [float(t) for t in done.stdout.split()] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("call, match", [
    (lambda: PackedWeight(np.zeros((8, 64), np.uint8), "bf16_pairs", 32), "multiple of 16"),
    (lambda: _C.bf16_pairs_pack(np.zeros((8, 4), np.uint16), np.zeros((8, 8), np.uint8)), "multiple of 16"),
    (lambda: _C.bf16_linear(np.zeros((1, 4), np.float32), np.zeros((16, 8), np.uint8), 4, None,
                            np.zeros((1, 16), np.float32), 1, "fast"), "unknown path"),
    (lambda: _C.packed_linear(np.zeros((1, 4), np.float32), np.zeros((8, 8), np.uint8), "bf16_pairs", 4, None,
                              np.zeros((1, 8), np.float32), 1), "multiple of 16"),
])
def test_bad_arguments_raise_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_engine_entry_takes_a_matrix_amx_does_not_take_in_input_blocks():
    """The module path's entry (`packed_linear`, which rounds the inputs once and hands them to
    bf16_pairs_threaded, the decode stack's entry): 6,000 rows pass one L2 input block of 48
    columns (5,456 rows), so it splits them, and a matrix of 48 columns (not a multiple of 32)
    takes the vdpbf16ps order even where AMX is the default path (bf16_amx_multiplies); the
    floats stay those of one direct call."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(6000, 48, generator=g), torch.randn(32, 48, generator=g)
    pw = PackedWeight.from_bf16(w.to(torch.bfloat16)).to_bf16_pairs()
    out = np.empty((6000, 32), dtype=np.float32)
    _C.packed_linear(x.numpy(), pw.data, "bf16_pairs", 48, None, out, 2)
    assert np.array_equal(out, run(x, pw.data, None, path=PATHS[0]))


def test_engine_entry_splits_rows_for_amx_in_whole_tiles():
    """A matrix that AMX takes (576 columns) through `packed_linear` with 1,000 rows: its input
    blocks (448 rows in L2, whole pairs of 16-row tiles) and thread split give each row the
    floats of one direct call on the default path, whichever this CPU has."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(1000, 576, generator=g), torch.randn(64, 576, generator=g)
    data = pairs(w)
    want = run(x, data, None)
    for threads in (1, 2, 3):
        out = np.empty_like(want)
        _C.packed_linear(x.numpy(), data, "bf16_pairs", 576, None, out, threads)
        assert np.array_equal(out, want), threads


@pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 19, 1000])
def test_gate_up_and_activation_in_one_pass_give_the_two_calls_floats(m, activation):
    """bf16_gated_linear (a bf16 MLP's gate/up product and its activation on AMX tiles, the
    [m, 2I] product never written out) equals packed_linear then silu_mul / gelu_tanh_mul bit
    for bit at any thread split; 1,000 rows pass one L2 input block (448 rows of 576 columns)."""
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(2 * 96, 576, generator=g) * 0.1
    data = pairs(w)
    gate_up, want = np.empty((m, 192), np.float32), np.empty((m, 96), np.float32)
    _C.packed_linear(x.numpy(), data, "bf16_pairs", 576, None, gate_up, 1)
    (_C.silu_mul if activation == "silu" else _C.gelu_tanh_mul)(gate_up, want, 1)
    for threads in (1, 2, 3):
        got = np.full((m, 96), np.nan, np.float32)
        _C.bf16_gated_linear(x.numpy(), data, 576, got, threads, activation)
        assert np.array_equal(got, want), threads


def rounded(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.shape, np.uint16)
    _C.bf16_round(x, out)
    return out


@pytest.mark.parametrize("m", [1, 16, 19, 1000, 1001])
def test_rows_already_rounded_give_the_floats_of_the_rows_they_came_from(m):
    """packed_linear and bf16_gated_linear take bf16 rows (uint16 bits) rounded by whoever made
    them: any row count (AMX's last partial tile read from a padded copy), any thread split,
    the floats of the fp32 rows; the gated pass's bf16 output is its fp32 output rounded."""
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 576, generator=g), torch.randn(2 * 96, 576, generator=g) * 0.1
    data, xb = pairs(w), rounded(x.numpy())
    bias = torch.randn(192, generator=g).numpy()
    want = np.empty((m, 192), np.float32)
    _C.packed_linear(x.numpy(), data, "bf16_pairs", 576, bias, want, 1)
    want_gated = np.empty((m, 96), np.float32)
    if AMX:
        _C.bf16_gated_linear(x.numpy(), data, 576, want_gated, 1, "silu")
    for threads in (1, 2, 3):
        got = np.full((m, 192), np.nan, np.float32)
        _C.packed_linear(xb, data, "bf16_pairs", 576, bias, got, threads)
        assert np.array_equal(got, want), threads
        if not AMX:
            continue
        for x_in in (x.numpy(), xb):
            got_gated, got_b = np.full((m, 96), np.nan, np.float32), np.zeros((m, 96), np.uint16)
            _C.bf16_gated_linear(x_in, data, 576, got_gated, threads, "silu")
            _C.bf16_gated_linear(x_in, data, 576, got_b, threads, "silu")
            assert np.array_equal(got_gated, want_gated) and np.array_equal(got_b, rounded(want_gated)), threads


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_into_bf16_rows_is_its_fp32_rows_rounded(residual):
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(37, 576, generator=g).numpy(), torch.randn(37, 576, generator=g).numpy()
    weight = torch.randn(576, generator=g).numpy()
    want, x_fp32 = np.empty_like(x), x.copy()
    _C.rms_norm(x_fp32, r if residual else None, weight, 1e-6, want, 2)
    got, x_b = np.zeros(x.shape, np.uint16), x.copy()
    _C.rms_norm(x_b, r if residual else None, weight, 1e-6, got, 2)
    assert np.array_equal(got, rounded(want)) and np.array_equal(x_b, x_fp32)  # the sum written back alike


def test_bf16_rows_go_to_bf16_pairs_only():
    with pytest.raises(ValueError, match="bf16_pairs matrix only, not q8_0"):
        _C.packed_linear(np.zeros((1, 32), np.uint16), np.zeros((16, 16), np.uint8), "q8_0", 32, None,
                         np.zeros((1, 16), np.float32), 1)
    layer = PackedLinear(PackedWeight.from_bf16(torch.zeros(16, 64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="bf16 rows into a bf16 matrix"):
        layer(torch.zeros(2, 64, dtype=torch.bfloat16))


def test_gate_up_pass_takes_whole_halves_on_amx_only():
    assert _C.bf16_gated_fits(192, 576) == AMX
    assert not _C.bf16_gated_fits(208, 576)  # halves of 104 rows: no whole 16-row blocks
    assert not _C.bf16_gated_fits(192, 48)  # AMX takes columns in multiples of 32
    assert not _C.bf16_gated_fits(0, 576)
    with pytest.raises(ValueError, match="bf16_gated_fits"):
        _C.bf16_gated_linear(np.zeros((1, 48), np.float32), np.zeros((192, 96), np.uint8), 48,
                             np.zeros((1, 96), np.float32), 1)
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        _C.bf16_gated_linear(np.zeros((1, 64), np.float32), np.zeros((192, 128), np.uint8), 64,
                             np.zeros((1, 96), np.float32), 1, "relu")
