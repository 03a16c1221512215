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

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int sliding_window,
                           int num_groups, int num_full_groups)
    : num_blocks_(num_blocks),
      block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      sliding_window_(sliding_window),
      num_groups_(num_groups),
      num_full_groups_(num_full_groups),
      ref_count_(num_blocks, 0),
      prev_(num_blocks, -1),
      next_(num_blocks, -1),
      in_free_(num_blocks, 0),
      has_hash_(num_blocks, 0),
      block_hash_(num_blocks, 0),
      block_parent_(num_blocks, 0),
      block_group_(num_blocks, 0),
      block_tokens_(enable_prefix_caching ? static_cast<size_t>(num_blocks) * block_size : 0) {
  ref_count_[kDummyBlock] = 1;  // pinned forever
  for (int b = 1; b < num_blocks_; ++b) push_free(b, false);
}

uint64_t BlockManager::chain_hash(uint64_t parent, const int32_t *tokens) const {
  uint64_t h = mix64(parent ^ kHashSeed);
  for (int i = 0; i < block_size_; ++i) h = mix64(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + i));
  return h;
}

// Each group's copy of a block is cached under its own key (group 0's is the chained hash).
uint64_t BlockManager::group_key(uint64_t hash, int group) const {
  return group == 0 ? hash : mix64(hash ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(group)));
}

int BlockManager::find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens, int group) const {
  auto it = hash_to_block_.find(group_key(hash, group));
  if (it == hash_to_block_.end()) return -1;
  int b = it->second;
  // A hash collision must never hand out another prompt's (or group's) KV: compare the key itself.
  const int32_t *stored = &block_tokens_[static_cast<size_t>(b) * block_size_];
  if (block_parent_[b] != parent || block_group_[b] != group ||
      std::memcmp(stored, tokens, sizeof(int32_t) * block_size_) != 0)
    return -1;
  return b;
}

// A prefix block is a hit only when every group still has it cached (a sliding group's copy
// may have been evicted after it left a window): then all of them are taken.
bool BlockManager::take_cached_blocks(Sequence &seq, uint64_t hash, uint64_t parent, const int32_t *tokens) {
  int found[kMaxGroups];
  for (int g = 0; g < num_groups_; ++g)
    if ((found[g] = find_cached(hash, parent, tokens, g)) < 0) return false;
  for (int g = 0; g < num_groups_; ++g) {
    const int b = found[g];
    if (ref_count_[b] == 0) unlink_free(b);
    ++ref_count_[b];
    seq.block_table.push_back(b);
  }
  return true;
}

int BlockManager::take_prefix(Sequence &seq, int max_blocks) {
  if (!prefix_caching_) return 0;
  const auto &tokens = seq.data.get_token_ids();
  uint64_t parent = 0;
  int taken = 0;
  for (; taken < max_blocks; ++taken) {
    const int32_t *blk = tokens.data() + static_cast<size_t>(taken) * block_size_;
    uint64_t h = chain_hash(parent, blk);
    if (!take_cached_blocks(seq, h, parent, blk)) break;
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
  return std::max(0, table_len(num_positions) - static_cast<int>(seq.block_table.size()));
}

void BlockManager::push_slots(const Sequence &seq, int p, std::vector<int64_t> &slots) const {
  const size_t first = static_cast<size_t>(p / block_size_) * num_groups_;
  for (int g = 0; g < num_groups_; ++g)
    slots.push_back(static_cast<int64_t>(seq.block_table[first + g]) * block_size_ + p % block_size_);
}

void BlockManager::release(int b) {
  if (b == kDummyBlock) return;  // freed out of the window already
  if (--ref_count_[b] == 0) push_free(b, !has_hash_[b]);
}

bool BlockManager::allocate_up_to(Sequence &seq, int num_positions) {
  int need = blocks_needed(seq, num_positions);
  if (need > num_free_) return false;
  for (int i = 0; i < need; ++i) seq.block_table.push_back(pop_free_block());
  return true;
}

int BlockManager::free_outside_window(Sequence &seq, int first_query) {
  if (sliding_window_ <= 0 || num_full_groups_ >= num_groups_) return 0;
  const int first_seen = first_query + 1 - sliding_window_;
  const int held = static_cast<int>(seq.block_table.size()) / num_groups_;
  const int dead = std::min(first_seen > 0 ? first_seen / block_size_ : 0, held);
  int freed = 0;
  for (int i = seq.num_window_freed; i < dead; ++i) {
    for (int g = num_full_groups_; g < num_groups_; ++g) {
      int &entry = seq.block_table[static_cast<size_t>(i) * num_groups_ + g];
      const int b = entry;
      entry = kDummyBlock;
      if (b == kDummyBlock) continue;
      release(b);
      ++freed;
    }
  }
  seq.num_window_freed = std::max(seq.num_window_freed, dead);
  return freed;
}

void BlockManager::trim(Sequence &seq, int num_positions) {
  const size_t keep = static_cast<size_t>(table_len(std::max(num_positions, 0)));
  while (seq.block_table.size() > keep) {
    // Never a hashed block: only full blocks of accepted tokens are keyed, and those are kept.
    release(seq.block_table.back());
    seq.block_table.pop_back();
  }
}

void BlockManager::register_full_blocks(Sequence &seq) {
  if (!prefix_caching_) return;
  const auto &tokens = seq.data.get_token_ids();
  int full = std::min(seq.num_processed, seq.data.get_len()) / block_size_;
  full = std::min(full, static_cast<int>(seq.block_table.size()) / num_groups_);
  for (int i = seq.num_hashed_blocks; i < full; ++i) {
    const int32_t *blk = tokens.data() + static_cast<size_t>(i) * block_size_;
    uint64_t h = chain_hash(seq.last_block_hash, blk);
    for (int g = 0; g < num_groups_; ++g)
      register_block(seq.block_table[static_cast<size_t>(i) * num_groups_ + g], h, seq.last_block_hash, blk, g);
    seq.last_block_hash = h;
    seq.num_hashed_blocks = i + 1;
  }
}

void BlockManager::register_block(int b, uint64_t hash, uint64_t parent, const int32_t *tokens, int group) {
  // A block freed out of the window before it was keyed holds nothing of this sequence's
  // any more: the chain goes on past it, but it is never a prefix hit.
  const uint64_t key = group_key(hash, group);
  if (b == kDummyBlock || has_hash_[b] || hash_to_block_.find(key) != hash_to_block_.end()) return;
  hash_to_block_[key] = b;
  has_hash_[b] = 1;
  block_hash_[b] = key;
  block_parent_[b] = parent;
  block_group_[b] = group;
  std::memcpy(&block_tokens_[static_cast<size_t>(b) * block_size_], tokens, sizeof(int32_t) * block_size_);
}

void BlockManager::free_sequence(Sequence &seq) {
  // Release in reverse so a sequence's tail blocks are evicted before its shared head.
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) release(*it);
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
