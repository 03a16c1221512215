// Attention over the paged KV cache on CPU for short queries (decode, and prefill chunks of a
// few tokens on top of a cached prefix), reading K/V in place through the block tables. The
// plain-torch path first gathers every sequence's blocks into a padded copy and then runs
// SDPA over it per sequence; for short queries that copy and SDPA's setup cost several times
// the arithmetic. Plain C++ on raw fp32 buffers, no PyTorch.
#pragma once

#include <cstdint>
#include <string>

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
};

// q [T, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks];
// query_rows [T]: the block-table row of each query (nullptr: query t uses row t, decode);
// context_lens [T]: positions query t attends to, its own included (causal: a prompt's
// query at position p has p + 1), all already stored in the cache; out [T, H, D].
// Split across up to `threads` threads of the shared pool into ranges of about equal
// context (one range when the batch is too small to pay); each query's result is the same
// whatever the split and whatever other queries the call holds.
void paged_attention_threaded(const PagedAttentionShape &shape, const float *q, const float *k_cache,
                              const float *v_cache, const int32_t *block_tables, const int32_t *query_rows,
                              const int32_t *context_lens, float scale, float *out, int threads);

// What is wrong with the contexts of a call, or "" when nothing is: every query's row lies in
// the block table, its context length in [1, the row's capacity] (and under 2^24), and the
// block ids that each row's longest context reaches lie in the cache. Checked before a call
// (the kernel itself trusts them).
std::string paged_context_error(const PagedAttentionShape &shape, const int32_t *block_tables,
                                const int32_t *query_rows, const int32_t *context_lens);

}  // namespace deepinfer
