"""_C.store_kv: a step's K/V rows, read in place inside the fused qkv output, written into
their cache slots exactly as torch's cast and indexed copy write them (bf16: rounded to
nearest even as .to(torch.bfloat16); a NaN stays a NaN, its bits those of torch's scalar
rounding, 0x7fc0, where torch's vector loop writes 0xffff), on any thread split and without
AVX-512; bad slots and shapes refused by name before anything is written."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers.packed import kernel_array

# Values whose bf16 rounding is a corner: ties to even both ways, the largest float (rounds
# to inf), infinities, NaNs of both signs, subnormals (kept, not flushed), signed zeros.
CORNERS = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), torch.finfo(torch.float32).max, float("inf"), float("-inf"),
           float("nan"), -float("nan"), 1e-40, -1e-40, 0.0, -0.0]


def qkv_rows(tokens: int, kv_heads: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [T, Hkv, D]: views into a qkv output whose rows also hold 9 query heads."""
    g = torch.Generator().manual_seed(seed)
    q_width, kv_width = 9 * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_width + 2 * kv_width, generator=g)
    k = qkv[:, q_width:q_width + kv_width].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_width + kv_width:].view(tokens, kv_heads, head_dim)
    for i, value in enumerate(CORNERS):  # each corner in several rows, heads and lanes (vector and tail)
        for j in range(4):
            k[(7 * i + 3 * j) % tokens, j % kv_heads, (5 * i + j) % head_dim] = value
            v[(3 * i + 7 * j) % tokens, (j + 1) % kv_heads, (5 * i + 3 * j) % head_dim] = value
    return k, v


def torch_store(k, v, k_cache, v_cache, slots):
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def store_both_ways(dtype, kv_heads, head_dim, threads, tokens=70):
    k, v = qkv_rows(tokens, kv_heads, head_dim)
    shape = (12, 8, kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, dtype=dtype) for _ in range(4)]
    slots = torch.randperm(12 * 8, generator=torch.Generator().manual_seed(1))[:tokens]
    _C.store_kv(k.numpy(), v.numpy(), kernel_array(caches[0]), kernel_array(caches[1]), slots.numpy(), threads)
    torch_store(k, v, caches[2], caches[3], slots)
    return caches


def same_values(ours: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for a NaN."""
    nan = want.isnan()
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    return torch.equal(ours.isnan(), nan) and torch.equal(ours.view(bits)[~nan], want.view(bits)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(3, 64), (3, 24), (1, 8)])  # 72 and 8 a row: scalar tails
@pytest.mark.parametrize("threads", [1, 2])
def test_store_kv_writes_what_torch_writes(dtype, kv_heads, head_dim, threads):
    ours_k, ours_v, want_k, want_v = store_both_ways(dtype, kv_heads, head_dim, threads)
    assert want_k.isnan().any() and want_k.isinf().any()  # the corners are in
    assert same_values(ours_k, want_k) and same_values(ours_v, want_v)  # other slots untouched too


CHILD = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_kv_store import store_both_ways
for c, name in zip(store_both_ways(torch.bfloat16, 3, 64, 2), "abcd"):
    np.save(f"{sys.argv[2]}/{name}.npy", c.view(torch.int16).numpy())
"""


def test_store_kv_without_avx512_writes_the_same_bits(tmp_path):
    """The portable rounding (DEEPINFER_DP_PACKED_AVX512=0, read once per process: a child)."""
    env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
    subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__), str(tmp_path)], env=env, check=True,
                   timeout=300)
    here = store_both_ways(torch.bfloat16, 3, 64, 2)
    for c, name in zip(here, "abcd", strict=True):
        assert np.array_equal(np.load(tmp_path / f"{name}.npy"), c.view(torch.int16).numpy()), name


def test_store_kv_refuses_bad_inputs_and_writes_nothing():
    k, v = qkv_rows(4, 3, 64)
    k_cache, v_cache = np.zeros((2, 8, 3, 64), np.float32), np.zeros((2, 8, 3, 64), np.float32)
    slots = np.array([0, 1, 2, 16], np.int64)
    with pytest.raises(ValueError, match="store_kv: slot 16 outside the cache's 16"):
        _C.store_kv(k.numpy(), v.numpy(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot -1"):
        _C.store_kv(k.numpy(), v.numpy(), k_cache, v_cache, np.array([0, 1, 2, -1], np.int64))
    empty = np.zeros((0, 3, 64), np.float32)  # a step with no rows (NumPy: zero strides)
    _C.store_kv(empty, empty, k_cache, v_cache, np.zeros(0, np.int64))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(ValueError, match="one entry per row"):
        _C.store_kv(k.numpy(), v.numpy(), k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="k's heads differ"):
        _C.store_kv(k.numpy(), v.numpy(), np.zeros((2, 8, 2, 64), np.float32), np.zeros((2, 8, 2, 64), np.float32),
                    slots[:3])
    with pytest.raises(ValueError, match="heads contiguous"):
        _C.store_kv(k.transpose(1, 2).numpy(), v.numpy(), k_cache, v_cache, slots)
    with pytest.raises(TypeError):  # an fp32 cache and a bf16 one: no overload takes the pair
        _C.store_kv(k.numpy(), v.numpy(), k_cache, v_cache.view(np.uint16), slots)
