#include "bf16_linear.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bf16_amx.h"
#include "line_vector.h"
#include "packed_linear_avx512.h"
#include "rows_ahead.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DEEPINFER_BF16_X86 1
// One target for both 512-bit paths: the widening instantiation uses no bf16 instruction.
#define BF16_KERNEL __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma")))
#endif

namespace deepinfer {

namespace {

constexpr int kLanes = 16;  // rows per block: one 512-bit vector of fp32 outputs

// Input rows per tile of NB blocks: about 24 chains, with the NB weight vectors and a
// broadcast input still in the 32 registers.
constexpr int tile_rows(int NB) { return NB <= 4 ? 6 : NB <= 6 ? 4 : 3; }

uint16_t flush_bf16(uint16_t h) { return (h & 0x7f80) == 0 ? static_cast<uint16_t>(h & 0x8000) : h; }

// c10's round_to_nearest_even, then vdpbf16ps's view of a subnormal.
uint16_t round_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return flush_bf16(static_cast<uint16_t>(u >> 16));
}

float bf16_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float flush_sum(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.f, v) : v; }

const uint16_t *block_of(const PackedMatrix &w, int row) {
  return reinterpret_cast<const uint16_t *>(w.data) + static_cast<size_t>(row / kLanes) * w.cols * kLanes;
}

// The reference order, one output at a time (CPUs without AVX2).
void scalar_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1) {
  const int K = w.cols, steps = K / 2;
  for (int m = 0; m < M; ++m) {
    const uint16_t *xr = xb + static_cast<size_t>(m) * K;
    for (int n = n0; n < n1; ++n) {
      const uint16_t *col = block_of(w, n) + (n % kLanes) * 2;
      float acc = 0.f;
      for (int p = 0; p < steps; ++p) {  // the product is exact: fma rounds the sum only
        acc = flush_sum(std::fma(bf16_float(col[32 * p + 1]), bf16_float(xr[2 * p + 1]), acc));
        acc = flush_sum(std::fma(bf16_float(col[32 * p]), bf16_float(xr[2 * p]), acc));
      }
      y[static_cast<size_t>(m) * w.rows + n] = bias ? acc + bias[n] : acc;
    }
  }
}

#ifdef DEEPINFER_BF16_X86
// One step of the chain of 16 outputs: vdpbf16ps, or its widened equal (odd pair member
// first, each sum rounded once and a subnormal one flushed).
template <bool kNative>
BF16_KERNEL inline __m512 dot_step(__m512 acc, __m512i w, __m512i x) {
  if constexpr (kNative) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  } else {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const __m512 tiny = _mm512_set1_ps(FLT_MIN), sign = _mm512_set1_ps(-0.f);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, hi)),
                          _mm512_castsi512_ps(_mm512_and_si512(x, hi)), acc);
    acc = _mm512_mask_and_ps(acc, _mm512_cmp_ps_mask(_mm512_abs_ps(acc), tiny, _CMP_LT_OQ), acc, sign);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc);
    return _mm512_mask_and_ps(acc, _mm512_cmp_ps_mask(_mm512_abs_ps(acc), tiny, _CMP_LT_OQ), acc, sign);
  }
}

