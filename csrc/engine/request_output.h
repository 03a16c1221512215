// Per-step results. Outputs live in a pool and are valid until the pool is released
// (the next schedule() or flush); a handle checks the pool's generation on every read,
// so a released output raises instead of showing another request's data.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "sequence.h"

namespace deepinfer {

struct RequestOutputData {
  std::string request_id;
  int64_t seq_id = -1;
  std::vector<int32_t> token_ids;  // tokens produced for this request in this step
  bool finished = false;
  SequenceStatus status = SequenceStatus::RUNNING;
  int prompt_len = 0;
  int output_len = 0;
  float logprob = 0.0f;
  bool has_logprob = false;
  int sample_row = -1;  // row of the step's sampled tokens this output came from
  // The k most likely tokens at this step (k per output, as the request asked; empty when
  // it asked for none), best first: top_token_ids[j] has log-probability top_logprobs[j].
  std::vector<int32_t> top_token_ids;
  std::vector<float> top_logprobs;
  // Prompt log-probabilities, set on a request's first output only when it asked for them:
  // entry p (p = 0 .. prompt_len - 2) is prompt token p + 1 given the tokens before it;
  // prompt_top_* hold prompt_top_k alternatives per entry, row-major.
  bool has_prompt_logprobs = false;
  int prompt_top_k = 0;
  std::vector<float> prompt_logprobs;
  std::vector<int32_t> prompt_top_token_ids;
  std::vector<float> prompt_top_logprobs;
};

class ReleasedOutputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class RequestOutputPool {
 public:
  // Index of a fresh slot for the current generation (slots are reused, not freed).
  size_t acquire();
  RequestOutputData &at(size_t i) { return slots_[i]; }
  // Invalidates every handle handed out so far.
  void release_all();
  uint64_t generation() const { return generation_; }
  size_t size() const { return used_; }

 private:
  std::vector<RequestOutputData> slots_;
  size_t used_ = 0;
  uint64_t generation_ = 1;
};

// A handle to one output: pooled (pool + slot + generation) or owned (after clone()).
class RequestOutput {
 public:
  RequestOutput(std::shared_ptr<RequestOutputPool> pool, size_t slot, uint64_t generation);
  explicit RequestOutput(std::shared_ptr<RequestOutputData> owned);

  const RequestOutputData &data() const;  // throws ReleasedOutputError if released
  bool is_valid() const;
  bool is_pooled() const { return owned_ == nullptr; }
  RequestOutput clone() const;
  RequestOutput clone_finished(SequenceStatus status) const;
  // An owned copy carrying the request's prompt log-probabilities (see RequestOutputData).
  RequestOutput clone_with_prompt_logprobs(std::vector<float> logprobs, int top_k, std::vector<int32_t> top_ids,
                                           std::vector<float> top_logprobs) const;

 private:
  std::shared_ptr<RequestOutputPool> pool_;
  size_t slot_ = 0;
  uint64_t generation_ = 0;
  std::shared_ptr<RequestOutputData> owned_;
};

// The outputs of one post-processing call: a contiguous range of pool slots.
class StepOutputs {
 public:
  StepOutputs(std::shared_ptr<RequestOutputPool> pool, size_t begin, size_t end);
  size_t size() const { return end_ - begin_; }
  RequestOutput at(size_t i) const;
  // Gives each output the top alternatives of its sample row: `ids` and `logprobs` are
  // [num_rows, k] row-major, and row r keeps its first min(row_k[r], k) entries.
  void set_top_logprobs(const int64_t *ids, const float *logprobs, size_t num_rows, int k, const int32_t *row_k);

 private:
  std::shared_ptr<RequestOutputPool> pool_;
  size_t begin_, end_;
  uint64_t generation_;
};

}  // namespace deepinfer
