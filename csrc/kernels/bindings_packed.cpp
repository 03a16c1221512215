// pybind11 entry for the packed-weight kernels (packed_linear.h): checks the format, the
// shapes and the row ids up front, so a bad call raises ValueError("<op>: <what>") instead of
// reading out of bounds, then drops the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cpu_fused_ops.h"
#include "packed_linear.h"
#include "packed_parts.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

using F32 = py::array_t<float, py::array::c_style>;
using U8 = py::array_t<uint8_t, py::array::c_style>;
using U16 = py::array_t<uint16_t, py::array::c_style>;  // bf16 rows, viewed as uint16
using I64 = py::array_t<int64_t, py::array::c_style>;

void need(bool ok, const char *op, const std::string &what) {
  if (!ok) throw py::value_error(std::string(op) + ": " + what);
}

WeightFormat parse_format(const std::string &name, const char *op) {
  WeightFormat f;
  if (packed_format_named(name, &f)) return f;
  throw py::value_error(std::string(op) + ": unknown weight format '" + name +
                        "' (bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, bf16_pairs)");
}

// The matrix behind `weight` [rows, row_bytes] uint8, checked against format and cols.
PackedMatrix matrix(const U8 &weight, const std::string &format, int cols, const char *op) {
  need(weight.ndim() == 2, op, "want weight [rows, bytes per row] uint8");
  const WeightFormat f = parse_format(format, op);
  const size_t row_bytes = packed_row_bytes(f, cols);
  need(row_bytes > 0, op, "cols=" + std::to_string(cols) + " does not fit " + format + "'s blocks");
  need(static_cast<size_t>(weight.shape(1)) == row_bytes, op,
       "weight rows hold " + std::to_string(weight.shape(1)) + " bytes, " + format + " x " + std::to_string(cols) +
           " needs " + std::to_string(row_bytes));
  need(f != WeightFormat::kBF16Pairs || weight.shape(0) % 16 == 0, op, "bf16_pairs rows must be a multiple of 16");
  return PackedMatrix{weight.data(), static_cast<int>(weight.shape(0)), cols, row_bytes, f};
}

// packed_linear's checks of x's shape (either dtype), out and bias; returns M.
int check_linear(const py::array &x, const PackedMatrix &w, const std::optional<F32> &bias, const F32 &out,
                 int num_threads, const char *op) {
  need(x.ndim() == 2 && out.ndim() == 2, op, "want x [M, K], out [M, N]");
  need(x.shape(1) == w.cols, op, "x's K differs from the weight's cols");
  const int M = static_cast<int>(x.shape(0)), N = w.rows;
  need(out.shape(0) == M && out.shape(1) == N, op, "out must be [M, N]");
  need(out.writeable(), op, "out must be writable");
  need(!bias || (bias->ndim() == 1 && bias->shape(0) == N), op, "bias must be [N]");
  need(num_threads >= 1, op, "num_threads must be >= 1");
  return M;
}

void packed_linear_py(const F32 &x, const U8 &weight, const std::string &format, int cols,
                      const std::optional<F32> &bias, F32 &out, int num_threads) {
  const PackedMatrix w = matrix(weight, format, cols, "packed_linear");
  const int M = check_linear(x, w, bias, out, num_threads, "packed_linear");
  const float *xp = x.data(), *bp = bias ? bias->data() : nullptr;
  float *yp = out.mutable_data();
  py::gil_scoped_release release;
  packed_linear_threaded(xp, w, bp, yp, M, num_threads);
}

// packed_linear on rows already rounded to bf16 (a bf16_pairs matrix only).
void packed_linear_rounded_py(const U16 &x, const U8 &weight, const std::string &format, int cols,
                              const std::optional<F32> &bias, F32 &out, int num_threads) {
  const char *op = "packed_linear";
  need(format == "bf16_pairs", op, "bf16 rows (uint16) go to a bf16_pairs matrix only, not " + format);
  const PackedMatrix w = matrix(weight, format, cols, op);
  const int M = check_linear(x, w, bias, out, num_threads, op);
  const uint16_t *xp = x.data();
  const float *bp = bias ? bias->data() : nullptr;
  float *yp = out.mutable_data();
  py::gil_scoped_release release;
  bf16_pairs_threaded(xp, w, bp, yp, M, num_threads);
}

// bf16_gated_linear's checks of the matrix, the activation and the shapes; returns M.
int check_gated(const py::array &x, const PackedMatrix &w, int cols, const py::array &out, int num_threads,
                const std::string &activation) {
  const char *op = "bf16_gated_linear";
  need(activation == "silu" || activation == "gelu_tanh", op,
       "unknown activation '" + activation + "' (silu, gelu_tanh)");
  need(bf16_gated_fits(w), op,
       "want a bf16_pairs matrix of gate then up rows, each half a multiple of 16 rows, cols a multiple of 32, "
       "on a CPU with AMX-BF16 (bf16_gated_fits)");
  need(x.ndim() == 2 && x.shape(1) == cols, op, "want x [M, cols]");
  const int M = static_cast<int>(x.shape(0));
  need(out.ndim() == 2 && out.shape(0) == M && out.shape(1) == w.rows / 2 && out.writeable(), op,
       "out must be writable [M, rows / 2]");
  need(num_threads >= 1, op, "num_threads must be >= 1");
  return M;
}