// NB blocks (from row `first`) against MB input rows: NB x MB chains in registers, each
// weight vector loaded once per step for all MB rows; the lanes in [n0, n1) are stored.
template <bool kNative, int NB, int MB>
BF16_KERNEL void tile(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int first, int n0,
                      int n1, RowsAhead &next) {
  const int K = w.cols, steps = K / 2;
  const size_t stride = static_cast<size_t>(K) * kLanes;  // uint16 values per block
  const uint16_t *wb = block_of(w, first);
  __m512 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm512_setzero_ps();
  for (int p = 0; p < steps; ++p) {
    next.next();
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_si512(wb + b * stride + 32 * p);
    for (int j = 0; j < MB; ++j) {
      int pair;
      std::memcpy(&pair, xb + static_cast<size_t>(j) * K + 2 * p, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[b][j] = dot_step<kNative>(acc[b][j], wv[b], xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int base = first + kLanes * b, lo = std::max(n0 - base, 0), hi = std::min(n1 - base, kLanes);
    if (lo >= hi) continue;
    const __mmask16 mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + base) : _mm512_setzero_ps();
    for (int j = 0; j < MB; ++j)
      _mm512_mask_storeu_ps(y + static_cast<size_t>(j) * w.rows + base, mask,
                            bias ? _mm512_add_ps(acc[b][j], bv) : acc[b][j]);
  }
}

// The last `rows` (< MB + 1) input rows against NB blocks, as one tile.
template <bool kNative, int NB, int MB>
BF16_KERNEL void tile_rest(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int rows, int first,
                           int n0, int n1, RowsAhead &next) {
  if constexpr (MB > 0) {
    if (rows == MB) return tile<kNative, NB, MB>(xb, w, bias, y, first, n0, n1, next);
    tile_rest<kNative, NB, MB - 1>(xb, w, bias, y, rows, first, n0, n1, next);
  }
}

// NB blocks against all M rows, tile_rows(NB) at a time (the blocks stay in cache
// meanwhile), asking for a share of the next group's lines (`next`) every step of every tile.
template <bool kNative, int NB>
BF16_KERNEL void blocks_against_rows(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M,
                                     int first, int n0, int n1, RowsAhead next) {
  const size_t K = w.cols, N = w.rows;
  constexpr int kRows = tile_rows(NB);
  int m = 0;
  for (; m + kRows <= M; m += kRows) tile<kNative, NB, kRows>(xb + m * K, w, bias, y + m * N, first, n0, n1, next);
  tile_rest<kNative, NB, kRows - 1>(xb + m * K, w, bias, y + m * N, M - m, first, n0, n1, next);
}

// The last `count` (< 8) blocks of a range, as one group (nothing of the matrix after it).
template <bool kNative>
BF16_KERNEL void last_blocks(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int first,
                             int count, int n0, int n1, SideLines *side) {
  const RowsAhead none(nullptr, 0, 0, 0, 1, side);
  switch (count) {
    case 7: return blocks_against_rows<kNative, 7>(xb, w, bias, y, M, first, n0, n1, none);
    case 6: return blocks_against_rows<kNative, 6>(xb, w, bias, y, M, first, n0, n1, none);
    case 5: return blocks_against_rows<kNative, 5>(xb, w, bias, y, M, first, n0, n1, none);
    case 4: return blocks_against_rows<kNative, 4>(xb, w, bias, y, M, first, n0, n1, none);
    case 3: return blocks_against_rows<kNative, 3>(xb, w, bias, y, M, first, n0, n1, none);
    case 2: return blocks_against_rows<kNative, 2>(xb, w, bias, y, M, first, n0, n1, none);
    case 1: return blocks_against_rows<kNative, 1>(xb, w, bias, y, M, first, n0, n1, none);
    default: return;
  }
}

// Blocks per pass: at one or two rows enough chains to cover vdpbf16ps's latency (and
// weight streams to keep memory busy); from three rows on, 6 blocks x 4 rows, which leave
// fewer half-empty tiles than 4 x 6: a thread's share of SmolLM2's matrices is 18, 30 or 96
// blocks (groups of 4 left a tile of 2 blocks), and 8 rows are two tiles of 4 (6-row tiles
// left one of 2 rows; at 8 rows, one thread, 88-94% of the instruction's peak against 72-78%).
// Where a group is multiplied by more than one tile of rows, the next group is read
// meanwhile, its lines spread over every step of the group's tiles: a group (110 KB at 576
// columns) is read by its first tile and reused by the rest, and a share asked before each
// tile (~100 lines at once) gained nothing. At one tile the hardware prefetcher keeps up.
// `side`'s lines are spread over every step of every tile.
template <bool kNative, int NB>
BF16_KERNEL void blocks_in_groups(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M,
                                  int n0, int n1, SideLines *side) {
  const int end = std::min((n1 + kLanes - 1) / kLanes * kLanes, w.rows);
  const size_t block_bytes = static_cast<size_t>(w.cols) * kLanes * sizeof(uint16_t);
  constexpr int kRows = tile_rows(NB);
  const int tile_steps = (M + kRows - 1) / kRows * (w.cols / 2);
  const int steps = M > kRows ? tile_steps : 0;
  int first = n0 / kLanes * kLanes;
  if (side) side->spread(static_cast<int64_t>((end - first) / kLanes + NB - 1) / NB * tile_steps, NB * kRows / 24);
  for (; first + NB * kLanes <= end; first += NB * kLanes) {
    const int next = first / kLanes + NB, next_end = steps ? std::min(end / kLanes, next + NB) : next;
    blocks_against_rows<kNative, NB>(xb, w, bias, y, M, first, n0, n1,
                                     RowsAhead(w.data, block_bytes, next, next_end, steps, side));
  }
  last_blocks<kNative>(xb, w, bias, y, M, first, (end - first) / kLanes, n0, n1, side);
}

template <bool kNative>
void simd_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int n0, int n1,
                  SideLines *side) {
  switch (M) {
    case 1: return blocks_in_groups<kNative, 8>(xb, w, bias, y, M, n0, n1, side);
    case 2: return blocks_in_groups<kNative, 6>(xb, w, bias, y, M, n0, n1, side);
    default: return blocks_in_groups<kNative, 6>(xb, w, bias, y, M, n0, n1, side);
  }
}

__attribute__((target("avx512f"))) void round_avx512(const float *x, size_t count, uint16_t *out) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out + i), bf16_round16(_mm512_loadu_ps(x + i)));
  for (; i < count; ++i) out[i] = round_bf16(x[i]);
}

