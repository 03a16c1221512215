// fp32 y = x · wᵀ + b on CPU for the small row counts of decode steps. Each weight row is
// read from memory once per call and used against every input row while it sits in the L1
// cache, in register tiles of 3 weight rows x 4 input rows; the AVX2 path reaches the
// machine's multiply-add rate from about 16 rows up, where oneDNN's blocked GEMM needs 64,
// and at a few rows it is bound by streaming the weights, which it does across the threads.
// Every output is the same sum in the same order whatever the row count or thread split, so
// a sequence's logits do not depend on what else is in the batch.
#pragma once

#include <cstdint>

namespace deepinfer {

// x [M, K], w [N, K] (nn.Linear's layout), bias [N] or nullptr, y [M, N]; row-major fp32.
// Computes the output columns [n_begin, n_end) only, so callers can split N across threads.
// Past input_row_block(K) rows the inputs are taken a block at a time; with AVX-512 (and
// DEEPINFER_DP_PACKED_AVX512 not "0") 9 and more rows run the pair tiles of
// packed_linear_avx512.h. Neither changes a float.
void linear_columns(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int n_begin,
                    int n_end);

// linear_columns for weight rows already in cache (a few just widened into a buffer): the
// input rows are walked once per call, not once per tile of weight rows. Same floats.
void linear_cached_rows(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                        int n_begin, int n_end);

// Input rows a many-row product takes at a time: a block of x of about 1 MB stays in the L2
// cache while every weight row of the call's columns passes over it (beyond it, x streamed
// from L3 once per group of weight rows and the kernels fell behind torch's GEMM past ~256
// rows). A multiple of 8, the tiles' input rows.
int input_row_block(int K);

// linear_columns over all N columns, split across up to `threads` threads of the shared pool
// in multiples of 3 columns (one thread when the matrix is too small to pay for waking one).
void linear_threaded(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int threads);

}  // namespace deepinfer
