#include "packed_weights.h"

#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DEEPINFER_HAVE_AVX2 1
#endif

namespace deepinfer {

namespace {

constexpr int kBlock = 32;

// IEEE half -> float, exact (every half is a float).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float scale_at(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// The portable loops: block layouts as ggml defines them. A Q4 block's byte j holds value j
// in its low nibble and value j + 16 in its high one.
void widen_scalar(const PackedMatrix &w, const uint8_t *row, float *out) {
  const int blocks = w.cols / kBlock;
  switch (w.format) {
    case WeightFormat::kBF16:
      for (int k = 0; k < w.cols; ++k) {
        uint32_t bits = static_cast<uint32_t>(row[2 * k] | (row[2 * k + 1] << 8)) << 16;
        std::memcpy(out + k, &bits, 4);
      }
      break;
    case WeightFormat::kQ4_0:
      for (int b = 0; b < blocks; ++b, row += 18, out += kBlock) {
        const float d = scale_at(row);
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>((row[2 + j] & 0xf) - 8);
          out[j + 16] = d * static_cast<float>((row[2 + j] >> 4) - 8);
        }
      }
      break;
    case WeightFormat::kQ4_1:
      for (int b = 0; b < blocks; ++b, row += 20, out += kBlock) {
        const float d = scale_at(row), m = scale_at(row + 2);
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>(row[4 + j] & 0xf) + m;
          out[j + 16] = d * static_cast<float>(row[4 + j] >> 4) + m;
        }
      }
      break;
    case WeightFormat::kQ8_0:
      for (int b = 0; b < blocks; ++b, row += 34, out += kBlock) {
        const float d = scale_at(row);
        for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(row[2 + j]));
      }
      break;
  }
}

#ifdef DEEPINFER_HAVE_AVX2
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN inline __m256 bytes_to_float(__m128i eight_bytes_low, bool is_signed) {
  const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eight_bytes_low) : _mm256_cvtepu8_epi32(eight_bytes_low);
  return _mm256_cvtepi32_ps(wide);
}

AVX2_FN inline __m256 scale_vec(const uint8_t *p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// The 32 nibbles of a Q4 block as 32 floats (value j in out[j]), offset by `bias`.
AVX2_FN inline void nibbles(const uint8_t *qs, int bias, __m256 q[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f), off = _mm_set1_epi8(static_cast<char>(bias));
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), off);
  const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), off);
  q[0] = bytes_to_float(lo, true);
  q[1] = bytes_to_float(_mm_srli_si128(lo, 8), true);
  q[2] = bytes_to_float(hi, true);
  q[3] = bytes_to_float(_mm_srli_si128(hi, 8), true);
}

AVX2_FN void widen_avx2(const PackedMatrix &w, const uint8_t *row, float *out) {
  const int blocks = w.cols / kBlock;
  __m256 q[4];
  switch (w.format) {
    case WeightFormat::kBF16: {
      int k = 0;
      for (; k + 8 <= w.cols; k += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row + 2 * k));
        _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
      }
      PackedMatrix tail = w;
      tail.cols = w.cols - k;
      if (tail.cols) widen_scalar(tail, row + 2 * k, out + k);
      break;
    }
    case WeightFormat::kQ4_0:
      for (int b = 0; b < blocks; ++b, row += 18, out += kBlock) {
        const __m256 d = scale_vec(row);
        nibbles(row + 2, 8, q);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(d, q[i]));
      }
      break;
    case WeightFormat::kQ4_1:
      for (int b = 0; b < blocks; ++b, row += 20, out += kBlock) {
        const __m256 d = scale_vec(row), m = scale_vec(row + 2);
        nibbles(row + 4, 0, q);
        // d * q is exact (11-bit scale times a 4-bit integer), so this rounds once, like gguf.
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(d, q[i]), m));
      }
      break;
    case WeightFormat::kQ8_0:
      for (int b = 0; b < blocks; ++b, row += 34, out += kBlock) {
        const __m256 d = scale_vec(row);
        for (int i = 0; i < 4; ++i) {
          const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row + 2 + 8 * i));
          _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(d, bytes_to_float(v, true)));
        }
      }
      break;
  }
}

bool use_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

}  // namespace

size_t packed_row_bytes(WeightFormat format, int cols) {
  if (cols <= 0) return 0;
  if (format == WeightFormat::kBF16) return static_cast<size_t>(cols) * 2;
  if (cols % kBlock) return 0;
  const size_t blocks = static_cast<size_t>(cols / kBlock);
  switch (format) {
    case WeightFormat::kQ4_0: return blocks * 18;
    case WeightFormat::kQ4_1: return blocks * 20;
    case WeightFormat::kQ8_0: return blocks * 34;
    default: return 0;
  }
}

int packed_block_size(WeightFormat format) { return format == WeightFormat::kBF16 ? 1 : kBlock; }

void widen_row(const PackedMatrix &w, int row, float *out) {
  const uint8_t *p = w.data + static_cast<size_t>(row) * w.row_bytes;
#ifdef DEEPINFER_HAVE_AVX2
  if (use_avx2()) return widen_avx2(w, p, out);
#endif
  widen_scalar(w, p, out);
}

}  // namespace deepinfer
