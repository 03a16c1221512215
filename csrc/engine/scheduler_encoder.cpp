// The per-step encoder budget (vLLM's max_num_encoder_input_tokens): how many image tokens
// the vision encoder may make in one step. The encoder runs for an image when the first of
// its rows is computed (multimodal/step_inputs.py), so a prefill chunk that would begin an
// image the step has no room for ends before that image; the image's rows come in a later
// step. The first image of a step always fits, so an image larger than the whole budget
// still makes progress (alone in its step).
#include <algorithm>

#include "scheduler.h"

namespace deepinfer {

// The chunk of `seq` from `start` (at most `chunk` tokens) that fits the budget left in this
// step; `tokens` and `charged` are what charge_encoder then records if it is scheduled. An
// image counts once per epoch of the sequence, when a chunk first reaches it (a later chunk
// of it reads the encoder cache); images wholly inside a cached prefix are never computed.
// Images another request already encoded count too: the budget is an upper bound.
int Scheduler::fit_encoder_budget(const Sequence &seq, int start, int chunk, int *tokens, size_t *charged) {
  const auto &spans = seq.image_spans;
  size_t i = seq.images_charged;
  while (i < spans.size() && spans[i].end <= start) ++i;
  *tokens = 0;
  *charged = i;
  const int limit = config_.max_num_encoder_input_tokens;
  if (limit <= 0) return chunk;
  for (; i < spans.size() && spans[i].start < start + chunk; ++i) {
    int used = encoder_tokens_ + *tokens;
    if (used > 0 && used + spans[i].tokens > limit) {
      ++stats_.encoder_budget_cuts;
      return std::max(spans[i].start, start) - start;
    }
    *tokens += spans[i].tokens;
    *charged = i + 1;
  }
  return chunk;
}

void Scheduler::charge_encoder(Sequence &seq, int tokens, size_t charged) {
  seq.images_charged = charged;
  encoder_tokens_ += tokens;
}

}  // namespace deepinfer
