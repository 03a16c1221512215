#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "packed_linear_avx512.h"
#include "paged_attention_heads.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace deepinfer {

namespace {

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

struct Span {
  int first, count;
};

std::vector<Span> query_spans(const int32_t *rows, int n, int most) {
  std::vector<Span> spans;
  for (int i = 0; i < n; ++i) {
    if (rows && !spans.empty() && spans.back().count < most && rows[spans.back().first] == rows[i])
      ++spans.back().count;
    else
      spans.push_back({i, 1});
  }
  return spans;
}

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
  size_t q_stride;      // floats between queries: num_heads * head_dim
  const int32_t *lens;  // the queries' context lengths
  int count;
  int window;           // sliding window (0: none): query j reads [window_start(lens[j]), lens[j])
  int heads, group;     // query heads of the unit; query head h reads KV head h / group of it
};

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
#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline
using attention_heads::hsum;
using attention_heads::NextRows;
using attention_heads::prefetch_share;
using attention_heads::QueryHeads;

// e^x for x <= 0 on 8 lanes (Cephes' expf: range reduction by ln 2, degree-5 polynomial;
// within 2 ulp of libm's): the softmax of a long context takes as many exps as positions x
// heads, and one libm call per score cost about as much as reading the cache.
AVX2_INLINE __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below that the result is ~0 either way
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// The largest of n scores, 8 lanes at a time (a max is exact in any order; the scalar
// std::max_element took about a fifth of a long prefill's attention).
AVX2_INLINE float max_of(const float *sc, int n) {
  float mx = sc[0];
  int t = 0;
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(sc);
    for (t = 8; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + t));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  for (; t < n; ++t) mx = std::max(mx, sc[t]);
  return mx;
}

