#include "packed_linear_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "packed_blocks.h"
#include "packed_blocks_kquant.h"
#include "rows_ahead.h"

namespace deepinfer {

#ifdef DEEPINFER_PACKED_AVX512
bool packed_avx512_enabled() {
  static const bool on = [] {
    const char *env = std::getenv("DEEPINFER_DP_PACKED_AVX512");
    return !(env && std::strcmp(env, "0") == 0) && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return on;
}

namespace {
using namespace packed_detail;

#define AVX512_KERNEL __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c")))

constexpr int kAheadRows = 16;  // how far ahead in rows the fused kernel prefetches (into L2)
constexpr int kTwoPairsInputs = 4;  // up to this many input rows, the fused kernel takes two pairs a pass
// The buffered path's tiles: 6 pairs (12 weight rows) x 4 input rows, 24 accumulators. Against
// 3 pairs x 8 rows, Gemma 3's lm_head at 64 rows took 225-229 ms against 236-240 on Zen 4 (a
// tile's outputs fall in 4 rows of the output, not 8); small matrices 0-3% faster.
constexpr int kTilePairs = 6;
constexpr int kTileInputs = 4;
constexpr int kGroupPairs = 6;  // pairs widened into the buffer at a time (as the AVX2 path's 12 rows)

// The two halves of an accumulator as the outputs of rows a and b; b == a (an odd last row
// paired with itself) is stored once.
AVX512_KERNEL inline void store_pair(__m512 acc, const float *bias, float *y, int a, int b) {
  const float sa = sum8(_mm512_castps512_ps256(acc)), sb = sum8(_mm512_extractf32x8_ps(acc, 1));
  y[a] = bias ? sa + bias[a] : sa;
  if (b != a) y[b] = bias ? sb + bias[b] : sb;
}

// sum8 of both halves of acc[0..7] at once, transposed: lane 4l + q of the result holds the
// sum of acc[2q + l / 2]'s half l % 2 (row a's lanes, then row b's). Each step makes the same
// additions on the same pairs as sum8 (so the same floats) for 16 outputs together: 14
// shuffles and 7 adds where eight store_pairs take 56 and 48 (shuffles issue on port 5, one
// of the two 512-bit FMA ports).
AVX512_KERNEL inline __m512 sum8_x16(const __m512 acc[8]) {
  __m512 h[4], g[2];
  for (int q = 0; q < 4; ++q)  // v[i] + v[i + 4]: the low 128 bits of each half plus its high ones
    h[q] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * q], acc[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(acc[2 * q], acc[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int r = 0; r < 2; ++r)  // h[0] + h[2], h[1] + h[3] (sum8's movehl step)
    g[r] = _mm512_add_ps(_mm512_shuffle_ps(h[2 * r], h[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(h[2 * r], h[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),  // then their sum (movehdup step)
                       _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// NP x MB accumulators (pair p's against input row j at acc[p * MB + j]) stored as
// store_pair stores each, eight at a time through sum8_x16 (zeros pad the last eight).
template <int NP, int MB>
AVX512_KERNEL inline void store_tile(const __m512 *acc, const int (*rows)[2], const float *bias, float *y, int N) {
  constexpr int kAccs = NP * MB;
  alignas(64) float sums[16];
#pragma GCC unroll 8
  for (int g = 0; g < kAccs; g += 8) {
    __m512 group[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) group[t] = g + t < kAccs ? acc[g + t] : _mm512_setzero_ps();
    _mm512_store_ps(sums, sum8_x16(group));
    for (int t = 0; t < 8 && g + t < kAccs; ++t) {
      const int p = (g + t) / MB, j = (g + t) % MB, a = rows[p][0], b = rows[p][1];
      const float sa = sums[8 * (t & 1) + t / 2], sb = sums[8 * (t & 1) + 4 + t / 2];
      float *yj = y + static_cast<size_t>(j) * N;
      yj[a] = bias ? sa + bias[a] : sa;
      if (b != a) yj[b] = bias ? sb + bias[b] : sb;
    }
  }
}

// The fused path: NP pairs of rows (a and b of each widened in registers, one per half)
// against MB input rows broadcast to both halves. A pair's four multiply-adds a block wait on
// each other, so up to four input rows two pairs a pass keep twice the chains in flight; past
// that the widening and the multiply-adds fill the 512-bit ports with one pair.
template <class F, int NP, int MB>
AVX512_KERNEL void pairs_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y,
                                const int (*rows)[2]) {
  const int K = w.cols;
  const uint8_t *p[NP][2];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < 2; ++r) p[q][r] = w.data + static_cast<size_t>(rows[q][r]) * w.row_bytes;
  __m512 acc[NP * MB], wv[4], xv[4];
  for (int j = 0; j < NP * MB; ++j) acc[j] = _mm512_setzero_ps();
  typename F::State st[NP][2];
  for (int kb = 0; kb < K; kb += F::kValues) {
    for (int q = 0; q < NP; ++q) F::prepare(p[q][0], st[q][0]), F::prepare(p[q][1], st[q][1]);
    for (int s = 0; s < F::kSubs; ++s) {  // 32 values at a time (a K-quant block holds 8 x 32)
      const int k = kb + 32 * s;
      if (MB == 1)
        for (int i = 0; i < 4; ++i) xv[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + k + 8 * i));
      // Into L2 only: asked into L1 (T0), one row over the whole matrix took 1.4x its time in
      // L2 on Zen 4; asked into L2 it takes the same.
      const size_t ahead = kAheadRows * w.row_bytes + s * F::kBytes / F::kSubs;
      for (int q = 0; q < NP; ++q) {
        _mm_prefetch(reinterpret_cast<const char *>(p[q][0] + ahead), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(p[q][1] + ahead), _MM_HINT_T1);
        F::widen_pair(p[q][0], p[q][1], s, st[q][0], st[q][1], wv);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < MB; ++j)
            acc[q * MB + j] = _mm512_fmadd_ps(
                wv[i],
                MB == 1 ? xv[i] : _mm512_broadcast_f32x8(_mm256_loadu_ps(x + static_cast<size_t>(j) * K + k + 8 * i)),
                acc[q * MB + j]);
      }
    }
    for (int q = 0; q < NP; ++q) p[q][0] += F::kBytes, p[q][1] += F::kBytes;
  }
  // From 4 accumulators on, one padded sum8_x16 beats MB store_pairs (measured 2-7% at 4-8 rows).
  if (NP * MB >= 4) return store_tile<NP, MB>(acc, rows, bias, y, w.rows);
  for (int q = 0; q < NP; ++q)
    for (int j = 0; j < MB; ++j)
      store_pair(acc[q * MB + j], bias, y + static_cast<size_t>(j) * w.rows, rows[q][0], rows[q][1]);
}

template <class F, int MB>
AVX512_KERNEL void pair_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int n0, int n1) {
  constexpr int kPairs = MB <= kTwoPairsInputs ? 2 : 1;
  int n = n0;
  for (; n + 2 * kPairs <= n1; n += 2 * kPairs) {
    int rows[kPairs][2];
    for (int q = 0; q < kPairs; ++q) rows[q][0] = n + 2 * q, rows[q][1] = n + 2 * q + 1;
    pairs_inputs<F, kPairs, MB>(x, w, bias, y, rows);
  }
  for (; n < n1; n += 2) {  // the last rows, and a lone last row paired with itself
    const int rows[1][2] = {{n, std::min(n + 1, n1 - 1)}};
    pairs_inputs<F, 1, MB>(x, w, bias, y, rows);
  }
}

template <class F>
void few_rows(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  switch (M) {
    case 1: return pair_columns<F, 1>(x, w, bias, y, n0, n1);
    case 2: return pair_columns<F, 2>(x, w, bias, y, n0, n1);
    case 3: return pair_columns<F, 3>(x, w, bias, y, n0, n1);
    case 4: return pair_columns<F, 4>(x, w, bias, y, n0, n1);
    case 5: return pair_columns<F, 5>(x, w, bias, y, n0, n1);
    case 6: return pair_columns<F, 6>(x, w, bias, y, n0, n1);
    case 7: return pair_columns<F, 7>(x, w, bias, y, n0, n1);
    default: return pair_columns<F, 8>(x, w, bias, y, n0, n1);
  }
}

// The buffered path's widening: pair p of `rows` into buf + p * 2K, interleaved by 8 values
// (row a's 8c..8c+7, then row b's), so that one aligned 64-byte load gives a tile its pair.
template <class F>
AVX512_KERNEL void widen_pairs(const PackedMatrix &w, const int (*rows)[2], int pairs, float *buf) {
  __m512 wv[4];
  for (int p = 0; p < pairs; ++p) {
    const uint8_t *pa = w.data + static_cast<size_t>(rows[p][0]) * w.row_bytes;
    const uint8_t *pb = w.data + static_cast<size_t>(rows[p][1]) * w.row_bytes;
    float *out = buf + static_cast<size_t>(p) * 2 * w.cols;
    typename F::State sa, sb;
    for (int k = 0; k < w.cols; k += F::kValues, pa += F::kBytes, pb += F::kBytes) {
      F::prepare(pa, sa);
      F::prepare(pb, sb);
      for (int s = 0; s < F::kSubs; ++s, out += 64) {
        F::widen_pair(pa, pb, s, sa, sb, wv);
        for (int i = 0; i < 4; ++i) _mm512_store_ps(out + 16 * i, wv[i]);
      }
    }
  }
}

// A tile's share of its chains when K is taken in blocks (k_block): all of K; the first block
// (from zeros, left in `partial`); a middle one (from `partial`, back into it); the last (from
// `partial`, into the outputs). Taken in blocks a chain adds the same products in the same
// order: the same floats.
enum class Chains { kWhole, kFirst, kMiddle, kLast };

// NP buffered pairs against MB input rows over k in [k0, k1): cpu_linear's tile, each chain
// the same.
template <int NP, int MB, Chains C>
AVX512_KERNEL void pair_tile(const float *buf, const float *x, const int (*rows)[2], const float *bias, float *y,
                             int N, int K, int k0, int k1, float *partial) {
  constexpr bool kFromZero = C == Chains::kWhole || C == Chains::kFirst;
  constexpr bool kToOutputs = C == Chains::kWhole || C == Chains::kLast;
  __m512 acc[NP][MB];
  for (int p = 0; p < NP; ++p)
    for (int j = 0; j < MB; ++j) {
      if constexpr (kFromZero) acc[p][j] = _mm512_setzero_ps();
      else acc[p][j] = _mm512_load_ps(partial + 16 * (p * MB + j));
    }
  for (int k = k0; k < k1; k += 8) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = _mm512_load_ps(buf + static_cast<size_t>(p) * 2 * K + 2 * k);
    for (int j = 0; j < MB; ++j) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + static_cast<size_t>(j) * K + k));
      for (int p = 0; p < NP; ++p) acc[p][j] = _mm512_fmadd_ps(wv[p], xv, acc[p][j]);
    }
  }
  if constexpr (kToOutputs) {
    store_tile<NP, MB>(&acc[0][0], rows, bias, y, N);
  } else {
    for (int p = 0; p < NP; ++p)
      for (int j = 0; j < MB; ++j) _mm512_store_ps(partial + 16 * (p * MB + j), acc[p][j]);
  }
}

