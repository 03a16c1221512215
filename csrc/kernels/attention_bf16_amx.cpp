#include "attention_bf16_amx.h"

#ifdef DEEPINFER_BF16_ATTENTION
#include <algorithm>

#include "attention_bf16_softmax.h"

namespace deepinfer {
namespace attention_bf16 {

namespace {

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

}  // namespace

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

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
