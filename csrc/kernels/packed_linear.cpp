#include "packed_linear.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "bf16_amx.h"
#include "bf16_linear.h"
#include "cpu_linear.h"
#include "line_vector.h"
#include "packed_blocks.h"
#include "packed_blocks_kquant.h"
#include "packed_linear_avx512.h"
#include "rows_ahead.h"
#include "thread_pool.h"

namespace deepinfer {

namespace {
// Weight rows widened at a time for 9 and more input rows: 12 rows of SmolLM2's 576 columns
// (27 KB) and a group of 4 input rows stay in L1 together. Timed side by side against groups
// of 3 (one thread, thread CPU time, 64 input rows): 1.05-1.24x on the Q4_1 layers and the
// Q8_0 lm_head, the same floats.
constexpr int kGroupRows = 12;
// Input rows up to which each weight block is widened in registers and used at once. Both
// paths timed side by side on SmolLM2's Q4_1 gate_up (one thread, thread CPU time): the
// fused one is 1.2-1.4x faster at 2-6 rows, even at 8, and slower at 16, where cpu_linear's
// 3 x 4 register tiles on widened rows reuse each loaded input vector three times. With
// several weight rows per pass (below) it is 1.1-1.3x faster again at 7 and 8 rows.
constexpr int kFewRows = 8;
// How far ahead in rows the fused kernels prefetch: at one input row a matrix streamed from
// memory needs its lines some 10-20 KB ahead (Gemma 3's Q8_0 lm_head has 680-byte rows); 4
// rows ahead left part of the read bandwidth unused. They are asked into L2 (T1): into L1
// (T0), the lm_head over the whole matrix took 1.7x its time in L2 on Zen 4, into L2 the same.
constexpr int kAheadRows = 32;
// Input rows the buffered path runs between two shares of its prefetches (cpu_linear's
// tiles take 4 input rows at a time).
constexpr int kPrefetchRun = 8;
// Packed bytes per thread below which splitting is not worth waking a worker (about what
// the fp32 kernel's 64 K weights take in Q4_1 at a few rows: the work is the widening).
constexpr int64_t kMinBytesPerThread = 1 << 15;

#ifdef DEEPINFER_PACKED_AVX2
using namespace packed_detail;

// MB input rows against NB weight rows of format F, widening each weight block in registers
// straight into the multiply-adds: at a few rows the widening is most of the work, and a
// round trip through a row buffer would double it. Each output is the same chain of fused
// multiply-adds over K in steps of 8 as in cpu_linear's tiles, so the floats equal the
// buffered path's. A chain waits out the multiply-add's latency at every step, so NB x MB
// independent chains are kept in flight (at least 8: two multiply-add pipes, 4 cycles each);
// the format is a template argument so no per-block test remains.
template <class F, int MB, int NB>
DEEPINFER_AVX2_FN void rows_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int n) {
  const int K = w.cols;
  const uint8_t *rows[NB];
  __m256 acc[NB][MB];
  for (int b = 0; b < NB; ++b) {
    rows[b] = w.data + static_cast<size_t>(n + b) * w.row_bytes;
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm256_setzero_ps();
  }
  __m256 wv[4], xv[4];
  typename F::State state[NB];
  for (int kb = 0; kb < K; kb += F::kValues) {
    for (int b = 0; b < NB; ++b) F::prepare(rows[b], state[b]);
    for (int s = 0; s < F::kSubs; ++s) {  // 32 values at a time (a K-quant block holds 8 x 32)
      const int k = kb + 32 * s;
      // At one input row its block stays in registers for all NB weight rows (fewer loads next
      // to the widening's own); at more rows the loads go into the multiply-adds.
      if (MB == 1)
        for (int i = 0; i < 4; ++i) xv[i] = _mm256_loadu_ps(x + k + 8 * i);
      // One weight row's block at a time, so only its four vectors are live next to the
      // accumulators; the chains of the other rows overlap it out of order.
      for (int b = 0; b < NB; ++b) {
        // The rows after this group, a block's share at a time: at one input row the kernel is
        // bound by memory, and the hardware prefetcher alone leaves half the bandwidth unused.
        _mm_prefetch(reinterpret_cast<const char *>(rows[b] + kAheadRows * w.row_bytes + s * F::kBytes / F::kSubs),
                     _MM_HINT_T1);
        F::widen(rows[b], s, state[b], wv);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < MB; ++j)
            acc[b][j] = _mm256_fmadd_ps(
                wv[i], MB == 1 ? xv[i] : _mm256_loadu_ps(x + static_cast<size_t>(j) * K + k + 8 * i), acc[b][j]);
      }
    }
    for (int b = 0; b < NB; ++b) rows[b] += F::kBytes;
  }
  for (int b = 0; b < NB; ++b) {
    for (int j = 0; j < MB; ++j) {
      const float s = sum8(acc[b][j]);
      y[static_cast<size_t>(j) * w.rows + n + b] = bias ? s + bias[n + b] : s;
    }
  }
}

