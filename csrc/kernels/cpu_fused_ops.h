// The small per-layer ops of a CPU decode step, each one pass over its rows instead of the
// four to eight torch ops (and their dispatch and temporaries) they replace: RMSNorm, with
// the residual add folded in; RoPE applied in place; and greedy argmax over the logits.
// Elementwise math follows transformers' order of operations, without fused multiply-adds
// (the file is built with -ffp-contract=off), so RoPE matches torch exactly and RMSNorm up
// to the order of its sum of squares.
#pragma once

#include <cstdint>

namespace deepinfer {

// out[t] = (x[t] * 1/sqrt(mean(x[t]^2) + eps)) * weight, for rows [begin, end) of width h.
// With `residual` set, x[t] is first replaced by x[t] + residual[t] (written back to x),
// the residual stream of a decoder layer.
void rms_norm_rows(float *x, const float *residual, const float *weight, float eps, float *out, int h, int begin,
                   int end);

// rms_norm_rows with out in bf16, rounded as bf16_round_rows rounds: the input of a bf16
// product (which would round it so itself), written at half the bytes.
void rms_norm_rows_rounded(float *x, const float *residual, const float *weight, float eps, uint16_t *out, int h,
                           int begin, int end);

// RoPE in the rotate_half layout on `heads` heads of size d of each row t, in place:
// x' = x * cos[t] + rotate_half(x) * sin[t]. Row t starts at x + t * row_stride; cos and sin
// are [rows, d].
void rotary_rows(float *x, int64_t row_stride, int heads, int d, const float *cos, const float *sin, int begin,
                 int end);

// out = silu(g) * u over n floats, silu(x) = x / (1 + e^-x) with e^x by Cephes' polynomial
// (the same operations in the vector and the scalar tail, so the value of an element does
// not depend on where it falls): the activation of the Llama MLP and of the MoE experts.
void silu_mul(const float *g, const float *u, float *out, int n);

// out = gelu_tanh(g) * u over n floats (GeGLU: Gemma's MLP), gelu_tanh the tanh-approximated
// GELU 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as the equal
// x / (1 + e^-z), z = 2 sqrt(2/pi) (x + 0.044715 x^3), with silu_mul's e^x: the same bits in
// the vector and the scalar tail, so the module path and the decode stack agree exactly
// (torch's tanh GELU cannot be reproduced from C++ bit for bit).
void gelu_tanh_mul(const float *g, const float *u, float *out, int n);

// Index of the largest value of each row of width v (the first one on ties; a row holding
// NaN gives its first NaN, as torch.argmax does).
void argmax_rows(const float *x, int v, int64_t *out, int begin, int end);

// argmax_rows where masks[t] is set: only the tokens whose bit is 1 in that row's bitmask
// (int32 words, bit i of word j = token 32 * j + i allowed, at least ceil(v / 32) words) take
// part, with the result of setting the others to -inf first, ties and NaN included. Rows
// with masks[t] == nullptr are plain argmax_rows. Greedy structured output, without a copy.
void masked_argmax_rows(const float *x, int v, const int32_t *const *masks, int64_t *out, int begin, int end);

}  // namespace deepinfer
