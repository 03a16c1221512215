// The AVX-512 forms of the packed products (packed_linear.h), for CPUs that have it. Two
// weight rows share each 512-bit register, one per 256-bit half, and each half runs the AVX2
// kernels' chain of multiply-adds for its row step for step (8 lanes over K, then cpu_linear's
// horizontal sum), so every output is the same float as on the AVX2 path, whatever the row
// count: only the number of rows per instruction changes.
#pragma once

#include "packed_weights.h"

namespace deepinfer {

// True where the CPU runs AVX-512 (F, DQ, BW, VL) and DEEPINFER_DP_PACKED_AVX512 is not "0"
// (read once: the switch lets a test run both paths, and a user avoid 512-bit code on a CPU
// that slows its clock for it). The callers also need w.cols % 32 == 0.
bool packed_avx512_enabled();

// x [M, w.cols] with M in [1, 8], blocks widened in registers (packed_linear's fused path):
// output columns [n0, n1) of y [M, w.rows].
void packed_few_rows_avx512(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                            int n1);

// Any M: output columns [n0, n1) of y, in groups of weight rows widened once into an L1
// buffer (packed_linear's buffered path) and multiplied in register tiles. It asks for no
// other kernel's input (side_lines.h): its tiles keep both FMA ports busy, and a prefetch
// waiting for a free miss buffer stalls them (measured: docs/cpu_engine.md).
void packed_many_rows_avx512(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                             int n1);

// The same tiles over an fp32 weight w [N, K] (nn.Linear's layout, K % 8 == 0), its rows
// copied into the buffer's pair layout: cpu_linear's AVX2 chains, so the same floats.
void linear_many_rows_avx512(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int n0,
                             int n1);

}  // namespace deepinfer