template <class F, int MB, int NB>
__attribute__((target("avx2,fma,f16c"))) void columns_inputs(const float *x, const PackedMatrix &w,
                                                             const float *bias, float *y, int n0, int n1) {
  int n = n0;
  for (; n + NB <= n1; n += NB) rows_inputs<F, MB, NB>(x, w, bias, y, n);
  for (; n < n1; ++n) rows_inputs<F, MB, 1>(x, w, bias, y, n);
}

// Weight rows per pass for each input-row count: enough chains in flight, and the
// accumulators plus the widened blocks within (or just past) the 16 vector registers.
template <class F>
void few_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  constexpr bool kWideBlocks = F::kBytes / F::kSubs > 32;  // Q8_0 (34 bytes) and bf16 (64)
  switch (M) {
    case 1: return columns_inputs<F, 1, 4>(x, w, bias, y, n0, n1);
    case 2: return columns_inputs<F, 2, 4>(x, w, bias, y, n0, n1);
    case 3: return columns_inputs<F, 3, 3>(x, w, bias, y, n0, n1);
    // Q8_0's and bf16's blocks take four loads to widen, Q4's two; paired at 4 and 5 rows,
    // Q8_0 measured 0.81-0.94x of one weight row a pass.
    case 4: return kWideBlocks ? columns_inputs<F, 4, 1>(x, w, bias, y, n0, n1)
                               : columns_inputs<F, 4, 2>(x, w, bias, y, n0, n1);
    case 5: return kWideBlocks ? columns_inputs<F, 5, 1>(x, w, bias, y, n0, n1)
                               : columns_inputs<F, 5, 2>(x, w, bias, y, n0, n1);
    case 6: return columns_inputs<F, 6, 1>(x, w, bias, y, n0, n1);
    case 7: return columns_inputs<F, 7, 1>(x, w, bias, y, n0, n1);
    default: return columns_inputs<F, kFewRows, 1>(x, w, bias, y, n0, n1);
  }
}

// M in [1, kFewRows]: the format picked once, outside every loop.
void fused_inputs(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  switch (w.format) {
    case WeightFormat::kBF16: return few_inputs<BF16>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_0: return few_inputs<Q4_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_1: return few_inputs<Q4_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ8_0: return few_inputs<Q8_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_0: return few_inputs<Q5_0>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_1: return few_inputs<Q5_1>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ2_K: return few_inputs<Q2_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ3_K: return few_inputs<Q3_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ4_K: return few_inputs<Q4_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ5_K: return few_inputs<Q5_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kQ6_K: return few_inputs<Q6_K>(x, w, bias, y, M, n0, n1);
    case WeightFormat::kBF16Pairs: return;  // bf16_pairs_columns
  }
}

bool fused_ok(const PackedMatrix &w) {
  static const bool cpu =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return cpu && w.cols % packed_block_size(w.format) == 0 && w.cols % 32 == 0;
}
#endif
}  // namespace

