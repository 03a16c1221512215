"""Attention over a paged KV cache, in plain torch (runs on CPU and CUDA alike).

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
token t of a sequence lives in block block_table[t // block_size] at offset
t % block_size. Block 0 is a reserved dummy block: block tables are padded with it and the
placeholder step writes to it.

On CPU in fp32, decode and prefill chunks of a few tokens per sequence (prefix-cache hits,
small prompts) go to a C++ kernel that reads K/V in place through the block tables, one
query row per token, all sequences in one call. Elsewhere (CUDA, other dtypes) decode is
one gather of every sequence's blocks and one SDPA call per layer, the padding masked by
seq_lens; longer prefills loop over sequences (few, long) with SDPA, reading earlier context
from the cache when a sequence has some (chunked prefill, prefix caching).

A layer with a sliding window (Mistral, Gemma 3's local layers) attends each query over its
last `window` positions only, as transformers' sliding-window mask does; every path masks
(or, in the kernel, skips) the positions before them, so blocks that fell out of the window
may hold anything (a freed block's table entry is the dummy block 0).
"""

from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_dp import _C
from deepinfer_dp.layers import cpu_threads
from deepinfer_dp.layers.packed import kernel_array

# The C++ paged attention on CPU (fp32) for decode and short prefill chunks; False selects
# the gather + SDPA path everywhere.
CPU_KERNEL = True
# Prefill chunks of at most this many tokens per sequence use the kernel as well; longer ones
# go to SDPA, whose matrix products win once queries are many -- except in steps small enough
# to run torch on one thread (cpu_threads.narrow_step, up to 512 tokens), where the kernel on
# all threads beat SDPA on one 1.8-2.8x (one sequence of 100-400 new tokens over 0-64 cached,
# SmolLM2's heads, 2 threads). A batch-invariant step (cpu_threads.batch_invariant) takes the
# kernel at any length: it gives each query the floats it would get attending alone.
KERNEL_MAX_QUERY_LEN = 32


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit; built once per step by the model runner."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with block 0
    query_start_loc: torch.Tensor  # int32 [S + 1]: cumulative query lengths
    seq_lens: torch.Tensor  # int32 [S]: context length including this step's tokens
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    is_placeholder: bool = False  # the placeholder step's dummy token (its outputs are thrown away)
    # KV groups (layers/kv_groups.py): slot_mapping is [T * G] and each block-table row
    # interleaves the groups' blocks; a layer reads its own group's through for_group.
    num_kv_groups: int = 1
    # Per-step tensors derived on first use by layer 0 and reused by the other layers.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """This step as the layers of KV group `group` see it: their own slots and block
        tables (made once a step, shared by the group's layers)."""
        groups = self.num_kv_groups
        if groups == 1:
            return self
        key = ("kv_group", group)
        if key not in self.derived:
            tables = self.block_tables.view(self.block_tables.shape[0], -1, groups)[:, :, group].contiguous()
            slots = self.slot_mapping.view(-1, groups)[:, group].contiguous()
            self.derived[key] = replace(self, slot_mapping=slots, block_tables=tables, num_kv_groups=1, derived={})
        return self.derived[key]


class ForwardContext:
    """The metadata of the step in flight, shared by one model's attention layers.

    One per model instance rather than a module global, so that several models (DP ranks
    run in threads) can step concurrently in one process."""

    def __init__(self):
        self.attn_metadata: AttentionMetadata | None = None


class Attention(nn.Module):
    """Writes this step's K/V into the cache, then attends q over the cached context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 context: ForwardContext, window: int = 0):
        super().__init__()
        self.window = window  # sliding window (0: the whole context)
        # bf16 arithmetic over a bf16 cache where the CPU has AMX or AVX512-BF16 (dtype=bfloat16:
        # models/bf16_compute.py sets it); else fp32 arithmetic over the widened cache.
        self.bf16_math = False
        self.kv_group = 0  # its KV group: the block table it reads (set with the cache)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.context = context
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounded: bool = False) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]; rounded: in bf16 where the bf16 kernel
        runs (rows for a product that rounds them itself, packed.takes_bf16_rows), else as q."""
        md = self.context.attn_metadata
        if md is None or self.k_cache is None:
            raise RuntimeError("attention needs bind_kv_cache() and attention metadata first")
        md = md.for_group(self.kv_group)
        store_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        if md.is_prefill:
            out = self._prefill(q, k, v, md, rounded)
        else:
            out = decode_attention(q, self.k_cache, self.v_cache, md, self.scale, self.window, self.bf16_math, rounded)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 md: AttentionMetadata, rounded: bool = False) -> torch.Tensor:
        kernel = md.max_query_len <= KERNEL_MAX_QUERY_LEN or cpu_threads.wide_threads() > 1 \
            or cpu_threads.batch_invariant() or (self.bf16_math and bool(_C.bf16_attention_form(self.head_dim)))
        if _use_cpu_kernel(q, self.k_cache) and kernel:
            rows, lens = prefill_queries(md)
            return paged_attention_cpu(q, self.k_cache, self.v_cache, md.block_tables, lens, rows, self.scale,
                                       self.window, self.bf16_math, rounded)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, slen) in enumerate(zip(md.query_lens_host, md.seq_lens_host, strict=True)):
            end = start + qlen
            if qlen == slen:  # no cached context: attend over the fresh K/V directly
                out[start:end] = _causal_attention(q[start:end], k[start:end], v[start:end],
                                                   self.scale, self.window)
            else:
                keys, values = _gather_context(self.k_cache, self.v_cache, md.block_tables[i], slen)
                out[start:end] = _attention_with_context(q[start:end], keys, values, self.scale, self.window)
            start = end
        return out


