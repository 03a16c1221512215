// Speculative decoding in the scheduler: drafts set between steps, fed after a sequence's
// last token in its next decode step, and verified when the step is processed.
//
// A sequence with k drafts feeds 1 + k positions and samples one row per position: row j is
// the target's token after draft j - 1. Post-processing appends row 0, then row j + 1 while
// row j equals draft j (the target agreed with it), so the appended tokens are the accepted
// drafts plus the target's next token. That is greedy verification; under sampling, with a
// draft that is one fixed token, each row drawn from the target's distribution makes it
// rejection sampling (deepinfer_dp/spec_decode/speculator.py, may_draft), and a sampler for
// a draft distribution writes the same rows (an accepted draft as itself, then a correction
// token that differs from it), so this loop serves all of them. Each
// appended token passes the stop rules and gets its own output: a run crossing a stop is cut
// exactly there. The slots of rejected drafts are rolled back (their blocks given back), so
// the prefix cache and the next step only ever see accepted tokens.
#include <algorithm>
#include <stdexcept>

#include "scheduler.h"

namespace deepinfer {

namespace {
// Most drafts one sequence may carry; far above any useful k, it bounds a bad caller.
constexpr int kMaxDrafts = 64;
}  // namespace

std::vector<int32_t> ngram_propose(const std::vector<int32_t> &tokens, int k, int min_n, int max_n) {
  if (k < 1 || min_n < 1 || max_n < min_n)
    throw std::invalid_argument("ngram_propose: needs k >= 1 and 1 <= min_n <= max_n");
  const int len = static_cast<int>(tokens.size());
  for (int n = std::min(max_n, len - 1); n >= min_n; --n) {
    const int32_t *suffix = tokens.data() + (len - n);
    // Latest earlier occurrence first: recent context predicts the continuation best.
    for (int start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + n, tokens.data() + start)) continue;
      int from = start + n;
      int to = std::min(from + k, len);
      return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + to);
    }
  }
  return {};
}

// Drafting allowed, room left, and not paused by the acceptance back-off.
bool Scheduler::draft_allowed(const Sequence &seq) const {
  return !seq.is_finished() && seq.limits.allow_drafts && !seq.done_by_length(max_seq_len_) &&
         seq.data.get_len() >= seq.draft_resume_len;
}

std::vector<std::shared_ptr<Sequence>> Scheduler::draft_candidates() const {
  std::vector<std::shared_ptr<Sequence>> out;
  for (const auto &seq : running_)
    if (draft_allowed(*seq) && seq->num_pending == 0 && seq->num_uncomputed() == 1) out.push_back(seq);
  return out;
}

bool Scheduler::may_draft() const {
  for (const auto &seq : running_)
    if (draft_allowed(*seq)) return true;
  return false;
}

