#include "bf16_peak.h"

#include <cstdint>
#include <ctime>

#include "bf16_amx.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace deepinfer {

namespace {

// This thread's CPU time: on a shared machine, time other processes take the core is not counted.
double seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) double fma_loop(long iters) {
  __m512 a[12];
  const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  const double t = seconds();
  for (long k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  const double dt = seconds() - t;
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(a[i]);
  volatile float sink = s;  // keeps the chains
  (void)sink;
  return iters * 12.0 * 16 * 2 / dt / 1e9;
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_loop(long iters) {
  __m512 a[12];
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80), c = (__m512bh)_mm512_set1_epi32(0x33803380);
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  const double t = seconds();
  for (long k = 0; k < iters; ++k)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], b, c);
  const double dt = seconds() - t;
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(a[i]);
  volatile float sink = s;
  (void)sink;
  return iters * 12.0 * 32 * 2 / dt / 1e9;
}

// 12 FMA chains a step, 8 steps a round: 96 FMAs, about as long as four tile products.
__attribute__((target("avx512f"), always_inline)) inline void fma_round(__m512 v[12], __m512 m, __m512 d) {
  for (int s = 0; s < 8; ++s)
    for (int i = 0; i < 12; ++i) v[i] = _mm512_fmadd_ps(v[i], m, d);
}

// Seconds of `iters` rounds of four TDPBF16PS into four C tiles from two A and two B tiles
// loaded once (`which` & 1), of fma_round (`which` & 2), or of both.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) double amx_fma_loop(long iters, int which) {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = 0x3f80, b[i] = 0x3380;  // 1 and 2^-24: no overflow
  __m512 v[12];
  const __m512 m = _mm512_set1_ps(1.0000001f), d = _mm512_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i));
  amx_configure_tiles();
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const double t = seconds();
  for (long k = 0; k < iters; ++k) {
    if (which & 1) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (which & 2) fma_round(v, m, d);
  }
  const double dt = seconds() - t;
  _tile_stored(3, c, 64);  // keeps the products
  float s = c[0];
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(v[i]);
  volatile float sink = s;
  (void)sink;
  _tile_release();
  return dt;
}

}  // namespace

void amx_fma_overlap(long iters, double out[3]) {
  for (int w = 0; w < 3; ++w) out[w] = bf16_amx_available() ? amx_fma_loop(iters, w + 1) : 0.0;
}

double amx_peak_gflops(long iters) {
  return bf16_amx_available() ? iters * 4.0 * 16 * 16 * 32 * 2 / amx_fma_loop(iters, 1) / 1e9 : 0.0;
}

double dot_peak_gflops(bool bf16, long iters) {
  if (bf16) return __builtin_cpu_supports("avx512bf16") ? dpbf16_loop(iters) : 0.0;
  return __builtin_cpu_supports("avx512f") ? fma_loop(iters) : 0.0;
}

}  // namespace deepinfer
#else
namespace deepinfer {
double dot_peak_gflops(bool, long) { return 0.0; }
double amx_peak_gflops(long) { return 0.0; }
void amx_fma_overlap(long, double out[3]) { out[0] = out[1] = out[2] = 0.0; }
}  // namespace deepinfer
#endif