def attention_layers(model: nn.Module) -> list[Attention]:
    """`model`'s attention modules in layer order (none for a model whose attention is not
    this module's: its blocks are all kept)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k/v [T, Hkv, D] into the cache slots of this step: on CPU one C++ pass from where
    the rows lie (views of the qkv output), elsewhere one indexed copy each."""
    if _use_cpu_kernel(k, k_cache) and v.dtype == torch.float32:
        _C.store_kv(_heads_rows(k).numpy(), _heads_rows(v).numpy(), kernel_array(k_cache), kernel_array(v_cache),
                    slot_mapping.numpy(), cpu_threads.kernel_threads())
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, window: int = 0) -> torch.Tensor:
    # [L, H, D] -> [1, H, L, D]: SDPA wants heads in front, and a batch dimension: on CPU,
    # 3-D inputs take its math fallback (materialized scores, ~5x slower at 2,000 tokens than
    # the flash kernel that 4-D inputs get).
    if window and q.shape[0] > window:
        return _attention_with_context(q, k, v, scale, window)
    out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v),
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> [1, H, L, D] (a view)."""
    return x.transpose(0, 1)[None]


def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of one sequence's first seq_len positions, [seq_len, Hkv, D] each."""
    block_size = k_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    return keys, values


def _attention_with_context(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            scale: float, window: int = 0) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over keys of all seq_len positions
    (with a window: over the last `window` positions up to each query)."""
    qlen, seq_len = q.shape[0], keys.shape[0]
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a bf16 cache (kv_cache_dtype) under fp32 compute
    # Query i sits at absolute position seq_len - qlen + i and sees keys at positions <= it.
    q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if window:
        mask &= k_pos > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(keys), _heads_first(values),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _decode_layout(md: AttentionMetadata, block_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat block ids to gather [S * nb] and the key padding mask [S, 1, 1, nb * block_size];
    the same for every layer of a step with this window, so it is built once and kept on the metadata."""
    key = ("decode_layout", block_size, window)
    if key not in md.derived:
        num_blocks = min(-(-md.max_seq_len // block_size), md.block_tables.shape[1])
        blocks = md.block_tables[:, :num_blocks].reshape(-1).long()
        positions = torch.arange(num_blocks * block_size, device=blocks.device)
        mask = positions[None, :] < md.seq_lens[:, None]
        if window:
            mask &= positions[None, :] >= md.seq_lens[:, None] - window
        md.derived[key] = (blocks, mask[:, None, None, :])
    return md.derived[key]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                     scale: float, window: int = 0, bf16_math: bool = False, rounded: bool = False) -> torch.Tensor:
    """One query token per sequence: q [S, H, D] -> [S, H, D], all sequences in one call
    (rounded: as paged_attention_cpu's)."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs != md.block_tables.shape[0]:
        raise ValueError(f"a decode step has one token per sequence: got {num_seqs} tokens "
                         f"for {md.block_tables.shape[0]} sequences")
    if _use_cpu_kernel(q, k_cache):
        return paged_attention_cpu(q, k_cache, v_cache, md.block_tables, md.seq_lens.numpy(), None, scale, window,
                                   bf16_math, rounded)
    return _gathered_decode_attention(q, k_cache, v_cache, md, scale, window)


def _use_cpu_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (CPU_KERNEL and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype in (torch.float32, torch.bfloat16))


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: np.ndarray, query_rows: np.ndarray | None, scale: float,
                        window: int = 0, bf16_math: bool = False, rounded: bool = False) -> torch.Tensor:
    """The C++ kernel: each query row attends over its own context (its last `window`
    positions, when set), read in place through the block tables (no gathered copy, no
    per-sequence SDPA setup), on torch's threads; bf16_math: in bf16 arithmetic (Attention.bf16_math).
    q's rows may lie apart (read in place inside the qkv output); out is contiguous. rounded:
    out in bf16 where the bf16 kernel writes it (a bf16 cache under bf16_math), else fp32."""
    rounded = rounded and bf16_math and k_cache.dtype == torch.bfloat16 and bool(_C.bf16_attention_form(q.shape[-1]))
    out = torch.empty(q.shape, dtype=torch.bfloat16 if rounded else q.dtype)
    _C.paged_attention(_heads_rows(q).numpy(), kernel_array(k_cache), kernel_array(v_cache), block_tables.numpy(),
                       context_lens, kernel_array(out), scale, cpu_threads.kernel_threads(),
                       query_rows, window, bf16_math=bf16_math)
    return out


def _heads_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each row's heads contiguous, as the kernels read it (a copy otherwise)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]:
        return x
    return x.contiguous()


def prefill_queries(md: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """Per prefill token: its sequence's block-table row, and how many positions it sees
    (causal: the cached context before the chunk plus the chunk up to itself)."""
    if "prefill_queries" not in md.derived:
        qlens = np.asarray(md.query_lens_host, dtype=np.int64)
        slens = np.asarray(md.seq_lens_host, dtype=np.int64)
        rows = np.repeat(np.arange(qlens.size, dtype=np.int32), qlens)
        first = np.repeat(np.cumsum(qlens) - qlens, qlens)  # each token's sequence's first row
        lens = np.repeat(slens - qlens, qlens) + (np.arange(rows.size) - first) + 1
        md.derived["prefill_queries"] = (rows, lens.astype(np.int32))
    return md.derived["prefill_queries"]


def _gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               md: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """The plain-torch decode path (CUDA, and CPU in other dtypes): gather, then SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    blocks, mask = _decode_layout(md, k_cache.shape[1], window)
    # index_select copies whole blocks (several times faster than advanced indexing on
    # CPU); the transpose to [S, Hkv, L, D] stays a view, SDPA reads it strided.
    keys = k_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim).to(q.dtype)
    values = v_cache.index_select(0, blocks).view(num_seqs, -1, num_kv_heads, head_dim).to(q.dtype)
    # GQA without copying K/V per query head: the `group` query heads that share a KV head
    # become `group` query rows of that head (HF's repeat_kv maps head h to KV head h // group).
    q = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)