// The widened path on 256-bit vectors (CPUs with AVX2 and no AVX-512): a block of 16 rows is
// two vectors of 8 outputs, each step the same two rounded, flushed adds as dot_step's.
#define BF16_AVX2 __attribute__((target("avx2,fma")))

BF16_AVX2 inline __m256 flush256(__m256 acc) {
  const __m256 sign = _mm256_set1_ps(-0.f), tiny = _mm256_set1_ps(FLT_MIN);
  const __m256 small = _mm256_cmp_ps(_mm256_andnot_ps(sign, acc), tiny, _CMP_LT_OQ);
  return _mm256_blendv_ps(acc, _mm256_and_ps(acc, sign), small);
}

BF16_AVX2 inline __m256 dot_step256(__m256 acc, __m256i w, __m256i x) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = flush256(_mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, hi)),
                                 _mm256_castsi256_ps(_mm256_and_si256(x, hi)), acc));
  return flush256(_mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc));
}

// The block of 16 rows from `first` against MB input rows; the lanes in [n0, n1) are stored.
template <int MB>
BF16_AVX2 void tile256(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int first, int n0,
                       int n1) {
  const int K = w.cols, steps = K / 2;
  const uint16_t *wb = block_of(w, first);
  __m256 acc[2][MB];
  for (int j = 0; j < MB; ++j) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
  for (int p = 0; p < steps; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wb + 32 * p));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wb + 32 * p + 16));
    for (int j = 0; j < MB; ++j) {
      int pair;
      std::memcpy(&pair, xb + static_cast<size_t>(j) * K + 2 * p, 4);
      const __m256i xv = _mm256_set1_epi32(pair);
      acc[0][j] = dot_step256(acc[0][j], w0, xv);
      acc[1][j] = dot_step256(acc[1][j], w1, xv);
    }
  }
  const int lo = std::max(n0 - first, 0), hi = std::min(n1 - first, kLanes);
  for (int j = 0; j < MB; ++j) {
    float out[kLanes];
    _mm256_storeu_ps(out, acc[0][j]);
    _mm256_storeu_ps(out + 8, acc[1][j]);
    float *yr = y + static_cast<size_t>(j) * w.rows + first;
    for (int l = lo; l < hi; ++l) yr[l] = bias ? out[l] + bias[first + l] : out[l];
  }
}

// Each block of the range against all M rows, 4 at a time (the block stays in L1 meanwhile).
BF16_AVX2 void avx2_columns(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M, int n0,
                            int n1) {
  const size_t K = w.cols, N = w.rows;
  const int end = std::min((n1 + kLanes - 1) / kLanes * kLanes, w.rows);
  for (int first = n0 / kLanes * kLanes; first < end; first += kLanes) {
    int m = 0;
    for (; m + 4 <= M; m += 4) tile256<4>(xb + m * K, w, bias, y + m * N, first, n0, n1);
    switch (M - m) {
      case 3: tile256<3>(xb + m * K, w, bias, y + m * N, first, n0, n1); break;
      case 2: tile256<2>(xb + m * K, w, bias, y + m * N, first, n0, n1); break;
      case 1: tile256<1>(xb + m * K, w, bias, y + m * N, first, n0, n1); break;
      default: break;
    }
  }
}
#endif

bool env_off(const char *name) {
  const char *v = std::getenv(name);
  return v && std::strcmp(v, "0") == 0;
}

}  // namespace

bool bf16_dot_path_available(Bf16DotPath path) {
  if (path == Bf16DotPath::kAmx) return bf16_amx_available();
#ifdef DEEPINFER_BF16_X86
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  if (path == Bf16DotPath::kNative) return bf16 && packed_avx512_enabled();
  if (path == Bf16DotPath::kWiden512) return packed_avx512_enabled();
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (path == Bf16DotPath::kWiden256) return avx2;
#endif
  return path == Bf16DotPath::kScalar;
}