// A tile's accumulators between two blocks of K.
constexpr int kPartialFloats = kTilePairs * kTileInputs * 16;

// The columns of K a block: all of K while a tile's pairs and inputs fit in L1 with room to
// spare (K = 576: 37 KB), else equal blocks of about 32 KB of them. At K = 1536 a group's 74 KB
// of pairs came from L2 for every tile of inputs.
int k_block(int K) {
  constexpr int64_t kWholeBytes = 40 << 10, kBlockBytes = 32 << 10;
  const int64_t tile_bytes = static_cast<int64_t>(kTilePairs * 2 + kTileInputs) * sizeof(float) * K;
  if (tile_bytes <= kWholeBytes) return K;
  const int blocks = static_cast<int>((tile_bytes + kBlockBytes - 1) / kBlockBytes);
  return ((K + blocks - 1) / blocks + 7) / 8 * 8;
}

// The buffered pairs against every input row over [k0, k1), kTileInputs rows at a time (the
// inputs stream once per group of pairs and block of K); `partial`: kPartialFloats a tile.
template <int NP, Chains C>
AVX512_KERNEL void pairs_against_inputs(const float *buf, const float *x, const int (*rows)[2], const float *bias,
                                        float *y, int M, int N, int K, int k0, int k1, float *partial,
                                        RowsAhead &ahead) {
  int m = 0;
  for (; m + kTileInputs <= M; m += kTileInputs, partial += kPartialFloats) {
    ahead.next();
    pair_tile<NP, kTileInputs, C>(buf, x + static_cast<size_t>(m) * K, rows, bias, y + static_cast<size_t>(m) * N, N,
                                  K, k0, k1, partial);
  }
  ahead.next();
  const float *xm = x + static_cast<size_t>(m) * K;
  float *ym = y + static_cast<size_t>(m) * N;
  static_assert(kTileInputs <= 4, "the rows left after the whole tiles are 3 at most");
  switch (M - m) {
    case 3: return pair_tile<NP, 3, C>(buf, xm, rows, bias, ym, N, K, k0, k1, partial);
    case 2: return pair_tile<NP, 2, C>(buf, xm, rows, bias, ym, N, K, k0, k1, partial);
    case 1: return pair_tile<NP, 1, C>(buf, xm, rows, bias, ym, N, K, k0, k1, partial);
    default: return;
  }
}