// Softmax of n scores in place, 8 lanes at a time.
__attribute__((target("avx2,fma"))) void softmax_avx2(float *sc, int n) {
  const float mx = max_of(sc, n);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
    _mm256_storeu_ps(sc + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float denom = hsum(sum);
  for (; t < n; ++t) denom += (sc[t] = std::exp(sc[t] - mx));
  const float inv = 1.f / denom;
  for (t = 0; t < n; ++t) sc[t] *= inv;
}

// A unit's next block may sit anywhere in the cache, where the hardware prefetcher does not
// look, and one block's loads alone keep too few misses in flight (blocks laid out in order
// gained as much from asking ahead: benchmarks/decode_attention.py --layout): its rows are
// asked for while this block is computed: all at once, or in `shares` shares
// (attention_heads::prefetch_share).
inline void prefetch_all(const NextRows &nx) {
  const char *p = nx.at;
  for (int i = 0; i < nx.rows; ++i, p += nx.stride)
    for (int l = 0; l < nx.lines; ++l) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

template <class T>
NextRows next_rows(const PagedRows<T> &r, int t, int n, int width, int shares) {
  const int lines = (width * static_cast<int>(sizeof(T)) + 63) / 64;
  const int per = (n * lines + shares - 1) / shares;
  return NextRows{reinterpret_cast<const char *>(r.at(t)), r.row * sizeof(T), n, lines, per, 0};
}

// AVX2 path for head sizes 64, 128 and 256: the `group` query heads that share one KV head, of
// each of the chunk's queries (consecutive queries of one sequence: a decode token alone, or
// the tokens of a verification step or short prefill chunk), go through its positions
// together, block by block, so each K and V row comes from memory once and is reused from L1
// by all of them (at long contexts attention is bound by reading the cache). Each query
// stops at its own context length, with the block-by-block split it would have alone, so its
// floats do not depend on the queries around it. Heads (paged_attention_heads.h) does each
// block's work: one query head at a time, or with AVX-512 up to three sharing each load.
template <int D, class T, class Heads>
__attribute__((target("avx2,fma"))) void attend_chunk_avx2(const QueryChunk &c, const PagedRows<T> &k,
                                                           const PagedRows<T> &v, float scale, float *scores) {
  const int longest = *std::max_element(c.lens, c.lens + c.count);
  const auto scores_of = [&](int j, int h) { return scores + (static_cast<size_t>(j) * c.heads + h) * longest; };
  const auto heads_of = [&](int j, int t0) {
    return QueryHeads{c.q + j * c.q_stride, scores_of(j, 0) + t0, c.out + j * c.q_stride, static_cast<size_t>(longest),
                      c.heads, c.group, nullptr};
  };
  const auto first_of = [&](int j) { return window_start(c.lens[j], c.window); };
  int lowest = first_of(0);
  for (int j = 1; j < c.count; ++j) lowest = std::min(lowest, first_of(j));
  const int begin = lowest / k.block_size * k.block_size;  // the block holding the first position read
  const int width = c.heads / c.group * D;  // elements of one position's K (or V) in this unit
  // Query j's share of the block [t0, t0 + block_size): positions [lo, lo + n), n <= 0 for none.
  const auto share = [&](int j, int t0, int &lo) {
    lo = std::max(t0, first_of(j));
    return std::min(t0 + k.block_size, static_cast<int>(c.lens[j])) - lo;
  };
  // The next block's rows: a lone query (a decode token) hands them to Heads, which ask for
  // them a share before each query head's pass; a span's (its later queries reuse the block
  // from L1, so there is time) are asked for at once.
  const bool shared = c.count == 1;
  const auto ask = [&](NextRows next) {
    if (shared) return next;
    if (next.at) prefetch_all(next);
    return NextRows{};
  };
  const auto with_next = [&](QueryHeads h, NextRows &next) {
    h.next = next.at ? &next : nullptr;
    return h;
  };
  for (int t0 = begin; t0 < longest; t0 += k.block_size) {
    const T *kt = k.at(t0);
    const int ahead = t0 + k.block_size;
    NextRows next = ask(ahead < longest ? next_rows(k, ahead, std::min(k.block_size, longest - ahead), width, c.heads)
                                        : next_rows(v, begin, std::min(v.block_size, longest - begin), width, c.heads));
    for (int j = 0; j < c.count; ++j) {
      int lo;
      const int n = share(j, t0, lo);
      if (n > 0)
        Heads::template block_scores<D, T>(with_next(heads_of(j, lo), next), kt + (lo - t0) * k.row, k.row, n, scale);
    }
  }
  for (int j = 0; j < c.count; ++j) {
    for (int h = 0; h < c.heads; ++h) softmax_avx2(scores_of(j, h) + first_of(j), c.lens[j] - first_of(j));
    std::fill(c.out + j * c.q_stride, c.out + j * c.q_stride + c.heads * D, 0.f);
  }
  for (int t0 = begin; t0 < longest; t0 += v.block_size) {
    const T *vt = v.at(t0);
    const int ahead = t0 + v.block_size;
    NextRows next = ask(ahead < longest ? next_rows(v, ahead, std::min(v.block_size, longest - ahead), width, c.heads)
                                        : NextRows{});
    for (int j = 0; j < c.count; ++j) {
      int lo;
      const int n = share(j, t0, lo);
      if (n > 0) Heads::template block_values<D, T>(with_next(heads_of(j, lo), next), vt + (lo - t0) * v.row, v.row, n);
    }
  }
}
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
  const size_t D = s.head_dim, stride = static_cast<size_t>(s.num_heads) * D;
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
    const size_t first = i * stride + (static_cast<size_t>(g) * group + r % q_parts * heads) * D;
    const QueryChunk chunk{q + first, out + first, stride, lens, sp.count, s.window, heads,
                           q_parts > 1 ? heads : group};
    scores.resize(static_cast<size_t>(*std::max_element(lens, lens + sp.count)) * chunk.heads * sp.count);
    if (fast) {
      fast(chunk, k, v, scale, scores.data());
      continue;
    }
    for (int j = 0; j < sp.count; ++j)
      for (int h = 0; h < chunk.heads; ++h) {
        const size_t at = h / chunk.group * D;  // its KV head in the unit
        const PagedRows<T> kh{k.cache + at, blocks, s.block_size, row}, vh{v.cache + at, blocks, s.block_size, row};
        attend_head_scalar(chunk.q + j * stride + h * D, kh, vh, window_start(lens[j], s.window), lens[j],
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

uint16_t bf16_from_float(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: the canonical quiet NaN, as torch gives
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

void kv_store(void *cache, KvDtype dtype, size_t offset, const float *src, size_t n) {
  if (dtype == KvDtype::kF32) {
    std::memcpy(static_cast<float *>(cache) + offset, src, sizeof(float) * n);
    return;
  }
  uint16_t *dst = static_cast<uint16_t *>(cache) + offset;
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_from_float(src[i]);
}

void paged_attention_threaded(const PagedAttentionShape &s, const float *q, const void *k_cache, const void *v_cache,
                              KvDtype dtype, const int32_t *block_tables, const int32_t *query_rows,
                              const int32_t *context_lens, float scale, float *out, int threads) {
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
