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
#include <limits>
#include <stdexcept>

#include "scheduler.h"

namespace deepinfer {

namespace {
// Most drafts one sequence may carry; far above any useful k, it bounds a bad caller.
constexpr int kMaxDrafts = 64;
// The acceptance back-off: a pause doubles at most this many times, and the run of requests
// left out of drafting (engine-wide) at most kMaxSkipDoublings times.
constexpr int kMaxPauseDoublings = 3;
constexpr int kMaxSkipDoublings = 4;
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

std::vector<std::shared_ptr<Sequence>> Scheduler::draft_candidates() {
  std::vector<std::shared_ptr<Sequence>> out;
  for (const auto &seq : running_) {
    if (!draft_allowed(*seq) || seq->num_pending != 0 || seq->num_uncomputed() != 1) continue;
    if (!seq->draft_admitted) {
      seq->draft_admitted = true;
      admit_drafting(*seq);
      if (!draft_allowed(*seq)) continue;
    }
    out.push_back(seq);
  }
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
    const int limit = draft_limit(*seq, k);
    seq->draft_token_ids = limit > 0 ? ngram_propose(seq->data.get_token_ids(), limit, min_n, max_n)
                                     : std::vector<int32_t>{};
    n += seq->draft_token_ids.empty() ? 0 : 1;
  }
  return n;
}

// Drafts a sequence could still append after the target's own token.
int Scheduler::draft_room(const Sequence &seq) const {
  return std::min(seq.limits.max_tokens - seq.data.get_output_len() - 1, max_seq_len_ - seq.data.get_len() - 1);
}

int Scheduler::draft_limit(const Sequence &seq, int k) const {
  if (seq.draft_len > 0) k = std::min(k, seq.draft_len);
  return std::max(0, std::min(k, draft_room(seq)));
}

void Scheduler::set_draft_backoff(int max_misses, int pause_tokens, bool skip_requests) {
  if (max_misses < 0 || pause_tokens < 1)
    throw std::invalid_argument("set_draft_backoff: needs max_misses >= 0 and pause_tokens >= 1");
  draft_max_misses_ = max_misses;
  draft_pause_tokens_ = pause_tokens;
  draft_skip_requests_ = skip_requests;
}

// A verification step's drafts cost it a row each whether kept or not: on a CPU decode step
// of SmolLM2 at one sequence, 2 rows take ~1.15x one row, 4 rows ~1.45x, 8 rows ~2.5x. So a
// sequence proposes as many drafts as its last run suggests will be kept: a copy that departs
// from its source for a word keeps drafting, one or two drafts at a time, and is back to k
// as soon as a run is kept whole. A sequence whose drafts keep failing even one at a time
// (ordinary prose under prompt lookup, a draft model that rarely agrees) pauses, since a
// failed draft still costs a row, and with a draft model its drafting pass. It probes again
// after pause_tokens tokens, so a copy that starts later is still found; each failed probe
// doubles the pause (up to kMaxPauseDoublings times): a probe with a draft model also costs a
// catch-up pass over the tokens it skipped.
void Scheduler::note_acceptance(Sequence &seq, int matched, int num_drafts) {
  ++seq.draft_steps;
  seq.draft_kept += matched;
  if (draft_max_misses_ == 0) return;
  seq.draft_len = matched == num_drafts ? 0 : matched + 1;
  if (matched > 0) {
    seq.draft_misses = seq.draft_failed_probes = 0;
    return;
  }
  // A probe (the first step after a pause) that keeps nothing pauses again at once.
  if (++seq.draft_misses < draft_max_misses_ && seq.draft_failed_probes == 0) return;
  seq.draft_misses = 0;
  seq.draft_resume_len = seq.data.get_len() + (draft_pause_tokens_ << seq.draft_failed_probes);
  seq.draft_failed_probes = std::min(seq.draft_failed_probes + 1, kMaxPauseDoublings);
}

// The back-off across requests, for a draft model. Each request's own back-off still pays for
// its first drafts and its probes, and a draft model's first drafts for a request start with a
// pass over its prompt: a draft that rarely agrees with the target (an 8-layer layer-skip
// draft of SmolLM2 keeps ~3% of its drafts) cost 7-20% at one request at a time that way. So
// while requests keep finishing with few drafts kept, most new ones do not draft at all, and
// the one in every few that still does (so traffic that starts to repeat itself is noticed)
// starts as a probe: one draft, and at its first miss a pause as long as the failed requests
// before it have earned. A request is counted when it first could draft (a draft candidate,
// with speculation on), not when it arrives: one that runs in a large batch throughout never
// drafts either way, and must not use up the requests to be left out. Prompt lookup's first drafts cost a verification row only, and on
// prose a request that drafted twice and kept nothing says little about the next: it is
// left out of this.
void Scheduler::admit_drafting(Sequence &seq) {
  if (draft_max_misses_ == 0 || !draft_skip_requests_ || draft_failed_requests_ == 0) return;
  if (draft_skip_ > 0) {
    --draft_skip_;
    seq.draft_resume_len = std::numeric_limits<int>::max();
    ++stats_.spec_skipped_requests;
    return;
  }
  seq.draft_len = 1;
  seq.draft_failed_probes = std::min(draft_failed_requests_, kMaxPauseDoublings);
}

void Scheduler::note_request_drafting(const Sequence &seq) {
  if (draft_max_misses_ == 0 || !draft_skip_requests_ || seq.draft_steps == 0) return;
  if (2 * seq.draft_kept >= seq.draft_steps) {
    draft_failed_requests_ = draft_skip_ = 0;
    return;
  }
  draft_failed_requests_ = std::min(draft_failed_requests_ + 1, kMaxSkipDoublings);
  draft_skip_ = (1 << draft_failed_requests_) - 1;
}

// How many of its drafts a decode-ready sequence may feed now: none with a token in flight
// (its drafts would not follow it), and never more than it may still append (max_tokens,
// the context) minus the target's own token, nor more than the step's token budget.
int Scheduler::usable_drafts(const Sequence &seq, int budget) const {
  if (seq.draft_token_ids.empty() || seq.num_pending != 0 || !seq.limits.allow_drafts) return 0;
  int k = static_cast<int>(seq.draft_token_ids.size());
  k = std::min(k, draft_room(seq));
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
  note_acceptance(seq, matched, k);

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
