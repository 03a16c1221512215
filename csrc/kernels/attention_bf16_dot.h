// The bf16 attention's products on vdpbf16ps (AVX512-BF16, for a CPU without AMX): the
// layouts and steps of attention_bf16_amx.h's block(), each product a chain of register ops.
#pragma once

#include "attention_bf16_shared.h"

#ifdef DEEPINFER_BF16_ATTENTION
namespace deepinfer {
namespace attention_bf16 {

// block() on vdpbf16ps: the same layouts and steps, each product a chain of register ops.
BF16_TARGET void block_dot(const Call &c, const KvBlock &s, Tile &tl, const uint32_t *qt, float *o, int p0,
                           Ahead &ahead);

}  // namespace attention_bf16
}  // namespace deepinfer
#endif
