#include "paged_attention_bf16.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_amx.h"
#include "bf16_linear.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <immintrin.h>

#include "paged_attention_heads.h"
#define DEEPINFER_BF16_ATTENTION 1
#endif

namespace deepinfer {

#ifdef DEEPINFER_BF16_ATTENTION
namespace {

constexpr int kRows = 16;       // query rows of a tile: a query token and one of its heads each
constexpr int kKeys = 32;       // positions of a block: two 16-key score tiles, one 32-deep value product
constexpr int kMaxDim = 256;
constexpr int kGroupTiles = 8;  // tiles of one KV head and span that share each gathered block
constexpr int kResidentGroupTiles = 32;  // the same where o stays in the tiles (unit_rows)

// Both forms' code: only the AMX intrinsics emit AMX instructions, and the vdpbf16ps form uses none.
#define BF16_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma")))

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

// The call, as every unit reads it.
struct Call {
  const PagedAttentionShape &s;
  const float *q;
  const uint16_t *k_cache, *v_cache;
  const int32_t *tables, *rows, *lens;
  float scale;
  float *out;
  bool amx;  // the products on AMX tiles, else on vdpbf16ps
};

// Rows [begin, end) of a span's rows (query t0 + i / G, head kv * G + i % G) for each KV head
// kv in [kv_first, kv_first + kv_count).
struct Unit {
  int table_row, kv_first, kv_count, t0, begin, end;
  int64_t cost;
};

// A tile's rows and its running softmax. Rows past `count` have an empty context.
struct alignas(64) Tile {
  int32_t start[kRows], len[kRows];  // each row's first position and context length
  float m[kRows], l[kRows];          // running max and denominator
  int t[kRows], head[kRows];
  int count, lo, hi;                 // rows in use; positions some row sees: [lo, hi)
  int all_lo, all_hi;                // positions every row in use sees: [all_lo, all_hi)
};

// One KV head's block of 32 positions, as the tiles read it.
struct KvBlock {
  alignas(64) uint16_t k[kKeys * kMaxDim];   // K rows where they are copied, [32][D]
  alignas(64) uint16_t vb[kKeys * kMaxDim];  // V as B tiles: [D / 16][16 pairs][32]
  const uint16_t *k_rows[2];                 // each 16-position half's K rows: in the cache, or in k
  int k_stride[2];                           // their stride in bytes
};

// Per-thread buffers, reused from call to call.
struct Scratch {
  std::vector<Tile> tiles;
  std::vector<float> o;        // [tile][row][D], the value sums in the value tiles' column order
  std::vector<uint32_t> qt;    // [tile][D / 32][16 pairs][16 rows]: the rounded queries as B tiles
  std::vector<KvBlock> kv;     // the unit's KV heads' current block
};

// Where position p of block-table row `table_row` starts in a cache: its first KV head's element.
size_t slot_at(const Call &c, int table_row, int p) {
  const int bs = c.s.block_size;
  const int32_t block = c.tables[static_cast<size_t>(table_row) * c.s.max_blocks + p / bs];
  return (static_cast<size_t>(block) * bs + p % bs) * c.s.num_kv_heads * c.s.head_dim;
}

// 16 x 16 dwords transposed in registers: r[i] lane c -> r[c] lane i.
BF16_TARGET inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 128-bit lanes of b[c], b[4 + c], b[8 + c], b[12 + c], transposed
    const __m512i y0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), y1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i y2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i y3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(y0, y2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(y1, y3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
  }
}

// The tile's rows, their contexts and their queries rounded to bf16 as B tiles (qt).
BF16_TARGET void start_tile(const Call &c, const Unit &u, int kv, int first, Tile &tl, uint32_t *qt, float *o) {
  const int D = c.s.head_dim, G = c.s.num_heads / c.s.num_kv_heads;
  tl.count = std::min(kRows, u.end - first);
  tl.lo = tl.all_hi = INT_MAX;
  tl.hi = tl.all_lo = 0;
  alignas(64) uint16_t qb[kRows][kMaxDim];
  for (int j = 0; j < kRows; ++j) {
    tl.m[j] = -INFINITY;
    tl.l[j] = 0.f;
    tl.start[j] = tl.len[j] = 0;
    if (j >= tl.count) {
      std::memset(qb[j], 0, sizeof(uint16_t) * D);
      continue;
    }
    const int i = first + j;
    tl.t[j] = u.t0 + i / G;
    tl.head[j] = kv * G + i % G;
    tl.len[j] = c.lens[tl.t[j]];
    tl.start[j] = window_start(tl.len[j], c.s.window);
    tl.lo = std::min(tl.lo, tl.start[j]);
    tl.hi = std::max(tl.hi, tl.len[j]);
    tl.all_lo = std::max(tl.all_lo, tl.start[j]);
    tl.all_hi = std::min(tl.all_hi, tl.len[j]);
    const float *src = c.q + static_cast<size_t>(tl.t[j]) * q_row_stride(c.s) + static_cast<size_t>(tl.head[j]) * D;
    for (int d = 0; d < D; d += 16)
      _mm256_store_si256(reinterpret_cast<__m256i *>(qb[j] + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d)));
  }
  for (int ch = 0; ch < D / 32; ++ch) {
    __m512i r[16];
    for (int j = 0; j < kRows; ++j) r[j] = _mm512_load_si512(qb[j] + ch * 32);
    transpose16(r);
    for (int k = 0; k < 16; ++k) _mm512_storeu_si512(qt + (ch * 16 + k) * 16, r[k]);
  }
  std::memset(o, 0, sizeof(float) * kRows * D);
}

