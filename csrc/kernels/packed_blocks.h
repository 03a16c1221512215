// Internal to the packed-weight kernels: one 32-value block of a packed row widened into four
// AVX2 registers (values 8i..8i+7 in out[i]), exactly as packed_weights.h defines widening.
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

// The format as a type, for kernels that take it as a template argument.
struct BF16 {
  static constexpr size_t kBytes = 64;
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, __m256 w[4]) { widen_bf16(b, w); }
};
struct Q4_0 {
  static constexpr size_t kBytes = 18;
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, __m256 w[4]) { widen_q4_0(b, w); }
};
struct Q4_1 {
  static constexpr size_t kBytes = 20;
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, __m256 w[4]) { widen_q4_1(b, w); }
};
struct Q8_0 {
  static constexpr size_t kBytes = 34;
  DEEPINFER_AVX2_FN static void widen(const uint8_t *b, __m256 w[4]) { widen_q8_0(b, w); }
};

}  // namespace packed_detail
}  // namespace deepinfer
#endif
