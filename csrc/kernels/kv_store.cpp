#include "kv_store.h"

#include <cstring>

#include "bf16_linear.h"
#include "packed_linear_avx512.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace deepinfer {

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
// bf16_from_float on 16 lanes at a time, the same bits; returns how many of the n it stored.
// (The scalar loop's NaN branch keeps the compiler from widening it.)
__attribute__((target("avx512f"))) size_t bf16_store_avx512(uint16_t *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i),
                        _mm512_cvtepi32_epi16(bf16_round16_lanes(_mm512_loadu_ps(src + i))));
  return i;
}
#endif

}  // namespace

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
  size_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if (packed_avx512_enabled()) i = bf16_store_avx512(dst, src, n);
#endif
  for (; i < n; ++i) dst[i] = bf16_from_float(src[i]);
}

void kv_store_rows(const KvRows &r, void *k_cache, void *v_cache, KvDtype dtype, int threads) {
  const size_t width = static_cast<size_t>(r.width);
  split_rows(r.rows, threads, [&](int begin, int end) {
    for (int t = begin; t < end; ++t) {
      const size_t at = static_cast<size_t>(r.slots[t]) * width;
      kv_store(k_cache, dtype, at, r.k + t * r.k_stride, width);
      kv_store(v_cache, dtype, at, r.v + t * r.v_stride, width);
    }
  });
}

}  // namespace deepinfer
