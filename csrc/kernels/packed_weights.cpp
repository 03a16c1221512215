#include "packed_weights.h"

#include <cstring>
#include <utility>

#include "bf16_linear.h"
#include "packed_blocks.h"
#include "packed_blocks_kquant.h"

namespace deepinfer {

namespace {

constexpr int kBlock = 32, kSuperBlock = 256;

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

// A Q5 block (d, [min,] 4 bytes of fifth bits, 16 bytes of nibbles): value j's fifth bit is
// bit j of the 32-bit word.
void widen_q5_scalar(const uint8_t *b, bool with_min, float *out) {
  const float d = scale_at(b), m = with_min ? scale_at(b + 2) : 0.0f;
  const uint8_t *qs = b + (with_min ? 8 : 6);
  uint32_t qh;
  std::memcpy(&qh, qs - 4, 4);
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0xf) | static_cast<int>((qh >> j) & 1) << 4;
    const int hi = (qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
    out[j] = with_min ? d * static_cast<float>(lo) + m : d * static_cast<float>(lo - 16);
    out[j + 16] = with_min ? d * static_cast<float>(hi) + m : d * static_cast<float>(hi - 16);
  }
}

// Piece s of a Q2_K or Q3_K super-block (layouts as in packed_blocks_kquant.h).
void widen_low_bits_scalar(WeightFormat f, const uint8_t *b, int s, float *out) {
  const int h = s >> 2, t = s & 3;
  for (int l = 0; l < kBlock; ++l) {
    const int i = 2 * s + l / 16;  // the scale of these 16 values
    if (f == WeightFormat::kQ2_K) {
      const int q = (b[16 + 32 * h + l] >> (2 * t)) & 3;
      out[l] = scale_at(b + 80) * static_cast<float>(b[i] & 0xf) * static_cast<float>(q) -
               scale_at(b + 82) * static_cast<float>(b[i] >> 4);
    } else {
      const uint8_t *sc = b + 96;
      const int low = i < 8 ? sc[i] & 0xf : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
      const int q = (((b[32 + 32 * h + l] >> (2 * t)) & 3) | ((b[l] >> s) & 1) << 2) - 4;
      out[l] = scale_at(b + 108) * static_cast<float>((low | high << 4) - 32) * static_cast<float>(q);
    }
  }
}

// One 256-value K-quant super-block, piece s = values 32s..32s+31 (layouts as in
// packed_blocks_kquant.h).
void widen_kquant_scalar(WeightFormat f, const uint8_t *b, float *out) {
  for (int s = 0; s < 8; ++s, out += kBlock) {
    if (f == WeightFormat::kQ2_K || f == WeightFormat::kQ3_K) {
      widen_low_bits_scalar(f, b, s, out);
      continue;
    }
    if (f == WeightFormat::kQ6_K) {
      const int h = s >> 2, c = s & 3;
      const uint8_t *ql = b + 64 * h + 32 * (c & 1), *qh = b + 128 + 32 * h;
      const int8_t *sc = reinterpret_cast<const int8_t *>(b + 192) + 2 * s;
      const float d = scale_at(b + 208);
      for (int l = 0; l < kBlock; ++l) {
        const int q = (((ql[l] >> (4 * (c >> 1))) & 0xf) | (((qh[l] >> (2 * c)) & 3) << 4)) - 32;
        out[l] = d * static_cast<float>(sc[l / 16]) * static_cast<float>(q);
      }
      continue;
    }
    int sc, m;
    packed_detail::kquant_scale_min(b + 4, s, &sc, &m);
    const float dl = scale_at(b) * static_cast<float>(sc), ml = scale_at(b + 2) * static_cast<float>(m);
    const bool q5 = f == WeightFormat::kQ5_K;
    const uint8_t *qs = b + (q5 ? 48 : 16) + 32 * (s >> 1);
    for (int l = 0; l < kBlock; ++l) {
      const int q = ((qs[l] >> (4 * (s & 1))) & 0xf) | (q5 ? ((b[16 + l] >> s) & 1) << 4 : 0);
      out[l] = dl * static_cast<float>(q) - ml;
    }
  }
}

void widen_more_scalar(const PackedMatrix &w, const uint8_t *row, float *out) {
  switch (w.format) {
    case WeightFormat::kQ5_0:
    case WeightFormat::kQ5_1:
      for (int k = 0; k < w.cols; k += kBlock, row += packed_row_bytes(w.format, kBlock))
        widen_q5_scalar(row, w.format == WeightFormat::kQ5_1, out + k);
      break;
    default:
      for (int k = 0; k < w.cols; k += kSuperBlock, row += packed_row_bytes(w.format, kSuperBlock))
        widen_kquant_scalar(w.format, row, out + k);
  }
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
    default: return widen_more_scalar(w, row, out);
  }
}

