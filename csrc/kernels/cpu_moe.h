// The routed experts of one mixture-of-experts layer on CPU, fp32: the step's (token, slot)
// pairs sorted by expert, one grouped matrix product per expert for gate/up with SiLU(gate)
// * up fused in, one for down, then each token's weighted sum over its slots.
//
//   pairs -> counting sort by expert -> gather rows -> [gate|up] = x w13[e]^T -> a = silu(g) u
//         -> y = a w2[e]^T -> out[t] = sum over slots k, in slot order, of w[t,k] * y[t,k]
//
// The matrix products are cpu_linear's, which read each weight row once for all of an
// expert's rows; the work is split into (expert, column block) parts on the shared thread
// pool. Every output element is the same sum in the same order whatever the batch or the
// split (column blocks start at multiples of 24, so SiLU's vector/scalar choice is fixed per
// column), so a token's result does not depend on what else is in the step. No pair is ever
// dropped. Slots whose id is -1 belong to another rank's experts and add nothing; a token
// with no local slot gets zeros.
#pragma once

#include <cstdint>

namespace deepinfer {

struct MoeProblem {
  const float *x;     // token t's hidden state at x + t * x_stride, H floats
  int64_t x_stride;
  const int32_t *ids;    // [T, K] local expert of each slot, or -1
  const float *weights;  // [T, K] routing weights
  const float *w13;      // [E, 2I, H]: gate rows, then up rows (nn.Linear layout)
  const float *w2;       // [E, H, I]
  float *out;            // [T, H]
  int T, K, H, I, E;
};

void moe_experts(const MoeProblem &p, int num_threads);

}  // namespace deepinfer