void packed_linear_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                           int n_end, SideLines *side) {
  const int K = w.cols, N = w.rows, block = input_row_block(K);
  if (M > block) {  // a block of inputs in L2 against every group of weight rows; same floats
    for (int m = 0; m < M; m += block)
      packed_linear_columns(x + static_cast<size_t>(m) * K, w, bias, y + static_cast<size_t>(m) * N,
                            std::min(block, M - m), n_begin, n_end, side);
    return;
  }
  if (w.format == WeightFormat::kBF16Pairs)  // bf16 arithmetic, not widened
    return bf16_pairs_columns(x, w, bias, y, M, n_begin, n_end, bf16_dot_default_path(), side);
#ifdef DEEPINFER_PACKED_AVX2
  if (fused_ok(w)) {
    if (packed_avx512_enabled())
      return M <= kFewRows ? packed_few_rows_avx512(x, w, bias, y, M, n_begin, n_end)
                           : packed_many_rows_avx512(x, w, bias, y, M, n_begin, n_end);
    if (M <= kFewRows) return fused_inputs(x, w, bias, y, M, n_begin, n_end);
  }
#endif
  // One buffer per thread, kept between calls: kGroupRows rows of K floats (27 KB at K = 576).
  thread_local std::vector<float> rows;
  rows.resize(static_cast<size_t>(kGroupRows) * K);
  const int runs = (M + kPrefetchRun - 1) / kPrefetchRun;
  for (int n = n_begin; n < n_end; n += kGroupRows) {
    const int count = n + kGroupRows <= n_end ? kGroupRows : n_end - n;
    for (int i = 0; i < count; ++i) widen_row(w, n + i, rows.data() + static_cast<size_t>(i) * K);
    // The next group arrives while this one runs, a share before each run of input rows; the
    // runs change no float (each output's chain is the same at any M).
    const int next = std::min(n_end, n + kGroupRows);
    RowsAhead ahead(w.data, w.row_bytes, next, std::min(n_end, next + kGroupRows), runs);
    for (int m = 0; m < M; m += kPrefetchRun) {
      ahead.next();
      // The widened rows are columns [0, count) of a matrix starting at row n.
      linear_cached_rows(x + static_cast<size_t>(m) * K, rows.data(), bias ? bias + n : nullptr,
                         y + static_cast<size_t>(m) * N + n, std::min(kPrefetchRun, M - m), N, K, 0, count);
    }
  }
}

int packed_thread_parts(const PackedMatrix &w, int rows, int threads) {
  return packed_thread_parts_of_bytes(static_cast<int64_t>(rows) * static_cast<int64_t>(w.row_bytes), threads);
}

int packed_thread_parts_of_bytes(int64_t bytes, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, bytes / kMinBytesPerThread)));
}

namespace {

// w's rows split across up to `threads` threads of the shared pool in whole groups of 12 rows
// (the kernels' groups of 4, one input row, and 12, several): fn(begin, end, lines) for each
// part, lines its slice of `side` (nullptr: none).
void threaded_rows(const PackedMatrix &w, int threads, const SideShare &side,
                   const std::function<void(int, int, SideLines *)> &fn) {
  const int N = w.rows, parts = packed_thread_parts(w, N, threads);
  const int step = ((N + parts - 1) / parts + 11) / 12 * 12;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int begin = std::min(N, p * step), end = std::min(N, begin + step);
    SideLines lines = side.share(p, parts);
    if (begin < end) fn(begin, end, side.blocks ? &lines : nullptr);
  });
}

// x [M, K] rounded to bf16 into the calling thread's reused buffer, its rows split among the
// threads (each thread of a product rounding all of them would repeat the work).
const uint16_t *rounded_rows(const float *x, int M, int K, int threads) {
  thread_local LineVector<uint16_t> xb;  // (the workers' own `xb` in bf16_linear.cpp are other vectors)
  xb.resize(static_cast<size_t>(M) * K);
  uint16_t *rounded = xb.data();
  split_rows(M, threads, [&](int begin, int end) {
    bf16_round_rows(x + static_cast<size_t>(begin) * K, end - begin, K, rounded + static_cast<size_t>(begin) * K);
  });
  return rounded;
}

