// The per-block work of paged_attention.cpp's AVX2 path: the scores of a query's heads against
// a run of cached K rows, and their probabilities times the V rows. Two forms with the same
// floats: HeadsAvx2 takes one query head at a time; HeadsAvx512 (a CPU with AVX-512) takes up
// to three query heads of one KV head together, so each K and V vector is loaded once for all
// of them (one query head alone issues a load per multiply-add, and the loads, not the
// multiply-adds, bound a long prefill's attention). Every score is the same chain of
// multiply-adds over the head's dimensions and the same horizontal tree, and every output
// element the same chain over positions, so a query's floats do not depend on the form.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#define DEEPINFER_ATTN_AVX2 __attribute__((target("avx2,fma"), always_inline)) inline
#define DEEPINFER_ATTN_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"), always_inline)) inline

namespace deepinfer {
namespace attention_heads {

// Eight cache elements from p on, as fp32.
DEEPINFER_ATTN_AVX2 __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
DEEPINFER_ATTN_AVX2 __m256 load8(const uint16_t *p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
DEEPINFER_ATTN_AVX512 __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
DEEPINFER_ATTN_AVX512 __m512 load16(const uint16_t *p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

DEEPINFER_ATTN_AVX2 float hsum(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Lane p of the result = the sum of a[p]'s lanes.
DEEPINFER_ATTN_AVX2 __m256 hsum8x8(const __m256 a[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The scores of Q query heads qh[0..Q) against n positions from kt on, into sh[0..Q) (8
// positions at a time end in one tree of horizontal adds, the rest one by one).
template <int D, class T, int Q>
DEEPINFER_ATTN_AVX2 void scores(const float *const *qh, const T *kt, size_t row, int n, float scale,
                                float *const *sh) {
  constexpr int R = D / 8;
  const __m256 sv = _mm256_set1_ps(scale);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 acc[Q][8];
    for (int q = 0; q < Q; ++q)
      for (int p = 0; p < 8; ++p) acc[q][p] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256 qv[Q];
      for (int q = 0; q < Q; ++q) qv[q] = _mm256_loadu_ps(qh[q] + 8 * r);
      for (int p = 0; p < 8; ++p) {
        const __m256 kv = load8(kt + (i + p) * row + 8 * r);
        for (int q = 0; q < Q; ++q) acc[q][p] = _mm256_fmadd_ps(qv[q], kv, acc[q][p]);
      }
    }
    for (int q = 0; q < Q; ++q) _mm256_storeu_ps(sh[q] + i, _mm256_mul_ps(hsum8x8(acc[q]), sv));
  }
  for (; i < n; ++i) {
    for (int q = 0; q < Q; ++q) {
      __m256 acc = _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh[q] + 8 * r), load8(kt + i * row + 8 * r), acc);
      sh[q][i] = hsum(acc) * scale;
    }
  }
}

// out[q][0, D) += the n probabilities ph[q] times the V rows from vt on, for one query head.
// Past 128 dimensions the accumulators would not fit the 16 registers: slices of 64, each
// element's chain over the positions unchanged.
template <int D, class T>
DEEPINFER_ATTN_AVX2 void values1(const float *ph, const T *vt, size_t row, int n, float *out) {
  if constexpr (D > 128) {
    for (int s = 0; s < D; s += 64) values1<64, T>(ph, vt + s, row, n, out + s);
    return;
  }
  constexpr int R = D / 8;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_loadu_ps(out + 8 * r);
  for (int i = 0; i < n; ++i, vt += row) {
    const __m256 w = _mm256_set1_ps(ph[i]);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, load8(vt + 8 * r), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// The same for Q query heads of one KV head, 16 elements a register: each element's chain is
// values1's.
template <int D, class T, int Q>
DEEPINFER_ATTN_AVX512 void values(const float *const *ph, const T *vt, size_t row, int n, float *const *out) {
  constexpr int R = D / 16;
  __m512 acc[Q][R];
  for (int q = 0; q < Q; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_loadu_ps(out[q] + 16 * r);
  for (int i = 0; i < n; ++i, vt += row) {
    __m512 v[R];
    for (int r = 0; r < R; ++r) {
      v[r] = load16(vt + 16 * r);
      // Held in a register for all Q heads: left to itself the compiler folds the load into
      // each head's multiply-add, Q loads a vector, and on a core that loads one 512-bit
      // vector a cycle the loads then outnumber the multiply-adds.
      asm("" : "+v"(v[r]));
    }
    for (int q = 0; q < Q; ++q) {
      const __m512 w = _mm512_set1_ps(ph[q][i]);
      for (int r = 0; r < R; ++r) acc[q][r] = _mm512_fmadd_ps(w, v[r], acc[q][r]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[q] + 16 * r, acc[q][r]);
}

// The next block's cached rows, asked for ahead of use a share at a time: `rows` positions
// `stride` bytes apart from `at` on, `lines` cache lines of each; `per` lines a share.
struct NextRows {
  const char *at = nullptr;  // the next line's row; nullptr: nothing (left) to ask for
  size_t stride = 0;
  int rows = 0, lines = 0, per = 0, line = 0;
};

// Asks for the next `shares` shares of nx's lines (one a query head), into L1. A block's
// lines asked for all at once (192 for SmolLM2's K) overlapped nothing with the arithmetic
// of a decode token at long contexts (a layer took longer than reading plus computing one
// after the other); a share before each query head's pass keeps the reading going while the
// heads compute (benchmarks/decode_attention.py).
inline void prefetch_share(NextRows *nx, int shares = 1) {  // (SSE: any x86-64)
  if (nx == nullptr) return;
  // In locals: the compiler keeps a struct field that a prefetch loop updates in memory, and
  // the store and reload of each line's counter cost more than the decode scores beside them.
  const char *at = nx->at;
  int line = nx->line, rows = nx->rows;
  for (int l = nx->per * shares; l > 0 && rows > 0; --l) {
    _mm_prefetch(at + 64 * line, _MM_HINT_T0);
    if (++line == nx->lines) line = 0, at += nx->stride, --rows;
  }
  nx->at = at, nx->line = line, nx->rows = rows;
}

// One query's `heads` query heads (head h reads KV head h / group), their q at q + h * D,
// score rows at sc + h * stride, outputs at out + h * D; `next`: what to prefetch meanwhile.
struct QueryHeads {
  const float *q;
  float *sc, *out;
  size_t stride;
  int heads, group;
  NextRows *next;  // nullptr: no prefetching here
};

struct HeadsAvx2 {
  template <int D, class T>
  __attribute__((target("avx2,fma"))) static void block_scores(const QueryHeads &h, const T *kt, size_t row, int n,
                                                               float scale) {
    for (int i = 0; i < h.heads; ++i) {
      prefetch_share(h.next);
      const float *qh = h.q + i * D;
      float *sh = h.sc + i * h.stride;
      scores<D, T, 1>(&qh, kt + i / h.group * D, row, n, scale, &sh);
    }
  }
  template <int D, class T>
  __attribute__((target("avx2,fma"))) static void block_values(const QueryHeads &h, const T *vt, size_t row, int n) {
    for (int i = 0; i < h.heads; ++i) {
      prefetch_share(h.next);
      values1<D, T>(h.sc + i * h.stride, vt + i / h.group * D, row, n, h.out + i * D);
    }
  }
};

struct HeadsAvx512 {
  // Query heads [first, first + Q) of one KV head.
  template <int D, class T, int Q>
  DEEPINFER_ATTN_AVX512 static void tile_scores(const QueryHeads &h, int first, const T *kt, size_t row, int n,
                                                float scale) {
    const float *qh[Q];
    float *sh[Q];
    for (int q = 0; q < Q; ++q) qh[q] = h.q + (first + q) * D, sh[q] = h.sc + (first + q) * h.stride;
    scores<D, T, Q>(qh, kt + first / h.group * D, row, n, scale, sh);
  }
  // Past 128 dimensions (Gemma 3's 256) the V rows go in slices of 64, as values1's do, so
  // that the accumulators and a slice's V vectors fit the 32 registers.
  template <int D, class T, int Q>
  DEEPINFER_ATTN_AVX512 static void tile_values(const QueryHeads &h, int first, const T *vt, size_t row, int n) {
    constexpr int kSlice = D > 128 ? 64 : D;
    const float *ph[Q];
    float *out[Q];
    for (int s = 0; s < D; s += kSlice) {
      for (int q = 0; q < Q; ++q) ph[q] = h.sc + (first + q) * h.stride, out[q] = h.out + (first + q) * D + s;
      values<kSlice, T, Q>(ph, vt + first / h.group * D + s, row, n, out);
    }
  }
  // Each KV head's query heads in tiles of 3 (2 at head size 128: the accumulators and the V
  // row within the 32 registers), the rest one or two at a time.
  template <int D, class T>
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) static void block_scores(
      const QueryHeads &h, const T *kt, size_t row, int n, float scale) {
    for (int g = 0; g < h.heads; g += h.group) {
      int i = g;
      for (; i + 3 <= g + h.group; i += 3) prefetch_share(h.next, 3), tile_scores<D, T, 3>(h, i, kt, row, n, scale);
      for (; i < g + h.group; ++i) prefetch_share(h.next), tile_scores<D, T, 1>(h, i, kt, row, n, scale);
    }
  }
  template <int D, class T>
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) static void block_values(
      const QueryHeads &h, const T *vt, size_t row, int n) {
    constexpr int kTile = D <= 64 || D > 128 ? 3 : 2;  // (past 128: slices of 64)
    for (int g = 0; g < h.heads; g += h.group) {
      int i = g;
      for (; i + kTile <= g + h.group; i += kTile)
        prefetch_share(h.next, kTile), tile_values<D, T, kTile>(h, i, vt, row, n);
      for (; i < g + h.group; ++i) prefetch_share(h.next), tile_values<D, T, 1>(h, i, vt, row, n);
    }
  }
};

}  // namespace attention_heads
}  // namespace deepinfer
#endif
