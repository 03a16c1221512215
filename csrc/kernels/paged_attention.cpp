#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace deepinfer {

namespace {

// Where a sequence's position t sits in one layer's cache, for KV head 0.
struct PagedRows {
  const float *cache;
  const int32_t *blocks;
  int block_size;
  size_t row;  // floats per cached position: num_kv_heads * head_dim
  const float *at(int t) const {
    return cache + (static_cast<size_t>(blocks[t / block_size]) * block_size + t % block_size) * row;
  }
};

// Softmax of `n` scores in place.
void softmax(float *sc, int n) {
  float mx = *std::max_element(sc, sc + n);
  float denom = 0.f;
  for (int t = 0; t < n; ++t) denom += (sc[t] = std::exp(sc[t] - mx));
  const float inv = 1.f / denom;
  for (int t = 0; t < n; ++t) sc[t] *= inv;
}

// Portable path, any head size: one query head over its KV head's positions.
void attend_head_scalar(const float *q, const PagedRows &k, const PagedRows &v, int seq_len, int dim, float scale,
                        float *scores, float *out) {
  for (int t = 0; t < seq_len; ++t) {
    const float *kt = k.at(t);
    float sum = 0.f;
    for (int i = 0; i < dim; ++i) sum += q[i] * kt[i];
    scores[t] = sum * scale;
  }
  softmax(scores, seq_len);
  std::fill(out, out + dim, 0.f);
  for (int t = 0; t < seq_len; ++t) {
    const float *vt = v.at(t);
    for (int i = 0; i < dim; ++i) out[i] += scores[t] * vt[i];
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DEEPINFER_HAVE_AVX2 1

// AVX2 path for head sizes 64 and 128: the query head and the output row live in registers
// (D / 8 of them) while the positions stream past, one block at a time.
template <int D>
__attribute__((target("avx2,fma"))) void attend_head_avx2(const float *q, const PagedRows &k, const PagedRows &v,
                                                          int seq_len, float scale, float *scores, float *out) {
  constexpr int R = D / 8;
  __m256 qr[R];
  for (int r = 0; r < R; ++r) qr[r] = _mm256_loadu_ps(q + 8 * r);
  for (int t0 = 0; t0 < seq_len; t0 += k.block_size) {
    const int n = std::min(k.block_size, seq_len - t0);
    const float *kt = k.at(t0);
    for (int i = 0; i < n; ++i, kt += k.row) {
      __m256 a0 = _mm256_mul_ps(qr[0], _mm256_loadu_ps(kt));
      __m256 a1 = _mm256_mul_ps(qr[1], _mm256_loadu_ps(kt + 8));
      for (int r = 2; r < R; r += 2) {
        a0 = _mm256_fmadd_ps(qr[r], _mm256_loadu_ps(kt + 8 * r), a0);
        a1 = _mm256_fmadd_ps(qr[r + 1], _mm256_loadu_ps(kt + 8 * r + 8), a1);
      }
      __m256 a = _mm256_add_ps(a0, a1);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      scores[t0 + i] = _mm_cvtss_f32(h) * scale;
    }
  }
  softmax(scores, seq_len);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int t0 = 0; t0 < seq_len; t0 += v.block_size) {
    const int n = std::min(v.block_size, seq_len - t0);
    const float *vt = v.at(t0);
    for (int i = 0; i < n; ++i, vt += v.row) {
      const __m256 w = _mm256_set1_ps(scores[t0 + i]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * r), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#endif

using HeadFn = void (*)(const float *, const PagedRows &, const PagedRows &, int, float, float *, float *);

HeadFn pick_head_fn(int head_dim) {
#ifdef DEEPINFER_HAVE_AVX2
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    if (head_dim == 64) return &attend_head_avx2<64>;
    if (head_dim == 128) return &attend_head_avx2<128>;
  }
#endif
  (void)head_dim;
  return nullptr;
}

}  // namespace

void paged_attention(const PagedAttentionShape &s, const float *q, const float *k_cache, const float *v_cache,
                     const int32_t *block_tables, const int32_t *query_rows, const int32_t *context_lens,
                     float scale, float *out, int begin, int end) {
  const int group = s.num_heads / s.num_kv_heads;
  const size_t D = s.head_dim;
  const size_t row = static_cast<size_t>(s.num_kv_heads) * D;
  const HeadFn fast = pick_head_fn(s.head_dim);
  std::vector<float> scores;
  for (int i = begin; i < end; ++i) {
    const int32_t *blocks = block_tables + static_cast<size_t>(query_rows ? query_rows[i] : i) * s.max_blocks;
    const int len = context_lens[i];
    scores.resize(len);
    for (int h = 0; h < s.num_heads; ++h) {
      const size_t kv = static_cast<size_t>(h / group) * D;  // HF's repeat_kv: head h reads KV head h / group
      PagedRows k{k_cache + kv, blocks, s.block_size, row}, v{v_cache + kv, blocks, s.block_size, row};
      const float *qh = q + (static_cast<size_t>(i) * s.num_heads + h) * D;
      float *oh = out + (static_cast<size_t>(i) * s.num_heads + h) * D;
      if (fast)
        fast(qh, k, v, len, scale, scores.data(), oh);
      else
        attend_head_scalar(qh, k, v, len, s.head_dim, scale, scores.data(), oh);
    }
  }
}

}  // namespace deepinfer
