#include "request_output.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace deepinfer {

size_t RequestOutputPool::acquire() {
  if (used_ == slots_.size()) slots_.emplace_back();
  RequestOutputData &d = slots_[used_];
  d.token_ids.clear();  // keeps capacity: no allocation on the hot path
  d.has_logprob = false;
  d.sample_row = -1;
  d.top_token_ids.clear();
  d.top_logprobs.clear();
  if (d.has_prompt_logprobs) {  // rare: only a request's first output carries them
    d.has_prompt_logprobs = false;
    d.prompt_top_k = 0;
    d.prompt_logprobs.clear();
    d.prompt_top_token_ids.clear();
    d.prompt_top_logprobs.clear();
  }
  return used_++;
}

void RequestOutputPool::release_all() {
  used_ = 0;
  ++generation_;
}

RequestOutput::RequestOutput(std::shared_ptr<RequestOutputPool> pool, size_t slot, uint64_t generation)
    : pool_(std::move(pool)), slot_(slot), generation_(generation) {}

RequestOutput::RequestOutput(std::shared_ptr<RequestOutputData> owned) : owned_(std::move(owned)) {}

bool RequestOutput::is_valid() const { return owned_ != nullptr || pool_->generation() == generation_; }

const RequestOutputData &RequestOutput::data() const {
  if (owned_) return *owned_;
  if (pool_->generation() != generation_)
    throw ReleasedOutputError(
        "RequestOutput was released: pooled outputs are valid only until the next step() or "
        "flush_inflight_reqs(); call clone() on an output to keep it");
  return pool_->at(slot_);
}

RequestOutput RequestOutput::clone() const {
  return RequestOutput(std::make_shared<RequestOutputData>(data()));
}

RequestOutput RequestOutput::clone_finished(SequenceStatus status) const {
  auto copy = std::make_shared<RequestOutputData>(data());
  copy->finished = true;
  copy->status = status;
  return RequestOutput(std::move(copy));
}

RequestOutput RequestOutput::clone_with_prompt_logprobs(std::vector<float> logprobs, int top_k,
                                                        std::vector<int32_t> top_ids,
                                                        std::vector<float> top_logprobs) const {
  auto copy = std::make_shared<RequestOutputData>(data());
  const size_t expected = copy->prompt_len > 0 ? static_cast<size_t>(copy->prompt_len - 1) : 0;
  if (logprobs.size() != expected)
    throw std::invalid_argument("clone_with_prompt_logprobs: got " + std::to_string(logprobs.size()) +
                                " prompt logprobs for a prompt of " + std::to_string(copy->prompt_len) +
                                " tokens (one per token after the first)");
  if (top_k < 0 || top_ids.size() != expected * static_cast<size_t>(top_k) || top_logprobs.size() != top_ids.size())
    throw std::invalid_argument("clone_with_prompt_logprobs: top ids and logprobs must be (prompt_len - 1) x top_k");
  copy->has_prompt_logprobs = true;
  copy->prompt_top_k = top_k;
  copy->prompt_logprobs = std::move(logprobs);
  copy->prompt_top_token_ids = std::move(top_ids);
  copy->prompt_top_logprobs = std::move(top_logprobs);
  return RequestOutput(std::move(copy));
}

StepOutputs::StepOutputs(std::shared_ptr<RequestOutputPool> pool, size_t begin, size_t end)
    : pool_(std::move(pool)), begin_(begin), end_(end), generation_(pool_->generation()) {}

RequestOutput StepOutputs::at(size_t i) const {
  if (i >= size()) throw std::out_of_range("StepOutputs index out of range");
  return RequestOutput(pool_, begin_ + i, generation_);
}

}  // namespace deepinfer

namespace deepinfer {

void StepOutputs::set_top_logprobs(const int64_t *ids, const float *logprobs, size_t num_rows, int k,
                                   const int32_t *row_k) {
  if (pool_->generation() != generation_)
    throw ReleasedOutputError("set_top_logprobs: these step outputs were already released");
  if (k < 0) throw std::invalid_argument("set_top_logprobs: k must be >= 0");
  for (size_t i = begin_; i < end_; ++i) {
    RequestOutputData &d = pool_->at(i);
    if (d.sample_row < 0 || static_cast<size_t>(d.sample_row) >= num_rows)
      throw std::out_of_range("set_top_logprobs: output of request '" + d.request_id + "' has sample row " +
                              std::to_string(d.sample_row) + ", outside the " + std::to_string(num_rows) +
                              " rows given");
    const size_t row = static_cast<size_t>(d.sample_row);
    const int keep = std::max(0, std::min(k, static_cast<int>(row_k[row])));
    d.top_token_ids.assign(ids + row * k, ids + row * k + keep);
    d.top_logprobs.assign(logprobs + row * k, logprobs + row * k + keep);
  }
}

}  // namespace deepinfer
