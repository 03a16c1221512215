#include "block_manager.h"

#include <algorithm>
#include <cstring>

namespace deepinfer {

namespace {
constexpr uint64_t kHashSeed = 0x243f6a8885a308d3ULL;

inline uint64_t mix64(uint64_t x) {  // splitmix64 finalizer: full avalanche
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}
}  // namespace

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int sliding_window)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      sliding_window_(sliding_window),
      ref_count_(num_blocks, 0),
      prev_(num_blocks, -1),
      next_(num_blocks, -1),
      in_free_(num_blocks, 0),
      has_hash_(num_blocks, 0),
      block_hash_(num_blocks, 0),
      block_parent_(num_blocks, 0),
      block_tokens_(enable_prefix_caching ? static_cast<size_t>(num_blocks) * block_size : 0) {
  ref_count_[kDummyBlock] = 1;  // pinned forever
  for (int b = 1; b < num_blocks_; ++b) push_free(b, false);
}

uint64_t BlockManager::chain_hash(uint64_t parent, const int32_t *tokens) const {
  uint64_t h = mix64(parent ^ kHashSeed);
  for (int i = 0; i < block_size_; ++i) h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + i));
  return h;
}

int BlockManager::find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens) const {
  auto it = hash_to_block_.find(hash);
  if (it == hash_to_block_.end()) return -1;
  int b = it->second;
  // A hash collision must never hand out another prompt's KV: compare the key itself.
  const int32_t *stored = &block_tokens_[static_cast<size_t>(b) * block_size_];
  if (block_parent_[b] != parent || std::memcmp(stored, tokens, sizeof(int32_t) * block_size_) != 0) return -1;
  return b;
}

int BlockManager::take_prefix(Sequence &seq, int max_blocks) {
  if (!prefix_caching_) return 0;
  const auto &tokens = seq.data.get_token_ids();
  uint64_t parent = 0;
  int taken = 0;
  for (; taken < max_blocks; ++taken) {
    const int32_t *blk = tokens.data() + static_cast<size_t>(taken) * block_size_;
    uint64_t h = chain_hash(parent, blk);
    int b = find_cached(h, parent, blk);
    if (b < 0) break;
    if (ref_count_[b] == 0) unlink_free(b);
    ++ref_count_[b];
    seq.block_table.push_back(b);
    parent = h;
  }
  seq.num_hashed_blocks = taken;
  seq.last_block_hash = parent;
  return taken;
}

bool BlockManager::next_block_hash(const Sequence &seq, int max_blocks, uint64_t *hash) const {
  int next = seq.num_hashed_blocks;
  if (!prefix_caching_ || next >= max_blocks) return false;
  *hash = chain_hash(seq.last_block_hash, seq.data.get_token_ids().data() + static_cast<size_t>(next) * block_size_);
  return true;
}

int BlockManager::blocks_needed(const Sequence &seq, int num_positions) const {
  int want = (num_positions + block_size_ - 1) / block_size_;
  return std::max(0, want - static_cast<int>(seq.block_table.size()));
}

bool BlockManager::allocate_up_to(Sequence &seq, int num_positions) {
  int need = blocks_needed(seq, num_positions);
  if (need > num_free_) return false;
  for (int i = 0; i < need; ++i) seq.block_table.push_back(pop_free_block());
  return true;
}

int BlockManager::free_outside_window(Sequence &seq, int first_query) {
  if (sliding_window_ <= 0) return 0;
  const int first_seen = first_query + 1 - sliding_window_;
  const int dead = std::min(first_seen > 0 ? first_seen / block_size_ : 0, static_cast<int>(seq.block_table.size()));
  int freed = 0;
  for (int i = seq.num_window_freed; i < dead; ++i) {
    const int b = seq.block_table[i];
    seq.block_table[i] = kDummyBlock;
    if (b == kDummyBlock) continue;
    if (--ref_count_[b] == 0) push_free(b, !has_hash_[b]);
    ++freed;
  }
  seq.num_window_freed = std::max(seq.num_window_freed, dead);
  return freed;
}

