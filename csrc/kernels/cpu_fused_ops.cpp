#include "cpu_fused_ops.h"

#include <cmath>
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_linear.h"
#include "packed_linear_avx512.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DEEPINFER_HAVE_AVX2 1
#endif

namespace deepinfer {

namespace {

#ifdef DEEPINFER_HAVE_AVX2
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// The 16-lane activations where the packed products run AVX-512 (one switch for all
// 512-bit code: DEEPINFER_DP_PACKED_AVX512).
bool cpu_has_avx512() { return packed_avx512_enabled(); }

__attribute__((target("avx2"))) float sum_of_squares_avx2(const float *x, int h) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0.f;
  for (float l : lanes) s += l;
  for (; i < h; ++i) s += x[i] * x[i];
  return s;
}

// The 8 values y[i, i + 8) (i a multiple of 8, so the 8 bits lie in one word), where
// y = x when there is no mask, else y[j] = allowed(j) ? x[j] : -inf by the token bitmask.
__attribute__((target("avx2"))) inline __m256 lanes_at(const float *x, const int32_t *mask, int i) {
  if (!mask) return _mm256_loadu_ps(x + i);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const uint32_t bits = (static_cast<uint32_t>(mask[i / 32]) >> (i % 32)) & 0xFFu;
  const __m256i on =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit), lane_bit);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(x + i), _mm256_castsi256_ps(on));
}

// One chain of the argmax: a per-lane running maximum of y (above) and its index.
struct ArgmaxLanes {
  __m256 best;
  __m256i index;
};

// Lane by lane, the larger of two chains' values, the smaller index where they are equal:
// what one chain over both chains' positions would hold.
__attribute__((target("avx2"))) inline ArgmaxLanes merge_lanes(ArgmaxLanes a, ArgmaxLanes b) {
  const __m256 gt = _mm256_cmp_ps(b.best, a.best, _CMP_GT_OQ);
  const __m256 eq = _mm256_cmp_ps(b.best, a.best, _CMP_EQ_OQ);
  const __m256 lower = _mm256_castsi256_ps(_mm256_cmpgt_epi32(a.index, b.index));
  const __m256 take_b = _mm256_or_ps(gt, _mm256_and_ps(eq, lower));
  return {_mm256_blendv_ps(a.best, b.best, take_b),
          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a.index), _mm256_castsi256_ps(b.index), take_b))};
}

// Folds the 8 values at i into a chain (strictly greater: the first index wins per lane).
__attribute__((target("avx2"))) inline void step_lanes(ArgmaxLanes &c, __m256 val, int i, __m256 &nan) {
  nan = _mm256_or_ps(nan, _mm256_cmp_ps(val, val, _CMP_UNORD_Q));
  const __m256 gt = _mm256_cmp_ps(val, c.best, _CMP_GT_OQ);
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  c.best = _mm256_blendv_ps(c.best, val, gt);
  c.index = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(c.index), _mm256_castsi256_ps(idx), gt));
}

// The maximum of y and its first index, rows holding a NaN left to the scalar loop. Four
// chains over interleaved groups of 8 (one chain's compare-and-blend latency bound the loop),
// merged by value and then index, so the answer is one chain's. One path for plain and
// masked rows, so ties break identically.
__attribute__((target("avx2"))) bool argmax_avx2(const float *x, const int32_t *mask, int v, int64_t *out) {
  if (v < 8 || v % 8) return false;
  ArgmaxLanes c[4];
  for (int j = 0; j < 4; ++j) c[j] = {_mm256_set1_ps(-INFINITY), _mm256_set1_epi32(INT32_MAX)};
  __m256 nan = _mm256_setzero_ps();
  int i = 0;
  for (; i + 32 <= v; i += 32)
    for (int j = 0; j < 4; ++j) step_lanes(c[j], lanes_at(x, mask, i + 8 * j), i + 8 * j, nan);
  for (; i < v; i += 8) step_lanes(c[0], lanes_at(x, mask, i), i, nan);
  if (_mm256_movemask_ps(nan)) return false;
  // A lane that never beat -inf keeps INT32_MAX; the 8 lanes below then pick index 0 for a
  // row of -inf, as the scalar loop does.
  const ArgmaxLanes m = merge_lanes(merge_lanes(c[0], c[1]), merge_lanes(c[2], c[3]));
  alignas(32) float vals[8];
  alignas(32) int32_t ids[8];
  _mm256_store_ps(vals, m.best);
  _mm256_store_si256(reinterpret_cast<__m256i *>(ids), m.index);
  int pick = 0;
  for (int l = 1; l < 8; ++l)
    if (vals[l] > vals[pick] || (vals[l] == vals[pick] && ids[l] < ids[pick])) pick = l;
  *out = ids[pick] == INT32_MAX ? 0 : ids[pick];
  return true;
}
#endif

