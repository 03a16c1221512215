"""bf16 attention (paged_attention's bf16_math, dtype=bfloat16; AMX tiles or vdpbf16ps, whichever
this CPU runs, and on an AMX CPU the vdpbf16ps form too, in a child): close to the fp32 kernel
over the same cache and the rounded queries, and every query row's floats its own, whatever the
call's other queries, the thread split, a prefill's chunking or a sliding window; nothing a
cache slot past the contexts holds (NaN included) reaches a result."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepinfer_dp import _C

pytestmark = pytest.mark.skipif(not _C.bf16_attention_form(64), reason="needs AMX-BF16 or AVX512-BF16")


def make_case(seq_lens, heads, kv_heads, head_dim, block_size, seed=0, jumps=()):
    """bf16 caches (unused slots NaN), a shuffled block table, and every position of every
    sequence as a query (rows, context lengths, q). Keys at the positions in `jumps` are 16x
    larger: the scores of the rows that see them jump."""
    gen = torch.Generator().manual_seed(seed)
    blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * blocks + 2
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * blocks].reshape(len(seq_lens), blocks)
    for s, n in enumerate(seq_lens):
        flat_k, flat_v = k[table[s]].flatten(0, 1), v[table[s]].flatten(0, 1)
        flat_k[:n] = torch.randn(n, kv_heads, head_dim, generator=gen)
        for p in jumps:
            flat_k[p] *= 16
        flat_v[:n] = torch.randn(n, kv_heads, head_dim, generator=gen)
        k[table[s]], v[table[s]] = flat_k.unflatten(0, (blocks, block_size)), flat_v.unflatten(0, (blocks, block_size))
    rows = np.concatenate([np.full(n, s) for s, n in enumerate(seq_lens)]).astype(np.int32)
    lens = np.concatenate([np.arange(1, n + 1) for n in seq_lens]).astype(np.int32)
    q = torch.randn(len(rows), heads, head_dim, generator=gen)
    caches = [c.bfloat16().view(torch.uint16).numpy() for c in (k, v)]
    return q.numpy(), caches, table.int().numpy(), rows, lens


def attend(q, caches, table, rows, lens, bf16_math=True, threads=2, window=0):
    out = np.full(q.shape, np.nan, np.float32)
    _C.paged_attention(np.ascontiguousarray(q), caches[0], caches[1], table, np.ascontiguousarray(lens), out,
                       q.shape[-1] ** -0.5, threads, rows if rows is None else np.ascontiguousarray(rows), window,
                       bf16_math=bf16_math)
    return out


SHAPES = [(9, 3, 64, 16), (8, 1, 256, 8), (4, 4, 128, 32), (16, 2, 96, 1)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES)
def test_close_to_fp32_arithmetic_on_rounded_queries(heads, kv_heads, head_dim, block_size):
    q, caches, table, rows, lens = make_case([150, 37, 1], heads, kv_heads, head_dim, block_size)
    got = attend(q, caches, table, rows, lens)
    rounded = torch.from_numpy(q).bfloat16().float().numpy()
    want = attend(rounded, caches, table, rows, lens, bf16_math=False)
    assert not np.isnan(got).any()
    # measured 0.1% (the probabilities rounded to bf16 for the values' product)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES[:2])
def test_every_query_row_gets_its_own_floats(heads, kv_heads, head_dim, block_size, window):
    q, caches, table, rows, lens = make_case([130, 70, 3], heads, kv_heads, head_dim, block_size, seed=1)
    here = attend(q, caches, table, rows, lens, window=window)
    assert not np.isnan(here).any()
    assert np.array_equal(attend(q, caches, table, rows, lens, threads=1, window=window), here)
    assert np.array_equal(attend(q, caches, table, rows, lens, threads=3, window=window), here)
    for t in (0, 31, 32, 33, 129, 130, 131, 199, 202):  # across position blocks and sequences
        alone = attend(q[t:t + 1], caches, table, rows[t:t + 1], lens[t:t + 1], threads=1, window=window)
        assert np.array_equal(alone[0], here[t]), t
    chunk = slice(150, 190)  # a prefill chunk over cached context
    part = attend(q[chunk], caches, table, rows[chunk], lens[chunk], window=window)
    assert np.array_equal(part, here[chunk])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (4, 2, 96), (8, 2, 256), (10, 2, 64)])
def test_decode_rows_equal_the_same_queries_in_a_prefill(heads, kv_heads, head_dim):
    """Six decode tokens on two threads take all their KV heads in one unit each (whole cache
    blocks), the prefill's queries one KV head a unit: the same floats. Query heads per KV head
    1 to 5: on vdpbf16ps a decode token's tile of up to 4 rows puts positions in the lanes, a
    prefill's rows; 96 and 256 dimensions take the value parts in fours and twos."""
    seq_lens = [90, 40, 5, 33, 64, 17]
    q, caches, table, rows, lens = make_case(seq_lens, heads, kv_heads, head_dim, 16, seed=2)
    here = attend(q, caches, table, rows, lens)
    last = np.cumsum(seq_lens) - 1  # each sequence's last position, as a decode token
    decode = attend(q[last], caches, table, None, lens[last])
    assert np.array_equal(decode, here[last])
    assert np.array_equal(attend(q[last], caches, table, None, lens[last], threads=1), decode)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES[:2])
