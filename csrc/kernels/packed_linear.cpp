#include "packed_linear.h"

#include <vector>

#include "cpu_linear.h"

namespace deepinfer {

namespace {
constexpr int kGroupRows = 3;  // cpu_linear's tile height
}

void packed_linear_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                           int n_end) {
  const int K = w.cols, N = w.rows;
  // One buffer per thread, kept between calls: 3 rows of K floats (7 KB at K = 576).
  thread_local std::vector<float> rows;
  rows.resize(static_cast<size_t>(kGroupRows) * K);
  for (int n = n_begin; n < n_end; n += kGroupRows) {
    const int count = n + kGroupRows <= n_end ? kGroupRows : n_end - n;
    for (int i = 0; i < count; ++i) widen_row(w, n + i, rows.data() + static_cast<size_t>(i) * K);
    // The widened rows are columns [0, count) of a matrix starting at row n.
    linear_columns(x, rows.data(), bias ? bias + n : nullptr, y + n, M, N, K, 0, count);
  }
}

void widen_rows(const PackedMatrix &w, int begin, int end, float *out) {
  for (int r = begin; r < end; ++r) widen_row(w, r, out + static_cast<size_t>(r - begin) * w.cols);
}

}  // namespace deepinfer
