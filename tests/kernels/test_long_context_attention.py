"""Decode attention at long contexts (the 16 x 2,000-token workload's shape): the C++ kernel,
whose query heads share each KV row and whose softmax uses a vectorized exp, against
gather + SDPA, and bit-identical across thread splits."""

from __future__ import annotations

import torch

from deepinfer_dp import _C
from deepinfer_dp.layers import attention as A


def long_case(lens: list[int], heads: int = 9, kv_heads: int = 3, head_dim: int = 64, block_size: int = 16):
    g = torch.Generator().manual_seed(0)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled blocks, never block 0
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = order[start:start + nb]
        start += nb
    # Peaked scores (a few keys dominate), as real attention has, and very negative ones.
    k_cache = 3 * torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    md = A.AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(len(lens), dtype=torch.int64),
                             block_tables=tables, query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             seq_lens=seq_lens, query_lens_host=[1] * len(lens), seq_lens_host=lens,
                             max_query_len=1, max_seq_len=max(lens))
    return q, k_cache, v_cache, md


def kernel(q, k_cache, v_cache, md, threads: int) -> torch.Tensor:
    out = torch.empty_like(q)
    _C.paged_attention(q.numpy(), k_cache.numpy(), v_cache.numpy(), md.block_tables.numpy(), md.seq_lens.numpy(),
                       out.numpy(), q.shape[-1] ** -0.5, threads)
    return out


def test_long_contexts_match_sdpa_and_do_not_depend_on_threads():
    lens = [2000, 2257, 1, 17, 1999, 2048]  # block-aligned, ragged, and tiny ones
    q, k_cache, v_cache, md = long_case(lens)
    expected = A._gathered_decode_attention(q, k_cache, v_cache, md, q.shape[-1] ** -0.5)
    one = kernel(q, k_cache, v_cache, md, threads=1)
    torch.testing.assert_close(one, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(kernel(q, k_cache, v_cache, md, threads=2), one)
    assert torch.equal(kernel(q, k_cache, v_cache, md, threads=5), one)


def test_one_long_sequence_splits_over_kv_heads_without_changing_results():
    """A single sequence is split by KV head across threads; every split gives the same bits."""
    q, k_cache, v_cache, md = long_case([2257])
    one = kernel(q, k_cache, v_cache, md, threads=1)
    expected = A._gathered_decode_attention(q, k_cache, v_cache, md, q.shape[-1] ** -0.5)
    torch.testing.assert_close(one, expected, atol=2e-6, rtol=1e-5)
    for threads in (2, 3, 4):
        assert torch.equal(kernel(q, k_cache, v_cache, md, threads=threads), one)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of q [Lq, H, D] (the last Lq positions) over k/v [L, Hkv, D], in fp64."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.double().transpose(0, 1) for x in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    scores = qd @ kd.transpose(1, 2) * scale
    q_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
    scores.masked_fill_(torch.arange(k.shape[0])[None, :] > q_pos[:, None], float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1).float()


def test_prefill_attention_matches_fp64_reference():
    """The SDPA calls of long prefills (whole prompt, and a chunk over cached context), which
    run SDPA's 4-D (flash) path on CPU, against fp64 causal attention with GQA."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(300, 9, 64, generator=g)
    k, v = torch.randn(300, 3, 64, generator=g), torch.randn(300, 3, 64, generator=g)
    torch.testing.assert_close(A._causal_attention(q, k, v, 0.125), reference_attention(q, k, v, 0.125),
                               atol=2e-6, rtol=1e-5)
    chunk = q[-70:]
    torch.testing.assert_close(A._attention_with_context(chunk, k, v, 0.125),
                               reference_attention(chunk, k, v, 0.125), atol=2e-6, rtol=1e-5)
