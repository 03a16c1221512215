"""The C++ paged attention against the plain-torch paths (gather + SDPA for decode, the
per-sequence SDPA loop for prefill), and its input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_dp import _C
from deepinfer_dp.layers import attention as A


def random_case(num_seqs: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    seq_lens = torch.randint(1, 6 * block_size, (num_seqs,), generator=g, dtype=torch.int32)
    max_blocks = int(-(-seq_lens.max() // block_size)) + 1  # one spare column of padding
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    for i in range(num_seqs):  # distinct blocks per sequence, never block 0
        tables[i, : -(-int(seq_lens[i]) // block_size)] = torch.randperm(num_blocks - 1, generator=g)[
            : -(-int(seq_lens[i]) // block_size)] + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, heads, head_dim, generator=g)
    md = A.AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(num_seqs, dtype=torch.int64),
                             block_tables=tables, query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
                             seq_lens=seq_lens, query_lens_host=[1] * num_seqs, seq_lens_host=seq_lens.tolist(),
                             max_query_len=1, max_seq_len=int(seq_lens.max()))
    return q, k_cache, v_cache, md


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # SmolLM2's shape (the AVX2 path)
    (8, 8, 128, 4),    # no GQA, head size 128 (AVX2)
    (4, 2, 40, 8),     # a head size without a vector path (portable loop)
    (6, 1, 64, 32),    # all query heads on one KV head
    (4, 1, 256, 16),   # Gemma 3's head size 256 (AVX2, the V pass in slices of 64)
])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, head_dim, block_size):
    q, k_cache, v_cache, md = random_case(7, heads, kv_heads, head_dim, block_size)
    scale = head_dim ** -0.5
    expected = A._gathered_decode_attention(q, k_cache, v_cache, md, scale)
    out = torch.empty_like(q)
    _C.paged_attention(q.numpy(), k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(),
                              md.seq_lens.numpy(), out.numpy(), scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # decode_attention picks the kernel on CPU fp32 and gives the same
    torch.testing.assert_close(A.decode_attention(q, k_cache, v_cache, md, scale), out, atol=0, rtol=0)


def test_kernel_refuses_bad_inputs():
    q, k_cache, v_cache, md = random_case(3, 4, 2, 64, 16)
    args = [q.numpy(), k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(), md.seq_lens.numpy(),
            np.empty(q.shape, dtype=np.float32)]

    def call(**changes):
        names = ["q", "k_cache", "v_cache", "block_tables", "seq_lens", "out"]
        given = [changes.get(n, a) for n, a in zip(names, args, strict=True)]
        _C.paged_attention(*given, 0.125)

    call()  # the unchanged arguments are fine
    bad_table = md.block_tables.numpy().copy()
    bad_table[0, 0] = 64
    with pytest.raises(ValueError, match="block id outside the cache"):
        call(block_tables=bad_table)
    with pytest.raises(ValueError, match="context length out of range"):
        call(seq_lens=np.full(3, 10_000, dtype=np.int32))
    with pytest.raises(ValueError, match="out must have q's shape"):
        call(out=np.empty((3, 4, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        call(q=np.zeros((3, 3, 64), dtype=np.float32), out=np.zeros((3, 3, 64), dtype=np.float32))
    with pytest.raises(ValueError, match="one row per query"):
        call(block_tables=args[3][:2])
    with pytest.raises(TypeError):  # float64 is not silently copied
        call(q=args[0].astype(np.float64))
    with pytest.raises(TypeError):  # nor is a non-contiguous output (results would be lost)
        call(out=np.empty((3, 64, 4), dtype=np.float32).transpose(0, 2, 1))
    with pytest.raises(ValueError, match="q must be \\[T, heads, D\\] float32 with each row's heads contiguous"):
        call(q=np.zeros((3, 64, 4), dtype=np.float32).transpose(0, 2, 1))


@pytest.mark.parametrize("query_lens", [[3, 1, 7, 2], [1, 1, 1, 1], [5, 5, 5, 5]])
def test_short_prefill_chunks_match_the_sdpa_loop(query_lens, monkeypatch):
    """Chunks of a few tokens on top of cached context (prefix hits, chunked prefill): the
    kernel, one query row per token, equals the per-sequence SDPA path."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    _, k_cache, v_cache, dmd = random_case(len(query_lens), heads, kv_heads, head_dim, block_size, seed=3)
    seq_lens = [max(int(n), q) for n, q in zip(dmd.seq_lens, query_lens, strict=True)]
    total = sum(query_lens)
    q = torch.randn(total, heads, head_dim, generator=torch.Generator().manual_seed(4))
    # the chunk's own K/V are in the cache already (store_kv runs first): take them from there
    positions = [p for n, ql in zip(seq_lens, query_lens, strict=True) for p in range(n - ql, n)]
    rows = [i for i, ql in enumerate(query_lens) for _ in range(ql)]
    slots = [int(dmd.block_tables[r, p // block_size]) * block_size + p % block_size
             for r, p in zip(rows, positions, strict=True)]
    k = k_cache.view(-1, kv_heads, head_dim)[slots]
    v = v_cache.view(-1, kv_heads, head_dim)[slots]
    md = A.AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor(slots), block_tables=dmd.block_tables,
                             query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_lens_host=query_lens,
                             seq_lens_host=seq_lens, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    layer = A.Attention(heads, kv_heads, head_dim, head_dim ** -0.5, A.ForwardContext())
    layer.k_cache, layer.v_cache = k_cache, v_cache
    layer.context.attn_metadata = md
    ours = layer(q, k, v)
    monkeypatch.setattr(A, "CPU_KERNEL", False)
    md.derived.clear()
    expected = layer(q, k, v)
    torch.testing.assert_close(ours, expected, atol=2e-6, rtol=1e-5)


def run_threads(q, k_cache, v_cache, md, threads: int, scale: float = 0.125) -> torch.Tensor:
    out = torch.empty_like(q)
    _C.paged_attention(q.numpy(), k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(),
                       md.seq_lens.numpy(), out.numpy(), scale, threads)
    return out


def test_threads_split_the_batch_without_changing_results():
    q, k_cache, v_cache, md = random_case(48, 9, 3, 64, 16, seed=5)  # ~2300 positions: worth 2 threads
    assert int(md.seq_lens.sum()) >= 2 * 768
    one = run_threads(q, k_cache, v_cache, md, 1)
    # up to 5 threads a unit is a whole sequence (all its KV heads); at 16, with fewer than 4
    # sequences a thread, one KV head of one: the floats are the same either way
    assert all(torch.equal(run_threads(q, k_cache, v_cache, md, t), one) for t in (2, 5, 16))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),   # SmolLM2: three KV heads for two threads
    (4, 1, 256),  # Gemma 3: one KV head
    (4, 2, 40),   # the portable loop
])
def test_a_lone_token_splits_its_query_heads_without_changing_results(heads, kv_heads, head_dim):
    """One decode token has too few KV heads to keep the threads busy, so each query head is a
    unit of its own, reading its KV head's rows itself: the floats must not change."""
    q, k_cache, v_cache, md = random_case(1, heads, kv_heads, head_dim, 64, seed=3)
    assert int(md.seq_lens[0]) >= 64  # enough positions to split
    scale = head_dim ** -0.5
    one = run_threads(q, k_cache, v_cache, md, 1, scale)
    assert all(torch.equal(run_threads(q, k_cache, v_cache, md, t, scale), one) for t in (2, 3, 4))
    expected = A._gathered_decode_attention(q, k_cache, v_cache, md, scale)
    torch.testing.assert_close(run_threads(q, k_cache, v_cache, md, 2, scale), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 256, 40])  # the AVX2 chunk path and the portable loop
