// Continuous-batching scheduler: FCFS admission into a prefill batch or a decode batch,
// chunked prefill under a token budget, preemption by recompute, and post-processing
// that appends sampled tokens and applies the stop rules.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_manager.h"
#include "request_output.h"
#include "sequence.h"

namespace deepinfer {

struct SchedulerConfig {
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;
  int block_size = 16;
  int num_blocks = 1024;  // including the dummy block 0
  int max_model_len = 2048;
  int vocab_size = 32000;
  bool enable_prefix_caching = true;
  int sliding_window = 0;  // the sliding groups' window: blocks that leave it are freed (0: none)
  // KV groups (block_manager.h): a sequence holds a block per group for each block_size
  // positions; groups below num_full_groups keep them all, the others only the window's.
  int num_kv_groups = 1;
  int num_full_kv_groups = 0;
  // Image tokens the vision encoder may make in one step (vLLM's max_num_encoder_input_tokens;
  // 0: no limit): a prefill chunk ends before an image that does not fit (fit_encoder_budget).
  int max_num_encoder_input_tokens = 0;
};

// One step's batch: the selected sequences plus the flat arrays the worker feeds the
// model. Tokens are flattened sequence by sequence.
struct SchedulerOutput {
  uint64_t scheduler_uid = 0;  // the scheduler that made it: only that one may process it
  int64_t step_id = 0;
  bool is_prompt = false;
  std::vector<std::shared_ptr<Sequence>> seqs;
  std::vector<int> epochs;     // per sequence, at schedule time
  std::vector<char> samples;   // per sequence: does this step sample a token for it
  std::vector<int> sample_rows;  // per sequence: its (first) row in the sampled tokens, or -1
  // per sequence: draft tokens fed after its last token (speculative decoding). Such a
  // sequence samples 1 + num_drafts rows from sample_rows[i] on, one per fed position.
  std::vector<int> num_drafts;

  std::vector<int64_t> seq_ids;          // [S]
  std::vector<int64_t> input_ids;        // [T]; -1 where the token is still in flight
  std::vector<int32_t> input_from_prev;  // [T]; previous step's sample row for in-flight tokens, else -1
  std::vector<int64_t> positions;        // [T]
  std::vector<int64_t> slot_mapping;     // [T, num_kv_groups] row-major
  std::vector<int32_t> query_start_loc;  // [S + 1]
  std::vector<int32_t> seq_lens;         // [S] context length after this step
  // [S, max_blocks] row-major, padded with block 0; with KV groups entry i * G + g of a row
  // is group g's block i (max_blocks a multiple of G)
  std::vector<int32_t> block_tables;
  int max_blocks = 0;
  int block_size = 0;
  int num_kv_groups = 1;
  std::vector<int64_t> sample_indices;   // [N] token rows whose logits are sampled
  bool has_inflight_inputs = false;

  int num_seqs() const { return static_cast<int>(seqs.size()); }
  int num_tokens() const { return static_cast<int>(positions.size()); }
  int num_samples() const { return static_cast<int>(sample_indices.size()); }
  bool is_empty() const { return seqs.empty(); }
};

// Per-sequence view of a batch, for tests and debugging (the worker reads the flat arrays).
struct SequenceMetadata {
  std::string request_id;
  int64_t seq_id;
  bool is_prompt;
  std::vector<int32_t> token_ids;  // the history at schedule time
  std::vector<int32_t> block_table;
  int seqlen_q;  // tokens fed this step
  int seqlen_k;  // context length after this step
  bool do_sample;
};
std::vector<SequenceMetadata> build_seq_metadata(const SchedulerOutput &out);

// The configuration itself, or std::invalid_argument naming what is out of range.
const SchedulerConfig &checked(const SchedulerConfig &config);
uint64_t next_scheduler_uid();  // unique per process: a batch names the scheduler that made it

struct SchedulerStats {
  int64_t num_preemptions = 0;
  int64_t prefix_query_tokens = 0;  // prompt tokens looked up in the prefix cache
  int64_t prefix_hit_tokens = 0;    // of which served from it
  int64_t prompt_tokens = 0;        // prompt positions computed
  int64_t generation_tokens = 0;    // tokens appended by post-processing
  // Speculative decoding, as vLLM counts it: verified draft runs, their tokens, the drafts
  // the target agreed with, and of those how many at each draft position (0 = first).
  int64_t spec_num_drafts = 0;
  int64_t spec_num_draft_tokens = 0;
  int64_t spec_num_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_pos;
  int64_t spec_skipped_requests = 0;  // started without drafting by the engine-wide back-off
  int64_t encoder_budget_cuts = 0;    // prefill chunks ended early (or deferred) by the encoder budget
};

// Prompt lookup (n-gram speculation): the tokens that followed the latest earlier
// occurrence of the history's last n tokens, for the largest n in [min_n, max_n] that
// occurs; at most k of them; empty when no suffix recurs.
std::vector<int32_t> ngram_propose(const std::vector<int32_t> &tokens, int k, int min_n, int max_n);

class Scheduler {
 public:
  explicit Scheduler(const SchedulerConfig &config);