GatedActivation gated_activation(const std::string &activation) {
  return activation == "silu" ? silu_mul : gelu_tanh_mul;
}

// Whether a is C-contiguous float32 (false) or uint16 (bf16 bits: true); else ValueError.
bool bf16_rows(const py::array &a, const char *name, const char *op) {
  const bool f32 = a.dtype().is(py::dtype::of<float>()), u16 = a.dtype().is(py::dtype::of<uint16_t>());
  need((f32 || u16) && (a.flags() & py::array::c_style), op,
       std::string(name) + " must be C-contiguous float32, or uint16 (bf16 bits)");
  return u16;
}

// x [M, cols] float32, or uint16 rows already rounded to bf16; out float32, or uint16 for the
// floats rounded to bf16 (a bf16 down product's input).
void gated_linear_py(const py::array &x, const U8 &weight, int cols, py::array &out, int num_threads,
                     const std::string &activation) {
  const char *op = "bf16_gated_linear";
  const PackedMatrix w = matrix(weight, "bf16_pairs", cols, op);
  const bool x_b = bf16_rows(x, "x", op), out_b = bf16_rows(out, "out", op);
  const int M = check_gated(x, w, cols, out, num_threads, activation);
  const void *xp = x.data();
  void *yp = out.mutable_data();
  float *y = out_b ? nullptr : static_cast<float *>(yp);
  uint16_t *yb = out_b ? static_cast<uint16_t *>(yp) : nullptr;
  const GatedActivation act = gated_activation(activation);
  py::gil_scoped_release release;
  if (x_b)
    bf16_gated_rounded(static_cast<const uint16_t *>(xp), w, y, yb, M, num_threads, act);
  else
    bf16_gated_threaded(static_cast<const float *>(xp), w, y, yb, M, num_threads, act);
}

void packed_widen_py(const U8 &weight, const std::string &format, int cols, int begin, int end, F32 &out,
                     int num_threads) {
  const char *op = "packed_widen";
  const PackedMatrix w = matrix(weight, format, cols, op);
  need(0 <= begin && begin <= end && end <= w.rows, op, "rows [begin, end) outside the matrix");
  need(out.ndim() == 2 && out.shape(0) == end - begin && out.shape(1) == cols, op, "out must be [end - begin, cols]");
  need(out.writeable(), op, "out must be writable");
  need(num_threads >= 1, op, "num_threads must be >= 1");
  float *op_ = out.mutable_data();
  py::gil_scoped_release release;
  const int rows = end - begin, parts = std::min(packed_thread_parts(w, rows, num_threads), std::max(rows, 1));
  const int step = (rows + parts - 1) / parts;
  shared_pool(parts).run(parts, parts, [&](int p) {
    const int b = begin + std::min(rows, p * step), e = begin + std::min(rows, (p + 1) * step);
    widen_rows(w, b, e, op_ + static_cast<size_t>(b - begin) * cols);
  });
}

void packed_gather_py(const U8 &weight, const std::string &format, int cols, const I64 &ids, F32 &out) {
  const char *op = "packed_gather";
  const PackedMatrix w = matrix(weight, format, cols, op);
  need(ids.ndim() == 1, op, "want ids [T]");
  const int T = static_cast<int>(ids.shape(0));
  need(out.ndim() == 2 && out.shape(0) == T && out.shape(1) == cols, op, "out must be [T, cols]");
  need(out.writeable(), op, "out must be writable");
  const int64_t *idp = ids.data();
  for (int t = 0; t < T; ++t)
    need(idp[t] >= 0 && idp[t] < w.rows, op,
         "id " + std::to_string(idp[t]) + " outside [0, " + std::to_string(w.rows) + ")");
  float *op_ = out.mutable_data();
  py::gil_scoped_release release;
  for (int t = 0; t < T; ++t) widen_row(w, static_cast<int>(idp[t]), op_ + static_cast<size_t>(t) * cols);
}

// A fused matrix of packed parts in different formats (packed_parts.h), checked once; it holds
// its parts' arrays so their bytes outlive it.
class PackedPartsPy {
 public:
  PackedPartsPy(const std::vector<U8> &weights, const std::vector<std::string> &formats, int cols)
      : arrays_(weights) {
    const char *op = "PackedParts";
    need(!weights.empty() && weights.size() == formats.size(), op, "want one format per part, and a part");
    for (size_t i = 0; i < weights.size(); ++i) {
      parts_.push_back(matrix(arrays_[i], formats[i], cols, op));
      need(parts_.back().format != WeightFormat::kBF16Pairs, op, "bf16_pairs cannot be a part");
    }
    rows_ = packed_parts_rows(parts_);
    cols_ = cols;
  }

