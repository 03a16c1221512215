// How paged_attention.cpp's vector path takes one unit of work: a span of queries of one
// sequence (a decode token alone, or consecutive tokens of a prefill chunk or verification
// step) over the cached positions of some of its KV heads, block by block, so that each K and
// V row comes from memory once and is reused from L1 by all of the span's queries. Each
// query stops at its own context length, with the block-by-block split it would have alone,
// so its floats do not depend on the queries around it. The per-block arithmetic is in
// paged_attention_heads.h, the softmax in attention_softmax.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paged_attention.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "attention_softmax.h"
#include "paged_attention_heads.h"
#endif

namespace deepinfer {
namespace paged_span {

// Where a sequence's position t sits in one layer's cache, for KV head 0. T is the cache's
// element: float, or uint16_t holding bf16.
template <class T>
struct PagedRows {
  const T *cache;
  const int32_t *blocks;
  int block_size;
  size_t row;  // elements per cached position: num_kv_heads * head_dim
  const T *at(int t) const {
    return cache + (static_cast<size_t>(blocks[t / block_size]) * block_size + t % block_size) * row;
  }
};

inline float widen(float x) { return x; }
inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The queries of one span, for one KV head: their heads of that KV head, outputs, contexts.
struct QueryChunk {
  const float *q;       // the first query's heads; query j at q + j * q_stride
  float *out;           // likewise
  size_t q_stride;      // floats between queries' rows of q
  size_t out_stride;    // and of out: num_heads * head_dim
  const int32_t *lens;  // the queries' context lengths
  int count;
  int window;           // sliding window (0: none): query j reads [window_start(lens[j]), lens[j])
  int heads, group;     // query heads of the unit; query head h reads KV head h / group of it
};

#if defined(__x86_64__) && defined(__GNUC__)
#define DEEPINFER_SPAN_AVX2 __attribute__((target("avx2,fma")))

using attention_heads::NextRows;
using attention_heads::QueryHeads;

// Rows [t, t + n) of r, for one unit (`width` elements a row), asked for in `shares` shares.
template <class T>
NextRows next_rows(const PagedRows<T> &r, int t, int n, int width, int shares) {
  const int lines = (width * static_cast<int>(sizeof(T)) + 63) / 64;
  const int per = (n * lines + shares - 1) / shares;
  return NextRows{reinterpret_cast<const char *>(r.at(t)), r.row * sizeof(T), n, lines, per, 0};
}

// The positions each query of a span reads: query j, [first_of(j), lens[j]).
struct SpanReads {
  const QueryChunk &c;
  int block_size;
  int first_of(int j) const { return window_start(c.lens[j], c.window); }
  // Query j's share of the block [t0, t0 + block_size): positions [lo, lo + n), n <= 0 for none.
  int share(int j, int t0, int &lo) const {
    lo = std::max(t0, first_of(j));
    return std::min(t0 + block_size, static_cast<int>(c.lens[j])) - lo;
  }
};

// A block's rows as the span's queries read them: `row` elements apart from `at` (position t0).
template <class R>
struct BlockRows {
  const R *at;
  size_t row;
};

// A bf16 block's `rows` rows of a unit (`width` elements each) widened into dst, `width` apart:
// once for all of a span's queries, which is exact.
template <class T>
DEEPINFER_SPAN_AVX2 BlockRows<float> widened(const PagedRows<T> &r, int t0, int rows, int width, float *dst) {
  const T *src = r.at(t0);
  for (int i = 0; i < rows; ++i, src += r.row)
    for (int e = 0; e < width; e += 8) _mm256_storeu_ps(dst + i * width + e, attention_heads::load8(src + e));
  return {dst, static_cast<size_t>(width)};
}

// One unit: the scores of every query's heads against every block of K, their softmax, then
// the probabilities times every block of V. Heads does each block's work: one query head at a
// time, or with AVX-512 up to three sharing each load, and (Heads::kPairs) two queries that
// read the same positions together, each lane of a register one query's.
template <int D, class T, class Heads>
class SpanPass {
 public:
  DEEPINFER_SPAN_AVX2 SpanPass(const QueryChunk &c, const PagedRows<T> &k, const PagedRows<T> &v, float scale,
                               float *scores)
      : c_(c), k_(k), v_(v), scale_(scale), scores_(scores), reads_{c, k.block_size},
        longest_(*std::max_element(c.lens, c.lens + c.count)), width_(c.heads / c.group * D), shared_(c.count == 1) {
    int lowest = reads_.first_of(0);
    for (int j = 1; j < c.count; ++j) lowest = std::min(lowest, reads_.first_of(j));
    begin_ = lowest / k.block_size * k.block_size;  // the block holding the first position read
    if constexpr (Heads::kPairs) {
      if (!shared_) pair_queries();
      if (std::is_same_v<T, uint16_t> && !shared_)  // values_in_runs' blocks
        wide_.resize(static_cast<size_t>(Heads::kMaxRuns) * k.block_size * width_);
    }
  }

