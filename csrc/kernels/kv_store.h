// Writing a step's K and V rows into the paged cache, fp32 or bf16, through the slot of each
// token: one pass over the rows where they lie (inside the fused qkv output), without the
// cast copy and the indexed copy torch would make of each.
#pragma once

#include <cstddef>
#include <cstdint>

namespace deepinfer {

// A KV cache's element type. bf16 is the top half of an fp32: widening it back is exact, so
// the kernel's arithmetic on a bf16 cache equals the fp32 path's on that cache widened.
enum class KvDtype { kF32, kBF16 };

// An fp32 value rounded to bf16 (to nearest, ties to even), as torch's .to(torch.bfloat16)
// rounds it; a NaN becomes 0x7fc0, as torch's scalar rounding writes it (its vector loop
// writes 0xffff: a NaN either way).
uint16_t bf16_from_float(float x);

// Stores n fp32 values at element `offset` of a cache of element type `dtype`.
void kv_store(void *cache, KvDtype dtype, size_t offset, const float *src, size_t n);

// Where this step's K and V rows are and where they go: row t of K (of V) is `width` floats
// at k + t * k_stride (v + t * v_stride) and goes to elements [slots[t] * width, + width) of
// its cache.
struct KvRows {
  const float *k, *v;
  int64_t k_stride, v_stride;
  int rows, width;
  const int64_t *slots;
};

// Every row of `r` into k_cache and v_cache, split by rows over up to `threads` threads.
void kv_store_rows(const KvRows &r, void *k_cache, void *v_cache, KvDtype dtype, int threads);

}  // namespace deepinfer
