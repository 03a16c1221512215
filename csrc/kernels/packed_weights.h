// Weight matrices kept in the format they are stored in (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// the K-quants Q2_K-Q6_K; bf16), and
// their widening to fp32. Widening gives exactly the fp32 values that gguf's dequantize (and
// a bf16 -> fp32 cast) gives: the scales are fp16 (times small integers in the K-quants), so
// scale * quant is exact in fp32 and the one rounding left (Q4_1's and Q5_1's + min, the
// K-quants' - dmin * m) happens the same way.
//
// A matrix is [rows, cols] in nn.Linear's layout (one output per row); each row is its own
// run of blocks of 32 values along cols (the K-quants: super-blocks of 256; bf16: plain 2-byte
// values), row_bytes apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace deepinfer {

// kBF16Pairs: bf16 in vdpbf16ps's pair layout, computed in bf16 (bf16_linear.h), not widened.
enum class WeightFormat { kBF16, kQ4_0, kQ4_1, kQ8_0, kQ5_0, kQ5_1, kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K, kBF16Pairs };

struct PackedMatrix {
  const uint8_t *data;
  int rows, cols;
  size_t row_bytes;
  WeightFormat format;
};

// The format called `name` ("bf16", "q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q2_k", "q3_k",
// "q4_k", "q5_k", "q6_k", "bf16_pairs"); false for any other name.
bool packed_format_named(const std::string &name, WeightFormat *format);

// Bytes one row of `cols` values takes, or 0 when cols does not fit the format's blocks.
size_t packed_row_bytes(WeightFormat format, int cols);

// Values per block of the format (1 for bf16, 256 for the K-quants).
int packed_block_size(WeightFormat format);

// Widens row `row` of w into out[0, w.cols).
void widen_row(const PackedMatrix &w, int row, float *out);

}  // namespace deepinfer
