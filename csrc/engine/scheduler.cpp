#include "scheduler.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <unordered_set>

namespace deepinfer {

namespace {
double now_seconds() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }
}  // namespace

Scheduler::Scheduler(const SchedulerConfig &config)
    : config_(checked(config)),
      max_seq_len_(static_cast<int>(std::min<int64_t>(
          config.max_model_len,
          static_cast<int64_t>((config.num_blocks - 1) / config.num_kv_groups) * config.block_size + 1))),
      uid_(next_scheduler_uid()),
      blocks_(config.num_blocks, config.block_size, config.enable_prefix_caching, config.sliding_window,
              config.num_kv_groups, config.num_full_kv_groups),
      pool_(std::make_shared<RequestOutputPool>()) {}

void Scheduler::add_sequence(const std::shared_ptr<Sequence> &seq) {
  if (!seq) throw std::invalid_argument("add_sequence: seq is None");
  validate(*seq);
  seq->seq_id = next_seq_id_++;
  seq->arrival_time = now_seconds();
  seq->status = SequenceStatus::WAITING;
  // Host-side capacity only; KV blocks are a scheduling decision made later.
  int final_len = static_cast<int>(
      std::min<int64_t>(static_cast<int64_t>(seq->data.get_len()) + seq->limits.max_tokens, max_seq_len_));
  seq->data.reserve(final_len);
  seq->block_table.reserve(blocks_.table_len(final_len));
  waiting_.push_back(seq);
  by_request_[seq->request_id] = seq;
}

std::shared_ptr<Sequence> Scheduler::get_sequence(const std::string &request_id) const {
  auto it = by_request_.find(request_id);
  return it == by_request_.end() ? nullptr : it->second;
}

void Scheduler::drop_finished() {
  if (!has_finished_) return;
  auto done = [](const std::shared_ptr<Sequence> &s) { return s->is_finished(); };
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), done), waiting_.end());
  running_.erase(std::remove_if(running_.begin(), running_.end(), done), running_.end());
  has_finished_ = false;
}

std::shared_ptr<SchedulerOutput> Scheduler::schedule() {
  pool_->release_all();
  drop_finished();
  auto out = std::make_shared<SchedulerOutput>();
  out->scheduler_uid = uid_;
  out->step_id = ++step_id_;
  encoder_tokens_ = 0;
  out->block_size = config_.block_size;
  out->num_kv_groups = config_.num_kv_groups;
  reserve_batch(*out);
  out->query_start_loc.push_back(0);
  if (!schedule_prefills(*out)) schedule_decodes(*out);
  drop_finished();
  finalize_batch(*out);
  clear_drafts();  // drafts are for this step only
  return out;
}

// Sized for a decode step of every running sequence, the common case: no regrowth.
void Scheduler::reserve_batch(SchedulerOutput &out) const {
  size_t s = std::min<size_t>(running_.size() + waiting_.size(), config_.max_num_seqs) + 1;
  for (auto *v : {&out.seq_ids, &out.input_ids, &out.positions, &out.slot_mapping, &out.sample_indices})
    v->reserve(s);
  for (auto *v : {&out.input_from_prev, &out.query_start_loc, &out.seq_lens}) v->reserve(s);
  out.num_drafts.reserve(s);
  out.seqs.reserve(s);
  out.epochs.reserve(s);
  out.samples.reserve(s);
  out.sample_rows.reserve(s);
}

// A prefill batch: running sequences with a prompt still to compute (chunked prefill),
// then FCFS admission from `waiting` while slots, budget and blocks allow.
bool Scheduler::schedule_prefills(SchedulerOutput &out) {
  out.is_prompt = true;
  int budget = config_.max_num_batched_tokens;
  for (const auto &seq : running_) {
    if (budget <= 0) break;
    int remaining = seq->num_uncomputed();
    if (remaining <= 1 || seq->done_by_length(max_seq_len_)) continue;  // decode-ready
    int enc_tokens = 0;
    size_t enc_charged = 0;
    int chunk = fit_encoder_budget(*seq, seq->num_computed, std::min(remaining, budget), &enc_tokens, &enc_charged);
    if (chunk <= 0) continue;  // its next image waits for a step with room in the encoder budget
    blocks_.free_outside_window(*seq, seq->num_computed);
    if (!blocks_.allocate_up_to(*seq, seq->num_computed + chunk)) continue;
    add_to_batch(out, seq, chunk);
    charge_encoder(*seq, enc_tokens, enc_charged);
    budget -= chunk;
  }
  admit_waiting(out, budget);
  if (out.seqs.empty()) out.is_prompt = false;
  return !out.seqs.empty();
}

