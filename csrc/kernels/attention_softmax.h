// The softmax of paged_attention.cpp's vector paths: one query head's scores over its context,
// in place. Two forms with the same floats, 8 lanes (AVX2) or 16 (AVX-512): the exps and the
// products by the reciprocal are lane by lane, and the denominator is summed 8 lanes at a
// time in the same order by both, so a query's probabilities do not depend on the form.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "paged_attention_heads.h"

#define DEEPINFER_SOFTMAX_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline
#define DEEPINFER_SOFTMAX_AVX512 __attribute__((target("avx512f,avx512dq,avx2,fma"), always_inline)) inline

namespace deepinfer {
namespace attention_softmax {

using attention_heads::hsum;

// e^x for x <= 0 on 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial;
// within 2 ulp of libm's): the softmax of a long context takes as many exps as positions x
// heads, and one libm call per score cost about as much as reading the cache.
DEEPINFER_SOFTMAX_AVX2 __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below that the result is ~0 either way
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// The largest of n scores, 8 lanes at a time (a max is exact in any order; the scalar
// std::max_element took about a fifth of a long prefill's attention).
DEEPINFER_SOFTMAX_AVX2 float max_of(const float *sc, int n) {
  float mx = sc[0];
  int t = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(sc);
    for (t = 8; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  for (; t < n; ++t) mx = std::max(mx, sc[t]);
  return mx;
}

// Softmax of n scores in place, 8 lanes at a time.
inline __attribute__((target("avx2,fma"))) void softmax_avx2(float *sc, int n) {
  const float mx = max_of(sc, n);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
    _mm256_storeu_ps(sc + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float denom = hsum(sum);
  for (; t < n; ++t) denom += (sc[t] = std::exp(sc[t] - mx));
  const float inv = 1.f / denom;
  for (t = 0; t < n; ++t) sc[t] *= inv;
}

// exp_nonpositive on 16 lanes: the same operations lane by lane.
DEEPINFER_SOFTMAX_AVX512 __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2));
}

// The largest of n >= 16 scores, 4 x 16 lanes at a time (a max is exact in any order; one
// chain of maxes waits on each one's latency).
DEEPINFER_SOFTMAX_AVX512 float max_of16(const float *sc, int n) {
  __m512 m[4];
  for (int i = 0; i < 4; ++i) m[i] = _mm512_loadu_ps(sc);
  int t = 0;
  for (; t + 64 <= n; t += 64)
    for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(m[i], _mm512_loadu_ps(sc + t + 16 * i));
  for (; t + 16 <= n; t += 16) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(sc + t));
  float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
  for (; t < n; ++t) mx = std::max(mx, sc[t]);
  return mx;
}

// softmax_avx2's floats for H rows of n scores each, 16 lanes at a time: each 16 exps of a row
// go into its 8-lane sum as their two halves, low then high, which is softmax_avx2's order.
// The rows' sums are H chains that the core runs side by side (one row's chain of adds, not
// its exps, would bound the pass).
template <int H>
DEEPINFER_SOFTMAX_AVX512 void softmax_rows16(float *const *rows, int n) {
  float mx[H], denom[H];
  __m512 m16[H];
  __m256 sum[H];
  for (int h = 0; h < H; ++h) {
    mx[h] = n >= 16 ? max_of16(rows[h], n) : max_of(rows[h], n);
    m16[h] = _mm512_set1_ps(mx[h]);
    sum[h] = _mm256_setzero_ps();
  }
  int t = 0;
  for (; t + 16 <= n; t += 16)
    for (int h = 0; h < H; ++h) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(rows[h] + t), m16[h]));
      _mm512_storeu_ps(rows[h] + t, e);
      sum[h] = _mm256_add_ps(sum[h], _mm512_castps512_ps256(e));
      sum[h] = _mm256_add_ps(sum[h], _mm512_extractf32x8_ps(e, 1));
    }
  for (int h = 0; h < H; ++h) {
    float *sc = rows[h];
    int u = t;
    if (u + 8 <= n) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + u), _mm256_set1_ps(mx[h])));
      _mm256_storeu_ps(sc + u, e);
      sum[h] = _mm256_add_ps(sum[h], e);
      u += 8;
    }
    denom[h] = hsum(sum[h]);
    for (; u < n; ++u) denom[h] += (sc[u] = std::exp(sc[u] - mx[h]));
  }
  for (int h = 0; h < H; ++h) {
    const float inv = 1.f / denom[h];
    const __m512 inv16 = _mm512_set1_ps(inv);
    float *sc = rows[h];
    int u = 0;
    for (; u + 16 <= n; u += 16) _mm512_storeu_ps(sc + u, _mm512_mul_ps(_mm512_loadu_ps(sc + u), inv16));
    for (; u < n; ++u) sc[u] *= inv;
  }
}

// Softmax of `count` rows of n scores each, `stride` floats apart, in place: three at a time.
inline __attribute__((target("avx512f,avx512dq,avx2,fma"))) void softmax_avx512(float *first, size_t stride,
                                                                                int count, int n) {
  int h = 0;
  for (; h + 3 <= count; h += 3) {
    float *const rows[3] = {first + h * stride, first + (h + 1) * stride, first + (h + 2) * stride};
    softmax_rows16<3>(rows, n);
  }
  for (; h < count; ++h) {
    float *const row = first + h * stride;
    softmax_rows16<1>(&row, n);
  }
}

}  // namespace attention_softmax
}  // namespace deepinfer
#endif