  // Admission only: validates, reserves host-side capacity and enqueues in `waiting`.
  // A Sequence is added once, to one scheduler.
  void add_sequence(const std::shared_ptr<Sequence> &seq);
  std::shared_ptr<SchedulerOutput> schedule();
  // Appends sampled tokens (`tokens[i]` for sample row i), advances the processed
  // boundary, applies stop rules, frees finished sequences' blocks. Every batch this
  // scheduler made is processed once, in the order it was scheduled (std::invalid_argument
  // otherwise, before anything changes).
  StepOutputs process_outputs(const SchedulerOutput &out, const int64_t *tokens, size_t num_tokens,
                              const float *logprobs);
  // Ends a request for a reason found outside the scheduler (an abort, a stop string) and
  // frees its blocks. Returns its final output (finished, no new token; pooled like a
  // step's outputs), or nothing if no unfinished request has this id.
  std::optional<RequestOutput> abort(const std::string &request_id);
  std::optional<RequestOutput> finish_request(const std::string &request_id, SequenceStatus status);
  void release_outputs() { pool_->release_all(); }
  // The batches scheduled but not processed yet will never be (their forward pass failed,
  // and every request was aborted): the next batch is the next one processed. Refused
  // (std::logic_error) while a sequence is unfinished, whose tokens those batches carry.
  void discard_unprocessed();

  // Speculative decoding (csrc/engine/scheduler_spec.cpp). Drafts are set between steps and
  // used by the next schedule() only; it drops those it cannot use.
  // Running sequences that may get drafts now: decode-ready, nothing in flight, drafting allowed.
  // A sequence seen here for the first time gets its start in the engine-wide back-off
  // (set_draft_backoff): only requests that could draft count there.
  std::vector<std::shared_ptr<Sequence>> draft_candidates();
  // Whether a running sequence may draft now or, with a token in flight, at the next step:
  // drafting allowed and not paused by the acceptance back-off.
  bool may_draft() const;
  // Checks and sets the drafts of a candidate (std::invalid_argument naming what is wrong).
  void set_drafts(const std::shared_ptr<Sequence> &seq, std::vector<int32_t> drafts);
  // Prompt lookup for every candidate; returns how many got drafts.
  int propose_ngram(int k, int min_n, int max_n);
  // How many drafts to propose for a candidate now: at most k, no more than its acceptance
  // back-off allows, and none it could not append (max_tokens, the context) after the
  // target's own token.
  int draft_limit(const Sequence &seq, int k) const;
  // Acceptance back-off. A sequence's draft length follows what its verification steps
  // keep: after a run with a rejected draft it proposes one more than were kept, after a
  // run kept whole all k again. After `max_misses` verification steps in a row that keep
  // nothing, it stops being a draft candidate for its next `pause_tokens` tokens, then
  // probes with one draft; a probe that fails pauses twice as long as the pause before (at
  // most 8 x pause_tokens) until a step keeps a draft again. With `skip_requests` (a proposer
  // whose first drafts for a request cost a pass over its prompt: a draft model), also
  // engine-wide: when requests in a row finish having kept fewer drafts than half their
  // verification steps, new requests start without drafting: 1, 3, 7, then 15 in a row are
  // left out (each failing request doubles the run); the request after them probes with one
  // draft and, at its first miss, pauses as a failed probe would; one request that keeps
  // enough ends it. max_misses 0: all off (always k).
  void set_draft_backoff(int max_misses, int pause_tokens, bool skip_requests);

