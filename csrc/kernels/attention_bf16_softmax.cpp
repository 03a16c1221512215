#include "attention_bf16_softmax.h"

#ifdef DEEPINFER_BF16_ATTENTION
#include <algorithm>
#include <cmath>
#include <cstring>

namespace deepinfer {
namespace attention_bf16 {

namespace {

// 2^x for x <= kRescaleGap on 16 lanes: x = n + f with n = round(x), 2^f by a degree-4 polynomial on
// [-0.5, 0.5] fitted for relative error (at most 2.7e-6 in fp32: the probabilities are rounded
// to bf16, 2^-9, for the values' product, and the same p makes the numerator and the
// denominator; Cephes' degree 6, 2e-7, spent two more multiply-adds an exp), times 2^n by
// vscalefps. The softmax runs in base 2 (scores times scale * log2(e)): about half the
// instructions of an e^x by ln 2 reduction, and the exps are most of a prefill block's work.
BF16_TARGET __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));  // below 2^-126 the result is ~0 either way
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(0.009570094756782055f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05591785907745361f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.240247443318367f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931217908859253f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999992847442627f));
  return _mm512_scalef_ps(y, n);
}

constexpr float kLog2e = 1.44269504088896341f;

// A row's running max (base 2) moves only when a block's max passes it by more than this, and
// then to that block's max: the probabilities stay at most 2^8 (fp32 and bf16 hold them alike),
// and o and l are rescaled only then. Past a row's first blocks that is rare, which lets a
// long prefill keep o in the value tiles from block to block (run_tiles_resident). The cost:
// a row's largest probability is rounded to bf16 like the others, where it used to be 1.
constexpr float kRescaleGap = 8.f;

// Words [a0..a15, b0..b15] as pairs [a0, b0, a1, b1, ...]: lane j (a[j], b[j]), one vpermw.
BF16_TARGET __m512i interleave_pairs(__m512i x) {
  alignas(64) static const uint16_t index[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(index), x);
}

// The softmax's step over one block for every row of the tile, lane by lane, in base 2 (the
// scores times scale * log2(e), tl.m in those units): the new max (kRescaleGap) and the rescale
// factor alpha (exactly 1 for a row whose max did not move), the denominator (the block's
// probabilities summed by a fixed halving tree over its 32 positions, as row_softmax sums
// them), and the probabilities rounded to bf16 as the A tile of the values' product (pa:
// [row][position], 64 bytes a row). A block inside every row's context (most of a long
// prefill's) skips the per-position masks: the same floats. The exps' arguments are explicit
// fmsubs in both forms: left as a product and a difference, the compiler fuses them in one form
// and not the other.
BF16_TARGET __m512 tile_softmax(Tile &tl, int p0, float scale, float st[kKeys][kRows], uint32_t *pa) {
  const __m512 c = _mm512_set1_ps(scale * kLog2e);
  __mmask16 valid[kKeys];
  if (p0 >= tl.all_lo && p0 + kKeys <= tl.all_hi) {
    const __mmask16 in_use = static_cast<__mmask16>((1u << tl.count) - 1);
    for (int i = 0; i < kKeys; ++i) valid[i] = in_use;
  } else {
    const __m512i len = _mm512_load_si512(tl.len), start = _mm512_load_si512(tl.start);
    for (int i = 0; i < kKeys; ++i) {
      const __m512i pos = _mm512_set1_epi32(p0 + i);
      valid[i] = _mm512_cmpgt_epi32_mask(len, pos) & _mm512_cmple_epi32_mask(start, pos);
    }
  }
  // Four chains of maxes, not one waiting on each one's latency (a max is exact in any order),
  // in four named registers: indexed by i % 4 the compiler kept them in memory.
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  for (int i = 0; i < kKeys; i += 4) {
    m0 = _mm512_mask_max_ps(m0, valid[i], m0, _mm512_mul_ps(_mm512_load_ps(st[i]), c));
    m1 = _mm512_mask_max_ps(m1, valid[i + 1], m1, _mm512_mul_ps(_mm512_load_ps(st[i + 1]), c));
    m2 = _mm512_mask_max_ps(m2, valid[i + 2], m2, _mm512_mul_ps(_mm512_load_ps(st[i + 2]), c));
    m3 = _mm512_mask_max_ps(m3, valid[i + 3], m3, _mm512_mul_ps(_mm512_load_ps(st[i + 3]), c));
  }
  const __m512 bmax = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
  const __m512 m_old = _mm512_load_ps(tl.m);
  const __mmask16 grew = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(m_old, _mm512_set1_ps(kRescaleGap)), _CMP_GT_OQ);
  const __m512 m_new = _mm512_mask_blend_ps(grew, m_old, bmax);
  const __m512 alpha = _mm512_mask_blend_ps(grew, _mm512_set1_ps(1.f), exp2_16(_mm512_sub_ps(m_old, m_new)));
  __m512 p[kKeys];
  for (int i = 0; i < kKeys; ++i)
    p[i] = _mm512_maskz_mov_ps(valid[i], exp2_16(_mm512_fmsub_ps(_mm512_load_ps(st[i]), c, m_new)));
  __m512i w[16];
  for (int k = 0; k < kKeys / 2; ++k)  // lane j: row j's pair k
    w[k] = (__m512i)_mm512_cvtne2ps_pbh(p[2 * k + 1], p[2 * k]);
  for (int k = 0; k < kKeys / 2; ++k) w[k] = interleave_pairs(w[k]);
  for (int n = kKeys / 2; n >= 1; n /= 2)
    for (int i = 0; i < n; ++i) p[i] = _mm512_add_ps(p[i], p[i + n]);
  _mm512_store_ps(tl.m, m_new);
  _mm512_store_ps(tl.l, _mm512_fmadd_ps(_mm512_load_ps(tl.l), alpha, p[0]));
  transpose16(w);
  for (int j = 0; j < kRows; ++j) _mm512_store_si512(pa + j * 16, w[j]);
  return alpha;
}

