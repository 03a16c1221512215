// The bf16 attention's online softmax over a block of 32 positions, in base 2, for a tile of
// query rows lane by lane or one row at a time (row_softmax, a decode token's few rows): both
// forms' products hand it their scores and take its probabilities.
#pragma once

#include "attention_bf16_shared.h"

#ifdef DEEPINFER_BF16_ATTENTION
namespace deepinfer {
namespace attention_bf16 {

// Tiles of this many rows or fewer take row_softmax.
constexpr int kFewRows = 4;

// tile_softmax's floats for row j alone, its 32 scores s in two registers: a decode token's
// tile holds only its own heads, where 16 lanes of rows would mostly compute nothing. Returns
// the row's alpha.
BF16_TARGET float row_softmax(Tile &tl, int j, int p0, float scale, const __m512 s[2], uint32_t *pa);

// The block's softmax step for the tile's rows: pa and each row's alpha (rows past the tile's
// count: probabilities 0, alpha 1).
BF16_TARGET void block_softmax(const Call &c, Tile &tl, int p0, float st[kKeys][kRows], uint32_t *pa,
                               float *alpha);

// o[row] *= alpha[row] for the tile's rows whose max moved (alpha 1: the row as it is).
BF16_TARGET void rescale_rows(const Tile &tl, const float *alpha, float *o, int D);

// Whether a row of the tile has an alpha other than 1: its max moved.
bool any_moved(const Tile &tl, const float *alpha);

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