  DEEPINFER_SPAN_AVX2 void run() {
    blocks<false>();
    softmax();
    if constexpr (Heads::kPairs) {
      if (!shared_) return values_in_runs();
    }
    blocks<true>();
  }

 private:
  DEEPINFER_SPAN_AVX2 void softmax() {
    for (int j = 0; j < c_.count; ++j) {
      const int first = reads_.first_of(j), n = c_.lens[j] - first;
      if constexpr (Heads::kPairs)
        attention_softmax::softmax_avx512(scores_of(j, 0) + first, longest_, c_.heads, n);
      else
        for (int h = 0; h < c_.heads; ++h) attention_softmax::softmax_avx2(scores_of(j, h) + first, n);
      std::fill(c_.out + j * c_.out_stride, c_.out + j * c_.out_stride + c_.heads * D, 0.f);
    }
  }

  float *scores_of(int j, int h) const { return scores_ + (static_cast<size_t>(j) * c_.heads + h) * longest_; }

  QueryHeads heads_of(int j, int t0, NextRows *next = nullptr) const {
    return QueryHeads{c_.q + j * c_.q_stride, scores_of(j, 0) + t0, c_.out + j * c_.out_stride,
                      static_cast<size_t>(longest_), c_.heads, c_.group, next};
  }

  // Queries 2p and 2p + 1 side by side as pair_scores reads them, once for all the blocks.
  DEEPINFER_SPAN_AVX2 void pair_queries() {
    const size_t per = static_cast<size_t>(c_.heads) * 2 * D;
    qpairs_.resize(c_.count / 2 * per);
    for (int p = 0; 2 * p + 1 < c_.count; ++p)
      attention_heads::pair_queries(c_.q + 2 * p * c_.q_stride, c_.q + (2 * p + 1) * c_.q_stride, c_.heads, D,
                                    qpairs_.data() + p * per);
  }

  // Every block of K (or V) in order. The next block's rows are asked for a share at a time
  // (attention_heads::prefetch_share) while this one is computed: a lone query (a decode
  // token) hands them to Heads, which ask before each query head's pass; a span asks after
  // each of its queries (all at once, the requests beyond the line fill buffers stall the
  // core). After K's last block comes V's first.
  template <bool kValues>
  DEEPINFER_SPAN_AVX2 void blocks() {
    const PagedRows<T> &r = kValues ? v_ : k_;
    const int shares = shared_ ? c_.heads : c_.count;
    for (int t0 = begin_; t0 < longest_; t0 += r.block_size) {
      const int ahead = t0 + r.block_size;
      NextRows next = ahead < longest_ ? next_rows(r, ahead, std::min(r.block_size, longest_ - ahead), width_, shares)
                      : kValues    ? NextRows{}
                                   : next_rows(v_, begin_, std::min(v_.block_size, longest_ - begin_), width_, shares);
      if constexpr (std::is_same_v<T, uint16_t>)
        if (!wide_.empty()) {
          block<kValues>(t0, widened(r, t0, std::min(r.block_size, longest_ - t0), width_, wide_.data()), next);
          continue;
        }
      block<kValues>(t0, BlockRows<T>{r.at(t0), r.row}, next);
    }
  }

  // A span's values with pairs, kMaxRuns blocks at a time: a pair that reads every position of
  // the run goes through its blocks in one call, its outputs held in registers from block to
  // block (each element's chain over the positions unchanged); the other queries block by
  // block as in blocks<true>.
  DEEPINFER_SPAN_AVX2 void values_in_runs() {
    constexpr int kRuns = Heads::kMaxRuns;
    const int bs = v_.block_size, span = kRuns * bs;
    for (int t0 = begin_; t0 < longest_; t0 += span) {
      const int runs = std::min(kRuns, (longest_ - t0 + bs - 1) / bs), ahead = t0 + span;
      BlockRows<float> rows[kRuns];
      const float *at[kRuns];
      for (int b = 0; b < runs; ++b) {
        rows[b] = rows_of(t0 + b * bs, wide_.data() + static_cast<size_t>(b) * bs * width_);
        at[b] = rows[b].at;
      }
      NextRows next = ahead < longest_ ? next_rows(v_, ahead, std::min(bs, longest_ - ahead), width_, c_.count)
                                       : NextRows{};
      for (int j = 0; j < c_.count;) {
        int took = 1;
        if (j + 1 < c_.count && reads_all(j, t0, runs * bs) && reads_all(j + 1, t0, runs * bs)) {
          Heads::template pair_values<D>(heads_of(j, t0), heads_of(j + 1, t0), at, runs, rows[0].row, bs);
          took = 2;
        } else {
          for (int b = 0; b < runs; ++b) took = step<true>(j, t0 + b * bs, rows[b], next);
        }
        attention_heads::prefetch_share(&next, took);
        j += took;
      }
    }
  }