// Positions [p0, p0 + 32) of KV head kv's K as the scores' A tiles, zeros outside [lo, hi) (a
// cache slot past every row's context may hold anything, NaN included).
BF16_TARGET void gather_keys(const Call &c, int table_row, int kv, int p0, int lo, int hi, KvBlock &s) {
  const int D = c.s.head_dim;
  auto row_at = [&](int p) { return slot_at(c, table_row, p) + static_cast<size_t>(kv) * D; };
  // Each 16-position half of K as the A tile: read in place when its rows are 16 slots of one
  // cache block, all inside [lo, hi); else copied into s.k with zeros.
  for (int h = 0; h < 2; ++h) {
    const int first = p0 + 16 * h;
    if (c.s.block_size % 16 == 0 && first >= lo && first + 16 <= hi) {
      s.k_rows[h] = c.k_cache + row_at(first);
      s.k_stride[h] = c.s.num_kv_heads * D * 2;
      continue;
    }
    for (int i = 0; i < 16; ++i) {
      const int p = first + i;
      const uint16_t *k_row = p >= lo && p < hi ? c.k_cache + row_at(p) : nullptr;
      for (int d = 0; d < D; d += 32)
        _mm512_store_si512(s.k + (16 * h + i) * D + d, k_row ? _mm512_loadu_si512(k_row + d) : _mm512_setzero_si512());
    }
    s.k_rows[h] = s.k + 16 * h * D;
    s.k_stride[h] = D * 2;
  }
}

