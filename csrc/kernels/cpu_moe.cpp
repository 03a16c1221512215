#include "cpu_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cpu_fused_ops.h"
#include "cpu_linear.h"
#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DEEPINFER_HAVE_AVX2 1
#endif

namespace deepinfer {

namespace {
// Column blocks start at multiples of this: a multiple of the linear kernel's 3-row tile
// and of the 8-lane SiLU vector.
constexpr int kColumnAlign = 24;
// Rows of one expert fed to the linear kernel at once, so they stay in cache while the
// part's weight rows stream past (prefill steps give an expert hundreds of rows).
constexpr int kRowChunk = 64;
// Multiply-adds below which a layer runs on the calling thread alone.
constexpr int64_t kMinParallelWork = 1 << 18;


// The (token, slot) pairs of the step grouped by expert: expert e's pairs are
// order[offsets[e] .. offsets[e + 1]), each pair t * K + k, in increasing pair order.
struct Plan {
  std::vector<int> offsets, order, position;  // position[pair]: its row in the sorted order, or -1
};

Plan make_plan(const MoeProblem &p) {
  Plan plan;
  const int pairs = p.T * p.K;
  plan.offsets.assign(p.E + 1, 0);
  for (int i = 0; i < pairs; ++i)
    if (p.ids[i] >= 0) ++plan.offsets[p.ids[i] + 1];
  for (int e = 0; e < p.E; ++e) plan.offsets[e + 1] += plan.offsets[e];
  plan.order.resize(plan.offsets[p.E]);
  plan.position.assign(pairs, -1);
  std::vector<int> next(plan.offsets.begin(), plan.offsets.end() - 1);
  for (int i = 0; i < pairs; ++i)
    if (p.ids[i] >= 0) {
      plan.position[i] = next[p.ids[i]];
      plan.order[next[p.ids[i]]++] = i;
    }
  return plan;
}

struct Part {
  int expert, begin, end;  // output columns [begin, end) of this expert's product
};

// Parts for a product with `cols` output columns per expert: one per expert when there are
// enough experts to keep the threads busy, else each expert's columns cut into blocks. The
// experts with most rows come first, so the pool's dynamic split finishes them early.
std::vector<Part> make_parts(const Plan &plan, int E, int cols, int threads) {
  std::vector<int> active;
  for (int e = 0; e < E; ++e)
    if (plan.offsets[e + 1] > plan.offsets[e]) active.push_back(e);
  std::stable_sort(active.begin(), active.end(), [&](int a, int b) {
    return plan.offsets[a + 1] - plan.offsets[a] > plan.offsets[b + 1] - plan.offsets[b];
  });
  const int n = static_cast<int>(active.size());
  const int blocks = (n == 0 || n >= 2 * threads) ? 1 : (2 * threads + n - 1) / n;
  const int width = ((cols + blocks - 1) / blocks + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
  std::vector<Part> parts;
  for (int e : active)
    for (int c = 0; c < cols; c += width) parts.push_back({e, c, std::min(cols, c + width)});
  return parts;
}

// The product of an expert's rows [rows, K] with columns [begin, end) of w^T, written into
// y (row stride N), fed to the linear kernel in row chunks.
void product(const float *x, const float *w, float *y, int rows, int N, int K, int begin, int end) {
  for (int r = 0; r < rows; r += kRowChunk) {
    const int m = std::min(kRowChunk, rows - r);
    linear_columns(x + static_cast<size_t>(r) * K, w, nullptr, y + static_cast<size_t>(r) * N, m, N, K, begin, end);
  }
}

// Buffers of one call, one row per sorted pair.
struct Scratch {
  std::unique_ptr<float[]> xg, gate_up, act, y;  // [P, H], [P, 2I], [P, I], [P, H]
  explicit Scratch(const MoeProblem &p, int pairs)
      : xg(new float[static_cast<size_t>(pairs) * p.H]), gate_up(new float[static_cast<size_t>(pairs) * 2 * p.I]),
        act(new float[static_cast<size_t>(pairs) * p.I]), y(new float[static_cast<size_t>(pairs) * p.H]) {}
};

void gate_up_part(const MoeProblem &p, const Plan &plan, Scratch &s, const Part &part) {
  const int first = plan.offsets[part.expert], rows = plan.offsets[part.expert + 1] - first;
  const int I = p.I, H = p.H;
  const float *w = p.w13 + static_cast<size_t>(part.expert) * 2 * I * H;
  const float *x = s.xg.get() + static_cast<size_t>(first) * H;
  float *gu = s.gate_up.get() + static_cast<size_t>(first) * 2 * I;
  product(x, w, gu, rows, 2 * I, H, part.begin, part.end);
  product(x, w, gu, rows, 2 * I, H, I + part.begin, I + part.end);
  for (int r = 0; r < rows; ++r) {
    const float *g = gu + static_cast<size_t>(r) * 2 * I;
    silu_mul(g + part.begin, g + I + part.begin, s.act.get() + static_cast<size_t>(first + r) * I + part.begin,
             part.end - part.begin);
  }
}

void down_part(const MoeProblem &p, const Plan &plan, Scratch &s, const Part &part) {
  const int first = plan.offsets[part.expert], rows = plan.offsets[part.expert + 1] - first;
  const float *w = p.w2 + static_cast<size_t>(part.expert) * p.H * p.I;
  product(s.act.get() + static_cast<size_t>(first) * p.I, w, s.y.get() + static_cast<size_t>(first) * p.H, rows, p.H,
          p.I, part.begin, part.end);
}

// out[t] = sum over the token's local slots, in slot order, of weight * y: a product, then
// a sum, each rounded (no fused multiply-add), as transformers' weighted sum over slots.
void combine_rows(const MoeProblem &p, const Plan &plan, const float *y, int t0, int t1) {
  for (int t = t0; t < t1; ++t) {
    float *o = p.out + static_cast<size_t>(t) * p.H;
    std::fill(o, o + p.H, 0.0f);
    for (int k = 0; k < p.K; ++k) {
      const int pos = plan.position[t * p.K + k];
      if (pos < 0) continue;
      const float w = p.weights[t * p.K + k];
      const float *yr = y + static_cast<size_t>(pos) * p.H;
      for (int h = 0; h < p.H; ++h) o[h] += w * yr[h];
    }
  }
}

void run_parts(int count, int threads, const std::function<void(int)> &fn) {
  if (threads <= 1) {
    for (int i = 0; i < count; ++i) fn(i);
  } else {
    shared_pool(threads).run(count, threads, fn);
  }
}

}  // namespace


void moe_experts(const MoeProblem &p, int num_threads) {
  const Plan plan = make_plan(p);
  const int pairs = static_cast<int>(plan.order.size());
  const int64_t work = static_cast<int64_t>(pairs) * 3 * p.I * p.H;
  const int threads = work < kMinParallelWork ? 1 : std::max(1, num_threads);
  Scratch s(p, pairs);
  // 1. gather each pair's token row, in expert order
  const int gather_parts = std::max(1, std::min(threads, pairs / 16));
  run_parts(gather_parts, threads, [&](int part) {
    for (int i = pairs * part / gather_parts; i < pairs * (part + 1) / gather_parts; ++i)
      std::memcpy(s.xg.get() + static_cast<size_t>(i) * p.H, p.x + (plan.order[i] / p.K) * p.x_stride,
                  sizeof(float) * p.H);
  });
  // 2. gate/up products with SiLU(gate) * up, 3. down products
  const std::vector<Part> up = make_parts(plan, p.E, p.I, threads);
  run_parts(static_cast<int>(up.size()), threads, [&](int i) { gate_up_part(p, plan, s, up[i]); });
  const std::vector<Part> down = make_parts(plan, p.E, p.H, threads);
  run_parts(static_cast<int>(down.size()), threads, [&](int i) { down_part(p, plan, s, down[i]); });
  // 4. each token's weighted sum over its slots
  const int combine_parts = std::max(1, std::min(threads, p.T / 8));
  run_parts(combine_parts, threads, [&](int part) {
    combine_rows(p, plan, s.y.get(), p.T * part / combine_parts, p.T * (part + 1) / combine_parts);
  });
}

}  // namespace deepinfer
