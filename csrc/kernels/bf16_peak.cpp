#include "bf16_peak.h"

#include <ctime>

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

}  // namespace

double dot_peak_gflops(bool bf16, long iters) {
  if (bf16) return __builtin_cpu_supports("avx512bf16") ? dpbf16_loop(iters) : 0.0;
  return __builtin_cpu_supports("avx512f") ? fma_loop(iters) : 0.0;
}

}  // namespace deepinfer
#else
namespace deepinfer {
double dot_peak_gflops(bool, long) { return 0.0; }
}  // namespace deepinfer
#endif