// The same block's V for the unit's KV heads, as B tiles (zeros outside [lo, hi)): pair row k
// of part (ch, half) holds V[2k][d], V[2k + 1][d] for the 16 dimensions d of the 32-dimension
// chunk ch that unpacklo (half 0) or unpackhi (half 1) picks. A position's heads are read
// together, so a cache block is read front to back.
BF16_TARGET void gather_values(const Call &c, const Unit &u, int p0, int lo, int hi, KvBlock *blocks) {
  const int D = c.s.head_dim;
  auto heads_at = [&](int p) -> const uint16_t * {
    return p < lo || p >= hi ? nullptr : c.v_cache + slot_at(c, u.table_row, p) + static_cast<size_t>(u.kv_first) * D;
  };
  for (int k = 0; k < kKeys / 2; ++k) {
    const uint16_t *ra = heads_at(p0 + 2 * k), *rb = heads_at(p0 + 2 * k + 1);
    for (int h = 0; h < u.kv_count; ++h)
      for (int ch = 0; ch < D / 32; ++ch) {
        const __m512i a = ra ? _mm512_loadu_si512(ra + h * D + ch * 32) : _mm512_setzero_si512();
        const __m512i b = rb ? _mm512_loadu_si512(rb + h * D + ch * 32) : _mm512_setzero_si512();
        _mm512_store_si512(blocks[h].vb + ((2 * ch) * 16 + k) * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(blocks[h].vb + ((2 * ch + 1) * 16 + k) * 32, _mm512_unpackhi_epi16(a, b));
      }
  }
}

// Scores of the block's 32 positions (rows: positions, lanes: the tile's query rows) on the
// tiles, its two 16-position halves side by side (C tiles 0 and 1), on tiles 0-3 only: each
// half's K rows in tile 2 in turn, the queries in 3.
BF16_TARGET void block_scores(const KvBlock &s, const uint32_t *qt, int D, float st[kKeys][kRows]) {
  _tile_zero(0);
  _tile_zero(1);
  for (int ch = 0; ch < D / 32; ++ch) {
    _tile_loadd(3, qt + ch * 256, 64);
    _tile_loadd(2, s.k_rows[0] + ch * 32, s.k_stride[0]);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(2, s.k_rows[1] + ch * 32, s.k_stride[1]);
    _tile_dpbf16ps(1, 2, 3);
  }
  _tile_stored(0, st[0], 64);
  _tile_stored(1, st[16], 64);
}

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

// Tiles of this many rows or fewer take row_softmax.
constexpr int kFewRows = 4;

// The next block's K and V lines of the unit's KV heads, asked for a share at a time while
// this block computes (attention_heads::prefetch_share; all at once, the requests beyond the
// line fill buffers stalled the core): up to two runs of slots in one cache block each.
struct Ahead {
  attention_heads::NextRows rows[4];
  int count = 0;
  void ask() {
    for (int i = 0; i < count; ++i) attention_heads::prefetch_share(&rows[i]);
  }
};

// Ahead for positions [p, p + 32) ∩ [lo, hi), its lines spread over `asks` asks.
Ahead next_block(const Call &c, const Unit &u, int p, int lo, int hi, int asks) {
  Ahead a;
  const int D = c.s.head_dim, bs = c.s.block_size, end = std::min(p + kKeys, hi);
  const size_t stride = static_cast<size_t>(c.s.num_kv_heads) * D * 2;
  const int lines = (u.kv_count * D * 2 + 63) / 64;
  for (p = std::max(p, lo); p < end && a.count < 4;) {
    const int run = std::min(end, (p / bs + 1) * bs) - p;
    const size_t at = (slot_at(c, u.table_row, p) + static_cast<size_t>(u.kv_first) * D) * 2;  // bytes
    const int per = (run * lines + asks - 1) / asks;
    a.rows[a.count++] = {reinterpret_cast<const char *>(c.k_cache) + at, stride, run, lines, per, 0};
    a.rows[a.count++] = {reinterpret_cast<const char *>(c.v_cache) + at, stride, run, lines, per, 0};
    p += run;
  }
  return a;
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

// One block for one tile: o[row] = o[row] * alpha + P[row] . V, the products accumulated onto
// o's rows in C tiles loaded from o and stored back (tiles 4-7 configured with the unit's
// rows, run_unit), three 16-column value tiles at a time.
BF16_TARGET void block(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0,
                       Ahead &ahead) {
  const int D = c.s.head_dim, stride = D * 4;
  alignas(64) float st[kKeys][kRows];
  alignas(64) uint32_t pa[kRows * 16];
  alignas(64) float alpha[kRows];
  ahead.ask();
  block_scores(s, qt, D, st);
  ahead.ask();
  block_softmax(c, tl, p0, st, pa, alpha);
  rescale_rows(tl, alpha, o, D);
  _tile_loadd(4, pa, 64);
  // C 5, 6, 7 and V rows in 0, 1, 2: the products overlap, and each store waits on one
  // product's latency, not on a chain of them.
  for (int part = 0; part < D / 16; part += 3) {
    const int n = std::min(3, D / 16 - part);
    float *op = o + part * 16;
    const uint16_t *vp = s.vb + part * 16 * 32;
    _tile_loadd(5, op, stride);
    _tile_loadd(0, vp, 64);
    if (n > 1) {
      _tile_loadd(6, op + 16, stride);
      _tile_loadd(1, vp + 16 * 32, 64);
    }
    if (n > 2) {
      _tile_loadd(7, op + 32, stride);
      _tile_loadd(2, vp + 2 * 16 * 32, 64);
    }
    _tile_dpbf16ps(5, 4, 0);
    if (n > 1) _tile_dpbf16ps(6, 4, 1);
    if (n > 2) _tile_dpbf16ps(7, 4, 2);
    _tile_stored(5, op, stride);
    if (n > 1) _tile_stored(6, op + 16, stride);
    if (n > 2) _tile_stored(7, op + 32, stride);
    ahead.ask();
  }
}

// o's value tiles (D / 16 of them: D <= 64) in C tiles 4-7, and back.
BF16_TARGET void load_o(const float *o, int D) {
  _tile_loadd(4, o, D * 4);
  _tile_loadd(5, o + 16, D * 4);
  if (D / 16 < 4) return;
  _tile_loadd(6, o + 32, D * 4);
  _tile_loadd(7, o + 48, D * 4);
}

BF16_TARGET void store_o(float *o, int D) {
  _tile_stored(4, o, D * 4);
  _tile_stored(5, o + 16, D * 4);
  if (D / 16 < 4) return;
  _tile_stored(6, o + 32, D * 4);
  _tile_stored(7, o + 48, D * 4);
}

// block() with o held in C tiles 4-7 from block to block (D <= 64): stored, rescaled and
// reloaded only where a row's max moved, else the block's products add straight onto it. The
// same products on the same floats as block(), without its loads and stores of o.
BF16_TARGET void block_resident(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0) {
  const int D = c.s.head_dim;
  alignas(64) float st[kKeys][kRows];
  alignas(64) uint32_t pa[kRows * 16];
  alignas(64) float alpha[kRows];
  block_scores(s, qt, D, st);
  block_softmax(c, tl, p0, st, pa, alpha);
  if (any_moved(tl, alpha)) {
    store_o(o, D);
    rescale_rows(tl, alpha, o, D);
    load_o(o, D);
  }
  _tile_loadd(0, pa, 64);
  _tile_loadd(1, s.vb, 64);
  _tile_loadd(2, s.vb + 16 * 32, 64);
  _tile_dpbf16ps(4, 0, 1);
  _tile_dpbf16ps(5, 0, 2);
  if (D / 16 < 4) return;
  _tile_loadd(3, s.vb + 2 * 16 * 32, 64);
  _tile_dpbf16ps(6, 0, 3);
  _tile_loadd(1, s.vb + 3 * 16 * 32, 64);
  _tile_dpbf16ps(7, 0, 1);
}

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

// The tile's rows out: o / l, each 32-dimension chunk's two value tiles (unpacklo's and
// unpackhi's dimensions) merged back into dimension order.
BF16_TARGET void finish_tile(const Call &c, const Tile &tl, const float *o) {
  const int D = c.s.head_dim;
  // Dimension d = 8a + b of a chunk sits in the low tile's column 4a + b for b < 4, else in
  // the high tile's column 4a + b - 4 (lane 16 + that of the two-table permute).
  alignas(64) int32_t index[32];
  for (int d = 0; d < 32; ++d) index[d] = d % 8 < 4 ? 4 * (d / 8) + d % 8 : 16 + 4 * (d / 8) + d % 8 - 4;
  const __m512i first = _mm512_load_si512(index), second = _mm512_load_si512(index + 16);
  for (int j = 0; j < tl.count; ++j) {
    float *dst = c.out + (static_cast<size_t>(tl.t[j]) * c.s.num_heads + tl.head[j]) * D;
    const __m512 l = _mm512_set1_ps(tl.l[j]);
    for (int ch = 0; ch < D / 32; ++ch) {
      const __m512 lo = _mm512_loadu_ps(o + j * D + ch * 32), hi = _mm512_loadu_ps(o + j * D + ch * 32 + 16);
      _mm512_storeu_ps(dst + ch * 32, _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), l));
      _mm512_storeu_ps(dst + ch * 32 + 16, _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), l));
    }
  }
}

