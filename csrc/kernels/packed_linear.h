// y = x · wᵀ + b with w kept packed (GGUF formats, bf16; see packed_weights.h) and x, y,
// b in fp32: the matrix product of decode-sized batches for models that run from their
// stored format. Each group of 3 weight rows is widened once into a small buffer that stays
// in the L1 cache and then goes through the fp32 register tiles of cpu_linear.h against
// every input row, so the result is bit for bit what linear_columns gives on the widened
// matrix, whatever the row count or the thread split, while memory carries only the packed
// bytes (Q4_1: 5 bits a weight instead of 32). At up to 8 input rows (decode, speculative
// verification) the blocks are widened in registers straight into the same chains of
// multiply-adds, with no buffer. On a CPU with AVX-512 both paths take their pair forms
// (packed_linear_avx512.h): two weight rows a 512-bit register, the same floats.
//
// This is the API other CPU kernels (MoE experts) call: "a packed weight matrix times fp32
// rows".
#pragma once

#include <cstdint>

#include "bf16_amx.h"
#include "packed_weights.h"
#include "side_lines.h"

namespace deepinfer {

// x [M, w.cols], bias [w.rows] or nullptr, y [M, w.rows]; computes the output columns
// [n_begin, n_end) only, so callers can split them across threads (in multiples of 3 to
// keep every group of rows whole; any split gives the same values). `side`: lines of another
// kernel's input to ask for meanwhile (side_lines.h): only the bf16 kernels ask for them; the
// fp32-arithmetic paths do not (asked from their buffered tiles, the lines stalled them).
void packed_linear_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                           int n_end, SideLines *side = nullptr);

// How many threads `rows` rows of w are worth splitting across (at most `threads`).
int packed_thread_parts(const PackedMatrix &w, int rows, int threads);

// How many threads a product reading `bytes` packed bytes is worth splitting across.
int packed_thread_parts_of_bytes(int64_t bytes, int threads);

// packed_linear_columns over all of w's rows, split across up to `threads` threads of the
// shared pool in whole groups of 12 rows (one thread when the matrix is too small to pay). It
// asks for no other kernel's lines: a caller with lines for a bf16_pairs matrix calls
// bf16_pairs_threaded.
void packed_linear_threaded(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int threads);

// packed_linear_threaded for a bf16_pairs matrix whose inputs are already rounded (xb [M,
// w.cols], bf16_round_rows' values; any M: AMX's last partial tile is read from a padded
// copy): the same floats, no thread rounding them.
void bf16_pairs_threaded(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int threads,
                         const SideShare &side = {});

// Whether bf16_gated_threaded takes w: a bf16_pairs matrix of gate then up rows that the
// default bf16 path multiplies on AMX tiles, each half a whole number of 16-row blocks.
bool bf16_gated_fits(const PackedMatrix &w);

// An MLP's act(x Gᵀ) * (x Uᵀ) into out [M, w.rows / 2] for w = [G; U] (bf16_gated_fits), or
// with out_b set instead, those floats rounded to bf16 into out_b (a bf16 down product's
// input): bf16_amx_gated over the gate blocks split across up to `threads` threads. The floats
// of packed_linear_threaded's product followed by act, without writing the product out.
void bf16_gated_threaded(const float *x, const PackedMatrix &w, float *out, uint16_t *out_b, int M, int threads,
                         GatedActivation act);

// bf16_gated_threaded on inputs already rounded (xb [M, w.cols], as bf16_pairs_threaded
// takes them).
void bf16_gated_rounded(const uint16_t *xb, const PackedMatrix &w, float *out, uint16_t *out_b, int M, int threads,
                        GatedActivation act);

// Widens rows [begin, end) of w into out [end - begin, w.cols] (for prefill GEMMs and
// embedding lookups of a few rows).
void widen_rows(const PackedMatrix &w, int begin, int end, float *out);

}  // namespace deepinfer
