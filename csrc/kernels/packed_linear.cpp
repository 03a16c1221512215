#include "packed_linear.h"

#include <vector>

#include "cpu_linear.h"
#include "packed_blocks.h"

namespace deepinfer {

namespace {
constexpr int kGroupRows = 3;  // cpu_linear's tile height

#ifdef DEEPINFER_PACKED_AVX2
using namespace packed_detail;

// cpu_linear's horizontal sum, step for step (the same float whatever the path).
DEEPINFER_AVX2_FN float sum8(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// One input row against NB weight rows, widening each block in registers straight into the
// multiply-adds: at batch 1 the widening is most of the work, and a round trip through the
// buffer would double it. Each output is the same chain of fused multiply-adds over K in
// steps of 8 as in cpu_linear's tiles, so the floats equal the buffered path's.
template <int NB>
DEEPINFER_AVX2_FN void rows_one_input(const float *x, const PackedMatrix &w, const float *bias, float *y, int n) {
  const size_t step = block_bytes(w.format);
  const uint8_t *rows[NB];
  __m256 acc[NB], wv[4];
  for (int i = 0; i < NB; ++i) {
    rows[i] = w.data + static_cast<size_t>(n + i) * w.row_bytes;
    acc[i] = _mm256_setzero_ps();
  }
  for (int k = 0; k < w.cols; k += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8), x2 = _mm256_loadu_ps(x + k + 16),
                 x3 = _mm256_loadu_ps(x + k + 24);
    for (int i = 0; i < NB; ++i) {
      widen_block(w.format, rows[i], wv);
      rows[i] += step;
      acc[i] = _mm256_fmadd_ps(wv[0], x0, acc[i]);
      acc[i] = _mm256_fmadd_ps(wv[1], x1, acc[i]);
      acc[i] = _mm256_fmadd_ps(wv[2], x2, acc[i]);
      acc[i] = _mm256_fmadd_ps(wv[3], x3, acc[i]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    const float s = sum8(acc[i]);
    y[n + i] = bias ? s + bias[n + i] : s;
  }
}

__attribute__((target("avx2,fma,f16c"))) void columns_one_input(const float *x, const PackedMatrix &w,
                                                                const float *bias, float *y, int n0, int n1) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) rows_one_input<4>(x, w, bias, y, n);
  for (; n < n1; ++n) rows_one_input<1>(x, w, bias, y, n);
}

bool fused_ok(const PackedMatrix &w) {
  static const bool cpu =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return cpu && w.cols % 32 == 0;
}
#endif
}  // namespace

void packed_linear_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                           int n_end) {
  const int K = w.cols, N = w.rows;
#ifdef DEEPINFER_PACKED_AVX2
  if (M == 1 && fused_ok(w)) return columns_one_input(x, w, bias, y, n_begin, n_end);
#endif
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
