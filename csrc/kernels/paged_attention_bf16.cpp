#include "paged_attention_bf16.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_bf16_amx.h"
#include "attention_bf16_dot.h"
#include "attention_bf16_shared.h"
#include "attention_bf16_softmax.h"
#include "bf16_amx.h"
#include "bf16_linear.h"
#include "thread_pool.h"

namespace deepinfer {

#ifdef DEEPINFER_BF16_ATTENTION
namespace {

using namespace attention_bf16;

constexpr int kGroupTiles = 8;  // tiles of one KV head and span that share each gathered block
constexpr int kResidentGroupTiles = 32;  // the same where o stays in the tiles (unit_rows)

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
    const size_t at = (static_cast<size_t>(tl.t[j]) * c.s.num_heads + tl.head[j]) * D;
    const __m512 l = _mm512_set1_ps(tl.l[j]);
    for (int ch = 0; ch < D / 32; ++ch) {
      const __m512 lo = _mm512_loadu_ps(o + j * D + ch * 32), hi = _mm512_loadu_ps(o + j * D + ch * 32 + 16);
      const __m512 a = _mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), l);
      const __m512 b = _mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), l);
      if (c.out_b) {
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(c.out_b + at + ch * 32), bf16_round16(a));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(c.out_b + at + ch * 32 + 16), bf16_round16(b));
      } else {
        _mm512_storeu_ps(c.out + at + ch * 32, a);
        _mm512_storeu_ps(c.out + at + ch * 32 + 16, b);
      }
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
                         const int32_t *context_lens, float scale, float *out, int threads, uint16_t *out_b) {
  if (shape.num_queries <= 0) return;
  const Call c{shape, q, k_cache, v_cache, block_tables, query_rows, context_lens,
               scale, out, out_b, bf16_amx_available()};
  const std::vector<Unit> units = make_units(c, threads);
  shared_pool(threads).run(static_cast<int>(units.size()), threads, [&](int u) {
    thread_local Scratch scratch;
    run_unit(c, units[u], scratch);
  });
}
#else
const char *paged_attention_bf16_form(const PagedAttentionShape &) { return ""; }
void paged_attention_bf16(const PagedAttentionShape &, const float *, const uint16_t *, const uint16_t *,
                         const int32_t *, const int32_t *, const int32_t *, float, float *, int, uint16_t *) {}
#endif

bool paged_attention_bf16_fits(const PagedAttentionShape &shape) { return *paged_attention_bf16_form(shape) != 0; }

}  // namespace deepinfer