  void linear(const F32 &x, const std::optional<F32> &bias, F32 &out, int num_threads) const {
    const char *op = "PackedParts.linear";
    need(x.ndim() == 2 && out.ndim() == 2, op, "want x [M, K], out [M, N]");
    need(x.shape(1) == cols_, op, "x's K differs from the weight's cols");
    const int M = static_cast<int>(x.shape(0));
    need(out.shape(0) == M && out.shape(1) == rows_, op, "out must be [M, N]");
    need(out.writeable(), op, "out must be writable");
    need(!bias || (bias->ndim() == 1 && bias->shape(0) == rows_), op, "bias must be [N]");
    need(num_threads >= 1, op, "num_threads must be >= 1");
    const float *xp = x.data(), *bp = bias ? bias->data() : nullptr;
    float *yp = out.mutable_data();
    py::gil_scoped_release release;
    packed_parts_threaded(xp, parts_, bp, yp, M, num_threads);
  }

  int rows() const { return rows_; }

 private:
  std::vector<U8> arrays_;
  PackedParts parts_;
  int rows_ = 0, cols_ = 0;
};

}  // namespace

void bind_packed_kernels(py::module_ &m) {
  py::class_<PackedPartsPy>(m, "PackedParts",
                            "A matrix whose row ranges are packed in different formats (a fused q/k/v or\n"
                            "gate/up projection): the parts' [rows_i, bytes per row] uint8 arrays in row order.")
      .def(py::init<const std::vector<U8> &, const std::vector<std::string> &, int>(), py::arg("weights"),
           py::arg("formats"), py::arg("cols"))
      .def("linear", &PackedPartsPy::linear, py::arg("x").noconvert(), py::arg("bias").noconvert() = py::none(),
           py::arg("out").noconvert(), py::arg("num_threads") = 1,
           "out[M, rows] = x[M, cols] @ W.T (+ bias), each part's rows by its own format's kernel: bit for\n"
           "bit what `linear` gives on the widened matrix. num_threads > 1 splits the rows by bytes.")
      .def_property_readonly("rows", &PackedPartsPy::rows);
  m.def("packed_linear", &packed_linear_py, py::arg("x").noconvert(), py::arg("weight").noconvert(),
        py::arg("format"), py::arg("cols"), py::arg("bias").noconvert() = py::none(), py::arg("out").noconvert(),
        py::arg("num_threads") = 1,
        "out[M, N] = x[M, cols] @ W.T (+ bias[N]) in fp32, W [N, cols] packed as `format` (bf16, q4_0,\n"
        "q4_1, q5_0, q5_1, q8_0, q2_k-q6_k; weight holds its bytes, [N, bytes per row] uint8)\n"
        "and widened in cache; bit for bit\n"
        "what `linear` gives on the widened matrix. num_threads > 1 splits the output columns.");
  m.def("packed_linear", &packed_linear_rounded_py, py::arg("x").noconvert(), py::arg("weight").noconvert(),
        py::arg("format"), py::arg("cols"), py::arg("bias").noconvert() = py::none(), py::arg("out").noconvert(),
        py::arg("num_threads") = 1,
        "The same for x [M, cols] uint16, rows already rounded to bf16, and a 'bf16_pairs' matrix: the floats\n"
        "of the float32 rows they were rounded from.");
  m.def("bf16_gated_linear", &gated_linear_py, py::arg("x").noconvert(), py::arg("weight").noconvert(),
        py::arg("cols"), py::arg("out").noconvert(), py::arg("num_threads") = 1, py::arg("activation") = "silu",
        "out[M, I] = act(x @ G.T) * (x @ U.T) for weight = [G; U] [2I, cols] in 'bf16_pairs' on AMX tiles,\n"
        "act 'silu' or 'gelu_tanh': the floats of packed_linear then silu_mul / gelu_tanh_mul, the [M, 2I]\n"
        "product never written out. x float32, or uint16 rows already rounded to bf16; out float32, or\n"
        "uint16 for the results rounded to bf16.");
  m.def("bf16_gated_fits", [](int rows, int cols) {
          return bf16_gated_fits(PackedMatrix{nullptr, rows, cols, static_cast<size_t>(2 * cols),
                                              WeightFormat::kBF16Pairs});
        }, py::arg("rows"), py::arg("cols"),
        "Whether bf16_gated_linear takes a [rows, cols] bf16_pairs gate/up matrix on this CPU.");
  m.def("packed_widen", &packed_widen_py, py::arg("weight").noconvert(), py::arg("format"), py::arg("cols"),
        py::arg("begin"), py::arg("end"), py::arg("out").noconvert(), py::arg("num_threads") = 1,
        "Widens rows [begin, end) of a packed matrix into out [end - begin, cols] float32 (the values\n"
        "gguf's dequantize gives).");
  m.def("packed_gather", &packed_gather_py, py::arg("weight").noconvert(), py::arg("format"), py::arg("cols"),
        py::arg("ids").noconvert(), py::arg("out").noconvert(),
        "out[t] = row ids[t] of a packed matrix, widened to float32 (an embedding lookup).");
}

}  // namespace deepinfer