#ifdef DEEPINFER_PACKED_AVX2
// F: the format's block type (packed_blocks.h), chosen once per row rather than per block.
template <class F>
__attribute__((target("avx2,fma,f16c"))) void widen_blocks(const uint8_t *row, int cols, float *out) {
  __m256 v[4];
  typename F::State state;
  for (int k = 0; k < cols; k += F::kValues, row += F::kBytes) {
    F::prepare(row, state);
    for (int s = 0; s < F::kSubs; ++s) {
      F::widen(row, s, state, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 32 * s + 8 * i, v[i]);
    }
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
    case WeightFormat::kQ5_0: return widen_blocks<Q5_0>(row, w.cols, out);
    case WeightFormat::kQ5_1: return widen_blocks<Q5_1>(row, w.cols, out);
    case WeightFormat::kQ2_K: return widen_blocks<Q2_K>(row, w.cols, out);
    case WeightFormat::kQ3_K: return widen_blocks<Q3_K>(row, w.cols, out);
    case WeightFormat::kQ4_K: return widen_blocks<Q4_K>(row, w.cols, out);
    case WeightFormat::kQ5_K: return widen_blocks<Q5_K>(row, w.cols, out);
    case WeightFormat::kQ6_K: return widen_blocks<Q6_K>(row, w.cols, out);
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
      {"q8_0", WeightFormat::kQ8_0}, {"q5_0", WeightFormat::kQ5_0}, {"q5_1", WeightFormat::kQ5_1},
      {"q2_k", WeightFormat::kQ2_K}, {"q3_k", WeightFormat::kQ3_K}, {"q4_k", WeightFormat::kQ4_K}, {"q5_k", WeightFormat::kQ5_K}, {"q6_k", WeightFormat::kQ6_K},
      {"bf16_pairs", WeightFormat::kBF16Pairs}};
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
  const int values = packed_block_size(format);
  if (cols % values) return 0;
  const size_t blocks = static_cast<size_t>(cols / values);
  switch (format) {
    case WeightFormat::kQ4_0: return blocks * 18;
    case WeightFormat::kQ4_1: return blocks * 20;
    case WeightFormat::kQ8_0: return blocks * 34;
    case WeightFormat::kQ5_0: return blocks * 22;
    case WeightFormat::kQ5_1: return blocks * 24;
    case WeightFormat::kQ2_K: return blocks * 84;
    case WeightFormat::kQ3_K: return blocks * 110;
    case WeightFormat::kQ4_K: return blocks * 144;
    case WeightFormat::kQ5_K: return blocks * 176;
    case WeightFormat::kQ6_K: return blocks * 210;
    default: return 0;
  }
}

int packed_block_size(WeightFormat format) {
  switch (format) {
    case WeightFormat::kBF16: return 1;
    case WeightFormat::kBF16Pairs: return 2;
    case WeightFormat::kQ2_K:
    case WeightFormat::kQ3_K:
    case WeightFormat::kQ4_K:
    case WeightFormat::kQ5_K:
    case WeightFormat::kQ6_K: return kSuperBlock;
    default: return kBlock;
  }
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