def test_scores_that_jump_in_a_later_block_rescale_the_sums_before_it(heads, kv_heads, head_dim, block_size):
    """A row's running max may lag its scores by 8 doublings before o and l are rescaled; keys
    16x larger at positions 40 and 100 make rows past them jump far more than that after their
    first blocks. Prefill rows (o held in the tiles where the head size allows) and decode rows
    (o in memory) rescale alike, and stay close to fp32 arithmetic."""
    seq_lens = [150, 70]
    q, caches, table, rows, lens = make_case(seq_lens, heads, kv_heads, head_dim, block_size, seed=4, jumps=(40, 100))
    here = attend(q, caches, table, rows, lens)
    rounded = torch.from_numpy(q).bfloat16().float().numpy()
    want = attend(rounded, caches, table, rows, lens, bf16_math=False)
    assert np.linalg.norm(here - want) / np.linalg.norm(want) < 5e-3
    last = np.cumsum(seq_lens) - 1
    assert np.array_equal(attend(q[last], caches, table, None, lens[last]), here[last])


def test_an_fp32_cache_keeps_fp32_arithmetic():
    q, caches, table, rows, lens = make_case([50, 20], 9, 3, 64, 16, seed=3)
    wide = [torch.from_numpy(c).view(torch.bfloat16).float().numpy() for c in caches]
    assert np.array_equal(attend(q, wide, table, rows, lens), attend(q, wide, table, rows, lens, bf16_math=False))


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", SHAPES[:2])
def test_outputs_rounded_to_bf16_are_the_fp32_outputs_as_a_product_rounds_them(heads, kv_heads, head_dim,
                                                                             block_size):
    """A uint16 out gets each output rounded as the bf16 product taking the rows rounds them
    (bf16_round): prefill rows and decode rows; an fp32 cache or fp32 arithmetic refuses it."""
    q, caches, table, rows, lens = make_case([150, 70, 3], heads, kv_heads, head_dim, block_size, seed=5)
    last = np.cumsum([150, 70, 3]) - 1
    for q_, table_rows, lens_ in ((q, rows, lens), (q[last], None, lens[last])):
        want = np.empty((len(q_), heads * head_dim), np.uint16)
        _C.bf16_round(attend(q_, caches, table, table_rows, lens_).reshape(len(q_), -1), want)
        got = np.full(q_.shape, 0xFFFF, np.uint16)
        _C.paged_attention(np.ascontiguousarray(q_), caches[0], caches[1], table, np.ascontiguousarray(lens_), got,
                           head_dim ** -0.5, 2, table_rows if table_rows is None else np.ascontiguousarray(table_rows),
                           bf16_math=True)
        assert np.array_equal(got.reshape(len(q_), -1), want)
    wide = [torch.from_numpy(c).view(torch.bfloat16).float().numpy() for c in caches]
    for cache, bf16_math in ((caches, False), (wide, True)):
        with pytest.raises(ValueError, match="out in bf16"):
            _C.paged_attention(q, cache[0], cache[1], table, lens, np.empty(q.shape, np.uint16), 0.125, 2, rows,
                               bf16_math=bf16_math)


@pytest.mark.skipif(_C.bf16_attention_form(64) != "amx", reason="the vdpbf16ps form is this CPU's own form")
def test_the_vdpbf16ps_form_on_an_amx_cpu():
    """An AMX CPU takes the tiles; with DEEPINFER_DP_BF16_AMX=0 (read once a process) the same
    tests run the vdpbf16ps form, where the CPU has AVX512-BF16."""
    env = dict(os.environ, DEEPINFER_DP_BF16_AMX="0")
    form = subprocess.run([sys.executable, "-c", "from deepinfer_dp import _C; print(_C.bf16_attention_form(64))"],
                          env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    if form != "native":
        pytest.skip(f"without AMX this CPU's form is {form!r}")
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                            "-k", "not vdpbf16ps_form"], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:]