def test_queries_of_one_sequence_attended_together_equal_each_alone(head_dim):
    """A verification step's tokens (one sequence, consecutive positions) go through the K/V
    together, a few at a time; each token's output must be the one it gets alone, bit for
    bit, whatever its neighbours' lengths and the thread split."""
    _, k_cache, v_cache, md = random_case(2, 9, 3, head_dim, 16, seed=7)
    table = md.block_tables.numpy()
    base = int(md.seq_lens[0])
    # 7 tokens at the end of sequence 0 (lengths base-6 .. base), then 2 of sequence 1.
    lens = np.array([base - 6 + i for i in range(7)] + [int(md.seq_lens[1])] * 2, dtype=np.int32)
    lens = np.maximum(lens, 1)
    rows = np.array([0] * 7 + [1, 1], dtype=np.int32)
    q = torch.randn(len(lens), 9, head_dim, generator=torch.Generator().manual_seed(3))
    together = torch.empty_like(q)
    _C.paged_attention(q.numpy(), k_cache.numpy(), v_cache.numpy(), table, lens, together.numpy(), 0.125, 2, rows)
    for t in range(len(lens)):
        alone = torch.empty_like(q[t:t + 1])
        _C.paged_attention(q[t:t + 1].contiguous().numpy(), k_cache.numpy(), v_cache.numpy(), table,
                           lens[t:t + 1], alone.numpy(), 0.125, 1, rows[t:t + 1])
        assert torch.equal(alone[0], together[t]), t


@pytest.mark.parametrize("bf16_cache,bf16_math", [(False, False), (True, False), (True, True)])
def test_queries_read_in_place_inside_a_qkv_output_give_the_same_floats(bf16_cache, bf16_math):
    """A prefill's q rows lie apart, inside the fused qkv output; the kernels read them there
    (the fp32 one and, with bf16_math on an AMX CPU, the tiles): the floats of a contiguous copy."""
    _, k_cache, v_cache, md = random_case(3, 9, 3, 64, 16, seed=11)
    lens = np.concatenate([np.arange(1, n + 1) for n in md.seq_lens_host]).astype(np.int32)
    rows = np.repeat(np.arange(3, dtype=np.int32), md.seq_lens_host)
    qkv = torch.randn(len(lens), (9 + 2 * 3) * 64, generator=torch.Generator().manual_seed(12))
    q = qkv[:, :9 * 64].view(-1, 9, 64)
    caches = [c.bfloat16() if bf16_cache else c for c in (k_cache, v_cache)]
    in_place = A.paged_attention_cpu(q, *caches, md.block_tables, lens, rows, 0.125, bf16_math=bf16_math)
    copied = A.paged_attention_cpu(q.contiguous(), *caches, md.block_tables, lens, rows, 0.125, bf16_math=bf16_math)
    assert q.stride(0) == qkv.shape[1] and torch.equal(in_place, copied)
    assert in_place.is_contiguous() and not in_place.isnan().any()