// FCFS admission. A prompt whose next uncached block is the same as one that a prompt
// admitted earlier in this step will compute waits for the next step, where it finds that
// block in the prefix cache (SGLang's in-batch prefix caching): N prompts that share a long
// system prompt compute it once instead of N times.
bool Scheduler::admit_waiting(SchedulerOutput &out, int &budget) {
  int active = 0;
  for (const auto &s : running_) active += s->done_by_length(max_seq_len_) ? 0 : 1;
  std::unordered_set<uint64_t> computing;  // first uncached block of each prompt admitted now
  bool admitted = false;
  size_t i = 0;
  while (i < waiting_.size() && budget > 0 && active < config_.max_num_seqs) {
    auto seq = waiting_[i];
    if (seq->num_pending > 0) break;  // its newest token is still in flight; keep FCFS order
    int total = seq->total_len();
    // Cannot happen: a sequence finishes ("length") when it reaches max_seq_len_, which the
    // whole cache holds. Were it broken, the queue would wait forever: say so instead.
    if (blocks_.table_len(total) > blocks_.num_usable_blocks())
      throw std::logic_error("scheduler: request '" + seq->request_id + "' has " + std::to_string(total) +
                             " tokens, more than the whole KV cache holds");
    // Always compute the last token; compute everything when the request needs each prompt
    // position's logits (prompt logprobs), as vLLM does.
    int max_hit_blocks = seq->limits.read_prefix_cache ? (total - 1) / config_.block_size : 0;
    // Take the cached prefix now (it may consume free blocks), give it back if the rest won't fit.
    int cached = blocks_.take_prefix(*seq, max_hit_blocks) * config_.block_size;
    uint64_t next_hash = 0;
    bool has_next = blocks_.next_block_hash(*seq, max_hit_blocks, &next_hash);
    if (has_next && computing.count(next_hash)) {
      blocks_.free_sequence(*seq);
      ++i;
      continue;
    }
    int enc_tokens = 0;
    size_t enc_charged = 0;
    int chunk = fit_encoder_budget(*seq, cached, std::min(total - cached, budget), &enc_tokens, &enc_charged);
    blocks_.free_outside_window(*seq, cached);  // a long cached prefix: only its window stays
    if (chunk <= 0 || blocks_.blocks_needed(*seq, cached + chunk) > blocks_.num_free_blocks()) {
      blocks_.free_sequence(*seq);
      break;
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(i));
    if (has_next) computing.insert(next_hash);
    blocks_.allocate_up_to(*seq, cached + chunk);
    seq->num_computed = seq->num_processed = cached;
    if (seq->data.get_output_len() == 0) seq->num_cached_tokens = cached;
    stats_.prefix_query_tokens += total;
    stats_.prefix_hit_tokens += cached;
    seq->status = SequenceStatus::RUNNING;
    running_.push_back(seq);
    add_to_batch(out, seq, chunk);
    charge_encoder(*seq, enc_tokens, enc_charged);
    budget -= chunk;
    ++active;
    admitted = true;
  }
  return admitted;
}

// A decode batch: one token for every running sequence, plus its draft tokens when it has
// some (speculative decoding: KV slots for all 1 + k are reserved). When a block is short,
// the drafts go first; then preempt the most recently admitted running sequence (possibly
// this one) by recompute. A sequence alone always finds room: it never grows past
// max_seq_len_, which the whole cache holds.
void Scheduler::schedule_decodes(SchedulerOutput &out) {
  int budget = config_.max_num_batched_tokens;
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    auto seq = running_[i];
    if (seq->is_finished() || seq->done_by_length(max_seq_len_) || seq->num_uncomputed() != 1 ||
        !can_feed_inflight(*seq))
      continue;
    bool scheduled = true;
    blocks_.free_outside_window(*seq, seq->num_computed);
    int k = usable_drafts(*seq, budget);
    if (k > 0 && !blocks_.allocate_up_to(*seq, seq->num_computed + 1 + k)) k = 0;
    while (!blocks_.allocate_up_to(*seq, seq->num_computed + 1 + k)) {
      auto victim = running_.back();
      running_.pop_back();
      preempt(victim);
      if (victim == seq) {
        scheduled = false;
        break;
      }
    }
    if (!scheduled) continue;
    add_to_batch(out, seq, 1, k);
    budget -= 1 + k;
  }
}

// A token still in flight can be fed only from the step just before this one (the worker
// takes it from that step's samples on the device); an older one must be processed first.
bool Scheduler::can_feed_inflight(const Sequence &seq) const {
  return seq.num_pending == 0 || (seq.num_pending == 1 && seq.last_sample_step == step_id_ - 1);
}

