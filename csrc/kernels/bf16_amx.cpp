#include "bf16_amx.h"

#include "bf16_linear.h"
#include "packed_linear_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DEEPINFER_BF16_AMX 1
#endif

namespace deepinfer {

#ifdef DEEPINFER_BF16_AMX
namespace {

constexpr int kTile = 16;                   // rows of a tile, and fp32 columns of a C tile
constexpr int kTileK = 32;                  // bf16 values along K in one A row / B tile
constexpr int kRowsAhead = 64;              // output rows asked for ahead of the tiles (ask_for_rows)
constexpr int kChunkBytes = 512 << 10;      // weight bytes a chunk of blocks holds (chunk_blocks)
constexpr long kReqXcompPerm = 0x1023;      // arch_prctl: ask for an XSAVE feature's state
constexpr long kXfeatureXtiledata = 18;     // AMX's tile data

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#define AMX_KERNEL __attribute__((target("amx-tile,amx-bf16,avx512f")))

// The C tile's valid part into y, + bias: rows [m, min(m + 16, M)), outputs [base, base + 16) ∩ [n0, n1).
// One masked 16-lane store a row: the results leave the tile at vector width.
AMX_KERNEL void store(const float *c, const float *bias, float *y, int N, int M, int m, int base, int n0, int n1) {
  const int lo = std::max(n0, base), hi = std::min(n1, base + kTile);
  if (lo >= hi) return;
  const __mmask16 lanes = static_cast<__mmask16>(((1u << (hi - lo)) - 1) << (lo - base));
  const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias + base) : _mm512_setzero_ps();
  for (int r = m; r < std::min(m + kTile, M); ++r) {
    __m512 v = _mm512_load_ps(c + (r - m) * kTile);
    if (bias) v = _mm512_add_ps(v, b);  // (no bias: stored as is, a -0 stays -0)
    _mm512_mask_storeu_ps(y + static_cast<size_t>(r) * N + base, lanes, v);
  }
}

// The products of row tiles [m, m + 32) (the second may lie past M: zeros) x blocks b0, b1
// in C tiles 0-3: (first rows, b0), (first rows, b1), (second rows, b0), (second rows, b1).
// Returns whether the second row tile holds rows below M (else it was not computed).
// The B tiles are loaded with the streaming hint: a row pair reads each once, and the chunk's
// other blocks pass before the next pair reads it again (from L2). Kept out of L1, they leave
// it to the row pair's A tiles, which every block of the chunk reads again.
AMX_KERNEL bool two_by_two(const uint16_t *xb, const PackedMatrix &w, int M, int m, int b0, int b1) {
  const int K = w.cols;
  const size_t stride = static_cast<size_t>(K) * kTile;  // uint16 values per block
  const uint16_t *w0 = reinterpret_cast<const uint16_t *>(w.data) + b0 * stride;
  const uint16_t *w1 = reinterpret_cast<const uint16_t *>(w.data) + b1 * stride;
  const uint16_t *x0 = xb + static_cast<size_t>(m) * K, *x1 = x0 + static_cast<size_t>(kTile) * K;
  const bool two_rows = m + kTile < M;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int k = 0; k < K; k += kTileK) {
    _tile_loadd(4, x0 + k, K * 2);
    _tile_stream_loadd(6, w0 + static_cast<size_t>(k) * kTile, 64);
    _tile_stream_loadd(7, w1 + static_cast<size_t>(k) * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_rows) {
      _tile_loadd(5, x1 + k, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  return two_rows;
}

// Blocks of 16 weight rows a chunk takes: about kChunkBytes of the matrix, in pairs. The
// chunk stays in L2 while every row pair runs against all of it; a row pair's A tiles (up to
// 36 KB at 576 columns) stay in L1 meanwhile. Block-major over all rows instead read both
// operands from L2 at every step: 4 tiles of 16 lines each for 4 tile products.
int chunk_blocks(int K) {
  const int per_block = K * kTile * 2;
  return std::max(2, kChunkBytes / per_block / 2 * 2);
}

// The output lines that row pair m's whole tiles of blocks b, b + 1 will be stored into, asked
// for ahead (for writing). y is mostly cold (a fresh activation) and the tiles store its rows a
// row's stride apart, a new page every row or so, which the hardware prefetchers do not
// follow: each tile store waited on its lines' read for ownership.
AMX_KERNEL void ask_for_rows(float *y, int N, int m, int b) {
  float *first = y + static_cast<size_t>(m) * N + b * kTile;
  for (int r = 0; r < 2 * kTile; ++r) {
    __builtin_prefetch(first + static_cast<size_t>(r) * N, 1, 3);
    __builtin_prefetch(first + static_cast<size_t>(r) * N + kTile, 1, 3);
  }
}

// two_by_two's C tiles into c (tiles 2 and 3 only with two_rows).
AMX_KERNEL void stash(bool two_rows, float c[4][kTile * kTile]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (two_rows) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
}

}  // namespace

AMX_KERNEL void amx_configure_tiles(int upper_rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 4 ? kTile : upper_rows);
    c.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes, so without this barrier the
  // stores of the rows and column sizes may be dropped as dead (seen in a -O2 build: every
  // tile left unconfigured, SIGILL at the first tile op).
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

bool bf16_amx_available() {
  static const bool ok = [] {
    const char *env = std::getenv("DEEPINFER_DP_BF16_AMX");
    if ((env && std::strcmp(env, "0") == 0) || !packed_avx512_enabled()) return false;
    unsigned a, b, c, d;  // leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

namespace {

// Row pair m against blocks b, b1 (b1 == b: one block) into y's columns [n0, n1) (+ bias).
AMX_KERNEL void row_pair_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int m,
                                 int b, int b1, int n0, int n1) {
  // Whole tiles without a bias leave the tiles straight into y: through c and 16-lane stores,
  // the output's cache misses stalled the product about a fifth longer.
  const bool whole_columns = !bias && b1 == b + 1 && b * kTile >= n0 && (b1 + 1) * kTile <= n1;
  if (whole_columns && m + kRowsAhead + 2 * kTile <= M) ask_for_rows(y, w.rows, m + kRowsAhead, b);
  const bool two_rows = two_by_two(xb, w, M, m, b, b1);
  if (whole_columns && m + 2 * kTile <= M) {
    float *y0 = y + static_cast<size_t>(m) * w.rows + b * kTile, *y1 = y0 + static_cast<size_t>(kTile) * w.rows;
    _tile_stored(0, y0, w.rows * 4);
    _tile_stored(1, y0 + kTile, w.rows * 4);
    _tile_stored(2, y1, w.rows * 4);
    _tile_stored(3, y1 + kTile, w.rows * 4);
    return;
  }
  alignas(64) float c[4][kTile * kTile];
  stash(two_rows, c);
  store(c[0], bias, y, w.rows, M, m, b * kTile, n0, n1);
  if (b1 != b) store(c[1], bias, y, w.rows, M, m, b1 * kTile, n0, n1);
  if (two_rows) {
    store(c[2], bias, y, w.rows, M, m + kTile, b * kTile, n0, n1);
    if (b1 != b) store(c[3], bias, y, w.rows, M, m + kTile, b1 * kTile, n0, n1);
  }
}

// A row pair's gate and up products (two_by_two's C tiles, stashed) for gate block b.
struct GatedTiles {
  alignas(64) float c[4][kTile * kTile];
  int m = -1, b = 0;
  bool two_rows = false;
};

// The activation of g's products into out or out_b, rows [g.m, min(g.m + 32, M)).
AMX_KERNEL void finish_gated(const GatedTiles &g, int I, float *out, uint16_t *out_b, int M, GatedActivation act) {
  alignas(64) float h[kTile * kTile];
  for (int t = 0; t < (g.two_rows ? 2 : 1); ++t) {
    act(g.c[2 * t], g.c[2 * t + 1], h, kTile * kTile);
    const int first = g.m + t * kTile;
    for (int r = first; r < std::min(first + kTile, M); ++r) {
      const __m512 v = _mm512_load_ps(h + (r - first) * kTile);
      const size_t at = static_cast<size_t>(r) * I + g.b * kTile;
      if (out_b)
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out_b + at), bf16_round16(v));
      else
        _mm512_storeu_ps(out + at, v);
    }
  }
}

}  // namespace

AMX_KERNEL void bf16_amx_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M,
                                 int n0, int n1) {
  amx_configure_tiles();  // tiles 0-3: C (2 row tiles x 2 blocks); 4-5: A (the row tiles); 6-7: B (the blocks)
  const int first = n0 / kTile, end = (n1 + kTile - 1) / kTile, chunk = chunk_blocks(w.cols);
  for (int c0 = first; c0 < end; c0 += chunk) {
    const int c1 = std::min(end, c0 + chunk);
    for (int m = 0; m < M; m += 2 * kTile)
      for (int b = c0; b < c1; b += 2) row_pair_columns(xb, w, bias, y, M, m, b, std::min(b + 1, c1 - 1), n0, n1);
  }
  _tile_release();
}

