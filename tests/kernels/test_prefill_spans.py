"""Long prefill attention takes queries of one sequence in spans of up to 16 (each K/V block
read once for all of them, and on AVX-512 two queries at a time in the lanes of one register):
every query still gets the floats it gets alone, the same as with spans of 3
(DEEPINFER_DP_PREFILL_SPAN=3, read once per process, so in a child), on any thread count, under
a sliding window and at every head size, and close to fp64 causal attention."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_long_context_attention import long_case, reference_attention

from deepinfer_dp import _C

CHILD = """
import sys, numpy as np
from deepinfer_dp import _C
q, k, v, table, lens, rows = (np.load(p) for p in sys.argv[1:7])
out = np.full(q.shape, np.nan, np.float32)
_C.paged_attention(q, k, v, table, lens, out, 0.125, 2, rows)
np.save(sys.argv[7], out)
"""


def prefill_case(bf16: bool):
    """A whole prompt of 600 tokens and a chunk of 203 tokens over 130 cached ones."""
    _, k_cache, v_cache, md = long_case([600, 333])
    lens = np.concatenate([np.arange(1, 601), np.arange(131, 334)]).astype(np.int32)
    rows = np.concatenate([np.zeros(600), np.ones(203)]).astype(np.int32)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(3)).numpy()
    if bf16:
        k_cache, v_cache = (c.bfloat16().view(torch.uint16) for c in (k_cache, v_cache))
    return q, k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(), lens, rows


def attend(q, k, v, table, lens, rows, threads: int) -> np.ndarray:
    out = np.full(q.shape, np.nan, np.float32)
    _C.paged_attention(q, k, v, table, lens, out, 0.125, threads, rows)
    return out


@pytest.mark.parametrize("bf16", [False, True])
def test_long_prefill_spans_give_every_query_its_own_floats(bf16, tmp_path):
    case = prefill_case(bf16)
    here = attend(*case, threads=2)
    assert not np.isnan(here).any()
    assert np.array_equal(attend(*case, threads=1), here)
    assert np.array_equal(attend(*case, threads=3), here)
    q, k, v, table, lens, rows = case
    for t in (0, 15, 16, 17, 299, 599, 600, 601, 802):  # across span edges and both sequences
        alone = attend(q[t:t + 1].copy(), k, v, table, lens[t:t + 1], rows[t:t + 1], threads=1)
        assert np.array_equal(alone[0], here[t]), t
    paths = [tmp_path / f"{i}.npy" for i in range(7)]
    for path, arr in zip(paths, case, strict=False):
        np.save(path, arr)
    env = {**os.environ, "DEEPINFER_DP_PREFILL_SPAN": "3"}
    subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], env=env, check=True, timeout=300)
    assert np.array_equal(np.load(paths[6]), here)


def test_long_prefill_spans_match_fp64_attention():
    q, k, v, table, lens, rows = prefill_case(bf16=False)
    out = torch.from_numpy(attend(q, k, v, table, lens, rows, threads=2))
    k_seq = torch.from_numpy(k)[torch.from_numpy(table[0]).long()].flatten(0, 1)[:600]
    v_seq = torch.from_numpy(v)[torch.from_numpy(table[0]).long()].flatten(0, 1)[:600]
    expected = reference_attention(torch.from_numpy(q[:600]), k_seq, v_seq, 0.125)
    torch.testing.assert_close(out[:600], expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 64), (4, 4, 64), (4, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("bf16", [False, True])
def test_queries_paired_in_a_span_keep_their_own_floats(heads, kv_heads, head_dim, window, bf16):
    # A chunk of 150 tokens over 41 cached ones: pairs of queries share most blocks, part of
    # the last one, and under the window start reading at different positions of a block.
    _, k_cache, v_cache, md = long_case([191], heads, kv_heads, head_dim)
    if bf16:
        k_cache, v_cache = (c.bfloat16().view(torch.uint16) for c in (k_cache, v_cache))
    k, v, table = k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy()
    lens = np.arange(42, 192, dtype=np.int32)
    rows = np.zeros(len(lens), np.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(5)).numpy()
    scale = head_dim ** -0.5
    together = np.full(q.shape, np.nan, np.float32)
    _C.paged_attention(q, k, v, table, lens, together, scale, 1, rows, window)
    assert not np.isnan(together).any()
    for t in range(len(lens)):
        alone = np.full((1, heads, head_dim), np.nan, np.float32)
        _C.paged_attention(q[t:t + 1].copy(), k, v, table, lens[t:t + 1], alone, scale, 1, rows[t:t + 1], window)
        assert np.array_equal(alone[0], together[t]), t
