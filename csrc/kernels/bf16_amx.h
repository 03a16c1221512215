// The bf16 product on AMX tiles (TDPBF16PS: a 16x32 bf16 tile times a 32x16 one, added
// into a 16x16 fp32 tile), for CPUs with AMX-BF16: measured 890 GFLOP/s on one core of this
// machine against 107 for vdpbf16ps and 212 for 512-bit fp32 FMA (benchmarks/bf16_kernels.py).
// The pairs layout is already AMX's B-tile layout: 16 steps of one block of 16 rows are one
// contiguous 1 KB tile.
//
// Every row count takes the same tiles (rows past M are zeros), every output the same tile
// products in the same K order, so each row's floats are its own whatever the batch or the
// thread split. They are not vdpbf16ps's floats: TDPBF16PS's internal order is not a
// sequence of fp32 adds (none of five candidate orders matched it), so a CPU without AMX
// (bf16_linear.h's paths) differs from it in the last bits.
#pragma once

#include <cstdint>

#include "packed_weights.h"

namespace deepinfer {

// Whether this process can run AMX-BF16 (the CPU has it, Linux granted the tile state,
// DEEPINFER_DP_BF16_AMX is not "0" and AVX-512 is on: packed_avx512_enabled). Asked once.
bool bf16_amx_available();

// Loads the tile configuration of this file's kernel and of paged_attention_bf16.cpp on the
// calling thread: tiles 0-3 of 16 rows x 64 bytes, tiles 4-7 of upper_rows (1-16) rows x 64
// bytes (the attention's value products for a decode token's few rows load and store no
// more). Only where bf16_amx_available().
void amx_configure_tiles(int upper_rows = 16);

// y[m, n] for n in [n0, n1) (any bounds) of rounded inputs xb [M16, w.cols] bf16, M16 = M
// rounded up to 16 with zero rows; w.cols % 32 == 0.
void bf16_amx_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                      int n1);

// A gated activation over n floats: out = act(g) * u (cpu_fused_ops.h's silu_mul, gelu_tanh_mul).
using GatedActivation = void (*)(const float *g, const float *u, float *out, int n);

// An MLP's gate/up product and its activation in one pass, for w the gate rows then the up
// rows (I = w.rows / 2 each, a multiple of 16): out[m, j] = act(g) * u for j in [j0, j1)
// (multiples of 16), g and u the products of input row m with gate row j and up row I + j as
// bf16_amx_columns computes them, act's floats. out is [M, I]; the [M, 2I] product is never
// written out. With out_b set instead of out, those floats rounded to bf16 (bf16_round_rows'
// rounding) into out_b [M, I]: the input of a bf16 down product.
void bf16_amx_gated(const uint16_t *xb, const PackedMatrix &w, float *out, uint16_t *out_b, int M, int j0, int j1,
                    GatedActivation act);

}  // namespace deepinfer
