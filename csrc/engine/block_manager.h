// Paged KV cache allocator: fixed-size blocks, reference counts, a free list in LRU
// order, and a prefix cache keyed by a hash chained over full blocks' token ids. For a model
// whose every layer attends over a sliding window, a sequence's blocks that fall wholly out
// of the window are given back as it grows (vLLM's sliding-window manager): its table keeps
// the dummy block in their place, which attention never reads.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "sequence.h"

namespace deepinfer {

class BlockManager {
 public:
  // Block 0 is the dummy block of placeholder steps and is never handed out.
  static constexpr int kDummyBlock = 0;

  // sliding_window: every layer's window (positions a query sees, itself included), or 0
  // when some layer sees the whole context (nothing is freed early).
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int sliding_window = 0);

  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  int num_usable_blocks() const { return num_blocks_ - 1; }
  // Blocks nobody holds: never used, or cached and evictable.
  int num_free_blocks() const { return num_free_; }
  bool prefix_caching() const { return prefix_caching_; }
  int ref_count(int block) const { return ref_count_[block]; }

  // Takes up to `max_blocks` cached full blocks of `seq`'s prefix (ref counts up); returns how many.
  int take_prefix(Sequence &seq, int max_blocks);
  // After take_prefix: the chained hash of `seq`'s first uncached full block, if it has one
  // below `max_blocks` (the block a prefill of `seq` would compute and register next).
  bool next_block_hash(const Sequence &seq, int max_blocks, uint64_t *hash) const;
  // Grows `seq`'s block table to cover `num_positions`; false (nothing taken) if short of blocks.
  bool allocate_up_to(Sequence &seq, int num_positions);
  int blocks_needed(const Sequence &seq, int num_positions) const;
  // Before a step whose first query of `seq` sits at position `first_query`: gives back the
  // blocks wholly before that query's window (no later query reads them); returns how many.
  // A freed block keeps its prefix-cache key until it is handed out again.
  int free_outside_window(Sequence &seq, int first_query);
  int sliding_window() const { return sliding_window_; }
  // Gives back the blocks past the first `num_positions` positions (rejected draft slots).
  void trim(Sequence &seq, int num_positions);
  // Keys the sequence's newly full, processed blocks in the prefix cache.
  void register_full_blocks(Sequence &seq);
  // Drops the sequence's hold on its blocks; cached ones stay reusable until evicted.
  void free_sequence(Sequence &seq);
  // Forgets every cached prefix; false (nothing forgotten) while any block is held.
  bool reset_prefix_cache();

 private:
  uint64_t chain_hash(uint64_t parent, const int32_t *tokens) const;
  int find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens) const;
  int pop_free_block();
  void push_free(int block, bool to_front);
  void unlink_free(int block);
  void forget_hash(int block);

  int num_blocks_;
  int block_size_;
  bool prefix_caching_;
  int sliding_window_;
  int num_free_ = 0;
  std::vector<int> ref_count_;
  // Intrusive doubly linked free list: head is evicted first.
  std::vector<int> prev_, next_;
  std::vector<char> in_free_;
  int head_ = -1, tail_ = -1;
  // Prefix cache: hash -> block, and per block its key (parent hash + token ids) to verify hits.
  std::unordered_map<uint64_t, int> hash_to_block_;
  std::vector<char> has_hash_;
  std::vector<uint64_t> block_hash_, block_parent_;
  std::vector<int32_t> block_tokens_;  // num_blocks * block_size
};

}  // namespace deepinfer