// pairs_against_inputs over all of K, a block of k_step columns at a time: a block of pairs
// stays in L1 while every tile of inputs passes over it.
template <int NP>
void pairs_over_k(const float *buf, const float *x, const int (*rows)[2], const float *bias, float *y, int M, int N,
                  int K, int k_step, float *partial, RowsAhead &ahead) {
  if (k_step >= K)
    return pairs_against_inputs<NP, Chains::kWhole>(buf, x, rows, bias, y, M, N, K, 0, K, nullptr, ahead);
  pairs_against_inputs<NP, Chains::kFirst>(buf, x, rows, bias, y, M, N, K, 0, k_step, partial, ahead);
  int k0 = k_step;
  for (; k0 + k_step < K; k0 += k_step)
    pairs_against_inputs<NP, Chains::kMiddle>(buf, x, rows, bias, y, M, N, K, k0, k0 + k_step, partial, ahead);
  pairs_against_inputs<NP, Chains::kLast>(buf, x, rows, bias, y, M, N, K, k0, K, partial, ahead);
}

float *aligned64(std::vector<float> &v) {
  return reinterpret_cast<float *>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// The pairs of [n0, n1) against every input row, kGroupPairs pairs at a time, each group
// widened by `widen(rows, pairs, buf)` into an aligned buffer kept per thread.
template <class Widen>
void pairs_of_columns(Widen widen, const void *weights, size_t row_bytes, const float *x, const float *bias, float *y,
                      int M, int N, int K, int n0, int n1) {
  // 64-byte-aligned buffers per thread, kept between calls: kGroupPairs pairs of K floats each,
  // and where K is taken in blocks the tiles' accumulators between blocks.
  thread_local std::vector<float> storage, partials;
  storage.resize(static_cast<size_t>(kGroupPairs) * 2 * K + 16);
  float *buf = aligned64(storage);
  const int k_step = k_block(K), k_blocks = (K + k_step - 1) / k_step;
  if (k_blocks > 1) partials.resize(static_cast<size_t>(M / kTileInputs + 1) * kPartialFloats + 16);
  float *partial = k_blocks > 1 ? aligned64(partials) : nullptr;
  int rows[kGroupPairs][2];
  for (int n = n0; n < n1; n += 2 * kGroupPairs) {
    int pairs = 0;
    for (int r = n; r < std::min(n1, n + 2 * kGroupPairs); r += 2, ++pairs) {
      rows[pairs][0] = r;
      rows[pairs][1] = std::min(r + 1, n1 - 1);
    }
    widen(rows, pairs, buf);
    // The next group arrives while this one's tiles run, a share before each tile.
    const int next = std::min(n1, n + 2 * kGroupPairs);
    const int tiles = (pairs / kTilePairs + pairs % kTilePairs) * (M / kTileInputs + 1) * k_blocks;
    RowsAhead ahead(weights, row_bytes, next, std::min(n1, next + 2 * kGroupPairs), tiles);
    int p = 0;
    for (; p + kTilePairs <= pairs; p += kTilePairs)
      pairs_over_k<kTilePairs>(buf + static_cast<size_t>(p) * 2 * K, x, rows + p, bias, y, M, N, K, k_step, partial,
                               ahead);
    for (; p < pairs; ++p)
      pairs_over_k<1>(buf + static_cast<size_t>(p) * 2 * K, x, rows + p, bias, y, M, N, K, k_step, partial, ahead);
  }
}

template <class F>
void many_rows(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  const auto widen = [&w](const int (*rows)[2], int pairs, float *buf) { widen_pairs<F>(w, rows, pairs, buf); };
  pairs_of_columns(widen, w.data, w.row_bytes, x, bias, y, M, w.rows, w.cols, n0, n1);
}

// fp32 weight rows "widened" by copying them into the buffer's pair layout (K % 8 == 0).
AVX512_KERNEL void copy_pairs(const float *w, int K, const int (*rows)[2], int pairs, float *buf) {
  for (int p = 0; p < pairs; ++p) {
    const float *a = w + static_cast<size_t>(rows[p][0]) * K, *b = w + static_cast<size_t>(rows[p][1]) * K;
    float *out = buf + static_cast<size_t>(p) * 2 * K;
    for (int k = 0; k < K; k += 8, out += 16) {
      _mm256_store_ps(out, _mm256_loadu_ps(a + k));
      _mm256_store_ps(out + 8, _mm256_loadu_ps(b + k));
    }
  }
}

}  // namespace