  bool reads_all(int j, int t0, int n) const { return reads_.first_of(j) <= t0 && c_.lens[j] >= t0 + n; }

  // V's block at t0 as fp32 rows: in place, or a bf16 block widened into `wide`.
  DEEPINFER_SPAN_AVX2 BlockRows<float> rows_of(int t0, float *wide) {
    if constexpr (std::is_same_v<T, uint16_t>)
      return widened(v_, t0, std::min(v_.block_size, longest_ - t0), width_, wide);
    else
      return (void)wide, BlockRows<float>{v_.at(t0), v_.row};
  }

  template <bool kValues, class R>
  DEEPINFER_SPAN_AVX2 void block(int t0, const BlockRows<R> &rows, NextRows &next) {
    for (int j = 0; j < c_.count;) {
      const int took = step<kValues>(j, t0, rows, next);
      if (!shared_) attention_heads::prefetch_share(&next, took);
      j += took;
    }
  }

  // Query j's work on one block, or with pairs (fp32 rows) queries j's and j + 1's (j even):
  // where both read the block from the same position they go together over the positions
  // both read (for scores, in whole groups of 8), then each alone over the rest of its share:
  // the same split, and so the same floats, as the query has alone. Returns the queries taken.
  template <bool kValues, class R>
  DEEPINFER_SPAN_AVX2 int step(int j, int t0, const BlockRows<R> &rows, NextRows &next) {
    int lo, lo_b = -1;
    const int n = reads_.share(j, t0, lo);
    if constexpr (Heads::kPairs && std::is_same_v<R, float>) {
      if (j + 1 < c_.count) {
        const int nb = reads_.share(j + 1, t0, lo_b), whole = kValues ? 1 : 8;
        const int m = lo_b == lo ? std::max(std::min(n, nb) / whole * whole, 0) : 0;
        if (m > 0) two<kValues>(j, lo, m, t0, rows);
        if (n > m) one<kValues>(j, lo + m, n - m, t0, rows, next);
        if (nb > m) one<kValues>(j + 1, lo_b + m, nb - m, t0, rows, next);
        return 2;
      }
    }
    if (n > 0) one<kValues>(j, lo, n, t0, rows, next);
    return 1;
  }

  // Query j's positions [lo, lo + n) of the block at t0.
  template <bool kValues, class R>
  DEEPINFER_SPAN_AVX2 void one(int j, int lo, int n, int t0, const BlockRows<R> &rows, NextRows &next) {
    const QueryHeads h = heads_of(j, lo, shared_ && next.at ? &next : nullptr);
    const R *at = rows.at + (lo - t0) * rows.row;
    if constexpr (kValues)
      Heads::template block_values<D, R>(h, at, rows.row, n);
    else
      Heads::template block_scores<D, R>(h, at, rows.row, n, scale_);
  }

  // Queries j's and j + 1's positions [lo, lo + m) of the block at t0.
  template <bool kValues>
  DEEPINFER_SPAN_AVX2 void two(int j, int lo, int m, int t0, const BlockRows<float> &rows) {
    const float *at = rows.at + (lo - t0) * rows.row;
    if constexpr (kValues)
      Heads::template pair_values<D>(heads_of(j, lo), heads_of(j + 1, lo), &at, 1, rows.row, m);
    else
      Heads::template pair_scores<D>(heads_of(j, lo), heads_of(j + 1, lo),
                                     qpairs_.data() + static_cast<size_t>(j / 2) * c_.heads * 2 * D, at, rows.row,
                                     m, scale_);
  }

  const QueryChunk &c_;
  const PagedRows<T> &k_, &v_;
  float scale_;
  float *scores_;  // count x heads rows of `longest_` scores
  SpanReads reads_;
  int longest_, width_, begin_ = 0;  // width_: elements of one position's K (or V) in this unit
  bool shared_;                      // a lone query
  std::vector<float> qpairs_;        // pair_queries
  std::vector<float> wide_;          // a bf16 block widened for a span's queries
};

// Attends the chunk's query heads of every query of the chunk (head sizes 64, 128, 256), k/v at
// its first KV head; scores holds count * heads * (longest context) floats.
template <int D, class T, class Heads>
DEEPINFER_SPAN_AVX2 void attend_chunk_avx2(const QueryChunk &c, const PagedRows<T> &k, const PagedRows<T> &v,
                                           float scale, float *scores) {
  SpanPass<D, T, Heads>(c, k, v, scale, scores).run();
}
#endif

}  // namespace paged_span
}  // namespace deepinfer
