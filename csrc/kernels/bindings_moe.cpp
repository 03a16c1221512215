// pybind11 entry for the mixture-of-experts kernel: checks every shape, dtype and expert id
// up front, so a bad call raises ValueError("moe_experts: ...") instead of reading out of
// bounds, then drops the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "cpu_moe.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

using F32 = py::array_t<float, py::array::c_style>;
using I32 = py::array_t<int32_t, py::array::c_style>;

void need(bool ok, const std::string &what) {
  if (!ok) throw py::value_error("moe_experts: " + what);
}

// x may have strided rows (a view into a received buffer): only its last axis must be dense.
void moe_experts_py(const py::array_t<float> &x, const I32 &topk_ids, const F32 &topk_weights, const F32 &w13,
                    const F32 &w2, F32 &out, int num_threads) {
  need(x.ndim() == 2 && topk_ids.ndim() == 2 && topk_weights.ndim() == 2 && w13.ndim() == 3 && w2.ndim() == 3 &&
           out.ndim() == 2,
       "want x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I], out [T, H]");
  MoeProblem p{};
  p.T = static_cast<int>(x.shape(0));
  p.H = static_cast<int>(x.shape(1));
  p.K = static_cast<int>(topk_ids.shape(1));
  p.E = static_cast<int>(w13.shape(0));
  p.I = static_cast<int>(w2.shape(2));
  const auto f = static_cast<py::ssize_t>(sizeof(float));
  need(x.strides(1) == f && x.strides(0) % f == 0 && (p.T <= 1 || x.strides(0) >= p.H * f),
       "x's rows must be dense floats (the rows themselves may be strided)");
  need(topk_ids.shape(0) == p.T && topk_weights.shape(0) == p.T && topk_weights.shape(1) == p.K && p.K > 0,
       "topk_ids and topk_weights must both be [T, K] with K > 0");
  need(w13.shape(1) == 2 * p.I && w13.shape(2) == p.H, "w13 must be [E, 2I, H] for w2 [E, H, I] and x [T, H]");
  need(w2.shape(0) == p.E && w2.shape(1) == p.H, "w2 must be [E, H, I] with w13's E and x's H");
  need(out.shape(0) == p.T && out.shape(1) == p.H && out.writeable(), "out must be a writable [T, H]");
  need(num_threads >= 1, "num_threads must be >= 1");
  const int32_t *ids = topk_ids.data();
  for (int64_t i = 0; i < static_cast<int64_t>(p.T) * p.K; ++i)
    need(ids[i] >= -1 && ids[i] < p.E, "expert id " + std::to_string(ids[i]) + " outside [-1, " +
                                           std::to_string(p.E) + ") (-1: another rank's expert)");
  p.x = x.data();
  p.x_stride = x.strides(0) / f;
  p.ids = ids;
  p.weights = topk_weights.data();
  p.w13 = w13.data();
  p.w2 = w2.data();
  p.out = out.mutable_data();
  py::gil_scoped_release release;
  moe_experts(p, num_threads);
}

}  // namespace

void bind_moe(py::module_ &m) {
  m.def("moe_experts", &moe_experts_py, py::arg("x").noconvert(), py::arg("topk_ids").noconvert(),
        py::arg("topk_weights").noconvert(), py::arg("w13").noconvert(), py::arg("w2").noconvert(),
        py::arg("out").noconvert(), py::arg("num_threads") = 1,
        "out[t] = sum over slots k (in order) with topk_ids[t, k] >= 0 of topk_weights[t, k] * expert(x[t]),\n"
        "expert e(x) = (silu(x w13[e, :I]^T) * (x w13[e, I:]^T)) w2[e]^T; float32, x [T, H] (rows may be\n"
        "strided), topk_ids int32 [T, K] (local expert, or -1: another rank's), topk_weights [T, K],\n"
        "w13 [E, 2I, H], w2 [E, H, I], out [T, H]. Tokens are grouped by expert, one matrix product per\n"
        "expert; num_threads splits the (expert, column block) parts. Bit-identical whatever the batch.");
}

}  // namespace deepinfer
