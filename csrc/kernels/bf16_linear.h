// y = x · wᵀ + b in bf16 arithmetic: w stored bf16, x rounded to bf16 (round to nearest
// even, as torch's .to(torch.bfloat16)), every product accumulated in fp32. This is the
// product vLLM's CPU backend computes for a bf16 checkpoint; on a CPU with AVX512-BF16 it
// runs on `vdpbf16ps` (a bf16 pair product added into fp32 twice per instruction: twice the
// multiply-adds of an fp32 FMA).
//
// Layout ("bf16_pairs", a PackedMatrix of format kBF16Pairs): the rows in blocks of 16, each
// block [cols / 2][16][2]: step p holds the pairs (w[n, 2p], w[n, 2p + 1]) of its 16 rows,
// one 64-byte vector, which is what vdpbf16ps multiplies against a broadcast pair of x. So
// rows % 16 == 0 and cols % 2 == 0.
//
// Order: output n is one fp32 chain over p = 0, 1, ..., cols / 2 - 1 of
//   acc += w[n, 2p + 1] * x[2p + 1];  acc += w[n, 2p] * x[2p]
// (each add rounded once, the product being exact), with vdpbf16ps's rules: bf16 inputs
// that are subnormal count as zero and a subnormal sum is flushed to zero. Then + bias.
// The same floats whatever the row count, the tiling or the thread split, and on every
// path but AMX: without AVX512-BF16 the pairs are widened to fp32 and added the same way.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "packed_weights.h"
#include "side_lines.h"

namespace deepinfer {

// kAmx: AMX tiles (bf16_amx.h; its own floats, for matrices with cols % 32 == 0; others
// take the next path); kNative: vdpbf16ps; kWiden512, kWiden256 and kScalar: vdpbf16ps's
// floats.
enum class Bf16DotPath { kAmx, kNative, kWiden512, kWiden256, kScalar };

// AMX where bf16_amx_available(), else vdpbf16ps where the CPU has it (and
// DEEPINFER_DP_BF16_DOT is not "0"), else 512-bit widening where AVX-512 is on
// (packed_avx512_enabled), else 256-bit widening where the CPU has AVX2 and FMA, else
// scalar code. Read once.
Bf16DotPath bf16_dot_default_path();
const char *bf16_dot_path_name(Bf16DotPath path);
// Whether `path` can run on this CPU.
bool bf16_dot_path_available(Bf16DotPath path);

// src [rows, cols] bf16 (nn.Linear's layout) into dst in the pairs layout, subnormals made
// signed zeros (what vdpbf16ps reads them as). rows % 16 == 0, cols % 2 == 0.
void bf16_pairs_pack(const uint16_t *src, int rows, int cols, uint16_t *dst);

// Row `row` of a pairs matrix, widened to fp32 (embedding lookups, widened GEMMs).
void bf16_pairs_widen_row(const PackedMatrix &w, int row, float *out);

// x [M, cols] rounded to bf16 as torch rounds (NaN -> 0x7fc0), subnormal results made zeros.
void bf16_round_rows(const float *x, int M, int cols, uint16_t *out);

#if defined(__x86_64__) && defined(__GNUC__)
// 16 floats rounded to bf16 as torch's .to(torch.bfloat16) rounds them (to nearest, ties to
// even, a NaN as 0x7fc0, subnormals kept), one per 32-bit lane: the KV cache's rounding
// (kv_store), and bf16_round16's before it flushes.
__attribute__((target("avx512f"))) inline __m512i bf16_round16_lanes(__m512 f) {
  const __m512i u = _mm512_castps_si512(f), one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);  // round half to even
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, odd)), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// 16 floats rounded as bf16_round_rows rounds them: for the kernels that round their rows
// as they store them (bf16_round_rows itself, the gated product's bf16 output).
__attribute__((target("avx512f"))) inline __m256i bf16_round16(__m512 f) {
  __m512i r = bf16_round16_lanes(f);
  r = _mm512_mask_and_epi32(r, _mm512_testn_epi32_mask(r, _mm512_set1_epi32(0x7f80)), r, _mm512_set1_epi32(0x8000));
  return _mm512_cvtepi32_epi16(r);
}
#endif

// The outputs [n_begin, n_end) of y [M, w.rows] (any bounds: a split inside a block of 16
// computes the block and stores its part). `side`: lines to ask for meanwhile (the 512-bit
// paths; the others leave them).
void bf16_pairs_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                        int n_end, Bf16DotPath path, SideLines *side = nullptr);

// bf16_pairs_columns on inputs already rounded (bf16_round_rows' values, xb [M, w.cols]),
// the same floats: a caller that rounds each input row once, as it produces it, spares every
// thread of a split product rounding all of them. On the AMX path (bf16_amx_available) xb
// must hold bf16_rows_padded(M) rows, those past M zero (bf16_pairs_threaded takes any M).
void bf16_pairs_columns_rounded(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M,
                                int n_begin, int n_end, Bf16DotPath path, SideLines *side = nullptr);

// Whether `path` multiplies w on AMX tiles (AMX takes cols % 32 == 0 only; other matrices
// go the next path down). Such a matrix reads its inputs a whole tile of 16 rows at a time.
inline bool bf16_amx_multiplies(const PackedMatrix &w, Bf16DotPath path) {
  return path == Bf16DotPath::kAmx && w.cols % 32 == 0;
}

// M rounded up to AMX's tile of 16 rows.
inline int bf16_rows_padded(int M) { return (M + 15) / 16 * 16; }

}  // namespace deepinfer