// Row j's 32 scores of st in two registers (lanes: positions).
BF16_TARGET void row_of(const float st[kKeys][kRows], int j, __m512 s[2]) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i column = _mm512_add_epi32(_mm512_mullo_epi32(iota, _mm512_set1_epi32(kRows)), _mm512_set1_epi32(j));
  for (int h = 0; h < 2; ++h) s[h] = _mm512_i32gather_ps(column, st[16 * h], 4);
}

}  // namespace

// tile_softmax's floats for row j alone, its 32 scores s in two registers: a decode token's
// tile holds only its own heads, where 16 lanes of rows would mostly compute nothing. Returns
// the row's alpha.
BF16_TARGET float row_softmax(Tile &tl, int j, int p0, float scale, const __m512 s[2], uint32_t *pa) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 c = _mm512_set1_ps(scale * kLog2e);
  __mmask16 valid[2];
  __m512 bmax = _mm512_set1_ps(-INFINITY);
  for (int h = 0; h < 2; ++h) {
    const __m512i pos = _mm512_add_epi32(iota, _mm512_set1_epi32(p0 + 16 * h));
    valid[h] = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(tl.len[j]), pos) &
               _mm512_cmple_epi32_mask(_mm512_set1_epi32(tl.start[j]), pos);
    bmax = _mm512_mask_max_ps(bmax, valid[h], bmax, _mm512_mul_ps(s[h], c));
  }
  const float m_old = tl.m[j], block_max = _mm512_reduce_max_ps(bmax);
  const bool grew = block_max > m_old + kRescaleGap;
  const float m_new = grew ? block_max : m_old;
  const float alpha = grew ? _mm512_cvtss_f32(exp2_16(_mm512_set1_ps(m_old - m_new))) : 1.f;
  __m512 p[2];
  for (int h = 0; h < 2; ++h)
    p[h] = _mm512_maskz_mov_ps(valid[h], exp2_16(_mm512_fmsub_ps(s[h], c, _mm512_set1_ps(m_new))));
  _mm512_store_si512(pa + j * 16, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
  __m512 x = _mm512_add_ps(p[0], p[1]);                     // positions i and i + 16
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x0E));  // + i + 8
  x = _mm512_add_ps(x, _mm512_shuffle_f32x4(x, x, 0x01));  // + i + 4
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x0E));        // + i + 2
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x01));        // + i + 1
  tl.m[j] = m_new;
  tl.l[j] = std::fma(tl.l[j], alpha, _mm512_cvtss_f32(x));
  return alpha;
}

// o[row] *= alpha[row] for the tile's rows whose max moved (alpha 1: the row as it is).
BF16_TARGET void rescale_rows(const Tile &tl, const float *alpha, float *o, int D) {
  for (int j = 0; j < tl.count; ++j) {
    if (alpha[j] == 1.f) continue;
    const __m512 a = _mm512_set1_ps(alpha[j]);
    for (int d = 0; d < D; d += 16) _mm512_storeu_ps(o + j * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + j * D + d), a));
  }
}

bool any_moved(const Tile &tl, const float *alpha) {
  return std::any_of(alpha, alpha + tl.count, [](float a) { return a != 1.f; });
}

// The block's softmax step for the tile's rows: pa and each row's alpha (rows past the tile's
// count: probabilities 0, alpha 1).
BF16_TARGET void block_softmax(const Call &c, Tile &tl, int p0, float st[kKeys][kRows], uint32_t *pa,
                               float *alpha) {
  if (tl.count > kFewRows) {
    _mm512_store_ps(alpha, tile_softmax(tl, p0, c.scale, st, pa));
  } else {
    _mm512_store_ps(alpha, _mm512_set1_ps(1.f));
    for (int j = 0; j < tl.count; ++j) {
      __m512 row[2];
      row_of(st, j, row);
      alpha[j] = row_softmax(tl, j, p0, c.scale, row, pa);
    }
    std::memset(pa + tl.count * 16, 0, sizeof(uint32_t) * 16 * (kRows - tl.count));
  }
}

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
