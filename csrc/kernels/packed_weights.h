// Weight matrices kept in the format they are stored in (GGUF Q4_0, Q4_1, Q8_0; bf16), and
// their widening to fp32. Widening gives exactly the fp32 values that gguf's dequantize (and
// a bf16 -> fp32 cast) gives: the scales are fp16, so scale * quant is exact in fp32 and the
// one rounding left (Q4_1's + min) happens the same way.
//
// A matrix is [rows, cols] in nn.Linear's layout (one output per row); each row is its own
// run of blocks of 32 values along cols (bf16: plain 2-byte values), row_bytes apart.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace deepinfer {

// kBF16Pairs: bf16 in vdpbf16ps's pair layout, computed in bf16 (bf16_linear.h), not widened.
enum class WeightFormat { kBF16, kQ4_0, kQ4_1, kQ8_0, kBF16Pairs };

struct PackedMatrix {
  const uint8_t *data;
  int rows, cols;
  size_t row_bytes;
  WeightFormat format;
};

// The format called `name` ("bf16", "q4_0", "q4_1", "q8_0", "bf16_pairs"); false for any other name.
bool packed_format_named(const std::string &name, WeightFormat *format);

// Bytes one row of `cols` values takes, or 0 when cols does not fit the format's blocks.
size_t packed_row_bytes(WeightFormat format, int cols);

// Values per block of the format (1 for bf16).
int packed_block_size(WeightFormat format);

// Widens row `row` of w into out[0, w.cols).
void widen_row(const PackedMatrix &w, int row, float *out);

}  // namespace deepinfer
