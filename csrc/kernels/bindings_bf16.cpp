// pybind11 entry for the bf16 kernels (bf16_linear.h): packing a bf16 matrix into the pair
// layout, the rounding of fp32 rows, and the product on a chosen path (tests and benchmarks
// compare the paths; the engine goes through packed_linear with format "bf16_pairs").
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "bf16_linear.h"
#include "bf16_peak.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

using F32 = py::array_t<float, py::array::c_style>;
using U8 = py::array_t<uint8_t, py::array::c_style>;
using U16 = py::array_t<uint16_t, py::array::c_style>;

void need(bool ok, const char *op, const std::string &what) {
  if (!ok) throw py::value_error(std::string(op) + ": " + what);
}

const Bf16DotPath kPaths[] = {Bf16DotPath::kAmx, Bf16DotPath::kNative, Bf16DotPath::kWiden512,
                               Bf16DotPath::kWiden256, Bf16DotPath::kScalar};

Bf16DotPath parse_path(const std::string &name, const char *op) {
  if (name == "auto") return bf16_dot_default_path();
  for (Bf16DotPath p : kPaths)
    if (name == bf16_dot_path_name(p)) {
      need(bf16_dot_path_available(p), op, "path '" + name + "' cannot run on this CPU");
      return p;
    }
  throw py::value_error(std::string(op) + ": unknown path '" + name + "' (auto, amx, native, widen512, widen256, scalar)");
}

void pack_py(const U16 &src, U8 &out) {
  const char *op = "bf16_pairs_pack";
  need(src.ndim() == 2, op, "want src [rows, cols] uint16 (bf16 bits)");
  const int rows = static_cast<int>(src.shape(0)), cols = static_cast<int>(src.shape(1));
  need(rows % 16 == 0 && cols % 2 == 0 && cols > 0, op,
       "rows must be a multiple of 16 and cols even, got [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  need(out.ndim() == 2 && out.shape(0) == rows && out.shape(1) == 2 * cols, op, "out must be [rows, 2 * cols] uint8");
  need(out.writeable(), op, "out must be writable");
  const uint16_t *s = src.data();
  uint16_t *d = reinterpret_cast<uint16_t *>(out.mutable_data());
  py::gil_scoped_release release;
  bf16_pairs_pack(s, rows, cols, d);
}

void round_py(const F32 &x, U16 &out) {
  need(x.ndim() == 2 && out.ndim() == 2 && x.shape(0) == out.shape(0) && x.shape(1) == out.shape(1), "bf16_round",
       "want x [M, K] float32 and out [M, K] uint16");
  need(out.writeable(), "bf16_round", "out must be writable");
  bf16_round_rows(x.data(), static_cast<int>(x.shape(0)), static_cast<int>(x.shape(1)), out.mutable_data());
}

void linear_py(const F32 &x, const U8 &weight, int cols, const std::optional<F32> &bias, F32 &out, int num_threads,
               const std::string &path_name) {
  const char *op = "bf16_linear";
  const Bf16DotPath path = parse_path(path_name, op);
  need(weight.ndim() == 2 && cols > 0 && cols % 2 == 0 && weight.shape(1) == 2 * cols && weight.shape(0) % 16 == 0, op,
       "want weight [rows (a multiple of 16), 2 * cols] uint8 in the pairs layout, cols even");
  need(x.ndim() == 2 && x.shape(1) == cols, op, "want x [M, cols]");
  const int M = static_cast<int>(x.shape(0)), N = static_cast<int>(weight.shape(0));
  need(out.ndim() == 2 && out.shape(0) == M && out.shape(1) == N && out.writeable(), op, "out must be writable [M, N]");
  need(!bias || (bias->ndim() == 1 && bias->shape(0) == N), op, "bias must be [N]");
  need(num_threads >= 1, op, "num_threads must be >= 1");
  const PackedMatrix w{weight.data(), N, cols, static_cast<size_t>(2 * cols), WeightFormat::kBF16Pairs};
  const float *xp = x.data(), *bp = bias ? bias->data() : nullptr;
  float *yp = out.mutable_data();
  py::gil_scoped_release release;
  // Any split gives the same floats; this one cuts blocks of 16 in two on purpose when asked
  // for an odd thread count, which tests use.
  const int parts = std::min(num_threads, N), step = (N + parts - 1) / parts;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int begin = std::min(N, p * step), end = std::min(N, begin + step);
    bf16_pairs_columns(xp, w, bp, yp, M, begin, end, path);
  });
}

}  // namespace

void bind_bf16_kernels(py::module_ &m) {
  m.def("bf16_pairs_pack", &pack_py, py::arg("src").noconvert(), py::arg("out").noconvert(),
        "Packs a bf16 matrix src [rows, cols] (its bits as uint16) into out [rows, 2 * cols] uint8 in\n"
        "vdpbf16ps's pair layout (format 'bf16_pairs'); subnormals become signed zeros.");
  m.def("bf16_round", &round_py, py::arg("x").noconvert(), py::arg("out").noconvert(),
        "out = x rounded to bf16 (round to nearest even, NaN -> 0x7fc0) with subnormals made zeros.");
  m.def("bf16_linear", &linear_py, py::arg("x").noconvert(), py::arg("weight").noconvert(), py::arg("cols"),
        py::arg("bias").noconvert() = py::none(), py::arg("out").noconvert(), py::arg("num_threads") = 1,
        py::arg("path") = "auto",
        "out[M, N] = bf16(x) @ W.T (+ bias) with fp32 accumulation, W in the 'bf16_pairs' layout;\n"
        "path: auto, amx, native (vdpbf16ps), widen512, widen256 or scalar: the last four give the same floats.");
  m.def("dot_peak_gflops", [](bool bf16, long iters) {
        py::gil_scoped_release release;
        return dot_peak_gflops(bf16, iters);
      }, py::arg("bf16"), py::arg("iters") = 20000000,
        "One core's multiply-add peak in GFLOP/s from a loop of 12 register chains: vdpbf16ps (bf16=True)\n"
        "or 512-bit fp32 FMA; 0 where the CPU lacks them.");
  m.def("amx_peak_gflops", [](long iters) {
        py::gil_scoped_release release;
        return amx_peak_gflops(iters);
      }, py::arg("iters") = 2000000,
        "One core's AMX peak in GFLOP/s: four TDPBF16PS a round into four C tiles from tiles loaded once\n"
        "(the 2 x 2 tiles the AMX products use); 0 where AMX-BF16 is not available.");
  m.def("amx_fma_overlap", [](long iters) {
        double out[3];
        {
          py::gil_scoped_release release;
          amx_fma_overlap(iters, out);
        }
        return py::make_tuple(out[0], out[1], out[2]);
      }, py::arg("iters") = 1000000,
        "(tiles, fmas, both): thread CPU seconds of `iters` rounds of four TDPBF16PS, of 96 512-bit FMAs in\n"
        "12 chains, and of both in one loop; near max(tiles, fmas) where they overlap, near the sum where\n"
        "they take turns. Zeros where AMX-BF16 is not available.");
  m.def("bf16_dot_paths", [] {
        std::vector<std::string> out;
        for (Bf16DotPath p : kPaths)
          if (bf16_dot_path_available(p)) out.emplace_back(bf16_dot_path_name(p));
        return out;
      }, "The bf16 product's paths this process can run.");
  m.def("bf16_dot_path", [] { return std::string(bf16_dot_path_name(bf16_dot_default_path())); },
        "The path bf16 products take in this process (amx, native, widen512, widen256 or scalar).");
}

}  // namespace deepinfer