void packed_few_rows_avx512(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                            int n1) {
  switch (w.format) {
    case WeightFormat::kBF16: return few_rows<BF16>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_0: return few_rows<Q4_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_1: return few_rows<Q4_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ8_0: return few_rows<Q8_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_0: return few_rows<Q5_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_1: return few_rows<Q5_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ2_K: return few_rows<Q2_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ3_K: return few_rows<Q3_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_K: return few_rows<Q4_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_K: return few_rows<Q5_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ6_K: return few_rows<Q6_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kBF16Pairs: return;  // bf16_pairs_columns
  }
}

void packed_many_rows_avx512(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                             int n1) {
  switch (w.format) {
    case WeightFormat::kBF16: return many_rows<BF16>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_0: return many_rows<Q4_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_1: return many_rows<Q4_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ8_0: return many_rows<Q8_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_0: return many_rows<Q5_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_1: return many_rows<Q5_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ2_K: return many_rows<Q2_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ3_K: return many_rows<Q3_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_K: return many_rows<Q4_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_K: return many_rows<Q5_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ6_K: return many_rows<Q6_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kBF16Pairs: return;  // bf16_pairs_columns
  }
}
void linear_many_rows_avx512(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int n0,
                             int n1) {
  const auto copy = [w, K](const int (*rows)[2], int pairs, float *buf) { copy_pairs(w, K, rows, pairs, buf); };
  pairs_of_columns(copy, w, sizeof(float) * K, x, bias, y, M, N, K, n0, n1);
}
#else
bool packed_avx512_enabled() { return false; }
void linear_many_rows_avx512(const float *, const float *, const float *, float *, int, int, int, int, int) {}
void packed_few_rows_avx512(const float *, const PackedMatrix &, const float *, float *, int, int, int) {}
void packed_many_rows_avx512(const float *, const PackedMatrix &, const float *, float *, int, int, int) {}
#endif

}  // namespace deepinfer
