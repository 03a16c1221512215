// A request's persistent state across scheduling rounds: token history with the
// prompt/output boundary, the processed boundary, its KV block table and limits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deepinfer {

enum class SequenceStatus {
  WAITING,
  RUNNING,
  PREEMPTED,  // preempted by recompute: back in `waiting`, generated tokens kept
  FINISHED_STOPPED,
  FINISHED_LENGTH,
  FINISHED_ABORTED,
};

bool is_finished_status(SequenceStatus s);
// OpenAI-style reason: "stop", "length", "abort", or "" while unfinished.
const char *finish_reason_name(SequenceStatus s);

// The per-request limits the scheduler enforces when it appends a token. max_tokens has no
// default: the caller always sets it (Python's SamplingParams owns the default), and
// Scheduler::add_sequence refuses one left at 0.
struct SequenceLimits {
  int max_tokens = 0;
  int min_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  int32_t eos_token_id = -1;
  bool ignore_eos = false;
  bool read_prefix_cache = true;  // false: recompute a cached prefix (prompt logprobs need it)
  // Speculative decoding may draft for it: only requests whose rows sample alike at every
  // position (plain greedy), so that verification is token-identical to decoding one by one.
  bool allow_drafts = true;
};

// One image's placeholder tokens in a prompt: positions [start, end) (an image may be split by
// other tokens, e.g. Idefics3's tile tags) and how many rows the vision encoder makes for it,
// which is what it costs against the per-step encoder budget (Scheduler::fit_encoder_budget).
struct ImageSpan {
  int start = 0;
  int end = 0;
  int tokens = 0;
};

class SequenceData {
 public:
  explicit SequenceData(std::vector<int32_t> prompt_token_ids);

  void append_token_id(int32_t token_id) { token_ids_.push_back(token_id); }
  int get_len() const { return static_cast<int>(token_ids_.size()); }
  int get_prompt_len() const { return prompt_len_; }
  int get_output_len() const { return get_len() - prompt_len_; }
  int32_t get_last_token_id() const { return token_ids_.back(); }
  const std::vector<int32_t> &get_token_ids() const { return token_ids_; }
  void reserve(size_t n) { token_ids_.reserve(n); }

 private:
  std::vector<int32_t> token_ids_;
  int prompt_len_;
};

class Sequence {
 public:
  // Throws std::invalid_argument for an empty prompt.
  Sequence(std::string request_id, std::vector<int32_t> prompt_token_ids, SequenceLimits limits);

  // Tokens known or in flight: history plus sampled tokens not yet appended (ZOS).
  int total_len() const { return data.get_len() + num_pending; }
  // Positions still to feed through the model before this sequence samples again.
  int num_uncomputed() const { return total_len() - num_computed; }
  // All tokens it may produce are already sampled; it finishes when they are processed.
  bool done_by_length(int max_seq_len) const;
  bool is_finished() const { return is_finished_status(status); }

  int64_t seq_id = -1;
  std::string request_id;
  SequenceData data;
  SequenceLimits limits;
  SequenceStatus status = SequenceStatus::WAITING;
  double arrival_time = 0.0;

  // Boundaries over positions: computed = written to the KV cache or in flight in a
  // scheduled step; processed = confirmed by post-processing (their tokens are final).
  int num_computed = 0;
  int num_processed = 0;
  int num_pending = 0;          // sampled tokens in flight, not yet appended
  int last_sample_row = -1;     // sample row of the newest in-flight token...
  int64_t last_sample_step = -1;  // ...in this step
  int num_cached_tokens = 0;    // prompt positions reused from the prefix cache
  int epoch = 0;                // bumped on preemption; stale in-flight work won't advance boundaries
  int num_preemptions = 0;

  // Draft tokens to verify after the last token in the next decode step (speculative
  // decoding); set by a proposer before schedule(), consumed or dropped by it.
  std::vector<int32_t> draft_token_ids;
  // The acceptance back-off (Scheduler::set_draft_backoff): how many drafts its next
  // verification may take (0: all K; none rejected yet, or the last run all kept), its
  // verification steps in a row that kept none, and the length it must reach before
  // drafting again after a pause.
  int draft_len = 0;
  int draft_misses = 0;
  int draft_resume_len = 0;
  int draft_steps = 0;  // its verification steps, and the drafts they kept (engine-wide back-off)
  int draft_kept = 0;
  bool draft_admitted = false;  // has been a draft candidate once: its start in the back-off is set
  int draft_failed_probes = 0;  // pauses in a row: each doubles the next one

  // A prompt's images, ascending (set before add_sequence); the first `images_charged` of
  // them were counted against a step's encoder budget in this epoch (reset on preemption).
  std::vector<ImageSpan> image_spans;
  size_t images_charged = 0;

  std::vector<int32_t> block_table;  // a block freed out of a sliding window: BlockManager::kDummyBlock
  int num_window_freed = 0;     // leading blocks given back as they left every layer's sliding window
  int num_hashed_blocks = 0;    // leading full blocks already keyed in the prefix cache
  uint64_t last_block_hash = 0;
};

}  // namespace deepinfer
