// Internal to the packed-weight kernels: one 32-value block of a packed row widened into four
// AVX2 registers (values 8i..8i+7 in out[i]), exactly as packed_weights.h defines widening.
// Shared by the row widening and the fused batch-1 product, so both give the same floats.
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

// Bytes of one 32-value block of `format` (bf16: 32 plain values).
constexpr size_t block_bytes(WeightFormat f) {
  return f == WeightFormat::kBF16 ? 64 : f == WeightFormat::kQ4_0 ? 18 : f == WeightFormat::kQ4_1 ? 20 : 34;
}

DEEPINFER_AVX2_FN __m256 scale_vec(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

DEEPINFER_AVX2_FN __m256 bytes_to_float(__m128i low8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low8)); }

// The 32 nibbles of a Q4 block as floats (value j in lane j % 8 of q[j / 8]), minus `bias`.
DEEPINFER_AVX2_FN void nibbles(const uint8_t *qs, int bias, __m256 q[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f), off = _mm_set1_epi8(static_cast<char>(bias));
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), off);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), off);
  q[0] = bytes_to_float(lo);
  q[1] = bytes_to_float(_mm_srli_si128(lo, 8));
  q[2] = bytes_to_float(hi);
  q[3] = bytes_to_float(_mm_srli_si128(hi, 8));
}

// Scales are fp16, so scale * quant is exact in fp32 and Q4_1's + min rounds once, as gguf's
// separate multiply and add do: a fused multiply-add gives the same float.
DEEPINFER_AVX2_FN void widen_block(WeightFormat f, const uint8_t *b, __m256 w[4]) {
  switch (f) {
    case WeightFormat::kBF16:
      for (int i = 0; i < 4; ++i) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b + 16 * i));
        w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      break;
    case WeightFormat::kQ4_0: {
      const __m256 d = scale_vec(b);
      nibbles(b + 2, 8, w);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, w[i]);
      break;
    }
    case WeightFormat::kQ4_1: {
      const __m256 d = scale_vec(b), m = scale_vec(b + 2);
      nibbles(b + 4, 0, w);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, w[i], m);
      break;
    }
    case WeightFormat::kQ8_0: {
      const __m256 d = scale_vec(b);
      for (int i = 0; i < 4; ++i)
        w[i] = _mm256_mul_ps(d, bytes_to_float(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b + 2 + 8 * i))));
      break;
    }
  }
}

}  // namespace packed_detail
}  // namespace deepinfer
#endif
