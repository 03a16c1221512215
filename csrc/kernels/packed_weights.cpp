#include "packed_weights.h"

#include <cstring>
#include <utility>

#include "bf16_linear.h"
#include "packed_blocks.h"

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
    case WeightFormat::kBF16Pairs: break;  // widen_row's own
  }
}

#ifdef DEEPINFER_PACKED_AVX2
// F: the format's block type (packed_blocks.h), chosen once per row rather than per block.
template <class F>
__attribute__((target("avx2,fma,f16c"))) void widen_blocks(const uint8_t *row, int cols, float *out) {
  __m256 v[4];
  for (int k = 0; k < cols; k += 32, row += F::kBytes) {
    F::widen(row, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 8 * i, v[i]);
  }
}

void widen_avx2(const PackedMatrix &w, const uint8_t *row, float *out) {
  using namespace packed_detail;
  switch (w.format) {
    case WeightFormat::kBF16:
      if (w.cols % 32) return widen_scalar(w, row, out);
      return widen_blocks<BF16>(row, w.cols, out);
    case WeightFormat::kQ4_0: return widen_blocks<Q4_0>(row, w.cols, out);
    case WeightFormat::kQ4_1: return widen_blocks<Q4_1>(row, w.cols, out);
    case WeightFormat::kQ8_0: return widen_blocks<Q8_0>(row, w.cols, out);
    case WeightFormat::kBF16Pairs: return;  // widen_row's own
  }
}

bool use_avx2() {
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif

}  // namespace

bool packed_format_named(const std::string &name, WeightFormat *format) {
  static const std::pair<const char *, WeightFormat> names[] = {
      {"bf16", WeightFormat::kBF16}, {"q4_0", WeightFormat::kQ4_0}, {"q4_1", WeightFormat::kQ4_1},
      {"q8_0", WeightFormat::kQ8_0}, {"bf16_pairs", WeightFormat::kBF16Pairs}};
  for (const auto &n : names)
    if (name == n.first) {
      *format = n.second;
      return true;
    }
  return false;
}

size_t packed_row_bytes(WeightFormat format, int cols) {
  if (cols <= 0) return 0;
  if (format == WeightFormat::kBF16) return static_cast<size_t>(cols) * 2;
  if (format == WeightFormat::kBF16Pairs) return cols % 2 ? 0 : static_cast<size_t>(cols) * 2;
  if (cols % kBlock) return 0;
  const size_t blocks = static_cast<size_t>(cols / kBlock);
  switch (format) {
    case WeightFormat::kQ4_0: return blocks * 18;
    case WeightFormat::kQ4_1: return blocks * 20;
    case WeightFormat::kQ8_0: return blocks * 34;
    default: return 0;
  }
}

int packed_block_size(WeightFormat format) {
  return format == WeightFormat::kBF16 ? 1 : format == WeightFormat::kBF16Pairs ? 2 : kBlock;
}

void widen_row(const PackedMatrix &w, int row, float *out) {
  if (w.format == WeightFormat::kBF16Pairs) return bf16_pairs_widen_row(w, row, out);  // rows interleaved by 16
  const uint8_t *p = w.data + static_cast<size_t>(row) * w.row_bytes;
#ifdef DEEPINFER_PACKED_AVX2
  if (use_avx2()) return widen_avx2(w, p, out);
#endif
  widen_scalar(w, p, out);
}

}  // namespace deepinfer
