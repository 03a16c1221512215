#include "sequence.h"

#include <stdexcept>
#include <utility>

namespace deepinfer {

bool is_finished_status(SequenceStatus s) {
  return s == SequenceStatus::FINISHED_STOPPED || s == SequenceStatus::FINISHED_LENGTH ||
         s == SequenceStatus::FINISHED_ABORTED;
}

const char *finish_reason_name(SequenceStatus s) {
  switch (s) {
    case SequenceStatus::FINISHED_STOPPED:
      return "stop";
    case SequenceStatus::FINISHED_LENGTH:
      return "length";
    case SequenceStatus::FINISHED_ABORTED:
      return "abort";
    default:
      return "";
  }
}

SequenceData::SequenceData(std::vector<int32_t> prompt_token_ids)
    : token_ids_(std::move(prompt_token_ids)), prompt_len_(static_cast<int>(token_ids_.size())) {}

Sequence::Sequence(std::string request_id_, std::vector<int32_t> prompt_token_ids, SequenceLimits limits_)
    : request_id(std::move(request_id_)), data(std::move(prompt_token_ids)), limits(std::move(limits_)) {
  // Everything downstream (the last token, the first block) assumes at least one token.
  if (data.get_len() == 0) throw std::invalid_argument("request '" + request_id + "': the prompt is empty");
}

bool Sequence::done_by_length(int max_seq_len) const {
  return data.get_output_len() + num_pending >= limits.max_tokens || total_len() >= max_seq_len;
}

}  // namespace deepinfer
