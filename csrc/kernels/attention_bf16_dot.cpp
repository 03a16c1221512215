#include "attention_bf16_dot.h"

#ifdef DEEPINFER_BF16_ATTENTION
#include <algorithm>
#include <cstring>

#include "attention_bf16_softmax.h"

namespace deepinfer {
namespace attention_bf16 {

namespace {

// block_scores without tiles: st[p][row] is one vdpbf16ps chain, from zero, over the head's D / 2
// pairs in order, of the rows' query pairs (qt: a register of the 16 rows a pair) times position
// p's key pair broadcast. Sixteen positions' chains at once, the query pairs loaded once for them.
BF16_TARGET void block_scores_dot(const KvBlock &s, const uint32_t *qt, int D, float st[kKeys][kRows]) {
  for (int h = 0; h < 2; ++h) {
    const char *k = reinterpret_cast<const char *>(s.k_rows[h]);
    const int stride = s.k_stride[h];
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int pair = 0; pair < D / 2; ++pair) {
      const __m512bh qp = (__m512bh)_mm512_loadu_si512(qt + pair * 16);
      const char *kp = k + pair * 4;
      for (int i = 0; i < 16; ++i) {
        int32_t key;
        std::memcpy(&key, kp + i * stride, 4);
        acc[i] = _mm512_dpbf16_ps(acc[i], qp, (__m512bh)_mm512_set1_epi32(key));
      }
    }
    for (int i = 0; i < 16; ++i) _mm512_store_ps(st[16 * h + i], acc[i]);
  }
}

// kRowsN rows (at most 4) from j0 and kParts (2 or 4) 16-column value parts from e0: o = o *
// alpha + one vdpbf16ps chain, from zero, over the block's 16 position pairs in order (pa:
// [row][pair], vb: [part][pair][16 columns x 2 positions]). Both constants, so that the sums
// stay in registers and a decode token's 3 rows compute no fourth.
template <int kRowsN, int kParts>
BF16_TARGET void values_dot(const KvBlock &s, const uint32_t *pa, const float *alpha, float *o, int D, int j0,
                            int e0) {
  __m512 acc[kRowsN][kParts];
  for (int r = 0; r < kRowsN; ++r)
    for (int e = 0; e < kParts; ++e) acc[r][e] = _mm512_setzero_ps();
  for (int k = 0; k < kKeys / 2; ++k) {
    __m512bh v[kParts];
    for (int e = 0; e < kParts; ++e) v[e] = (__m512bh)_mm512_load_si512(s.vb + ((e0 + e) * 16 + k) * 32);
    for (int r = 0; r < kRowsN; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pa[(j0 + r) * 16 + k]));
      for (int e = 0; e < kParts; ++e) acc[r][e] = _mm512_dpbf16_ps(acc[r][e], v[e], p);
    }
  }
  for (int r = 0; r < kRowsN; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[j0 + r]);
    for (int e = 0; e < kParts; ++e) {
      float *oj = o + (j0 + r) * D + (e0 + e) * 16;
      _mm512_storeu_ps(oj, _mm512_fmadd_ps(_mm512_loadu_ps(oj), a, acc[r][e]));
    }
  }
}

// The block's K pairs with positions in the lanes, kt [2 halves][D / 2 pairs][16 positions]: a
// decode token's few rows then fill the lanes.
BF16_TARGET void transpose_keys(const KvBlock &s, int D, uint32_t *kt) {
  for (int h = 0; h < 2; ++h) {
    const char *k = reinterpret_cast<const char *>(s.k_rows[h]);
    for (int ch = 0; ch < D / 32; ++ch) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + i * s.k_stride[h] + ch * 64);
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + (h * D / 2 + ch * 16 + p) * 16, r[p]);
    }
  }
}

// block_scores_dot's floats for the tile's first kRowsN rows, lanes: positions. The same chains:
// each pair's two products are exact, so which operand holds the query does not change a sum.
template <int kRowsN>
BF16_TARGET void few_scores_dot(const uint32_t *kt, const uint32_t *qt, int D, __m512 s[kFewRows][2]) {
  __m512 acc[kRowsN][2];
  for (int j = 0; j < kRowsN; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int pair = 0; pair < D / 2; ++pair) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + pair * 16);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + (D / 2 + pair) * 16);
    for (int j = 0; j < kRowsN; ++j) {
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(qt[pair * 16 + j]));
      acc[j][0] = _mm512_dpbf16_ps(acc[j][0], k0, q);
      acc[j][1] = _mm512_dpbf16_ps(acc[j][1], k1, q);
    }
  }
  for (int j = 0; j < kRowsN; ++j) s[j][0] = acc[j][0], s[j][1] = acc[j][1];
}

// block_softmax's floats for a tile of kFewRows rows or fewer, the scores on vdpbf16ps; pa and
// alpha only for the tile's rows (values_dot reads no others).
BF16_TARGET void few_rows_dot(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, int p0,
                              uint32_t *pa, float *alpha) {
  const int D = c.s.head_dim;
  alignas(64) uint32_t kt[kMaxDim * 16];
  transpose_keys(s, D, kt);
  __m512 rows[kFewRows][2];
  switch (tl.count) {
    case 1: few_scores_dot<1>(kt, qt, D, rows); break;
    case 2: few_scores_dot<2>(kt, qt, D, rows); break;
    case 3: few_scores_dot<3>(kt, qt, D, rows); break;
    default: few_scores_dot<4>(kt, qt, D, rows); break;
  }
  for (int j = 0; j < tl.count; ++j) alpha[j] = row_softmax(tl, j, p0, c.scale, rows[j], pa);
}

}  // namespace

// block() on vdpbf16ps: the same layouts and steps, each product a chain of register ops.
BF16_TARGET void block_dot(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0,
                           Ahead &ahead) {
  const int D = c.s.head_dim;
  alignas(64) float st[kKeys][kRows];
  alignas(64) uint32_t pa[kRows * 16];
  alignas(64) float alpha[kRows];
  ahead.ask();
  if (tl.count > kFewRows) {
    block_scores_dot(s, qt, D, st);
    ahead.ask();
    block_softmax(c, tl, p0, st, pa, alpha);
  } else {
    few_rows_dot(c, s, tl, qt, p0, pa, alpha);
    ahead.ask();
  }
  for (int e0 = 0; e0 < D / 16; e0 += 4) {  // D / 16 is even: parts of 4, then maybe 2
    const bool four = D / 16 - e0 >= 4;
    for (int j0 = 0; j0 < tl.count; j0 += 4) {
      switch (std::min(4, tl.count - j0) + (four ? 0 : 4)) {
        case 1: values_dot<1, 4>(s, pa, alpha, o, D, j0, e0); break;
        case 2: values_dot<2, 4>(s, pa, alpha, o, D, j0, e0); break;
        case 3: values_dot<3, 4>(s, pa, alpha, o, D, j0, e0); break;
        case 4: values_dot<4, 4>(s, pa, alpha, o, D, j0, e0); break;
        case 5: values_dot<1, 2>(s, pa, alpha, o, D, j0, e0); break;
        case 6: values_dot<2, 2>(s, pa, alpha, o, D, j0, e0); break;
        case 7: values_dot<3, 2>(s, pa, alpha, o, D, j0, e0); break;
        default: values_dot<4, 2>(s, pa, alpha, o, D, j0, e0); break;
      }
    }
    ahead.ask();
  }
}

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