float sum_of_squares(const float *x, int h) {
#ifdef DEEPINFER_HAVE_AVX2
  if (cpu_has_avx2()) return sum_of_squares_avx2(x, h);
#endif
  float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // the same partial sums as the AVX2 loop
  int i = 0;
  for (; i + 8 <= h; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += x[i + l] * x[i + l];
  float s = 0.f;
  for (float l : lanes) s += l;
  for (; i < h; ++i) s += x[i] * x[i];
  return s;
}

int64_t argmax_scalar(const float *x, int v) {
  int64_t best = 0;
  for (int i = 0; i < v; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

bool allowed(const int32_t *mask, int i) { return (static_cast<uint32_t>(mask[i / 32]) >> (i % 32)) & 1u; }

// argmax_scalar over y[i] = allowed(i) ? x[i] : -inf (what masking the logits to -inf and
// then taking torch.argmax gives: the first NaN among allowed tokens, else the first maximum).
int64_t masked_argmax_scalar(const float *x, const int32_t *mask, int v) {
  int64_t best = 0;
  float best_val = allowed(mask, 0) ? x[0] : -INFINITY;
  for (int i = 0; i < v; ++i) {
    const float y = allowed(mask, i) ? x[i] : -INFINITY;
    if (std::isnan(y)) return i;
    if (y > best_val) best = i, best_val = y;
  }
  return best;
}

// z of gelu_tanh_mul: z = x * (kGeluC1 + kGeluC3 * x * x), 2 sqrt(2/pi) and 0.044715 times it.
constexpr float kGeluC1 = 1.5957691216057308f, kGeluC3 = 0.0713548162726f;

// expf by Cephes' polynomial, the same operations in the scalar and the vector version (the
// file is built without contraction into fused multiply-adds), so both give the same bits.
inline float exp_scalar(float x) {
  x = std::min(std::max(x, -88.3762626647949f), 88.3762626647949f);
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  const float z = x * x;
  float y = 1.9875691500E-4f;
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

#ifdef DEEPINFER_HAVE_AVX2
__attribute__((target("avx2"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                            _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

#define FUSED_AVX512 __attribute__((target("avx512f")))

// exp8 on 16 lanes: the same operations, so the same bits.
FUSED_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                 _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
  x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), x), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// silu_mul_avx2 on 16 lanes (the activation of every MLP of a decode step: 1.9% of a 64-row
// bf16 step's CPU on 8 lanes).
FUSED_AVX512 int silu_mul_avx512(const float *g, const float *u, float *out, int n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(zero, gv));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  return i;
}

// rotary_rows' pass over one head on 16 lanes: the same operations as its scalar loop (a
// multiply and an add, never fused), so the same bits; returns how many of the half it did.
// (Left to the compiler, the file's baseline ISA made it 4 lanes wide.)
FUSED_AVX512 int rotate_half_avx512(float *v, const float *c, const float *s, int half) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  int i = 0;
  for (; i + 16 <= half; i += 16) {
    const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + half + i);
    const __m512 minus_b = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), _mm512_castps_si512(sign)));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + i)),
                                          _mm512_mul_ps(minus_b, _mm512_loadu_ps(s + i))));
    _mm512_storeu_ps(v + half + i, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + i)),
                                                 _mm512_mul_ps(a, _mm512_loadu_ps(s + half + i))));
  }
  return i;
}

FUSED_AVX512 int gelu_tanh_mul_avx512(const float *g, const float *u, float *out, int n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  const __m512 c1 = _mm512_set1_ps(kGeluC1), c3 = _mm512_set1_ps(kGeluC3);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 z = _mm512_mul_ps(x, _mm512_add_ps(c1, _mm512_mul_ps(c3, _mm512_mul_ps(x, x))));
    const __m512 e = exp16(_mm512_sub_ps(zero, z));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  return i;
}

__attribute__((target("avx2"))) int silu_mul_avx2(const float *g, const float *u, float *out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, gv));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  return i;
}

