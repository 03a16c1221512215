#include "packed_parts.h"

#include <algorithm>

#include "cpu_linear.h"
#include "packed_linear.h"
#include "thread_pool.h"

namespace deepinfer {

namespace {

// Rows [b, e) of `part` (its own row numbers), whose first row is row `first` of a matrix of
// `rows` rows. The kernels write output n of input row j at y[j * w.rows + n] and read
// bias[n], so the part's view takes the whole matrix's row count as that stride, and y and
// bias start at the part's first row.
void part_columns(const float *x, const PackedMatrix &part, int first, int rows, const float *bias, float *y, int M,
                  int b, int e) {
  PackedMatrix view = part;
  view.rows = rows;
  packed_linear_columns(x, view, bias ? bias + first : nullptr, y + first, M, b, e);
}

int64_t parts_bytes(const PackedParts &parts) {
  int64_t bytes = 0;
  for (const auto &p : parts) bytes += static_cast<int64_t>(p.rows) * static_cast<int64_t>(p.row_bytes);
  return bytes;
}

// The first row at or after byte `target` of the whole matrix, rounded up to whole groups of
// 12 rows of its part (the kernels' groups), or the part's end.
int row_at_byte(const PackedParts &parts, int64_t target) {
  int first = 0;
  for (const auto &p : parts) {
    const int64_t part_bytes = static_cast<int64_t>(p.rows) * static_cast<int64_t>(p.row_bytes);
    if (target < part_bytes) {
      const int r = static_cast<int>((target + static_cast<int64_t>(p.row_bytes) - 1) / static_cast<int64_t>(p.row_bytes));
      return first + std::min(p.rows, (r + 11) / 12 * 12);
    }
    target -= part_bytes;
    first += p.rows;
  }
  return first;
}

}  // namespace

int packed_parts_rows(const PackedParts &parts) {
  int rows = 0;
  for (const auto &p : parts) rows += p.rows;
  return rows;
}

void packed_parts_columns(const float *x, const PackedParts &parts, const float *bias, float *y, int M, int n_begin,
                          int n_end) {
  if (parts.empty()) return;
  const int K = parts[0].cols, N = packed_parts_rows(parts), block = input_row_block(K);
  for (int m = 0; m < M; m += block) {  // one block of inputs stays in L2 while every part passes over it
    const int rows = std::min(block, M - m);
    const float *xm = x + static_cast<size_t>(m) * K;
    float *ym = y + static_cast<size_t>(m) * N;
    int first = 0;
    for (const auto &p : parts) {
      const int b = std::max(n_begin, first), e = std::min(n_end, first + p.rows);
      if (b < e) part_columns(xm, p, first, N, bias, ym, rows, b - first, e - first);
      first += p.rows;
    }
  }
}

void packed_parts_threaded(const float *x, const PackedParts &parts, const float *bias, float *y, int M,
                           int threads) {
  const int64_t bytes = parts_bytes(parts);
  const int n = packed_thread_parts_of_bytes(bytes, threads);
  shared_pool(n).run(n, n, [&](int t) {
    const int begin = row_at_byte(parts, bytes * t / n), end = row_at_byte(parts, bytes * (t + 1) / n);
    if (begin < end) packed_parts_columns(x, parts, bias, y, M, begin, end);
  });
}

}  // namespace deepinfer
