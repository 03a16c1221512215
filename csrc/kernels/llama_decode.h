// A whole Llama-family decoder stack for one step of a few tokens a sequence (decode,
// speculative verification, short prefill chunks) on CPU, as one call: per layer the fused
// q/k/v product, per-head q/k RMSNorm (Qwen3, Gemma 3), RoPE, the K/V store into the paged
// cache, paged attention, the output product and residual RMSNorm, the gate/up product, the
// gated activation (SiLU, or Gemma's tanh GELU), the down product and residual RMSNorm; with
// Gemma 3's norms after each sublayer as well. The same kernels the module path calls one by
// one (packed or fp32 products, rms_norm_rows, rotary_rows, paged_attention, silu_mul,
// gelu_tanh_mul) in the same order on the same data, so every float equals the module
// path's; what goes is the hundreds of calls from Python per step, each with its checks,
// temporaries and thread-pool wake-up.
//
// KV groups (a model mixing sliding and full layers): each layer reads and writes its own
// group's block table and slots; layers of different groups may share a cache tensor.
#pragma once

#include <cstdint>
#include <vector>

#include "packed_parts.h"
#include "packed_weights.h"
#include "paged_attention.h"

namespace deepinfer {

// One projection: packed (matrix.data set), packed in parts of different formats (parts not
// empty: a fused q/k/v or gate/up a GGUF file quantized part by part), or fp32 [out, in] in
// nn.Linear's layout.
struct DecodeLinear {
  PackedMatrix matrix{};          // packed weights, or matrix.data == nullptr
  PackedParts parts;              // or these, in row order
  const float *weight = nullptr;  // fp32 [out, in] when not packed
  const float *bias = nullptr;    // [out] or nullptr
  int out = 0, in = 0;
};

// The gated activation between the gate/up and the down product.
enum class Activation { kSiLU, kGeluTanh };

struct DecodeLayer {
  DecodeLinear qkv, o, gate_up, down;  // qkv: q heads, then k, then v; gate_up: gate, then up
  // [hidden] each: the norm before attention and the one before the MLP (Llama's
  // post_attention_layernorm, Gemma's pre_feedforward_layernorm), each with the residual add.
  const float *input_norm = nullptr, *ffn_norm = nullptr;
  // Gemma 3: each sublayer's output normed before it joins the residual stream (nullptr: none).
  const float *attn_out_norm = nullptr, *mlp_out_norm = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;  // [head_dim]: per-head RMSNorm before RoPE, or none
  void *k_cache = nullptr, *v_cache = nullptr;       // [num_blocks, block_size, kv_heads, head_dim] of kv_dtype
  float scale = 1.f;                                 // attention scale
  int window = 0;                                    // sliding window of its attention (0: none)
  int rope = 0;                                      // its RoPE table (DecodeStep::cos/sin)
  int group = 0;                                     // its KV group (DecodeStep::slots/block_tables)
};

struct DecodeShape {
  int hidden, heads, kv_heads, head_dim, intermediate;
  int block_size, num_blocks;  // of every layer's cache
  KvDtype kv_dtype;            // likewise
  float eps;                   // the layers' RMSNorm epsilon (q/k norms included)
  Activation act;
  bool bf16_attention = false;  // attention in bf16 arithmetic (PagedAttentionShape::bf16_math)
};

// One step's tokens: T rows, each with its RoPE rows, its cache slot per KV group, and its
// context as paged_attention takes it (query_rows nullptr: row t is block-table row t).
struct DecodeStep {
  int tokens;
  const float *cos, *sin;  // [ropes, T, head_dim]
  const int64_t *slots;    // [groups, T], each in [0, num_blocks * block_size)
  const int32_t *block_tables;  // [groups, num_rows, max_blocks]
  int num_rows, max_blocks;
  const int32_t *context_lens, *query_rows;
};

// hidden [T, hidden]: the token embeddings in, scratch afterwards; out [T, hidden]: the
// hidden states after the final norm (final_norm, final_eps). Caller checks every shape,
// slot and block id (paged_context_error) first.
void llama_decode(const DecodeShape &shape, const std::vector<DecodeLayer> &layers, const float *final_norm,
                  float final_eps, const DecodeStep &step, float *hidden, float *out, int threads);

}  // namespace deepinfer