// Block by block, each gathered block taken by every tile whose rows see it (block() or
// block_dot()), the next block's K and V asked for meanwhile.
BF16_TARGET void run_blocks(const Call &c, const Unit &u, Scratch &s, int per_head, int lo, int hi) {
  const int D = c.s.head_dim, n_tiles = static_cast<int>(s.tiles.size());
  s.kv.resize(u.kv_count);
  for (int p0 = lo / kKeys * kKeys; p0 < hi; p0 += kKeys) {
    gather_values(c, u, p0, lo, hi, s.kv.data());
    for (int h = 0; h < u.kv_count; ++h) gather_keys(c, u.table_row, u.kv_first + h, p0, lo, hi, s.kv[h]);
    // A block outside a tile's rows' contexts would leave them as they are: skipped.
    auto touches = [&](int k) { return p0 < s.tiles[k].hi && p0 + kKeys > s.tiles[k].lo; };
    int active = 0;
    for (int k = 0; k < n_tiles; ++k) active += touches(k);
    Ahead ahead = next_block(c, u, p0 + kKeys, lo, hi, active * (2 + (D / 16 + 2) / 3));  // block()'s asks
    for (int k = 0; k < n_tiles; ++k) {
      if (!touches(k)) continue;
      const uint32_t *qt = s.qt.data() + k * 8 * D;
      float *o = s.o.data() + k * kRows * D;
      if (c.amx)
        block(c, s.kv[k / per_head], s.tiles[k], qt, o, p0, ahead);
      else
        block_dot(c, s.kv[k / per_head], s.tiles[k], qt, o, p0, ahead);
    }
  }
}