// fn(rows, m, count) over xb [M, K] in blocks of `block` rows (rows = xb + m * K), except the
// last M % 16 rows, which come from a copy padded with zero rows: AMX reads whole tiles of
// 16 rows, and the caller's buffer ends at row M.
void whole_tile_blocks(const uint16_t *xb, int M, int K, int block,
                       const std::function<void(const uint16_t *, int, int)> &fn) {
  const int whole = M / 16 * 16;
  for (int m = 0; m < whole; m += block) fn(xb + static_cast<size_t>(m) * K, m, std::min(block, whole - m));
  if (whole == M) return;
  thread_local LineVector<uint16_t> tail;
  tail.assign(static_cast<size_t>(16) * K, uint16_t{0});
  std::copy(xb + static_cast<size_t>(whole) * K, xb + static_cast<size_t>(M) * K, tail.begin());
  fn(tail.data(), whole, M - whole);
}

// Input rows an AMX product takes at a time: a block in L2 (input_row_block) in whole pairs
// of 16-row tiles (a block ending inside a tile would compute the next block's rows in it too).
int amx_row_block(int K) { return std::max(32, input_row_block(K) / 32 * 32); }

}  // namespace

void packed_linear_threaded(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int threads) {
  if (w.format == WeightFormat::kBF16Pairs)
    return bf16_pairs_threaded(rounded_rows(x, M, w.cols, threads), w, bias, y, M, threads);
  threaded_rows(w, threads, {}, [&](int begin, int end, SideLines *) {
    packed_linear_columns(x, w, bias, y, M, begin, end);
  });
}

bool bf16_gated_fits(const PackedMatrix &w) {
  return w.format == WeightFormat::kBF16Pairs && bf16_amx_multiplies(w, bf16_dot_default_path()) && w.rows > 0 &&
         w.rows % 32 == 0;
}

void bf16_gated_threaded(const float *x, const PackedMatrix &w, float *out, uint16_t *out_b, int M, int threads,
                         GatedActivation act) {
  bf16_gated_rounded(rounded_rows(x, M, w.cols, threads), w, out, out_b, M, threads, act);
}

void bf16_gated_rounded(const uint16_t *xb, const PackedMatrix &w, float *out, uint16_t *out_b, int M, int threads,
                        GatedActivation act) {
  const int K = w.cols, I = w.rows / 2, blocks = I / 16, block = amx_row_block(K);
  const int parts = std::min(blocks, packed_thread_parts(w, w.rows, threads)), step = (blocks + parts - 1) / parts;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int j0 = std::min(blocks, p * step) * 16, j1 = std::min(blocks, (p + 1) * step) * 16;
    if (j0 >= j1) return;
    whole_tile_blocks(xb, M, K, block, [&](const uint16_t *rows, int m, int count) {
      const size_t at = static_cast<size_t>(m) * I;
      bf16_amx_gated(rows, w, out ? out + at : nullptr, out_b ? out_b + at : nullptr, count, j0, j1, act);
    });
  });
}

void bf16_pairs_threaded(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int threads,
                         const SideShare &side) {
  const Bf16DotPath path = bf16_dot_default_path();
  // A block of input rows in L2 at a time, as packed_linear_columns takes them.
  const int K = w.cols, N = w.rows;
  const bool amx = bf16_amx_multiplies(w, path);
  const int block = amx ? amx_row_block(K) : input_row_block(K);
  threaded_rows(w, threads, side, [&](int begin, int end, SideLines *lines) {
    const auto columns = [&](const uint16_t *rows, int m, int count) {
      bf16_pairs_columns_rounded(rows, w, bias, y + static_cast<size_t>(m) * N, count, begin, end, path, lines);
    };
    if (amx) return whole_tile_blocks(xb, M, K, block, columns);
    for (int m = 0; m < M; m += block) columns(xb + static_cast<size_t>(m) * K, m, std::min(block, M - m));
  });
}

void widen_rows(const PackedMatrix &w, int begin, int end, float *out) {
  for (int r = begin; r < end; ++r) widen_row(w, r, out + static_cast<size_t>(r - begin) * w.cols);
}

}  // namespace deepinfer