  bool has_unfinished_seqs() const { return !waiting_.empty() || !running_.empty(); }
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  std::shared_ptr<Sequence> get_sequence(const std::string &request_id) const;
  const SchedulerConfig &config() const { return config_; }
  // The longest a sequence may grow: max_model_len, or less when the whole KV cache holds
  // fewer positions (plus the last sampled token, never fed back). A sequence that reaches
  // it finishes with "length" like one at max_model_len, so none can outgrow the cache.
  int max_seq_len() const { return max_seq_len_; }
  const BlockManager &block_manager() const { return blocks_; }
  // Forgets every cached prefix (vLLM's reset_prefix_cache); false while a sequence holds blocks.
  bool reset_prefix_cache() { return blocks_.reset_prefix_cache(); }
  const SchedulerStats &stats() const { return stats_; }
  int64_t step_id() const { return step_id_; }

 private:
  void validate(const Sequence &seq) const;
  void check_batch(const SchedulerOutput &out, const int64_t *tokens, size_t num_tokens) const;
  bool can_feed_inflight(const Sequence &seq) const;
  void drop_finished();
  void reserve_batch(SchedulerOutput &out) const;
  bool schedule_prefills(SchedulerOutput &out);
  void schedule_decodes(SchedulerOutput &out);
  bool admit_waiting(SchedulerOutput &out, int &budget);
  int fit_encoder_budget(const Sequence &seq, int start, int chunk, int *tokens, size_t *charged);
  void charge_encoder(Sequence &seq, int tokens, size_t charged);
  void preempt(const std::shared_ptr<Sequence> &seq);
  void add_to_batch(SchedulerOutput &out, const std::shared_ptr<Sequence> &seq, int num_tokens, int num_drafts = 0);
  int usable_drafts(const Sequence &seq, int budget) const;
  void clear_drafts();
  void note_acceptance(Sequence &seq, int matched, int num_drafts);
  void admit_drafting(Sequence &seq);
  void note_request_drafting(const Sequence &seq);
  int draft_room(const Sequence &seq) const;
  bool draft_allowed(const Sequence &seq) const;
  void process_spec_seq(const SchedulerOutput &out, size_t i, const int64_t *tokens, const float *logprobs);
  void emit_output(Sequence &seq, int32_t token, int row, const float *logprobs, bool stopped);
  void finalize_batch(SchedulerOutput &out);
  void finish(Sequence &seq, SequenceStatus status);
  bool check_stop(Sequence &seq, int32_t token) const;

  SchedulerConfig config_;
  int max_seq_len_;
  uint64_t uid_;
  BlockManager blocks_;
  std::deque<std::shared_ptr<Sequence>> waiting_;
  std::deque<std::shared_ptr<Sequence>> running_;
  std::unordered_map<std::string, std::shared_ptr<Sequence>> by_request_;
  std::shared_ptr<RequestOutputPool> pool_;
  SchedulerStats stats_;
  int draft_max_misses_ = 0;  // set_draft_backoff
  int draft_pause_tokens_ = 0;
  bool draft_skip_requests_ = false;
  int draft_failed_requests_ = 0;  // requests in a row whose drafts were rarely kept
  int draft_skip_ = 0;             // new requests still to start without drafting
  int64_t step_id_ = 0;
  int encoder_tokens_ = 0;  // charged against this step's encoder budget so far
  int64_t last_processed_step_ = 0;
  int64_t next_seq_id_ = 1;
  bool has_finished_ = false;  // some queued sequence finished: compact the queues
};

}  // namespace deepinfer
