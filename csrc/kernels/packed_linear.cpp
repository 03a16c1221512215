#include "packed_linear.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_linear.h"
#include "packed_blocks.h"
#include "thread_pool.h"

namespace deepinfer {

namespace {
// Weight rows widened at a time for 7 and more input rows: 12 rows of SmolLM2's 576 columns
// (27 KB) and a group of 4 input rows stay in L1 together. Timed side by side against groups
// of 3 (one thread, thread CPU time, 64 input rows): 1.05-1.24x on the Q4_1 layers and the
// Q8_0 lm_head, the same floats.
constexpr int kGroupRows = 12;
// Input rows up to which each weight block is widened in registers and used at once. Both
// paths timed side by side on SmolLM2's Q4_1 gate_up (one thread, thread CPU time): the
// fused one is 1.2-1.4x faster at 2-6 rows, even at 8, and slower at 16, where cpu_linear's
// 3 x 4 register tiles on widened rows reuse each loaded input vector three times.
constexpr int kFewRows = 6;
constexpr int kAheadRows = 4;  // how far ahead in rows the fused kernels prefetch
// Packed bytes per thread below which splitting is not worth waking a worker (about what
// the fp32 kernel's 64 K weights take in Q4_1 at a few rows: the work is the widening).
constexpr int64_t kMinBytesPerThread = 1 << 15;

#ifdef DEEPINFER_PACKED_AVX2
using namespace packed_detail;

// cpu_linear's horizontal sum, step for step (the same float whatever the path).
DEEPINFER_AVX2_FN float sum8(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// One input row against NB weight rows of format F, widening each block in registers
// straight into the multiply-adds: at batch 1 the widening is most of the work, and a round
// trip through the buffer would double it. Each output is the same chain of fused
// multiply-adds over K in steps of 8 as in cpu_linear's tiles, so the floats equal the
// buffered path's. Four rows at once keep four independent chains in flight, which hides
// the multiply-add latency; the format is a template argument so no per-block test remains.
template <class F, int NB>
DEEPINFER_AVX2_FN void rows_one_input(const float *x, const PackedMatrix &w, const float *bias, float *y, int n) {
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
      // The rows after this group, one block at a time: at one input row the kernel is
      // bound by memory, and the hardware prefetcher alone leaves half the bandwidth unused.
      _mm_prefetch(reinterpret_cast<const char *>(rows[i] + kAheadRows * w.row_bytes), _MM_HINT_T0);
      F::widen(rows[i], wv);
      rows[i] += F::kBytes;
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

template <class F>
__attribute__((target("avx2,fma,f16c"))) void columns_one_input(const float *x, const PackedMatrix &w,
                                                                const float *bias, float *y, int n0, int n1) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) rows_one_input<F, 4>(x, w, bias, y, n);
  for (; n < n1; ++n) rows_one_input<F, 1>(x, w, bias, y, n);
}

// MB input rows against one weight row of format F: each block is widened once into
// registers and used by every input row (x stays in L1). Each output's chain of multiply-adds
// is the same as in cpu_linear's tiles, so the floats are the same.
template <class F, int MB>
DEEPINFER_AVX2_FN void row_few_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int n) {
  const int K = w.cols;
  const uint8_t *row = w.data + static_cast<size_t>(n) * w.row_bytes;
  __m256 acc[MB], wv[4];
  for (int j = 0; j < MB; ++j) acc[j] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 32, row += F::kBytes) {
    _mm_prefetch(reinterpret_cast<const char *>(row + kAheadRows * w.row_bytes), _MM_HINT_T0);
    F::widen(row, wv);
    for (int j = 0; j < MB; ++j) {
      const float *xj = x + static_cast<size_t>(j) * K + k;
      acc[j] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xj), acc[j]);
      acc[j] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xj + 8), acc[j]);
      acc[j] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xj + 16), acc[j]);
      acc[j] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xj + 24), acc[j]);
    }
  }
  for (int j = 0; j < MB; ++j) {
    const float s = sum8(acc[j]);
    y[static_cast<size_t>(j) * w.rows + n] = bias ? s + bias[n] : s;
  }
}

template <class F, int MB>
__attribute__((target("avx2,fma,f16c"))) void columns_few(const float *x, const PackedMatrix &w, const float *bias,
                                                          float *y, int n0, int n1) {
  for (int n = n0; n < n1; ++n) row_few_inputs<F, MB>(x, w, bias, y, n);
}

template <class F>
void few_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  switch (M) {
    case 1: return columns_one_input<F>(x, w, bias, y, n0, n1);
    case 2: return columns_few<F, 2>(x, w, bias, y, n0, n1);
    case 3: return columns_few<F, 3>(x, w, bias, y, n0, n1);
    case 4: return columns_few<F, 4>(x, w, bias, y, n0, n1);
    case 5: return columns_few<F, 5>(x, w, bias, y, n0, n1);
    default: return columns_few<F, kFewRows>(x, w, bias, y, n0, n1);
  }
}

// M in [1, kFewRows]: the format picked once, outside every loop.
void fused_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  switch (w.format) {
    case WeightFormat::kBF16: return few_inputs<BF16>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_0: return few_inputs<Q4_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_1: return few_inputs<Q4_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ8_0: return few_inputs<Q8_0>(x, w, bias, y, M, n0, n1);
  }
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
  if (M <= kFewRows && fused_ok(w)) return fused_inputs(x, w, bias, y, M, n_begin, n_end);
#endif
  // One buffer per thread, kept between calls: kGroupRows rows of K floats (27 KB at K = 576).
  thread_local std::vector<float> rows;
  rows.resize(static_cast<size_t>(kGroupRows) * K);
  for (int n = n_begin; n < n_end; n += kGroupRows) {
    const int count = n + kGroupRows <= n_end ? kGroupRows : n_end - n;
    for (int i = 0; i < count; ++i) widen_row(w, n + i, rows.data() + static_cast<size_t>(i) * K);
    // The widened rows are columns [0, count) of a matrix starting at row n.
    linear_cached_rows(x, rows.data(), bias ? bias + n : nullptr, y + n, M, N, K, 0, count);
  }
}

int packed_thread_parts(const PackedMatrix &w, int rows, int threads) {
  const int64_t bytes = static_cast<int64_t>(rows) * static_cast<int64_t>(w.row_bytes);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, bytes / kMinBytesPerThread)));
}

void packed_linear_threaded(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int threads) {
  const int N = w.rows, parts = packed_thread_parts(w, N, threads);
  // Whole groups of 12 rows: the kernels' groups of 4 (one input row) and 12 (several).
  const int step = ((N + parts - 1) / parts + 11) / 12 * 12;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int begin = std::min(N, p * step), end = std::min(N, begin + step);
    if (begin < end) packed_linear_columns(x, w, bias, y, M, begin, end);
  });
}

void widen_rows(const PackedMatrix &w, int begin, int end, float *out) {
  for (int r = begin; r < end; ++r) widen_row(w, r, out + static_cast<size_t>(r - begin) * w.cols);
}

}  // namespace deepinfer
