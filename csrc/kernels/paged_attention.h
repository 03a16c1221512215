// Decode attention over the paged KV cache on CPU, reading K/V in place through the block
// tables. The plain-torch path first gathers every sequence's blocks into a padded copy and
// then runs SDPA over it; at decode (one query per sequence) that copy and SDPA's per-head
// setup cost several times the arithmetic. Plain C++ on raw fp32 buffers, no PyTorch.
#pragma once

#include <cstdint>

namespace deepinfer {

struct PagedAttentionShape {
  int num_seqs;      // S
  int num_heads;     // H (query heads)
  int num_kv_heads;  // Hkv; H % Hkv == 0 (grouped-query attention)
  int head_dim;      // D
  int block_size;
  int max_blocks;    // columns of the block table
  int num_blocks;    // blocks in the cache, for bounds checks
};

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks];
// seq_lens [S] (context length including this step's token, already stored in the cache);
// out [S, H, D]. Sequences [seq_begin, seq_end) only, so callers can split the batch.
void paged_decode_attention(const PagedAttentionShape &shape, const float *q, const float *k_cache,
                            const float *v_cache, const int32_t *block_tables, const int32_t *seq_lens,
                            float scale, float *out, int seq_begin, int seq_end);

}  // namespace deepinfer
