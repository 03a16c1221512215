// Internal to the packed-weight kernels: one 32-value block of a packed row widened into four
// AVX2 registers (values 8i..8i+7 in out[i]), exactly as packed_weights.h defines widening;
// and the same block of two rows into four AVX-512 registers, one row per half.
// Shared by the row widening and the fused small-batch product, so both give the same floats.
//
// One function per format, so a kernel can pick its format once, outside its loops: a
// format test per block costs more than the widening itself at batch 1.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "packed_weights.h"

#define DEEPINFER_PACKED_AVX2 1
#define DEEPINFER_AVX2_FN __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace deepinfer {
namespace packed_detail {

DEEPINFER_AVX2_FN __m256 scale_vec(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// Bytes p[0, 8) as eight 32-bit lanes (zero-extended straight from memory: one instruction).
DEEPINFER_AVX2_FN __m256i bytes8(const uint8_t *p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}

// A Q4 block's 16 bytes hold value j in byte j's low nibble and value j + 16 in its high one:
// q[0] = values 0-7, q[1] = 8-15, q[2] = 16-23, q[3] = 24-31, minus `bias`, as floats (exact).
DEEPINFER_AVX2_FN void nibbles(const uint8_t *qs, int bias, __m256 q[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0f), off = _mm256_set1_epi32(bias);
  const __m256i a = bytes8(qs), b = bytes8(qs + 8);
  q[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(a, mask), off));
  q[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, mask), off));
  q[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(a, 4), off));
  q[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), off));
}

DEEPINFER_AVX2_FN void widen_bf16(const uint8_t *b, __m256 w[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 16 * i));
    w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// cpu_linear's horizontal sum, step for step (the same float whatever the path).
DEEPINFER_AVX2_FN float sum8(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Scales are fp16, so scale * quant is exact in fp32: Q4_0's (q - 8) * d rounds nowhere, and
// Q4_1's d * q + min rounds once, as gguf's separate multiply and add do (a fused
// multiply-add gives the same float).
DEEPINFER_AVX2_FN void widen_q4_0(const uint8_t *b, __m256 w[4]) {
  const __m256 d = scale_vec(b);
  nibbles(b + 2, 8, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, w[i]);
}

DEEPINFER_AVX2_FN void widen_q4_1(const uint8_t *b, __m256 w[4]) {
  const __m256 d = scale_vec(b), m = scale_vec(b + 2);
  nibbles(b + 4, 0, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);
}

DEEPINFER_AVX2_FN void widen_q8_0(const uint8_t *b, __m256 w[4]) {
  const __m256 d = scale_vec(b);
  for (int i = 0; i < 4; ++i)
    w[i] = _mm256_mul_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + 8 * i)))));
}

// AVX-512: the same block of two weight rows widened at once, one row per 256-bit half
// (row a's values 8i..8i+7 in out[i]'s low half, row b's in its high half). Each half holds
// exactly the floats the AVX2 widening gives for its row, so a 512-bit multiply-add updates
// two independent 8-lane chains, each the same chain as the AVX2 kernel's: twice the lanes
// a cycle and half the widening instructions, and not one float changes.
#define DEEPINFER_PACKED_AVX512 1
#define DEEPINFER_AVX512_FN \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) inline

// A block's leading fp16 scales (Q4_1: d then min; the others: d) of rows a and b,
// converted in one instruction: out[s] holds scale s of row a in its low half and of row b
// in its high half.
template <int S>
DEEPINFER_AVX512_FN void scales_pair(const uint8_t *a, const uint8_t *b, __m512 out[S]) {
  uint32_t ha = 0, hb = 0;
  std::memcpy(&ha, a, 2 * S);
  std::memcpy(&hb, b, 2 * S);
  // S = 1: [da, db, ...]; S = 2: [da, ma, db, mb]
  const __m512 f = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(ha | static_cast<uint64_t>(hb) << (16 * S))));
  for (int s = 0; s < S; ++s)
    out[s] = _mm512_permutexvar_ps(_mm512_set_epi32(S + s, S + s, S + s, S + s, S + s, S + s, S + s, S + s,
                                                     s, s, s, s, s, s, s, s), f);
}

// The 16 quant bytes of a Q4 (or Q5) block in each row as 32 nibbles of each: q[0] = values
// 0-7 of row a, then of row b; q[1] = values 8-15; q[2] = 16-23; q[3] = 24-31.
DEEPINFER_AVX512_FN void nibbles_pair_ints(const uint8_t *qa, const uint8_t *qb, __m512i q[4]) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qa));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qb));
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(va, vb));  // bytes 0-7 of a, of b
  const __m512i hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(va, vb));  // bytes 8-15
  const __m512i mask = _mm512_set1_epi32(0x0f);
  q[0] = _mm512_and_si512(lo, mask);
  q[1] = _mm512_and_si512(hi, mask);
  q[2] = _mm512_srli_epi32(lo, 4);
  q[3] = _mm512_srli_epi32(hi, 4);
}