// Whether a tile's o fits the four C tiles 4-7 (AMX, D <= 64): run_tiles_resident's form.
bool o_fits_tiles(const Call &c) { return c.amx && c.s.head_dim <= 64; }

// Tile by tile, each over every block its rows see with o resident in the value tiles
// (block_resident; AMX, D <= 64): the unit's blocks gathered first, for all its tiles.
BF16_TARGET void run_tiles_resident(const Call &c, const Unit &u, Scratch &s, int per_head, int lo, int hi) {
  const int D = c.s.head_dim, first = lo / kKeys, blocks = (hi + kKeys - 1) / kKeys - first;
  s.kv.resize(static_cast<size_t>(blocks) * u.kv_count);
  for (int b = 0; b < blocks; ++b) {
    KvBlock *kv = s.kv.data() + static_cast<size_t>(b) * u.kv_count;
    gather_values(c, u, (first + b) * kKeys, lo, hi, kv);
    for (int h = 0; h < u.kv_count; ++h)
      gather_keys(c, u.table_row, u.kv_first + h, (first + b) * kKeys, lo, hi, kv[h]);
  }
  for (size_t k = 0; k < s.tiles.size(); ++k) {
    Tile &tl = s.tiles[k];
    const uint32_t *qt = s.qt.data() + k * 8 * D;
    float *o = s.o.data() + k * kRows * D;
    load_o(o, D);  // zeros (start_tile)
    for (int p0 = tl.lo / kKeys * kKeys; p0 < tl.hi; p0 += kKeys)
      block_resident(c, s.kv[static_cast<size_t>(p0 / kKeys - first) * u.kv_count + k / per_head], tl, qt, o, p0);
    store_o(o, D);
  }
}

BF16_TARGET void run_unit(const Call &c, const Unit &u, Scratch &s) {
  const int D = c.s.head_dim, per_head = (u.end - u.begin + kRows - 1) / kRows, n_tiles = u.kv_count * per_head;
  s.tiles.resize(n_tiles);
  s.o.resize(static_cast<size_t>(n_tiles) * kRows * D);
  s.qt.resize(static_cast<size_t>(n_tiles) * 8 * D);
  int lo = INT_MAX, hi = 0, rows = 1;
  for (int k = 0; k < n_tiles; ++k) {
    start_tile(c, u, u.kv_first + k / per_head, u.begin + (k % per_head) * kRows, s.tiles[k],
               s.qt.data() + k * 8 * D, s.o.data() + k * kRows * D);
    lo = std::min(lo, s.tiles[k].lo);
    hi = std::max(hi, s.tiles[k].hi);
    rows = std::max(rows, s.tiles[k].count);
  }
  if (c.amx) amx_configure_tiles(rows);
  // A prefill's span (more than a tile a KV head) keeps o in tiles; a decode token's tile of
  // few rows takes every block as it is gathered, its K and V read once from the cache.
  if (o_fits_tiles(c) && per_head > 1)
    run_tiles_resident(c, u, s, per_head, lo, hi);
  else
    run_blocks(c, u, s, per_head, lo, hi);
  if (c.amx) _tile_release();
  for (int k = 0; k < n_tiles; ++k) finish_tile(c, s.tiles[k], s.o.data() + k * kRows * D);
}

