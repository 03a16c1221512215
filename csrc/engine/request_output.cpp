#include "request_output.h"

#include <utility>

namespace deepinfer {

size_t RequestOutputPool::acquire() {
  if (used_ == slots_.size()) slots_.emplace_back();
  RequestOutputData &d = slots_[used_];
  d.token_ids.clear();  // keeps capacity: no allocation on the hot path
  d.has_logprob = false;
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

StepOutputs::StepOutputs(std::shared_ptr<RequestOutputPool> pool, size_t begin, size_t end)
    : pool_(std::move(pool)), begin_(begin), end_(end), generation_(pool_->generation()) {}

RequestOutput StepOutputs::at(size_t i) const {
  if (i >= size()) throw std::out_of_range("StepOutputs index out of range");
  return RequestOutput(pool_, begin_ + i, generation_);
}

}  // namespace deepinfer