// The same, minus `bias`, as floats (exact): nibbles::q[0..3] for both rows.
DEEPINFER_AVX512_FN void nibbles_pair(const uint8_t *qa, const uint8_t *qb, int bias, __m512 q[4]) {
  __m512i n[4];
  nibbles_pair_ints(qa, qb, n);
  const __m512i off = _mm512_set1_epi32(bias);
  for (int i = 0; i < 4; ++i) q[i] = _mm512_cvtepi32_ps(_mm512_sub_epi32(n[i], off));
}

DEEPINFER_AVX512_FN void widen_pair_q4_0(const uint8_t *a, const uint8_t *b, __m512 w[4]) {
  __m512 d;
  scales_pair<1>(a, b, &d);
  nibbles_pair(a + 2, b + 2, 8, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_mul_ps(d, w[i]);
}

DEEPINFER_AVX512_FN void widen_pair_q4_1(const uint8_t *a, const uint8_t *b, __m512 w[4]) {
  __m512 dm[2];
  scales_pair<2>(a, b, dm);
  nibbles_pair(a + 4, b + 4, 0, w);
  for (int i = 0; i < 4; ++i) w[i] = _mm512_fmadd_ps(dm[0], w[i], dm[1]);
}

DEEPINFER_AVX512_FN void widen_pair_q8_0(const uint8_t *a, const uint8_t *b, __m512 w[4]) {
  __m512 d;
  scales_pair<1>(a, b, &d);
  for (int h = 0; h < 2; ++h) {  // 16 quant bytes of each row at a time: values 16h..16h+15
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i *>(a + 2 + 16 * h));
    const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 2 + 16 * h));
    w[2 * h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(va, vb))));
    w[2 * h + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(va, vb))));
  }
}

DEEPINFER_AVX512_FN void widen_pair_bf16(const uint8_t *a, const uint8_t *b, __m512 w[4]) {
  for (int i = 0; i < 4; ++i) {
    const __m256i h = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 16 * i)),
                                       _mm_loadu_si128(reinterpret_cast<const __m128i *>(a + 16 * i)));
    w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// The state a block's pieces share (the K-quants' decoded scales); none here.
struct NoState {};

// The format as a type, for kernels that take it as a template argument. A block holds
// kValues values in kBytes bytes and widens in kSubs pieces of 32 values: after
// prepare(block, state), widen(block, s, state, w) gives values 32s..32s+31 of the block
// (these formats have one piece; the K-quants' 256-value super-blocks,
// packed_blocks_kquant.h, eight).
struct BF16 {
  static constexpr size_t kBytes = 64;
  static constexpr int kValues = 32, kSubs = 1;
  using State = NoState;
  DEEPINFER_AVX2_FN static void prepare(const uint8_t *, State &) {}
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, int, const State &, __m256 w[4]) { widen_bf16(b, w); }
  DEEPINFER_AVX512_FN static void widen_pair(const uint8_t *a, const uint8_t *b, int, const State &, const State &,
                                             __m512 w[4]) {
    widen_pair_bf16(a, b, w);
  }
};
struct Q4_0 {
  static constexpr size_t kBytes = 18;
  static constexpr int kValues = 32, kSubs = 1;
  using State = NoState;
  DEEPINFER_AVX2_FN static void prepare(const uint8_t *, State &) {}
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, int, const State &, __m256 w[4]) { widen_q4_0(b, w); }
  DEEPINFER_AVX512_FN static void widen_pair(const uint8_t *a, const uint8_t *b, int, const State &, const State &,
                                             __m512 w[4]) {
    widen_pair_q4_0(a, b, w);
  }
};
struct Q4_1 {
  static constexpr size_t kBytes = 20;
  static constexpr int kValues = 32, kSubs = 1;
  using State = NoState;
  DEEPINFER_AVX2_FN static void prepare(const uint8_t *, State &) {}
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, int, const State &, __m256 w[4]) { widen_q4_1(b, w); }
  DEEPINFER_AVX512_FN static void widen_pair(const uint8_t *a, const uint8_t *b, int, const State &, const State &,
                                             __m512 w[4]) {
    widen_pair_q4_1(a, b, w);
  }
};
struct Q8_0 {
  static constexpr size_t kBytes = 34;
  static constexpr int kValues = 32, kSubs = 1;
  using State = NoState;
  DEEPINFER_AVX2_FN static void prepare(const uint8_t *, State &) {}
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, int, const State &, __m256 w[4]) { widen_q8_0(b, w); }
  DEEPINFER_AVX512_FN static void widen_pair(const uint8_t *a, const uint8_t *b, int, const State &, const State &,
                                             __m512 w[4]) {
    widen_pair_q8_0(a, b, w);
  }
};

}  // namespace packed_detail
}  // namespace deepinfer
#endif
