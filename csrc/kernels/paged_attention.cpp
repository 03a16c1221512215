#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "packed_linear_avx512.h"
#include "paged_attention_bf16.h"
#include "paged_attention_heads.h"
#include "paged_attention_span.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace deepinfer {

namespace {

using paged_span::PagedRows;
using paged_span::QueryChunk;
using paged_span::widen;

// Inside a step the pool's workers spin between kernels, so a split pays once each thread
// gets a few dozen cached positions per unit (one decode token of ~100 positions already).
constexpr int64_t kMinPositionsPerThread = 32;
// The kernel keeps one score per position on each thread; past this it would run out of
// memory on a worker thread, where an exception cannot become a Python error.
constexpr int32_t kMaxContext = 1 << 24;

// Queries attended together: consecutive queries of one block-table row (the tokens of a
// verification step or a prefill chunk share their K/V), each K and V block read from memory
// once for all of them and reused from L1. At least kChunkQueries, so that a few tokens still
// keep both threads busy; as many as the call's queries allow up to kPrefillChunkQueries, so
// that a long prefill reads its context 16 times less often than one span of 3 does (the
// context's K/V, 1.5 MB each at 2,000 SmolLM2 positions, stream from L3 once per span).
constexpr int kChunkQueries = 3;
constexpr int kPrefillChunkQueries = 16;

// Spans a thread needs before units take whole spans rather than one KV head of one.
constexpr int kMinSpansPerThread = 4;

// The largest span: kPrefillChunkQueries, or DEEPINFER_DP_PREFILL_SPAN (read once; 3 gives
// the spans of before, for benchmarks/prefill_attention.py). A query's floats do not depend on it.
int prefill_span_limit() {
  static const int limit = [] {
    const char *env = std::getenv("DEEPINFER_DP_PREFILL_SPAN");
    const int v = env ? std::atoi(env) : 0;
    return v >= 1 ? v : kPrefillChunkQueries;
  }();
  return limit;
}

// Queries a span: enough spans for every thread to take several, within [kChunkQueries, limit].
int span_queries(int num_queries, int threads) {
  const int fit = num_queries / (2 * kMinSpansPerThread * std::max(threads, 1));
  return std::max(kChunkQueries, std::min(fit, prefill_span_limit()));
}

using Span = QuerySpan;

// Cuts the units (span u / per_span, its KV heads part u % per_span) into up to `parts` ranges
// [cuts[i], cuts[i + 1]) of about equal total context (a unit's work grows with its queries'
// contexts), so the threads finish together; one range when the batch is too small to pay
// for waking a worker. Units rather than spans, so that even one long sequence (its KV
// heads) keeps several threads busy.
std::vector<int> split_by_length(const std::vector<Span> &spans, const int32_t *lens, int per_span, int parts) {
  std::vector<int64_t> weight;
  int64_t total = 0, seen = 0;
  for (const Span &sp : spans) {
    weight.push_back(0);
    for (int i = sp.first; i < sp.first + sp.count; ++i) weight.back() += lens[i];
    total += weight.back() * per_span;
  }
  if (total < kMinPositionsPerThread * per_span * parts) parts = 1;  // positions, not units
  const int units = static_cast<int>(spans.size()) * per_span;
  std::vector<int> cuts{0};
  for (int u = 0; u < units && static_cast<int>(cuts.size()) < parts; ++u) {
    seen += weight[u / per_span];
    if (seen * parts >= total * static_cast<int64_t>(cuts.size())) cuts.push_back(u + 1);
  }
  cuts.push_back(units);
  return cuts;
}

// Softmax of `n` scores in place.
void softmax(float *sc, int n) {
  float denom = 0.f, mx = *std::max_element(sc, sc + n);
  for (int t = 0; t < n; ++t) denom += (sc[t] = std::exp(sc[t] - mx));
  const float inv = 1.f / denom;
  for (int t = 0; t < n; ++t) sc[t] *= inv;
}

// Portable path, any head size: one query head over its KV head's positions.
template <class T>
void attend_head_scalar(const float *q, const PagedRows<T> &k, const PagedRows<T> &v, int first, int seq_len,
                        int dim, float scale, float *scores, float *out) {
  for (int t = first; t < seq_len; ++t) {
    const T *kt = k.at(t);
    float sum = 0.f;
    for (int i = 0; i < dim; ++i) sum += q[i] * widen(kt[i]);
    scores[t] = sum * scale;
  }
  softmax(scores + first, seq_len - first);
  std::fill(out, out + dim, 0.f);
  for (int t = first; t < seq_len; ++t) {
    const T *vt = v.at(t);
    for (int i = 0; i < dim; ++i) out[i] += scores[t] * widen(vt[i]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DEEPINFER_HAVE_AVX2 1
using paged_span::attend_chunk_avx2;
#endif

// Attends the chunk's query heads of every query of the chunk, k/v at its first KV head;
// scores holds count * heads * (longest context) floats.
template <class T>
using ChunkFn = void (*)(const QueryChunk &, const PagedRows<T> &, const PagedRows<T> &, float, float *);

template <class T>
ChunkFn<T> pick_chunk_fn(int head_dim) {
#ifdef DEEPINFER_HAVE_AVX2
  using attention_heads::HeadsAvx2;
  using attention_heads::HeadsAvx512;
  if (packed_avx512_enabled()) {  // (its switch, DEEPINFER_DP_PACKED_AVX512, covers this kernel too)
    if (head_dim == 64) return &attend_chunk_avx2<64, T, HeadsAvx512>;
    if (head_dim == 128) return &attend_chunk_avx2<128, T, HeadsAvx512>;
    if (head_dim == 256) return &attend_chunk_avx2<256, T, HeadsAvx512>;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    if (head_dim == 64) return &attend_chunk_avx2<64, T, HeadsAvx2>;
    if (head_dim == 128) return &attend_chunk_avx2<128, T, HeadsAvx2>;
    if (head_dim == 256) return &attend_chunk_avx2<256, T, HeadsAvx2>;
  }
#endif
  (void)head_dim;
  return nullptr;
}

// Units [begin, end): part u % per_span of span u / per_span, per_span being 1 (all its KV
// heads), num_kv_heads (one each) or num_heads (one query head, reading its KV head's rows
// itself). One thread computes a unit, in a fixed order: no query head's floats depend on it.
template <class T>
void attend_units(const PagedAttentionShape &s, const std::vector<Span> &spans, int per_span, const float *q,
                  const T *k_cache, const T *v_cache, const int32_t *block_tables, const int32_t *query_rows,
                  const int32_t *context_lens, float scale, float *out, int begin, int end) {
  const int group = s.num_heads / s.num_kv_heads, kv_units = std::min(per_span, s.num_kv_heads);
  const int q_parts = per_span / kv_units, kv_per = s.num_kv_heads / kv_units, heads = kv_per * group / q_parts;
  const size_t D = s.head_dim, stride = static_cast<size_t>(s.num_heads) * D, q_stride = q_row_stride(s);
  const size_t row = static_cast<size_t>(s.num_kv_heads) * D;
  const ChunkFn<T> fast = pick_chunk_fn<T>(s.head_dim);
  std::vector<float> scores;
  for (int u = begin; u < end; ++u) {
    const Span &sp = spans[u / per_span];
    const int r = u % per_span, g = r / q_parts * kv_per, i = sp.first;
    const int32_t *blocks = block_tables + static_cast<size_t>(query_rows ? query_rows[i] : i) * s.max_blocks;
    const int32_t *lens = context_lens + i;
    // HF's repeat_kv: query heads [g * group, (g + 1) * group) read KV head g.
    PagedRows<T> k{k_cache + g * D, blocks, s.block_size, row}, v{v_cache + g * D, blocks, s.block_size, row};
    const size_t head = (static_cast<size_t>(g) * group + r % q_parts * heads) * D;
    const QueryChunk chunk{q + i * q_stride + head, out + i * stride + head, q_stride, stride, lens,
                           sp.count, s.window, heads, q_parts > 1 ? heads : group};
    scores.resize(static_cast<size_t>(*std::max_element(lens, lens + sp.count)) * chunk.heads * sp.count);
    if (fast) {
      fast(chunk, k, v, scale, scores.data());
      continue;
    }
    for (int j = 0; j < sp.count; ++j)
      for (int h = 0; h < chunk.heads; ++h) {
        const size_t at = h / chunk.group * D;  // its KV head in the unit
        const PagedRows<T> kh{k.cache + at, blocks, s.block_size, row}, vh{v.cache + at, blocks, s.block_size, row};
        attend_head_scalar(chunk.q + j * q_stride + h * D, kh, vh, window_start(lens[j], s.window), lens[j],
                           s.head_dim, scale, scores.data(), chunk.out + j * stride + h * D);
      }
  }
}

}  // namespace

std::string paged_context_error(const PagedAttentionShape &s, const int32_t *block_tables, const int32_t *rows,
                                const int32_t *lens) {
  // The longest context of each row is checked against that row's block ids.
  std::vector<int> longest(s.num_rows, 0);
  for (int i = 0; i < s.num_queries; ++i) {
    const int r = rows ? rows[i] : i;
    if (r < 0 || r >= s.num_rows) return "query row outside the block table";
    if (lens[i] < 1 || lens[i] > static_cast<int64_t>(s.max_blocks) * s.block_size)
      return "context length out of range for its block table";
    if (lens[i] > kMaxContext) return "context length above " + std::to_string(kMaxContext);
    longest[r] = std::max(longest[r], lens[i]);
  }
  for (int r = 0; r < s.num_rows; ++r)
    for (int64_t b = 0; b < (static_cast<int64_t>(longest[r]) + s.block_size - 1) / s.block_size; ++b) {
      const int id = block_tables[static_cast<size_t>(r) * s.max_blocks + b];
      if (id < 0 || id >= s.num_blocks) return "block id outside the cache";
    }
  return "";
}

std::vector<QuerySpan> query_spans(const int32_t *rows, int n, int most) {
  std::vector<QuerySpan> spans;
  for (int i = 0; i < n; ++i) {
    if (rows && !spans.empty() && spans.back().count < most && rows[spans.back().first] == rows[i])
      ++spans.back().count;
    else
      spans.push_back({i, 1});
  }
  return spans;
}

void paged_attention_threaded(const PagedAttentionShape &s, const float *q, const void *k_cache, const void *v_cache,
                              KvDtype dtype, const int32_t *block_tables, const int32_t *query_rows,
                              const int32_t *context_lens, float scale, float *out, int threads) {
  if (s.bf16_math && dtype == KvDtype::kBF16 && paged_attention_bf16_fits(s))
    return paged_attention_bf16(s, q, static_cast<const uint16_t *>(k_cache), static_cast<const uint16_t *>(v_cache),
                               block_tables, query_rows, context_lens, scale, out, threads);
  const std::vector<Span> spans = query_spans(query_rows, s.num_queries, span_queries(s.num_queries, threads));
  // Enough spans to share among the threads: each takes all its KV heads in one pass, so its
  // cache blocks are read front to back (one KV head's rows alone are a strided stream). Fewer
  // KV heads than two a thread (a lone decode token): one query head a unit.
  int per_span = static_cast<int>(spans.size()) >= kMinSpansPerThread * threads ? 1 : s.num_kv_heads;
  if (per_span == s.num_kv_heads && static_cast<int>(spans.size()) * per_span < 2 * threads) per_span = s.num_heads;
  const std::vector<int> cuts = split_by_length(spans, context_lens, per_span, threads);
  shared_pool(threads).run(static_cast<int>(cuts.size()) - 1, threads, [&](int c) {
    if (dtype == KvDtype::kBF16)
      attend_units(s, spans, per_span, q, static_cast<const uint16_t *>(k_cache),
                   static_cast<const uint16_t *>(v_cache), block_tables, query_rows, context_lens, scale, out,
                   cuts[c], cuts[c + 1]);
    else
      attend_units(s, spans, per_span, q, static_cast<const float *>(k_cache), static_cast<const float *>(v_cache),
                   block_tables, query_rows, context_lens, scale, out, cuts[c], cuts[c + 1]);
  });
}

}  // namespace deepinfer
