// Attention over the paged KV cache on CPU for short queries (decode, and prefill chunks of a
// few tokens on top of a cached prefix), reading K/V in place through the block tables. The
// plain-torch path first gathers every sequence's blocks into a padded copy and then runs
// SDPA over it per sequence; for short queries that copy and SDPA's setup cost several times
// the arithmetic. Plain C++ on raw buffers, no PyTorch: queries and outputs in fp32, the
// cache in fp32 or bf16 (kv_cache_dtype), widened exactly to fp32 as it is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kv_store.h"

namespace deepinfer {

struct PagedAttentionShape {
  int num_queries;   // T: query tokens, each with its own context
  int num_rows;      // S: rows of the block table (sequences)
  int num_heads;     // H (query heads)
  int num_kv_heads;  // Hkv; H % Hkv == 0 (grouped-query attention)
  int head_dim;      // D
  int block_size;
  int max_blocks;    // columns of the block table
  int num_blocks;    // blocks in the cache, for bounds checks
  int window = 0;    // sliding window: a query sees only its last `window` positions (0: all)
  // bf16 arithmetic over a bf16 cache (paged_attention_bf16.h: AMX or vdpbf16ps), for dtype=bfloat16;
  // where the CPU or the head size does not allow it, the fp32 arithmetic as without it.
  bool bf16_math = false;
  // Floats between query rows of q (0: num_heads * head_dim, q contiguous): q may be read in
  // place inside a fused qkv output. out is always contiguous.
  int64_t q_stride = 0;
};

inline size_t q_row_stride(const PagedAttentionShape &s) {
  return s.q_stride ? static_cast<size_t>(s.q_stride) : static_cast<size_t>(s.num_heads) * s.head_dim;
}

// The first position a query with `len` positions of context sees under `window` (0: none):
// transformers' sliding window, where key k is visible to query q when q - k < window.
inline int window_start(int len, int window) { return window > 0 && len > window ? len - window : 0; }

// q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] of element type `dtype`;
// block_tables [S, max_blocks];
// query_rows [T]: the block-table row of each query (nullptr: query t uses row t, decode);
// context_lens [T]: positions query t attends to, its own included (causal: a prompt's
// query at position p has p + 1), all already stored in the cache; out [T, H, D]. With
// shape.window set, query t reads only its last `window` positions: the blocks before them
// are never read (a sliding-window cache may have freed them).
// Split across up to `threads` threads of the shared pool into ranges of about equal
// context (one range when the batch is too small to pay); each query's result is the same
// whatever the split and whatever other queries the call holds.
void paged_attention_threaded(const PagedAttentionShape &shape, const float *q, const void *k_cache,
                              const void *v_cache, KvDtype dtype, const int32_t *block_tables,
                              const int32_t *query_rows, const int32_t *context_lens, float scale, float *out,
                              int threads);

// Queries [first, first + count) of a call: consecutive queries of one block-table row, which
// share its K/V blocks.
struct QuerySpan {
  int first, count;
};

// The call's queries as spans of at most `most` (query_rows nullptr: each query its own row).
std::vector<QuerySpan> query_spans(const int32_t *query_rows, int num_queries, int most);

// What is wrong with the contexts of a call, or "" when nothing is: every query's row lies in
// the block table, its context length in [1, the row's capacity] (and under 2^24), and the
// block ids that each row's longest context reaches lie in the cache. Checked before a call
// (the kernel itself trusts them).
std::string paged_context_error(const PagedAttentionShape &shape, const int32_t *block_tables,
                                const int32_t *query_rows, const int32_t *context_lens);

}  // namespace deepinfer
