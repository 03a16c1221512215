// Paged KV cache allocator: fixed-size blocks, reference counts, a free list in LRU
// order, and a prefix cache keyed by a hash chained over full blocks' token ids. For a model
// whose every layer attends over a sliding window, a sequence's blocks that fall wholly out
// of the window are given back as it grows (vLLM's sliding-window manager): its table keeps
// the dummy block in their place, which attention never reads.
//
// KV groups (vLLM's hybrid allocator): a model that mixes sliding-window and full-attention
// layers (Gemma 3) splits its layers into `num_groups` groups of equally many layers, each
// group one kind; layer j of every group shares cache tensor j, so a block of any group costs
// the same memory and all groups draw from this one pool. A sequence then holds one block per
// group for each `block_size` positions: its table is interleaved, entry i * num_groups + g is
// group g's block of positions [i * block_size, (i + 1) * block_size). Groups below
// `num_full_groups` keep every block; the others free theirs as they leave the window. With
// one group (every model but a hybrid one) the table is the plain one.
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
  static constexpr int kMaxGroups = 64;

  // sliding_window: the window (positions a query sees, itself included) of the sliding
  // groups, those from num_full_groups on; 0: nothing is freed early.
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int sliding_window = 0,
               int num_groups = 1, int num_full_groups = 0);

  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  int num_usable_blocks() const { return num_blocks_ - 1; }
  // Blocks nobody holds: never used, or cached and evictable.
  int num_free_blocks() const { return num_free_; }
  bool prefix_caching() const { return prefix_caching_; }
  int ref_count(int block) const { return ref_count_[block]; }
  int num_groups() const { return num_groups_; }
  // Table entries (blocks, one per group) that cover `num_positions` positions.
  int table_len(int num_positions) const { return (num_positions + block_size_ - 1) / block_size_ * num_groups_; }
  // Appends position p's cache slot in each group (block * block_size + offset), group 0 first.
  void push_slots(const Sequence &seq, int p, std::vector<int64_t> &slots) const;

  // Takes up to `max_blocks` cached full blocks of `seq`'s prefix (ref counts up); returns how many.
  int take_prefix(Sequence &seq, int max_blocks);
  // After take_prefix: the chained hash of `seq`'s first uncached full block, if it has one
  // below `max_blocks` (the block a prefill of `seq` would compute and register next).
  bool next_block_hash(const Sequence &seq, int max_blocks, uint64_t *hash) const;
  // Grows `seq`'s block table to cover `num_positions`; false (nothing taken) if short of blocks.
  bool allocate_up_to(Sequence &seq, int num_positions);
  int blocks_needed(const Sequence &seq, int num_positions) const;
  // Before a step whose first query of `seq` sits at position `first_query`: gives back the
  // sliding groups' blocks wholly before that query's window (no later query reads them);
  // returns how many.
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
  uint64_t group_key(uint64_t hash, int group) const;
  int find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens, int group) const;
  bool take_cached_blocks(Sequence &seq, uint64_t hash, uint64_t parent, const int32_t *tokens);
  void register_block(int block, uint64_t hash, uint64_t parent, const int32_t *tokens, int group);
  void release(int block);
  int pop_free_block();
  void push_free(int block, bool to_front);
  void unlink_free(int block);
  void forget_hash(int block);

  int num_blocks_;
  int block_size_;
  bool prefix_caching_;
  int sliding_window_;
  int num_groups_;
  int num_full_groups_;
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
  std::vector<int> block_group_;
  std::vector<int32_t> block_tokens_;  // num_blocks * block_size
};

}  // namespace deepinfer
