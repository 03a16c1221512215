// A whole Llama-family decoder stack for one step of a few tokens a sequence (decode,
// speculative verification, short prefill chunks) on CPU, as one call: per layer the fused
// q/k/v product, RoPE, the K/V store into the paged cache, paged attention, the output
// product and residual RMSNorm, the gate/up product, SiLU-and-multiply, the down product and
// residual RMSNorm. The same kernels the module path calls one by one (packed or fp32
// products, rms_norm_rows, rotary_rows, paged_attention, silu_mul) in the same order on the
// same data, so every float equals the module path's; what goes is the hundreds of calls
// from Python per step, each with its checks, temporaries and thread-pool wake-up.
#pragma once

#include <cstdint>
#include <vector>

#include "packed_weights.h"
#include "paged_attention.h"

namespace deepinfer {

// One projection: packed (matrix.data set) or fp32 [out, in] in nn.Linear's layout.
struct DecodeLinear {
  PackedMatrix matrix{};          // packed weights, or matrix.data == nullptr
  const float *weight = nullptr;  // fp32 [out, in] when not packed
  const float *bias = nullptr;    // [out] or nullptr
  int out = 0, in = 0;
};

struct DecodeLayer {
  DecodeLinear qkv, o, gate_up, down;  // qkv: q heads, then k, then v; gate_up: gate, then up
  const float *input_norm = nullptr, *post_norm = nullptr;
  void *k_cache = nullptr, *v_cache = nullptr;  // [num_blocks, block_size, kv_heads, head_dim] of kv_dtype
  float scale = 1.f;                              // attention scale
  int window = 0;                                 // sliding window of its attention (0: none)
};

struct DecodeShape {
  int hidden, heads, kv_heads, head_dim, intermediate;
  int block_size, num_blocks;  // of every layer's cache
  KvDtype kv_dtype;            // likewise
  float eps;                   // the layers' RMSNorm epsilon
};

// One step's tokens: T rows, each with its RoPE row, its cache slot, and its context as
// paged_attention takes it (query_rows nullptr: row t is block-table row t).
struct DecodeStep {
  int tokens;
  const float *cos, *sin;  // [T, head_dim]
  const int64_t *slots;    // [T], each in [0, num_blocks * block_size)
  const int32_t *block_tables;
  int num_rows, max_blocks;
  const int32_t *context_lens, *query_rows;
};

// hidden [T, hidden]: the token embeddings in, scratch afterwards; out [T, hidden]: the
// hidden states after the final norm (final_norm, final_eps). Caller checks every shape,
// slot and block id (paged_context_error) first.
void llama_decode(const DecodeShape &shape, const std::vector<DecodeLayer> &layers, const float *final_norm,
                  float final_eps, const DecodeStep &step, float *hidden, float *out, int threads);

}  // namespace deepinfer