void Scheduler::preempt(const std::shared_ptr<Sequence> &seq) {
  blocks_.free_sequence(*seq);
  seq->num_computed = seq->num_processed = 0;
  seq->images_charged = 0;  // recomputed: its images may be encoded again
  ++seq->epoch;
  ++seq->num_preemptions;
  ++stats_.num_preemptions;
  seq->status = SequenceStatus::PREEMPTED;
  waiting_.push_front(seq);
}

// `num_drafts` of the sequence's draft tokens follow its last token (a decode step only).
void Scheduler::add_to_batch(SchedulerOutput &out, const std::shared_ptr<Sequence> &seq, int num_tokens,
                             int num_drafts) {
  const auto &tokens = seq->data.get_token_ids();
  const int len = seq->data.get_len();
  const int start = seq->num_computed;
  for (int p = start; p < start + num_tokens; ++p) {
    if (p < len) {
      out.input_ids.push_back(tokens[p]);
      out.input_from_prev.push_back(-1);
    } else {
      // The token sampled by the previous (deferred, ZOS) step: the worker takes it from
      // that step's sampled ids on the device.
      if (p != len || seq->num_pending != 1 || seq->last_sample_step != step_id_ - 1)
        throw std::logic_error("scheduler: in-flight input token not from the previous step");
      out.input_ids.push_back(-1);
      out.input_from_prev.push_back(seq->last_sample_row);
      out.has_inflight_inputs = true;
    }
    out.positions.push_back(p);
    blocks_.push_slots(*seq, p, out.slot_mapping);
  }
  for (int j = 0; j < num_drafts; ++j) {
    int p = start + num_tokens + j;
    out.input_ids.push_back(seq->draft_token_ids[j]);
    out.input_from_prev.push_back(-1);
    out.positions.push_back(p);
    blocks_.push_slots(*seq, p, out.slot_mapping);
  }
  num_tokens += num_drafts;
  seq->num_computed += num_tokens;
  out.seqs.push_back(seq);
  out.epochs.push_back(seq->epoch);
  out.seq_ids.push_back(seq->seq_id);
  out.query_start_loc.push_back(out.query_start_loc.back() + num_tokens);
  out.seq_lens.push_back(seq->num_computed);
  bool sample = seq->num_computed - num_drafts == seq->total_len();
  out.samples.push_back(sample);
  out.num_drafts.push_back(num_drafts);
  if (sample) {
    int row = static_cast<int>(out.sample_indices.size());
    for (int j = num_drafts; j >= 0; --j)
      out.sample_indices.push_back(static_cast<int64_t>(out.positions.size()) - 1 - j);
    out.sample_rows.push_back(row);
    ++seq->num_pending;
    seq->last_sample_row = row;
    // A speculative step's tokens cannot be fed from the device (how many are accepted is
    // known only on the host): its sequence waits until the step is processed.
    seq->last_sample_step = num_drafts > 0 ? -1 : out.step_id;
  } else {
    out.sample_rows.push_back(-1);
  }
}

void Scheduler::finalize_batch(SchedulerOutput &out) {
  int max_blocks = blocks_.num_groups();
  for (const auto &s : out.seqs) max_blocks = std::max(max_blocks, static_cast<int>(s->block_table.size()));
  out.max_blocks = max_blocks;
  out.block_tables.assign(out.seqs.size() * max_blocks, BlockManager::kDummyBlock);
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    const auto &bt = out.seqs[i]->block_table;
    std::copy(bt.begin(), bt.end(), out.block_tables.begin() + i * max_blocks);
  }
}

std::vector<SequenceMetadata> build_seq_metadata(const SchedulerOutput &out) {
  std::vector<SequenceMetadata> md;
  md.reserve(out.seqs.size());
  for (size_t i = 0; i < out.seqs.size(); ++i) {
    const Sequence &s = *out.seqs[i];
    const int32_t *bt = out.block_tables.data() + i * out.max_blocks;
    int nb = std::min(out.max_blocks, (out.seq_lens[i] + out.block_size - 1) / out.block_size * out.num_kv_groups);
    md.push_back({s.request_id, s.seq_id, out.is_prompt, s.data.get_token_ids(),
                  std::vector<int32_t>(bt, bt + nb), out.query_start_loc[i + 1] - out.query_start_loc[i],
                  out.seq_lens[i], static_cast<bool>(out.samples[i])});
  }
  return md;
}

}  // namespace deepinfer
