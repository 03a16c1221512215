// The next group of a row-major matrix's rows, asked into L2 a share of lines at a time while
// the current group is multiplied: the buffered many-row kernels widen (or copy) a group of
// weight rows, the bf16 tiles read one, and then every input row runs against it; between two
// groups the hardware prefetcher does not run a whole group ahead, so a group read straight
// from memory waited on its lines. All of a group's lines asked for at once overflow the
// misses a core keeps in flight; a share before each piece of the current group's work (a
// tile, or for the bf16 tiles each step of one) keeps the reading going.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "side_lines.h"

namespace deepinfer {

struct RowsAhead {
  const char *at, *end;
  int64_t per;  // lines a share
  SideLines *side;  // another kernel's next input, asked for at the same calls (side_lines.h)

  // Rows [begin, end) of the matrix at `data`, `row_bytes` apart, over `shares` shares.
  RowsAhead(const void *data, size_t row_bytes, int begin, int end_row, int shares, SideLines *side_lines = nullptr)
      : at(static_cast<const char *>(data) + static_cast<size_t>(begin) * row_bytes),
        end(static_cast<const char *>(data) + static_cast<size_t>(std::max(begin, end_row)) * row_bytes),
        per((end - at) / 64 / std::max(shares, 1) + 1),
        side(side_lines) {}

  void next() {  // locality 2: prefetcht1 on x86 (into L2)
    for (int64_t l = 0; l < per && at < end; ++l, at += 64) __builtin_prefetch(at, 0, 2);
    if (side) side->tick();
  }
};

}  // namespace deepinfer
