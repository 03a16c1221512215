#include "llama_decode.h"

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16_linear.h"
#include "cpu_fused_ops.h"
#include "cpu_linear.h"
#include "packed_linear.h"
#include "paged_attention.h"
#include "thread_pool.h"

namespace deepinfer {

namespace {

// Whether l is one bf16_pairs matrix (bf16 arithmetic): its inputs are rounded to bf16 once,
// by the kernel that produces them, instead of by every thread of the product (1.5% of a
// 64-row bf16 step's CPU went to that).
bool takes_bf16(const DecodeLinear &l) {
  return l.parts.empty() && l.matrix.data && l.matrix.format == WeightFormat::kBF16Pairs;
}

// x: the inputs; xb: the same rounded to bf16 where takes_bf16(l), else nullptr. Only the bf16
// kernel reads `side` (side_lines.h).
void project(const DecodeLinear &l, const float *x, const uint16_t *xb, float *y, int rows, int threads,
             const SideShare &side = {}) {
  if (xb)
    bf16_pairs_threaded(xb, l.matrix, l.bias, y, rows, threads, side);
  else if (!l.parts.empty())
    packed_parts_threaded(x, l.parts, l.bias, y, rows, threads);
  else if (l.matrix.data)
    packed_linear_threaded(x, l.matrix, l.bias, y, rows, threads);
  else
    linear_threaded(x, l.weight, l.bias, y, rows, l.out, l.in, threads);
}

// Scratch of one step, sized once. normed_b and act_b (a model with bf16 products): normed
// and act rounded to bf16, rows up to AMX's tile of 16 (bf16_pairs_columns_rounded), those
// past T left zero.
struct Buffers {
  std::vector<float> normed, qkv, q, attn, gate_up, act, other;
  std::vector<uint16_t> normed_b, act_b;
  LineBlocks next_kv;  // the next layer's K/V blocks (side_lines.h)
  Buffers(const DecodeShape &s, int T, bool bf16)
      : normed(static_cast<size_t>(T) * s.hidden),
        qkv(static_cast<size_t>(T) * (s.heads + 2 * s.kv_heads) * s.head_dim),
        q(static_cast<size_t>(T) * s.heads * s.head_dim),
        attn(q.size()),
        gate_up(static_cast<size_t>(T) * 2 * s.intermediate),
        act(static_cast<size_t>(T) * s.intermediate),
        other(normed.size()),
        normed_b(bf16 ? static_cast<size_t>(bf16_rows_padded(T)) * s.hidden : 0),
        act_b(bf16 ? static_cast<size_t>(bf16_rows_padded(T)) * s.intermediate : 0) {}
};

// Per-head RMSNorm in place on `heads` heads of size d at x (q or k of one token row).
void norm_heads(float *x, const float *weight, int heads, int d, float eps) {
  if (weight) rms_norm_rows(x, nullptr, weight, eps, x, d, 0, heads);
}

// Attention of one layer: normed -> b.attn [T, heads * head_dim], the K/V of the step stored
// in the layer's KV group's slots, its RoPE table applied after any q/k norm.
void attention(const DecodeShape &s, const DecodeLayer &L, const DecodeStep &step, Buffers &b, int threads) {
  const int T = step.tokens, D = s.head_dim, width = (s.heads + 2 * s.kv_heads) * D;
  project(L.qkv, b.normed.data(), takes_bf16(L.qkv) ? b.normed_b.data() : nullptr, b.qkv.data(), T, threads);
  const size_t q_bytes = sizeof(float) * s.heads * D, kv = static_cast<size_t>(s.kv_heads) * D;
  const size_t rope_at = static_cast<size_t>(L.rope) * T * D;
  const float *cos = step.cos + rope_at, *sin = step.sin + rope_at;
  const int64_t *slots = step.slots + static_cast<size_t>(L.group) * T;
  const int32_t *tables = step.block_tables + static_cast<size_t>(L.group) * step.num_rows * step.max_blocks;
  split_rows(T, threads, [&](int begin, int end) {
    for (int t = begin; t < end; ++t) {
      float *row = b.qkv.data() + static_cast<size_t>(t) * width;
      norm_heads(row, L.q_norm, s.heads, D, s.eps);
      norm_heads(row + s.heads * D, L.k_norm, s.kv_heads, D, s.eps);
    }
    rotary_rows(b.qkv.data(), width, s.heads, D, cos, sin, begin, end);
    rotary_rows(b.qkv.data() + s.heads * D, width, s.kv_heads, D, cos, sin, begin, end);
    for (int t = begin; t < end; ++t) {
      const float *row = b.qkv.data() + static_cast<size_t>(t) * width;
      std::memcpy(b.q.data() + static_cast<size_t>(t) * s.heads * D, row, q_bytes);
      kv_store(L.k_cache, s.kv_dtype, slots[t] * kv, row + s.heads * D, kv);
      kv_store(L.v_cache, s.kv_dtype, slots[t] * kv, row + (s.heads + s.kv_heads) * D, kv);
    }
  });
  const PagedAttentionShape ps{T, step.num_rows, s.heads, s.kv_heads, D, s.block_size, step.max_blocks,
                               s.num_blocks, L.window, s.bf16_attention};
  paged_attention_threaded(ps, b.q.data(), L.k_cache, L.v_cache, s.kv_dtype, tables, step.query_rows,
                           step.context_lens, L.scale, b.attn.data(), threads);
}

// Every K and V block the layer's attention will read in this step (each query row's, from its
// window's first block), into kv.
void kv_blocks(const DecodeShape &s, const DecodeLayer &L, const DecodeStep &step, LineBlocks &kv) {
  const size_t element = s.kv_dtype == KvDtype::kF32 ? sizeof(float) : sizeof(uint16_t);
  const size_t block_bytes = static_cast<size_t>(s.block_size) * s.kv_heads * s.head_dim * element;
  std::vector<int> first(step.num_rows, INT32_MAX), last(step.num_rows, 0);
  for (int t = 0; t < step.tokens; ++t) {
    const int r = step.query_rows ? step.query_rows[t] : t, len = step.context_lens[t];
    first[r] = std::min(first[r], window_start(len, L.window) / s.block_size);
    last[r] = std::max(last[r], (len + s.block_size - 1) / s.block_size);
  }
  kv.starts.clear();
  kv.lines = static_cast<int>((block_bytes + 63) / 64);
  const int32_t *tables = step.block_tables + static_cast<size_t>(L.group) * step.num_rows * step.max_blocks;
  for (int r = 0; r < step.num_rows; ++r)
    for (int b = first[r]; b < last[r]; ++b) {
      const size_t at = static_cast<size_t>(tables[static_cast<size_t>(r) * step.max_blocks + b]) * block_bytes;
      kv.starts.push_back(static_cast<const char *>(L.k_cache) + at);
      kv.starts.push_back(static_cast<const char *>(L.v_cache) + at);
    }
}

// The MLP of one layer: normed -> out [T, hidden]. The down projection asks for `side` (the
// next layer's K/V blocks) as it goes: the product right before that attention, so that its
// blocks are the last in and the first still there (asked over both products, at 64 bf16
// SmolLM2 rows, a step gained about half as much).
void mlp(const DecodeShape &s, const DecodeLayer &L, int T, Buffers &b, float *out, int threads,
         const LineBlocks &side) {
  const int I = s.intermediate;
  const auto act = s.act == Activation::kGeluTanh ? gelu_tanh_mul : silu_mul;
  const bool round = takes_bf16(L.down);
  project(L.gate_up, b.normed.data(), takes_bf16(L.gate_up) ? b.normed_b.data() : nullptr, b.gate_up.data(), T,
          threads);
  split_rows(T, threads, [&](int begin, int end) {
    for (int t = begin; t < end; ++t) {
      const float *g = b.gate_up.data() + static_cast<size_t>(t) * 2 * I;
      act(g, g + I, b.act.data() + static_cast<size_t>(t) * I, I);
    }
    const size_t at = static_cast<size_t>(begin) * I;
    if (round) bf16_round_rows(b.act.data() + at, end - begin, I, b.act_b.data() + at);
  });
  project(L.down, b.act.data(), round ? b.act_b.data() : nullptr, out, T, threads, SideShare{&side, 0, side.total()});
}

}  // namespace

void llama_decode(const DecodeShape &s, const std::vector<DecodeLayer> &layers, const float *final_norm,
                  float final_eps, const DecodeStep &step, float *hidden, float *out, int threads) {
  const int T = step.tokens, H = s.hidden;
  Buffers b(s, T, std::any_of(layers.begin(), layers.end(), [](const DecodeLayer &L) {
              return takes_bf16(L.qkv) || takes_bf16(L.gate_up) || takes_bf16(L.down);
            }));
  // The residual stream lives in `res`; each sublayer writes its output into `next`, adds
  // the stream into it (rms_norm_rows' residual) and becomes the stream.
  float *res = hidden, *next = b.other.data();
  // yb: y's rows rounded to bf16 as well, for a bf16 product next (nullptr: none).
  const auto norm = [&](float *x, const float *residual, const float *weight, float eps, float *y, uint16_t *yb) {
    split_rows(T, threads, [&](int begin, int end) {
      rms_norm_rows(x, residual, weight, eps, y, H, begin, end);
      const size_t at = static_cast<size_t>(begin) * H;
      if (yb) bf16_round_rows(y + at, end - begin, H, yb + at);
    });
  };
  const auto normed_b = [&](const DecodeLinear &next) { return takes_bf16(next) ? b.normed_b.data() : nullptr; };
  norm(res, nullptr, layers[0].input_norm, s.eps, b.normed.data(), normed_b(layers[0].qkv));
  // DEEPINFER_DP_KV_AHEAD=0: no asking ahead. Read at every call, so that
  // benchmarks/kv_ahead.py can compare both in one process, every other step.
  const char *ahead = std::getenv("DEEPINFER_DP_KV_AHEAD");
  const bool ask_ahead = !(ahead && std::strcmp(ahead, "0") == 0);
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecodeLayer &L = layers[i];
    attention(s, L, step, b, threads);
    project(L.o, b.attn.data(), nullptr, next, T, threads);
    if (L.attn_out_norm) norm(next, nullptr, L.attn_out_norm, s.eps, next, nullptr);  // in place: each row read first
    norm(next, res, L.ffn_norm, s.eps, b.normed.data(), normed_b(L.gate_up));
    std::swap(res, next);
    const bool last_layer = i + 1 == layers.size();
    if (last_layer || !ask_ahead || !takes_bf16(L.down))  // only the bf16 tiles ask (side_lines.h)
      b.next_kv.starts.clear();
    else
      kv_blocks(s, layers[i + 1], step, b.next_kv);
    mlp(s, L, T, b, next, threads, b.next_kv);
    if (L.mlp_out_norm) norm(next, nullptr, L.mlp_out_norm, s.eps, next, nullptr);
    norm(next, res, last_layer ? final_norm : layers[i + 1].input_norm, last_layer ? final_eps : s.eps,
         last_layer ? out : b.normed.data(), last_layer ? nullptr : normed_b(layers[i + 1].qkv));
    std::swap(res, next);
  }
}

}  // namespace deepinfer