// The most rows of one KV head a unit takes: kGroupTiles tiles; where a prefill keeps o in the
// tiles (o_fits_tiles) and each tile reads the unit's gathered blocks from
// L2 rather than from L1, up to kResidentGroupTiles, so that fewer units gather the same
// blocks, while the call still makes 4 units a thread.
int unit_rows(const Call &c, int threads) {
  const int most = kGroupTiles * kRows;
  if (!o_fits_tiles(c)) return most;
  const int64_t fit = static_cast<int64_t>(c.s.num_queries) * c.s.num_heads / (4 * threads) / kRows * kRows;
  return static_cast<int>(std::clamp<int64_t>(fit, most, kResidentGroupTiles * kRows));
}

// Spans of consecutive queries of one block-table row, cut into units: a span of one tile a
// KV head (a decode token) takes all its KV heads in one unit when the call has spans enough
// for the threads, so that each cache block is read whole rather than as one head's strided
// rows; else each KV head's rows go in units of up to unit_rows rows. The costliest first, so
// that the threads finish together.
std::vector<Unit> make_units(const Call &c, int threads) {
  const int G = c.s.num_heads / c.s.num_kv_heads, most = unit_rows(c, threads);
  const std::vector<QuerySpan> spans = query_spans(c.rows, c.s.num_queries, INT_MAX);
  const bool whole_blocks = static_cast<int>(spans.size()) >= 2 * threads;
  std::vector<Unit> units;
  for (const QuerySpan &sp : spans) {
    const int i = sp.first, rows = sp.count * G, table_row = c.rows ? c.rows[i] : i;
    for (int b = 0; b < rows; b += most) {
      const int e = std::min(rows, b + most);
      int64_t cost = 0;
      for (int t = i + b / G; t <= i + (e - 1) / G; ++t) cost += c.lens[t] - window_start(c.lens[t], c.s.window);
      if (whole_blocks && rows <= kRows)
        units.push_back({table_row, 0, c.s.num_kv_heads, i, b, e, cost * c.s.num_kv_heads});
      else
        for (int h = 0; h < c.s.num_kv_heads; ++h) units.push_back({table_row, h, 1, i, b, e, cost});
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit &a, const Unit &b) { return a.cost > b.cost; });
  return units;
}

}  // namespace

const char *paged_attention_bf16_form(const PagedAttentionShape &shape) {
  if (shape.head_dim % 32 != 0 || shape.head_dim > kMaxDim) return "";
  if (bf16_amx_available()) return "amx";
  return bf16_dot_default_path() == Bf16DotPath::kNative ? "native" : "";
}

void paged_attention_bf16(const PagedAttentionShape &shape, const float *q, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *block_tables, const int32_t *query_rows,
                         const int32_t *context_lens, float scale, float *out, int threads) {
  if (shape.num_queries <= 0) return;
  const Call c{shape, q, k_cache, v_cache, block_tables, query_rows, context_lens, scale, out, bf16_amx_available()};
  const std::vector<Unit> units = make_units(c, threads);
  shared_pool(threads).run(static_cast<int>(units.size()), threads, [&](int u) {
    thread_local Scratch scratch;
    run_unit(c, units[u], scratch);
  });
}
#else
const char *paged_attention_bf16_form(const PagedAttentionShape &) { return ""; }
void paged_attention_bf16(const PagedAttentionShape &, const float *, const uint16_t *, const uint16_t *,
                         const int32_t *, const int32_t *, const int32_t *, float, float *, int) {}
#endif

bool paged_attention_bf16_fits(const PagedAttentionShape &shape) { return *paged_attention_bf16_form(shape) != 0; }

}  // namespace deepinfer
