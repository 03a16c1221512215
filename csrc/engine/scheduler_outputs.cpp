// The output side of a step: the sampled tokens appended to their sequences, each turned
// into a pooled RequestOutput, stop rules checked, finished sequences' blocks given back; and
// requests finished from outside the step (abort, a finish the caller decides).
#include <algorithm>
#include <stdexcept>

#include "scheduler.h"

namespace deepinfer {

StepOutputs Scheduler::process_outputs(const SchedulerOutput &out, const int64_t *tokens, size_t num_tokens,
                                       const float *logprobs) {
  check_batch(out, tokens, num_tokens);
  last_processed_step_ = out.step_id;
  size_t begin = pool_->size();
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    Sequence &seq = *out.seqs[i];
    if (seq.is_finished()) continue;  // finished or aborted meanwhile: a ZOS step ran one token too many
    if (out.epochs[i] == seq.epoch) {
      int query_len = out.query_start_loc[i + 1] - out.query_start_loc[i];
      if (out.is_prompt) stats_.prompt_tokens += query_len;
      seq.num_processed = std::max(seq.num_processed, out.seq_lens[i]);
      blocks_.register_full_blocks(seq);
    }
    if (!out.samples[i]) continue;
    if (out.num_drafts[i] > 0) {
      process_spec_seq(out, i, tokens, logprobs);
      continue;
    }
    int row = out.sample_rows[i];
    auto token = static_cast<int32_t>(tokens[row]);
    --seq.num_pending;
    seq.data.append_token_id(token);
    ++stats_.generation_tokens;
    emit_output(seq, token, row, logprobs, check_stop(seq, token));
  }
  drop_finished();
  return StepOutputs(pool_, begin, pool_->size());
}

// One pooled output for a token just appended; finishes the sequence when it stopped.
void Scheduler::emit_output(Sequence &seq, int32_t token, int row, const float *logprobs, bool stopped) {
  RequestOutputData &o = pool_->at(pool_->acquire());
  o.request_id = seq.request_id;
  o.seq_id = seq.seq_id;
  o.token_ids.push_back(token);
  o.finished = stopped;
  o.status = stopped ? seq.status : SequenceStatus::RUNNING;
  o.prompt_len = seq.data.get_prompt_len();
  o.output_len = seq.data.get_output_len();
  o.sample_row = row;
  if (logprobs) {
    o.logprob = logprobs[row];
    o.has_logprob = true;
  }
  if (stopped) finish(seq, seq.status);
}

// Sets the finished status and returns true when `token` ends the sequence.
bool Scheduler::check_stop(Sequence &seq, int32_t token) const {
  const SequenceLimits &lim = seq.limits;
  int out_len = seq.data.get_output_len();
  if (out_len >= lim.min_tokens) {
    bool is_stop = (!lim.ignore_eos && token == lim.eos_token_id) ||
                   std::find(lim.stop_token_ids.begin(), lim.stop_token_ids.end(), token) != lim.stop_token_ids.end();
    if (is_stop) {
      seq.status = SequenceStatus::FINISHED_STOPPED;
      return true;
    }
  }
  if (out_len >= lim.max_tokens || seq.data.get_len() >= max_seq_len_) {
    seq.status = SequenceStatus::FINISHED_LENGTH;
    return true;
  }
  return false;
}

void Scheduler::finish(Sequence &seq, SequenceStatus status) {
  note_request_drafting(seq);
  seq.status = status;
  blocks_.free_sequence(seq);
  by_request_.erase(seq.request_id);
  has_finished_ = true;
}

std::optional<RequestOutput> Scheduler::abort(const std::string &request_id) {
  return finish_request(request_id, SequenceStatus::FINISHED_ABORTED);
}

std::optional<RequestOutput> Scheduler::finish_request(const std::string &request_id, SequenceStatus status) {
  if (!is_finished_status(status)) throw std::invalid_argument("finish_request: status must be a finished one");
  auto it = by_request_.find(request_id);
  if (it == by_request_.end()) return std::nullopt;
  std::shared_ptr<Sequence> seq = it->second;  // keep it alive while finish() unmaps it
  finish(*seq, status);
  drop_finished();
  // Its final output. Tokens still in flight for it are dropped when their step is processed.
  size_t slot = pool_->acquire();
  RequestOutputData &o = pool_->at(slot);
  o.request_id = seq->request_id;
  o.seq_id = seq->seq_id;
  o.finished = true;
  o.status = status;
  o.prompt_len = seq->data.get_prompt_len();
  o.output_len = seq->data.get_output_len();
  return RequestOutput(pool_, slot, pool_->generation());
}

void Scheduler::discard_unprocessed() {
  if (has_unfinished_seqs())
    throw std::logic_error("discard_unprocessed: " + std::to_string(waiting_.size() + running_.size()) +
                           " unfinished sequence(s) still wait for the tokens of those batches; abort them first");
  last_processed_step_ = step_id_;
}

}  // namespace deepinfer