AMX_KERNEL void bf16_amx_gated(const uint16_t *xb, const PackedMatrix &w, float *out, uint16_t *out_b, int M,
                               int j0, int j1, GatedActivation act) {
  amx_configure_tiles();
  const int I = w.rows / 2, first = j0 / kTile, end = j1 / kTile;
  const int chunk = chunk_blocks(w.cols) / 2;  // a gate block and its up block
  // Each row pair's activation runs after the next pair's tile products are issued, not right
  // after its own: the tiles have their next operands in hand while the vector units work.
  GatedTiles tiles[2];
  int next = 0;
  for (int c0 = first; c0 < end; c0 += chunk) {
    const int c1 = std::min(end, c0 + chunk);
    for (int m = 0; m < M; m += 2 * kTile)
      for (int b = c0; b < c1; ++b) {
        GatedTiles &now = tiles[next], &before = tiles[next ^ 1];
        now.two_rows = two_by_two(xb, w, M, m, b, b + I / kTile);
        if (before.m >= 0) finish_gated(before, I, out, out_b, M, act);
        stash(now.two_rows, now.c);
        now.m = m;
        now.b = b;
        next ^= 1;
      }
  }
  if (tiles[next ^ 1].m >= 0) finish_gated(tiles[next ^ 1], I, out, out_b, M, act);
  _tile_release();
}
#else
void amx_configure_tiles() {}
bool bf16_amx_available() { return false; }
void bf16_amx_columns(const uint16_t *, const PackedMatrix &, const float *, float *, int, int, int) {}
void bf16_amx_gated(const uint16_t *, const PackedMatrix &, float *, uint16_t *, int, int, int, GatedActivation) {}
#endif

}  // namespace deepinfer
