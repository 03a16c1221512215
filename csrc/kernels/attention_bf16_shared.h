// The bf16 paged attention's shared pieces (paged_attention_bf16.h): the call, its units and
// tiles, a gathered block, and the target every part of it compiles for. The forms' products
// (attention_bf16_amx.h, attention_bf16_dot.h) and the softmax (attention_bf16_softmax.h) work
// on these; paged_attention_bf16.cpp makes the units and runs them.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define DEEPINFER_BF16_ATTENTION 1
#endif

#ifdef DEEPINFER_BF16_ATTENTION
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "paged_attention.h"
#include "paged_attention_heads.h"

namespace deepinfer {
namespace attention_bf16 {

constexpr int kRows = 16;       // query rows of a tile: a query token and one of its heads each
constexpr int kKeys = 32;       // positions of a block: two 16-key score tiles, one 32-deep value product
constexpr int kMaxDim = 256;

// Both forms' code: only the AMX intrinsics emit AMX instructions, and the vdpbf16ps form uses none.
#define BF16_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma")))

// The call, as every unit reads it.
struct Call {
  const PagedAttentionShape &s;
  const float *q;
  const uint16_t *k_cache, *v_cache;
  const int32_t *tables, *rows, *lens;
  float scale;
  float *out;
  uint16_t *out_b;  // set: the outputs rounded to bf16 here instead (out unused)
  bool amx;         // the products on AMX tiles, else on vdpbf16ps
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

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
