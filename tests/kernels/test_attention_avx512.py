"""The paged attention kernel's AVX-512 form (up to three query heads of a KV head sharing
each K and V load) gives every float the AVX2 form gives (forced by
DEEPINFER_DP_PACKED_AVX512=0, read once per process, so in a child): decode and prefill
queries, fp32 and bf16 caches, head sizes 64, 128 and 256 (Gemma 3: its V rows in slices of
64), groups of 1-5 query heads per KV head (tiles of three and the rest), and every prefill
token the floats it gets alone."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_cpu_attention import random_case

from deepinfer_dp import _C

CHILD = """
import sys, numpy as np
from deepinfer_dp import _C
q, k, v, table, lens, rows = (np.load(p) for p in sys.argv[1:7])
out = np.full(q.shape, np.nan, np.float32)
_C.paged_attention(q, k, v, table, lens, out, 0.125, 2, rows)
np.save(sys.argv[7], out)
"""


def prefill_case(heads: int, kv_heads: int, head_dim: int, bf16: bool):
    """Every position of two sequences as prefill queries (causal lengths)."""
    _, k_cache, v_cache, md = random_case(2, heads, kv_heads, head_dim, 16, seed=heads)
    lens = np.concatenate([np.arange(1, int(n) + 1) for n in md.seq_lens]).astype(np.int32)
    rows = np.concatenate([np.full(int(n), i) for i, n in enumerate(md.seq_lens)]).astype(np.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(5)).numpy()
    if bf16:
        k_cache, v_cache = (c.bfloat16().view(torch.uint16) for c in (k_cache, v_cache))
    return q, k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(), lens, rows


def attend(q, k, v, table, lens, rows, threads: int = 2) -> np.ndarray:
    out = np.full(q.shape, np.nan, np.float32)
    _C.paged_attention(q, k, v, table, lens, out, 0.125, threads, rows)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 64), (8, 2, 128), (4, 4, 64), (6, 3, 128),
                                                      (4, 1, 256)])
@pytest.mark.parametrize("bf16", [False, True])
def test_avx512_and_avx2_attention_give_the_same_floats(heads, kv_heads, head_dim, bf16, tmp_path):
    case = prefill_case(heads, kv_heads, head_dim, bf16)
    here = attend(*case)
    paths = [tmp_path / f"{i}.npy" for i in range(7)]
    for path, arr in zip(paths, case, strict=False):
        np.save(path, arr)
    env = {**os.environ, "DEEPINFER_DP_PACKED_AVX512": "0"}
    subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], env=env, check=True, timeout=300)
    assert not np.isnan(here).any()
    assert np.array_equal(np.load(paths[6]), here)
    q, k, v, table, lens, rows = case
    for t in (0, 7, len(lens) // 2, len(lens) - 1):  # each query alone, one thread
        alone = attend(q[t:t + 1].copy(), k, v, table, lens[t:t + 1], rows[t:t + 1], threads=1)
        assert np.array_equal(alone[0], here[t]), t