void BlockManager::trim(Sequence &seq, int num_positions) {
  size_t keep = static_cast<size_t>((std::max(num_positions, 0) + block_size_ - 1) / block_size_);
  while (seq.block_table.size() > keep) {
    int b = seq.block_table.back();
    seq.block_table.pop_back();
    if (b == kDummyBlock) continue;  // freed out of the window already
    // Never a hashed block: only full blocks of accepted tokens are keyed, and those are kept.
    if (--ref_count_[b] == 0) push_free(b, !has_hash_[b]);
  }
}

void BlockManager::register_full_blocks(Sequence &seq) {
  if (!prefix_caching_) return;
  const auto &tokens = seq.data.get_token_ids();
  int full = std::min(seq.num_processed, seq.data.get_len()) / block_size_;
  full = std::min(full, static_cast<int>(seq.block_table.size()));
  for (int i = seq.num_hashed_blocks; i < full; ++i) {
    const int32_t *blk = tokens.data() + static_cast<size_t>(i) * block_size_;
    uint64_t h = chain_hash(seq.last_block_hash, blk);
    int b = seq.block_table[i];
    // A block freed out of the window before it was keyed holds nothing of this sequence's
    // any more: the chain goes on past it, but it is never a prefix hit.
    if (b != kDummyBlock && !has_hash_[b] && hash_to_block_.find(h) == hash_to_block_.end()) {
      hash_to_block_[h] = b;
      has_hash_[b] = 1;
      block_hash_[b] = h;
      block_parent_[b] = seq.last_block_hash;
      std::memcpy(&block_tokens_[static_cast<size_t>(b) * block_size_], blk, sizeof(int32_t) * block_size_);
    }
    seq.last_block_hash = h;
    seq.num_hashed_blocks = i + 1;
  }
}

void BlockManager::free_sequence(Sequence &seq) {
  // Release in reverse so a sequence's tail blocks are evicted before its shared head.
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) {
    int b = *it;
    if (b == kDummyBlock) continue;  // freed out of the window already
    if (--ref_count_[b] == 0) push_free(b, !has_hash_[b]);
  }
  seq.block_table.clear();
  seq.num_window_freed = 0;
  seq.num_hashed_blocks = 0;
  seq.last_block_hash = 0;
}

int BlockManager::pop_free_block() {
  int b = head_;
  unlink_free(b);
  forget_hash(b);  // evict: its old contents are about to be overwritten
  ref_count_[b] = 1;
  return b;
}

bool BlockManager::reset_prefix_cache() {
  if (num_free_ != num_usable_blocks()) return false;
  for (int b = 0; b < num_blocks_; ++b) has_hash_[b] = 0;
  hash_to_block_.clear();
  return true;
}

void BlockManager::forget_hash(int b) {
  if (!has_hash_[b]) return;
  auto it = hash_to_block_.find(block_hash_[b]);
  if (it != hash_to_block_.end() && it->second == b) hash_to_block_.erase(it);
  has_hash_[b] = 0;
}

// Unkeyed blocks go to the front so cached blocks are the last to be evicted.
void BlockManager::push_free(int b, bool to_front) {
  in_free_[b] = 1;
  ++num_free_;
  if (head_ < 0) {
    head_ = tail_ = b;
    prev_[b] = next_[b] = -1;
  } else if (to_front) {
    prev_[b] = -1;
    next_[b] = head_;
    prev_[head_] = b;
    head_ = b;
  } else {
    next_[b] = -1;
    prev_[b] = tail_;
    next_[tail_] = b;
    tail_ = b;
  }
}

void BlockManager::unlink_free(int b) {
  in_free_[b] = 0;
  --num_free_;
  if (prev_[b] >= 0) next_[prev_[b]] = next_[b]; else head_ = next_[b];
  if (next_[b] >= 0) prev_[next_[b]] = prev_[b]; else tail_ = prev_[b];
  prev_[b] = next_[b] = -1;
}

}  // namespace deepinfer
