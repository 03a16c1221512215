// The per-block work of paged_attention.cpp's AVX2 path: the scores of a query's heads against
// a run of cached K rows, and their probabilities times the V rows. Two forms with the same
// floats: HeadsAvx2 takes one query head at a time; HeadsAvx512 (a CPU with AVX-512) takes up
// to three query heads of one KV head together, so each K and V vector is loaded once for all
// of them (one query head alone issues a load per multiply-add, and the loads, not the
// multiply-adds, bound a long prefill's attention), and for a span's queries takes two queries
// at once, one in each half of a 512-bit register. Every score is the same chain of
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
// values1's. The positions may lie in `runs` blocks of n positions each (vts[b] block b's
// rows, ph contiguous over all): the outputs stay in registers from one block to the next.
template <int D, class T, int Q>
DEEPINFER_ATTN_AVX512 void values(const float *const *ph, const T *const *vts, int runs, size_t row, int n,
                                  float *const *out) {
  constexpr int R = D / 16;
  __m512 acc[Q][R];
  for (int q = 0; q < Q; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = _mm512_loadu_ps(out[q] + 16 * r);
  for (int i = 0, b = 0; b < runs; ++b)
    for (const T *vt = vts[b], *end = vts[b] + n * row; vt != end; ++i, vt += row) {
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

// _mm256_hadd_ps on each 256-bit half: per 128-bit lane [x0+x1, x2+x3, y0+y1, y2+y3].
DEEPINFER_ATTN_AVX512 __m512 hadd512(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}

// hsum8x8 on each 256-bit half, the same tree: lanes [0, 8) of the result from the low
// halves of a[0..8), lanes [8, 16) from the high halves.
DEEPINFER_ATTN_AVX512 __m512 hsum8x8_halves(const __m512 a[8]) {
  const __m512 u0 = hadd512(hadd512(a[0], a[1]), hadd512(a[2], a[3]));
  const __m512 u1 = hadd512(hadd512(a[4], a[5]), hadd512(a[6], a[7]));
  // [low 0-3, high 0-3, low 4-7, high 4-7], then into order.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
}

// scores<D, float, Q> for two queries at once (n a multiple of 8): query a's heads in the low
// half of each register, b's in the high half, and each 8-dimension slice of a K row loaded
// once, broadcast into both halves. qp[q] holds head q's D / 8 slices so paired, 16 floats
// each (a's slice, then b's). Every lane runs scores' chain and every score its tree, so
// the floats are scores' own, at twice the multiply-adds an instruction.
template <int D, int Q>
DEEPINFER_ATTN_AVX512 void pair_scores(const float *const *qp, const float *kt, size_t row, int n, float scale,
                                       float *const *sa, float *const *sb) {
  constexpr int R = D / 8;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < n; i += 8) {
    __m512 acc[Q][8];
    for (int q = 0; q < Q; ++q)
      for (int p = 0; p < 8; ++p) acc[q][p] = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m512 qr[Q];
      for (int q = 0; q < Q; ++q) {
        qr[q] = _mm512_loadu_ps(qp[q] + 16 * r);
        asm("" : "+v"(qr[q]));  // in a register for all 8 positions (see values)
      }
      for (int p = 0; p < 8; ++p) {
        const __m512 kv = _mm512_broadcast_f32x8(_mm256_loadu_ps(kt + (i + p) * row + 8 * r));
        for (int q = 0; q < Q; ++q) acc[q][p] = _mm512_fmadd_ps(qr[q], kv, acc[q][p]);
      }
    }
    for (int q = 0; q < Q; ++q) {
      const __m512 s = _mm512_mul_ps(hsum8x8_halves(acc[q]), sv);
      _mm256_storeu_ps(sa[q] + i, _mm512_castps512_ps256(s));
      _mm256_storeu_ps(sb[q] + i, _mm512_extractf32x8_ps(s, 1));
    }
  }
}

// Two queries' `heads` heads of D dimensions as pair_scores reads them, into dst (heads x 2D).
DEEPINFER_ATTN_AVX2 void pair_queries(const float *qa, const float *qb, int heads, int dim, float *dst) {
  for (int e = 0; e < heads * dim; e += 8, dst += 16) {
    _mm256_storeu_ps(dst, _mm256_loadu_ps(qa + e));
    _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(qb + e));
  }
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
  static constexpr bool kPairs = false;  // no pair_scores / pair_values
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
  static constexpr bool kPairs = true;
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
      const T *at = vt + first / h.group * D + s;
      values<kSlice, T, Q>(ph, &at, 1, row, n, out);
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
  // Two queries' heads over the same n positions (a multiple of 8) of fp32 rows, their query
  // vectors paired by pair_queries into qp: each head's scores are block_scores' floats for it.
  template <int D>
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) static void pair_scores(
      const QueryHeads &a, const QueryHeads &b, const float *qp, const float *kt, size_t row, int n, float scale) {
    for (int g = 0; g < a.heads; g += a.group) {
      int i = g;
      for (; i + 3 <= g + a.group; i += 3) pair_tile_scores<D, 3>(a, b, qp, i, kt, row, n, scale);
      for (; i < g + a.group; ++i) pair_tile_scores<D, 1>(a, b, qp, i, kt, row, n, scale);
    }
  }
  // Two queries' heads times the same n V rows of each of `runs` blocks (vts[r] block r's, up
  // to kMaxRuns): 2 x 3 heads a tile share each V vector (2 x 1 at head size 128, within the
  // registers); each output element's chain is values1's.
  static constexpr int kMaxRuns = 4;
  template <int D>
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))) static void pair_values(
      const QueryHeads &a, const QueryHeads &b, const float *const *vts, int runs, size_t row, int n) {
    constexpr int kTile = D <= 64 || D > 128 ? 3 : 1;
    for (int g = 0; g < a.heads; g += a.group) {
      int i = g;
      for (; i + kTile <= g + a.group; i += kTile) pair_tile_values<D, kTile>(a, b, i, vts, runs, row, n);
      for (; i < g + a.group; ++i) pair_tile_values<D, 1>(a, b, i, vts, runs, row, n);
    }
  }

 private:
  template <int D, int Q>
  DEEPINFER_ATTN_AVX512 static void pair_tile_scores(const QueryHeads &a, const QueryHeads &b, const float *qp,
                                                     int first, const float *kt, size_t row, int n, float scale) {
    const float *qh[Q];
    float *sa[Q], *sb[Q];
    for (int q = 0; q < Q; ++q) {
      qh[q] = qp + (first + q) * 2 * D;
      sa[q] = a.sc + (first + q) * a.stride, sb[q] = b.sc + (first + q) * b.stride;
    }
    attention_heads::pair_scores<D, Q>(qh, kt + first / a.group * D, row, n, scale, sa, sb);
  }
  template <int D, int Q>
  DEEPINFER_ATTN_AVX512 static void pair_tile_values(const QueryHeads &a, const QueryHeads &b, int first,
                                                     const float *const *vts, int runs, size_t row, int n) {
    constexpr int kSlice = D > 128 ? 64 : D;
    const float *ph[2 * Q], *at[kMaxRuns];
    float *out[2 * Q];
    for (int s = 0; s < D; s += kSlice) {
      for (int q = 0; q < Q; ++q) {
        ph[q] = a.sc + (first + q) * a.stride, out[q] = a.out + (first + q) * D + s;
        ph[Q + q] = b.sc + (first + q) * b.stride, out[Q + q] = b.out + (first + q) * D + s;
      }
      for (int r = 0; r < runs; ++r) at[r] = vts[r] + first / a.group * D + s;
      values<kSlice, float, 2 * Q>(ph, at, runs, row, n, out);
    }
  }
};

}  // namespace attention_heads
}  // namespace deepinfer
#endif
