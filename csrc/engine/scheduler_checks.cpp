// The scheduler's guards at its boundary: the configuration, a request at admission and a
// batch handed back for post-processing. Each bad argument raises std::invalid_argument
// (ValueError in Python) naming what was wrong, before any state changes.
#include <atomic>
#include <stdexcept>

#include "scheduler.h"

namespace deepinfer {

namespace {
// Positions the whole cache may hold: keeps every position and block count an int and the
// prefix cache's token copy within a few GB, far beyond any real KV cache.
constexpr int64_t kMaxCachePositions = int64_t{1} << 28;
}  // namespace

const SchedulerConfig &checked(const SchedulerConfig &c) {
  if (c.block_size <= 0 || c.num_blocks < 2 || c.max_num_seqs < 1 || c.max_num_batched_tokens < 1 ||
      c.max_model_len < 2 || c.vocab_size < 1 || c.sliding_window < 0)
    throw std::invalid_argument(
        "SchedulerConfig: block_size, max_num_seqs, max_num_batched_tokens and vocab_size must be "
        "positive, num_blocks >= 2 (block 0 is reserved), max_model_len >= 2 and sliding_window >= 0");
  if (c.num_kv_groups < 1 || c.num_kv_groups > BlockManager::kMaxGroups || c.num_full_kv_groups < 0 ||
      c.num_full_kv_groups > c.num_kv_groups || c.num_blocks - 1 < c.num_kv_groups)
    throw std::invalid_argument("SchedulerConfig: num_kv_groups must be in [1, " +
                                std::to_string(BlockManager::kMaxGroups) +
                                "], num_full_kv_groups in [0, num_kv_groups], and num_blocks - 1 >= num_kv_groups "
                                "(one block of each group)");
  if (static_cast<int64_t>(c.num_blocks) * c.block_size > kMaxCachePositions)
    throw std::invalid_argument("SchedulerConfig: num_blocks * block_size = " +
                                std::to_string(static_cast<int64_t>(c.num_blocks) * c.block_size) +
                                " positions, more than the " + std::to_string(kMaxCachePositions) +
                                " a scheduler handles");
  return c;
}

uint64_t next_scheduler_uid() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

void Scheduler::validate(const Sequence &seq) const {
  const std::string who = "request '" + seq.request_id + "': ";
  if (seq.seq_id >= 0)
    throw std::invalid_argument(who + "this Sequence was already added to a scheduler; make a new one");
  const auto &tokens = seq.data.get_token_ids();
  if (tokens.empty()) throw std::invalid_argument(who + "the prompt is empty");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size)
      throw std::invalid_argument(who + "token id " + std::to_string(tokens[i]) + " at position " +
                                  std::to_string(i) + " is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
  }
  if (seq.limits.max_tokens < 1)
    throw std::invalid_argument(who + "max_tokens must be at least 1, got " + std::to_string(seq.limits.max_tokens));
  if (seq.limits.min_tokens < 0 || seq.limits.min_tokens > seq.limits.max_tokens)
    throw std::invalid_argument(who + "min_tokens must be in [0, max_tokens], got " +
                                std::to_string(seq.limits.min_tokens));
  int len = seq.data.get_len();
  if (len >= config_.max_model_len)
    throw std::invalid_argument(who + "the prompt has " + std::to_string(len) +
                                " tokens but the context length is " + std::to_string(config_.max_model_len) +
                                ", which leaves no room to generate");
  if (len >= max_seq_len_)
    throw std::invalid_argument(who + "the prompt has " + std::to_string(len) + " tokens but the whole KV cache " +
                                "holds " + std::to_string(max_seq_len_ - 1) + " (" +
                                std::to_string(blocks_.num_usable_blocks()) + " KV cache blocks of " +
                                std::to_string(config_.block_size) + "), which leaves no room to generate");
  if (by_request_.count(seq.request_id))
    throw std::invalid_argument(who + "a request with this id is already in the scheduler");
}

void Scheduler::check_batch(const SchedulerOutput &out, const int64_t *tokens, size_t num_tokens) const {
  const std::string step = "process_outputs: the batch of step " + std::to_string(out.step_id);
  if (out.scheduler_uid != uid_) throw std::invalid_argument(step + " was made by another scheduler");
  if (out.step_id <= last_processed_step_)
    throw std::invalid_argument(step + " was already processed (batches are processed once, in order)");
  if (out.step_id != last_processed_step_ + 1)
    throw std::invalid_argument(step + " comes before step " + std::to_string(last_processed_step_ + 1) +
                                " was processed (batches are processed once, in order)");
  if (num_tokens != out.sample_indices.size())
    throw std::invalid_argument("process_outputs: got " + std::to_string(num_tokens) + " sampled tokens for " +
                                std::to_string(out.sample_indices.size()) + " sample rows");
  for (size_t i = 0; i < num_tokens; ++i)
    if (tokens[i] < 0 || tokens[i] >= config_.vocab_size)
      throw std::invalid_argument("process_outputs: sampled token " + std::to_string(tokens[i]) + " (row " +
                                  std::to_string(i) + ") is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
}

}  // namespace deepinfer
