// The bf16 attention's products on AMX tiles (TDPBF16PS): a block's scores, and its values'
// product onto o, either loaded from o and stored back a block at a time (block) or held in C
// tiles 4-7 from block to block (block_resident, head size <= 64).
#pragma once

#include "attention_bf16_shared.h"

#ifdef DEEPINFER_BF16_ATTENTION
namespace deepinfer {
namespace attention_bf16 {

// One block for one tile: o[row] = o[row] * alpha + P[row] . V, the products accumulated onto
// o's rows in C tiles loaded from o and stored back (tiles 4-7 configured with the unit's
// rows, run_unit), three 16-column value tiles at a time.
BF16_TARGET void block(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0,
                       Ahead &ahead);

// o's value tiles (D / 16 of them: D <= 64) in C tiles 4-7, and back.
BF16_TARGET void load_o(const float *o, int D);
BF16_TARGET void store_o(float *o, int D);

// block() with o held in C tiles 4-7 from block to block (D <= 64): stored, rescaled and
// reloaded only where a row's max moved, else the block's products add straight onto it. The
// same products on the same floats as block(), without its loads and stores of o.
BF16_TARGET void block_resident(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0);

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
