// A matrix whose row ranges are stored in different formats: a fused projection (q/k/v,
// gate/up) whose parts a GGUF file quantized differently (a Llama Q4_K_M file's Q4_K q and k
// next to a Q6_K v). Each part keeps its stored format and runs through its own format's
// kernel (packed_linear.h) against the same block of inputs, so every output is the float
// that part alone gives: what the fp32 kernel gives on the widened matrix, at any row count
// and thread split.
#pragma once

#include <cstdint>
#include <vector>

#include "packed_weights.h"

namespace deepinfer {

// The parts in row order (all with the same cols; no bf16_pairs): part i holds the whole
// matrix's rows [sum of the rows before it, + its rows).
using PackedParts = std::vector<PackedMatrix>;

int packed_parts_rows(const PackedParts &parts);

// x [M, cols], bias [rows] or nullptr, y [M, rows]: output columns [n_begin, n_end) only, one
// block of input rows at a time against every part's rows in that range. No part is bf16
// arithmetic, so none asks for another kernel's lines (side_lines.h).
void packed_parts_columns(const float *x, const PackedParts &parts, const float *bias, float *y, int M, int n_begin,
                          int n_end);

// packed_parts_columns over all rows, split across up to `threads` threads of the shared pool
// into ranges of about equal bytes (a Q6_K row holds 1.5x a Q4_K row's).
void packed_parts_threaded(const float *x, const PackedParts &parts, const float *bias, float *y, int M, int threads);

}  // namespace deepinfer
