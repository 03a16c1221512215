// Attention in bf16 arithmetic, for dtype=bfloat16 (the compute path whose products already
// run in bf16): the scores as bf16 products of the rounded query and the bf16 cache, accumulated
// in fp32; an fp32 online softmax over blocks of 32 positions; the probabilities rounded to bf16
// for the values' product, accumulated in fp32. vLLM's CPU backend computes a bf16 model's
// attention the same way. A long prompt's attention, fp32 arithmetic over the widened cache in
// paged_attention.cpp, took half of a bf16 prefill.
//
// Two forms of the products, one per CPU: AMX tiles (TDPBF16PS) where the CPU has AMX-BF16, else
// vdpbf16ps on 512-bit registers (AVX512-BF16: AMD's Zen 4 and later), with the tiles' layouts
// and each score and value sum one chain over its pairs in order. A CPU takes one form for every
// call, so its floats are its own.
//
// Every query row (a query token and one of its heads) is computed alone: the products give
// each output element from its own row and column, and the softmax runs lane by lane over
// position blocks fixed from position 0, a fully masked block leaving a row's state as it was.
// So a row's floats do not depend on the other rows of its tile, the call's other queries, the
// thread split or a prefill's chunking, and once the model asks for it every call (decode,
// prefill, the one-call decode stack) takes this path.
#pragma once

#include <cstdint>

#include "paged_attention.h"

namespace deepinfer {

// Which form runs here for this shape: "amx" (bf16_amx_available), "native" (vdpbf16ps: the
// bf16 products' default path is it, bf16_dot_default_path), or "" where neither runs or the
// head size is not a multiple of 32 at most 256 (the caller widens to fp32 then).
const char *paged_attention_bf16_form(const PagedAttentionShape &shape);
// Whether either form runs (the form is not "").
bool paged_attention_bf16_fits(const PagedAttentionShape &shape);

// As paged_attention_threaded over a bf16 cache; q and out fp32, each query row's q rounded to
// bf16 as torch rounds. The caller checked the contexts (paged_context_error). With out_b set
// (out unused), each output is rounded to bf16 as bf16_round_rows rounds it, for a bf16 product
// that takes the rows next: the same floats it would round itself, at half the bytes.
void paged_attention_bf16(const PagedAttentionShape &shape, const float *q, const uint16_t *k_cache,
                         const uint16_t *v_cache, const int32_t *block_tables, const int32_t *query_rows,
                         const int32_t *context_lens, float scale, float *out, int threads,
                         uint16_t *out_b = nullptr);

}  // namespace deepinfer
