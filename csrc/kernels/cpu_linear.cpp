#include "cpu_linear.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "packed_linear_avx512.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DEEPINFER_HAVE_AVX2 1
#endif

namespace deepinfer {

namespace {
// How far ahead of the tile in work the next weight rows are prefetched (two tiles): far
// enough for DRAM latency at this machine's ~10 GB/s per core, near enough to stay in L1.
constexpr int kPrefetchRows = 6;

// Portable path (no AVX2, or K not a multiple of 8): one plain dot product per output.
void columns_scalar(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int n0,
                    int n1) {
  for (int n = n0; n < n1; ++n) {
    const float *wn = w + static_cast<size_t>(n) * K;
    for (int m = 0; m < M; ++m) {
      const float *xm = x + static_cast<size_t>(m) * K;
      float sum = 0.f;
      for (int k = 0; k < K; ++k) sum += wn[k] * xm[k];
      y[static_cast<size_t>(m) * N + n] = bias ? sum + bias[n] : sum;
    }
  }
}

#ifdef DEEPINFER_HAVE_AVX2
__attribute__((target("avx2,fma"), always_inline)) inline float sum8(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Which cache lines of the next weight rows a pass over K prefetches: every `stride`-th one
// from `phase` on. The passes of one tile row (one per 4 input rows) split the lines among
// them, so the loads stay spread over the whole computation instead of bursting in the
// first pass beyond what the core can have in flight and then leaving memory idle.
struct Prefetch {
  const float *next;  // nullptr: nothing to prefetch
  int phase, stride;
};

// NB weight rows against MB input rows over the whole of K: NB x MB accumulators of 8 lanes,
// each weight vector loaded once and used MB times, each input vector used NB times.
template <int NB, int MB>
__attribute__((target("avx2,fma"), always_inline)) inline void tile(const float *w, const float *x,
                                                                    const float *bias, float *y, int N, int K,
                                                                    Prefetch pf) {
  __m256 acc[NB][MB];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm256_setzero_ps();
  int skip = pf.phase;  // lines to pass over before this pass's next prefetch
  for (int k = 0; k < K; k += 8) {
    if (pf.next && k % 16 == 0 && skip-- == 0) {
      skip = pf.stride - 1;
      for (int i = 0; i < NB; ++i)
        _mm_prefetch(reinterpret_cast<const char *>(pf.next + static_cast<size_t>(i) * K + k), _MM_HINT_T0);
    }
    __m256 wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = _mm256_loadu_ps(w + static_cast<size_t>(i) * K + k);
    for (int j = 0; j < MB; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<size_t>(j) * K + k);
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < MB; ++j) {
      const float s = sum8(acc[i][j]);
      y[static_cast<size_t>(j) * N + i] = bias ? s + bias[i] : s;
    }
}

// NB weight rows (already in cache after the first tile) against all M input rows.
template <int NB>
__attribute__((target("avx2,fma"))) void rows_against_inputs(const float *w, const float *x, const float *bias,
                                                             float *y, int M, int N, int K, const float *next) {
  const int passes = (M + 3) / 4;
  int m = 0, pass = 0;
  for (; m + 4 <= M; m += 4, ++pass)
    tile<NB, 4>(w, x + static_cast<size_t>(m) * K, bias, y + static_cast<size_t>(m) * N, N, K,
                Prefetch{next, pass, passes});
  const float *xm = x + static_cast<size_t>(m) * K;
  float *ym = y + static_cast<size_t>(m) * N;
  const Prefetch last{next, pass, passes};
  switch (M - m) {
    case 3: tile<NB, 3>(w, xm, bias, ym, N, K, last); break;
    case 2: tile<NB, 2>(w, xm, bias, ym, N, K, last); break;
    case 1: tile<NB, 1>(w, xm, bias, ym, N, K, last); break;
    default: break;
  }
}

__attribute__((target("avx2,fma"))) void columns_avx2(const float *x, const float *w, const float *bias, float *y,
                                                      int M, int N, int K, int n0, int n1) {
  int n = n0;
  for (; n + 3 <= n1; n += 3) {
    const float *next = n + 3 + kPrefetchRows <= n1 ? w + static_cast<size_t>(n + kPrefetchRows) * K : nullptr;
    rows_against_inputs<3>(w + static_cast<size_t>(n) * K, x, bias ? bias + n : nullptr, y + n, M, N, K, next);
  }
  for (; n < n1; ++n)
    rows_against_inputs<1>(w + static_cast<size_t>(n) * K, x, bias ? bias + n : nullptr, y + n, M, N, K, nullptr);
}

// Weight rows already in L1 (the packed kernels' freshly widened rows): each group of 4 input
// rows is used against all of them before moving on, so the inputs stream from L2 once per
// call instead of once per 3 rows; nothing to prefetch. Same tiles, so the same floats.
__attribute__((target("avx2,fma"))) void cached_rows_avx2(const float *x, const float *w, const float *bias,
                                                          float *y, int M, int N, int K, int n0, int n1) {
  const Prefetch none{nullptr, 0, 1};
  int m = 0;
  for (; m + 4 <= M; m += 4) {
    const float *xm = x + static_cast<size_t>(m) * K;
    float *ym = y + static_cast<size_t>(m) * N;
    int n = n0;
    for (; n + 3 <= n1; n += 3) tile<3, 4>(w + static_cast<size_t>(n) * K, xm, bias ? bias + n : nullptr, ym + n, N, K, none);
    for (; n < n1; ++n) tile<1, 4>(w + static_cast<size_t>(n) * K, xm, bias ? bias + n : nullptr, ym + n, N, K, none);
  }
  if (m == M) return;
  const float *xm = x + static_cast<size_t>(m) * K;
  float *ym = y + static_cast<size_t>(m) * N;
  for (int n = n0; n < n1; ++n) {
    const float *wn = w + static_cast<size_t>(n) * K, *bn = bias ? bias + n : nullptr;
    switch (M - m) {
      case 3: tile<1, 3>(wn, xm, bn, ym + n, N, K, none); break;
      case 2: tile<1, 2>(wn, xm, bn, ym + n, N, K, none); break;
      default: tile<1, 1>(wn, xm, bn, ym + n, N, K, none); break;
    }
  }
}

bool use_avx2(int K) {
  static const bool cpu_has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return cpu_has && K % 8 == 0;
}
#endif

}  // namespace

int input_row_block(int K) {
  constexpr int64_t kBlockBytes = 1 << 20;
  return static_cast<int>(std::max<int64_t>(8, kBlockBytes / (4 * static_cast<int64_t>(std::max(K, 1))) / 8 * 8));
}

void linear_columns(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int n_begin,
                    int n_end) {
  const int block = input_row_block(K);
  if (M > block) {
    for (int m = 0; m < M; m += block)
      linear_columns(x + static_cast<size_t>(m) * K, w, bias, y + static_cast<size_t>(m) * N, std::min(block, M - m),
                     N, K, n_begin, n_end);
    return;
  }
#ifdef DEEPINFER_HAVE_AVX2
  if (use_avx2(K)) {
    // At up to 8 rows the weights stream from memory and the AVX2 tiles keep up with them.
    if (M > 8 && packed_avx512_enabled()) return linear_many_rows_avx512(x, w, bias, y, M, N, K, n_begin, n_end);
    return columns_avx2(x, w, bias, y, M, N, K, n_begin, n_end);
  }
#endif
  columns_scalar(x, w, bias, y, M, N, K, n_begin, n_end);
}

void linear_cached_rows(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                        int n_begin, int n_end) {
#ifdef DEEPINFER_HAVE_AVX2
  if (use_avx2(K)) return cached_rows_avx2(x, w, bias, y, M, N, K, n_begin, n_end);
#endif
  columns_scalar(x, w, bias, y, M, N, K, n_begin, n_end);
}

void linear_threaded(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int threads) {
  // Weights per thread below which splitting is not worth waking a worker.
  constexpr int64_t kMinWeightsPerThread = 1 << 16;
  const int64_t weights = static_cast<int64_t>(N) * K;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, weights / kMinWeightsPerThread)));
  // Column ranges in multiples of 3, the kernel's tile height.
  const int step = ((N + parts - 1) / parts + 2) / 3 * 3;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int begin = std::min(N, p * step), end = std::min(N, begin + step);
    if (begin < end) linear_columns(x, w, bias, y, M, N, K, begin, end);
  });
}

}  // namespace deepinfer