namespace {

// The fastest path this CPU runs of those that give vdpbf16ps's floats (vdpbf16ps itself only
// where `native`).
Bf16DotPath dot_order_path(bool native) {
  for (Bf16DotPath p : {Bf16DotPath::kNative, Bf16DotPath::kWiden512, Bf16DotPath::kWiden256})
    if ((native || p != Bf16DotPath::kNative) && bf16_dot_path_available(p)) return p;
  return Bf16DotPath::kScalar;
}

}  // namespace

Bf16DotPath bf16_dot_default_path() {
  static const Bf16DotPath path = bf16_dot_path_available(Bf16DotPath::kAmx)
                                      ? Bf16DotPath::kAmx
                                      : dot_order_path(!env_off("DEEPINFER_DP_BF16_DOT"));
  return path;
}

const char *bf16_dot_path_name(Bf16DotPath path) {
  switch (path) {
    case Bf16DotPath::kAmx: return "amx";
    case Bf16DotPath::kNative: return "native";
    case Bf16DotPath::kWiden512: return "widen512";
    case Bf16DotPath::kWiden256: return "widen256";
    case Bf16DotPath::kScalar: return "scalar";
  }
  return "?";
}

void bf16_pairs_pack(const uint16_t *src, int rows, int cols, uint16_t *dst) {
  for (int n = 0; n < rows; ++n) {
    uint16_t *col = dst + static_cast<size_t>(n / kLanes) * cols * kLanes + (n % kLanes) * 2;
    const uint16_t *r = src + static_cast<size_t>(n) * cols;
    for (int p = 0; p < cols / 2; ++p) {
      col[32 * p] = flush_bf16(r[2 * p]);
      col[32 * p + 1] = flush_bf16(r[2 * p + 1]);
    }
  }
}

void bf16_pairs_widen_row(const PackedMatrix &w, int row, float *out) {
  const uint16_t *col = block_of(w, row) + (row % kLanes) * 2;
  for (int p = 0; p < w.cols / 2; ++p) {
    out[2 * p] = bf16_float(col[32 * p]);
    out[2 * p + 1] = bf16_float(col[32 * p + 1]);
  }
}

void bf16_round_rows(const float *x, int M, int cols, uint16_t *out) {
  const size_t count = static_cast<size_t>(M) * cols;
#ifdef DEEPINFER_BF16_X86
  static const bool simd = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (simd) return round_avx512(x, count, out);
#endif
  for (size_t i = 0; i < count; ++i) out[i] = round_bf16(x[i]);
}

void bf16_pairs_columns(const float *x, const PackedMatrix &w, const float *bias, float *y, int M, int n_begin,
                        int n_end, Bf16DotPath path, SideLines *side) {
  if (M <= 0 || n_begin >= n_end) return;
  thread_local LineVector<uint16_t> xb;  // the rounded inputs, kept between calls
  const bool amx = bf16_amx_multiplies(w, path);
  const size_t K = w.cols, rows = amx ? bf16_rows_padded(M) : M;
  xb.resize(rows * K);
  bf16_round_rows(x, M, w.cols, xb.data());
  std::fill(xb.begin() + static_cast<std::ptrdiff_t>(M * K), xb.end(), uint16_t{0});  // AMX's whole tiles
  bf16_pairs_columns_rounded(xb.data(), w, bias, y, M, n_begin, n_end, path, side);
}

void bf16_pairs_columns_rounded(const uint16_t *xb, const PackedMatrix &w, const float *bias, float *y, int M,
                                int n_begin, int n_end, Bf16DotPath path, SideLines *side) {
  if (M <= 0 || n_begin >= n_end) return;
  if (bf16_amx_multiplies(w, path)) return bf16_amx_columns(xb, w, bias, y, M, n_begin, n_end);
  if (path == Bf16DotPath::kAmx) path = dot_order_path(true);  // this matrix's path without AMX: fixed per matrix
#ifdef DEEPINFER_BF16_X86
  if (path == Bf16DotPath::kNative) return simd_columns<true>(xb, w, bias, y, M, n_begin, n_end, side);
  if (path == Bf16DotPath::kWiden512) return simd_columns<false>(xb, w, bias, y, M, n_begin, n_end, side);
  if (path == Bf16DotPath::kWiden256) return avx2_columns(xb, w, bias, y, M, n_begin, n_end);
#endif
  scalar_columns(xb, w, bias, y, M, n_begin, n_end);
}

}  // namespace deepinfer
