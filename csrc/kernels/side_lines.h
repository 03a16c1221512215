// Another kernel's next input, asked into L2 a line at a time while a compute-bound kernel
// runs. In a decode step of a full batch the attention reads every sequence's K/V blocks (5 MB
// a layer for 64 SmolLM2 sequences of ~100 positions), scattered over the cache and cold: the
// layer before last touched them a whole step ago. Read in the attention itself they make it
// wait on memory, while the MLP's matrix products before it keep the memory bus nearly idle.
// So the MLP's down projection asks for the next layer's blocks, a line at a time from the
// steps of its own loops (RowsAhead::next), and the attention finds them in L2 or L3. Only
// the bf16 tiles ask: in the fp32-arithmetic tiles (AVX-512 pairs, the AVX2 buffered path)
// the prefetches stalled the tiles for more than the attention gained. A prefetch changes no
// float.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace deepinfer {

// Blocks of equal size to ask for: the lines of block b are starts[b] + 64 * [0, lines).
struct LineBlocks {
  std::vector<const char *> starts;
  int lines = 0;
  int64_t total() const { return static_cast<int64_t>(starts.size()) * lines; }
};

// Lines [begin, end) of some LineBlocks, numbered block after block: one thread's share.
class SideLines {
 public:
  SideLines() = default;  // nothing to ask for
  SideLines(const LineBlocks *blocks, int64_t begin, int64_t end) : blocks_(blocks), at_(begin), end_(end) {}

  // What is left, spread evenly over the next `calls` calls of tick(), at most `most` lines a
  // call: about one line a 24 multiply-add instructions, which at 64 input rows slowed the
  // kernels less than the attention gained. Asked faster, a short product (a few input rows)
  // waited on memory longer than the attention would have; what does not fit is left to the
  // attention, which asks for its own blocks as it goes.
  void spread(int64_t calls, int64_t most) {
    calls_ = std::max<int64_t>(calls, 1);
    left_ = std::min(end_ - at_, calls_ * std::max<int64_t>(most, 1));
    owed_ = 0;
  }

  void tick() {
    owed_ += left_;
    for (; owed_ >= calls_ && at_ < end_; owed_ -= calls_, ++at_)
      __builtin_prefetch(blocks_->starts[at_ / blocks_->lines] + 64 * (at_ % blocks_->lines), 0, 2);
  }

 private:
  const LineBlocks *blocks_ = nullptr;
  int64_t at_ = 0, end_ = 0, left_ = 0, calls_ = 1, owed_ = 0;
};

// Lines [begin, end) of `blocks` handed to a threaded product, which gives part p of n its
// slice (share(p, n)). The default: nothing.
struct SideShare {
  const LineBlocks *blocks = nullptr;
  int64_t begin = 0, end = 0;
  SideLines share(int p, int n) const {
    if (blocks == nullptr || end <= begin) return SideLines();
    const int64_t span = end - begin;
    return SideLines(blocks, begin + span * p / n, begin + span * (p + 1) / n);
  }
};

}  // namespace deepinfer