__attribute__((target("avx2"))) int gelu_tanh_mul_avx2(const float *g, const float *u, float *out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  const __m256 c1 = _mm256_set1_ps(kGeluC1), c3 = _mm256_set1_ps(kGeluC3);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 z = _mm256_mul_ps(x, _mm256_add_ps(c1, _mm256_mul_ps(c3, _mm256_mul_ps(x, x))));
    const __m256 e = exp8(_mm256_sub_ps(zero, z));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  return i;
}
#endif

}  // namespace

void rms_norm_rows(float *x, const float *residual, const float *weight, float eps, float *out, int h, int begin,
                   int end) {
  for (int t = begin; t < end; ++t) {
    float *row = x + static_cast<size_t>(t) * h;
    if (residual) {
      const float *r = residual + static_cast<size_t>(t) * h;
      for (int i = 0; i < h; ++i) row[i] = row[i] + r[i];
    }
    const float inv = 1.f / std::sqrt(sum_of_squares(row, h) / static_cast<float>(h) + eps);
    float *o = out + static_cast<size_t>(t) * h;
    for (int i = 0; i < h; ++i) o[i] = weight[i] * (row[i] * inv);
  }
}

void rms_norm_rows_rounded(float *x, const float *residual, const float *weight, float eps, uint16_t *out, int h,
                           int begin, int end) {
  thread_local std::vector<float> normed;  // one row at a time, in L1 when it is rounded
  normed.resize(static_cast<size_t>(h));
  for (int t = begin; t < end; ++t) {
    const size_t at = static_cast<size_t>(t) * h;
    rms_norm_rows(x + at, residual ? residual + at : nullptr, weight, eps, normed.data(), h, 0, 1);
    bf16_round_rows(normed.data(), 1, h, out + at);
  }
}

void rotary_rows(float *x, int64_t row_stride, int heads, int d, const float *cos, const float *sin, int begin,
                 int end) {
  const int half = d / 2;
  for (int t = begin; t < end; ++t) {
    const float *c = cos + static_cast<size_t>(t) * d, *s = sin + static_cast<size_t>(t) * d;
    for (int hd = 0; hd < heads; ++hd) {
      float *v = x + t * row_stride + static_cast<int64_t>(hd) * d;
      int i = 0;
#ifdef DEEPINFER_HAVE_AVX2
      if (cpu_has_avx512()) i = rotate_half_avx512(v, c, s, half);
#endif
      for (; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + (-b) * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

void argmax_rows(const float *x, int v, int64_t *out, int begin, int end) {
  for (int t = begin; t < end; ++t) {
    const float *row = x + static_cast<size_t>(t) * v;
#ifdef DEEPINFER_HAVE_AVX2
    if (cpu_has_avx2() && argmax_avx2(row, nullptr, v, out + t)) continue;
#endif
    out[t] = argmax_scalar(row, v);
  }
}

}  // namespace deepinfer

namespace deepinfer {

void masked_argmax_rows(const float *x, int v, const int32_t *const *masks, int64_t *out, int begin, int end) {
  for (int t = begin; t < end; ++t) {
    const int32_t *mask = masks[t];
    if (mask == nullptr) {
      argmax_rows(x, v, out, t, t + 1);
      continue;
    }
    const float *row = x + static_cast<size_t>(t) * v;
#ifdef DEEPINFER_HAVE_AVX2
    if (cpu_has_avx2() && argmax_avx2(row, mask, v, out + t)) continue;
#endif
    out[t] = masked_argmax_scalar(row, mask, v);
  }
}

void silu_mul(const float *g, const float *u, float *out, int n) {
  int i = 0;
#ifdef DEEPINFER_HAVE_AVX2
  if (cpu_has_avx512()) i = silu_mul_avx512(g, u, out, n);
  if (cpu_has_avx2()) i += silu_mul_avx2(g + i, u + i, out + i, n - i);
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.0f + exp_scalar(-g[i])) * u[i];
}

void gelu_tanh_mul(const float *g, const float *u, float *out, int n) {
  int i = 0;
#ifdef DEEPINFER_HAVE_AVX2
  if (cpu_has_avx512()) i = gelu_tanh_mul_avx512(g, u, out, n);
  if (cpu_has_avx2()) i += gelu_tanh_mul_avx2(g + i, u + i, out + i, n - i);
#endif
  for (; i < n; ++i) {
    const float x = g[i], z = x * (kGeluC1 + kGeluC3 * (x * x));
    out[i] = x / (1.0f + exp_scalar(0.0f - z)) * u[i];
  }
}

}  // namespace deepinfer