void Scheduler::set_drafts(const std::shared_ptr<Sequence> &seq, std::vector<int32_t> drafts) {
  if (!seq) throw std::invalid_argument("set_drafts: seq is None");
  const std::string who = "set_drafts: request '" + seq->request_id + "': ";
  if (get_sequence(seq->request_id) != seq) throw std::invalid_argument(who + "not a live sequence of this scheduler");
  if (seq->num_pending != 0 || seq->num_uncomputed() != 1 || seq->status != SequenceStatus::RUNNING)
    throw std::invalid_argument(who + "not decode-ready with nothing in flight (see draft_candidates)");
  if (static_cast<int>(drafts.size()) > kMaxDrafts)
    throw std::invalid_argument(who + std::to_string(drafts.size()) + " drafts, more than " +
                                std::to_string(kMaxDrafts));
  for (size_t j = 0; j < drafts.size(); ++j)
    if (drafts[j] < 0 || drafts[j] >= config_.vocab_size)
      throw std::invalid_argument(who + "draft token " + std::to_string(drafts[j]) + " (position " +
                                  std::to_string(j) + ") is outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
  seq->draft_token_ids = std::move(drafts);
}

int Scheduler::propose_ngram(int k, int min_n, int max_n) {
  int n = 0;
  for (const auto &seq : draft_candidates()) {
    seq->draft_token_ids = ngram_propose(seq->data.get_token_ids(), k, min_n, max_n);
    n += seq->draft_token_ids.empty() ? 0 : 1;
  }
  return n;
}

void Scheduler::set_draft_backoff(float min_accepted, int pause_tokens) {
  if (pause_tokens < 1) throw std::invalid_argument("set_draft_backoff: pause_tokens must be >= 1");
  draft_min_accepted_ = min_accepted;
  draft_pause_tokens_ = pause_tokens;
}

// A verification step's drafts cost the step a row each whether accepted or not: on a CPU
// decode step of SmolLM2, 4 rows take ~1.5x one row, 6 rows ~1.8x, so a sequence whose
// drafts are mostly rejected (ordinary prose under prompt lookup) makes its steps slower
// than not drafting. Its recent average (each step weighs 1/2) decides. A paused sequence
// probes again after pause_tokens tokens, so a copy that starts later is still found; each
// probe in a row that fails doubles the pause (up to kMaxPauseDoublings times), since a
// probe costs a verification step of K + 1 rows, and with a draft model its K draft passes
// and a catch-up pass over the tokens it skipped.
void Scheduler::note_acceptance(Sequence &seq, int matched) {
  constexpr int kMaxPauseDoublings = 3;
  if (draft_min_accepted_ < 0.f) return;
  seq.draft_accept_avg = seq.draft_accept_avg < 0.f ? matched : 0.5f * (seq.draft_accept_avg + matched);
  if (seq.draft_accept_avg >= draft_min_accepted_) {
    seq.draft_failed_probes = 0;
    return;
  }
  seq.draft_resume_len = seq.data.get_len() + (draft_pause_tokens_ << seq.draft_failed_probes);
  seq.draft_failed_probes = std::min(seq.draft_failed_probes + 1, kMaxPauseDoublings);
}

// How many of its drafts a decode-ready sequence may feed now: none with a token in flight
// (its drafts would not follow it), and never more than it may still append (max_tokens,
// the context) minus the target's own token, nor more than the step's token budget.
int Scheduler::usable_drafts(const Sequence &seq, int budget) const {
  if (seq.draft_token_ids.empty() || seq.num_pending != 0 || !seq.limits.allow_drafts) return 0;
  int k = static_cast<int>(seq.draft_token_ids.size());
  k = std::min(k, seq.limits.max_tokens - seq.data.get_output_len() - 1);
  k = std::min(k, max_seq_len_ - seq.data.get_len() - 1);
  k = std::min(k, budget - 1);
  return std::max(k, 0);
}

void Scheduler::clear_drafts() {
  for (const auto &seq : running_) seq->draft_token_ids.clear();
  for (const auto &seq : waiting_) seq->draft_token_ids.clear();
}

void Scheduler::process_spec_seq(const SchedulerOutput &out, size_t i, const int64_t *tokens,
                                 const float *logprobs) {
  Sequence &seq = *out.seqs[i];
  const int k = out.num_drafts[i];
  const int row0 = out.sample_rows[i];
  const int64_t *drafts = out.input_ids.data() + out.query_start_loc[i] + 1;
  int matched = 0;  // drafts the target agreed with, stops aside (the acceptance metric)
  while (matched < k && tokens[row0 + matched] == drafts[matched]) ++matched;
  stats_.spec_num_drafts += 1;
  stats_.spec_num_draft_tokens += k;
  stats_.spec_num_accepted_tokens += matched;
  if (static_cast<int>(stats_.spec_accepted_per_pos.size()) < k) stats_.spec_accepted_per_pos.resize(k, 0);
  for (int j = 0; j < matched; ++j) ++stats_.spec_accepted_per_pos[j];
  note_acceptance(seq, matched);

  --seq.num_pending;
  for (int j = 0; j <= matched; ++j) {
    auto token = static_cast<int32_t>(tokens[row0 + j]);
    seq.data.append_token_id(token);
    ++stats_.generation_tokens;
    bool stopped = check_stop(seq, token);
    emit_output(seq, token, row0 + j, logprobs, stopped);
    if (stopped) return;  // finish() freed its blocks
  }
  if (out.epochs[i] != seq.epoch) return;  // preempted meanwhile: recomputed from scratch anyway
  // Roll back: positions up to the last accepted draft hold valid K/V; the target's new
  // token is fed next step. Blocks past it (rejected slots only) go back to the pool.
  seq.num_computed = seq.num_processed = seq.data.get_len() - 1;
  blocks_.trim(seq, seq.data.get_len());
  blocks_.register_full_blocks(seq);
}

}  // namespace deepinfer
