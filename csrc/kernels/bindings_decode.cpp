// pybind11 entry for the whole-stack decode step (llama_decode.h): the weights are handed
// over once (the object keeps the arrays alive), the caches whenever they are (re)bound, and
// every step's indices are checked before the GIL is dropped, so a bad call raises
// ValueError("llama_decode: <what>") instead of writing out of bounds.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "llama_decode.h"
#include "paged_attention.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

using F32 = py::array_t<float, py::array::c_style>;
using I32 = py::array_t<int32_t, py::array::c_style>;
using I64 = py::array_t<int64_t, py::array::c_style>;

void need(bool ok, const std::string &what) {
  if (!ok) throw py::value_error("llama_decode: " + what);
}

class DecodeStack {
 public:
  DecodeStack(int hidden, int heads, int kv_heads, int head_dim, int intermediate, float eps, const F32 &final_norm,
              float final_eps)
      : shape_{hidden, heads, kv_heads, head_dim, intermediate, 0, 0, KvDtype::kF32, eps}, final_norm_(final_norm),
        final_eps_(final_eps) {
    need(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && intermediate > 0, "sizes must be positive");
    need(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
    need(final_norm.ndim() == 1 && final_norm.shape(0) == hidden, "final_norm must be [hidden]");
  }

  // Each projection is (weight, format, bias): format "f32" with weight [out, in] float32, or
  // a packed format with weight [out, bytes per row] uint8; bias [out] or None.
  void add_layer(const py::tuple &qkv, const py::tuple &o, const py::tuple &gate_up, const py::tuple &down,
                 const F32 &input_norm, const F32 &post_norm, float scale, int window) {
    const DecodeShape &s = shape_;
    const int q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    DecodeLayer L;
    L.qkv = linear(qkv, q + 2 * kv, s.hidden, "qkv");
    L.o = linear(o, s.hidden, q, "o");
    L.gate_up = linear(gate_up, 2 * s.intermediate, s.hidden, "gate_up");
    L.down = linear(down, s.hidden, s.intermediate, "down");
    need(input_norm.ndim() == 1 && input_norm.shape(0) == s.hidden && post_norm.ndim() == 1 &&
             post_norm.shape(0) == s.hidden,
         "norm weights must be [hidden]");
    L.input_norm = input_norm.data();
    L.post_norm = post_norm.data();
    L.scale = scale;
    need(window >= 0, "window must be >= 0 (0: no sliding window)");
    L.window = window;
    keep_.push_back(input_norm);
    keep_.push_back(post_norm);
    layers_.push_back(L);
    caches_bound_ = false;
  }

  // One K and one V cache per layer, each [num_blocks, block_size, kv_heads, head_dim]: float32,
  // or bf16 viewed as uint16 (kv_cache_dtype), the same in every layer. Checked as given, never
  // converted: the step writes into them.
  void set_caches(const std::vector<py::array> &k, const std::vector<py::array> &v) {
    need(!layers_.empty() && k.size() == layers_.size() && v.size() == layers_.size(), "one K and V cache per layer");
    const bool bf16 = k[0].dtype().is(py::dtype::of<uint16_t>());
    need(bf16 || k[0].dtype().is(py::dtype::of<float>()), "caches must be float32, or bf16 viewed as uint16");
    for (size_t i = 0; i < k.size(); ++i) {
      for (const py::array *c : {&k[i], &v[i]})
        need(c->ndim() == 4 && c->shape(0) == k[0].shape(0) && c->shape(1) == k[0].shape(1) &&
                 c->shape(2) == shape_.kv_heads && c->shape(3) == shape_.head_dim && c->writeable() &&
                 (c->flags() & py::array::c_style) && c->dtype().is(k[0].dtype()),
             "caches must be writable C-contiguous [num_blocks, block_size, kv_heads, head_dim], alike in every "
             "layer");
      layers_[i].k_cache = const_cast<void *>(k[i].data());  // checked writable above
      layers_[i].v_cache = const_cast<void *>(v[i].data());
    }
    need(k[0].shape(0) > 0 && k[0].shape(1) > 0, "caches must hold blocks");
    shape_.num_blocks = static_cast<int>(k[0].shape(0));
    shape_.block_size = static_cast<int>(k[0].shape(1));
    shape_.kv_dtype = bf16 ? KvDtype::kBF16 : KvDtype::kF32;
    caches_ = {k, v};
    caches_bound_ = true;
  }

  F32 run(const F32 &embeddings, const F32 &cos, const F32 &sin, const I64 &slots, const I32 &block_tables,
          const I32 &context_lens, const std::optional<I32> &query_rows, int threads) {
    need(caches_bound_, "caches are not set (set_caches after the last add_layer)");
    need(embeddings.ndim() == 2 && embeddings.shape(0) > 0 && embeddings.shape(0) <= INT_MAX &&
             embeddings.shape(1) == shape_.hidden,
         "embeddings must be [T > 0, hidden]");
    const int T = static_cast<int>(embeddings.shape(0));
    need(cos.ndim() == 2 && sin.ndim() == 2 && cos.shape(0) == T && sin.shape(0) == T &&
             cos.shape(1) == shape_.head_dim && sin.shape(1) == shape_.head_dim,
         "cos and sin must be [T, head_dim]");
    need(slots.ndim() == 1 && slots.shape(0) == T && context_lens.ndim() == 1 && context_lens.shape(0) == T,
         "slots and context_lens need one entry per token");
    need(block_tables.ndim() == 2 && block_tables.shape(1) > 0, "block_tables must be [rows, blocks]");
    need(!query_rows || (query_rows->ndim() == 1 && query_rows->shape(0) == T), "query_rows needs one entry per token");
    need(query_rows || block_tables.shape(0) == T, "without query_rows, block_tables needs one row per token");
    need(threads >= 1, "threads must be >= 1");
    const int64_t capacity = static_cast<int64_t>(shape_.num_blocks) * shape_.block_size;
    // Copies of the indices, checked: the step runs without the GIL.
    const std::vector<int64_t> slot(slots.data(), slots.data() + T);
    for (int64_t x : slot) need(x >= 0 && x < capacity, "slot " + std::to_string(x) + " outside the cache");
    const std::vector<int32_t> tables(block_tables.data(), block_tables.data() + block_tables.size());
    const std::vector<int32_t> lens(context_lens.data(), context_lens.data() + T);
    std::vector<int32_t> rows;
    if (query_rows) rows.assign(query_rows->data(), query_rows->data() + T);
    DecodeStep step{T, cos.data(), sin.data(), slot.data(), tables.data(), static_cast<int>(block_tables.shape(0)),
                    static_cast<int>(block_tables.shape(1)), lens.data(), query_rows ? rows.data() : nullptr};
    const PagedAttentionShape ps{T, step.num_rows, shape_.heads, shape_.kv_heads, shape_.head_dim,
                                 shape_.block_size, step.max_blocks, shape_.num_blocks};
    const std::string error = paged_context_error(ps, step.block_tables, step.query_rows, step.context_lens);
    need(error.empty(), error);
    std::vector<float> hidden(embeddings.data(), embeddings.data() + embeddings.size());
    F32 out({T, shape_.hidden});
    float *dst = out.mutable_data();
    {
      py::gil_scoped_release release;
      llama_decode(shape_, layers_, final_norm_.data(), final_eps_, step, hidden.data(), dst, threads);
    }
    return out;
  }

  int num_layers() const { return static_cast<int>(layers_.size()); }

 private:
  DecodeLinear linear(const py::tuple &spec, int out, int in, const char *name) {
    const std::string what = std::string(name) + ": ";
    need(spec.size() == 3, what + "want (weight, format, bias)");
    const std::string format = spec[1].cast<std::string>();
    DecodeLinear l;
    l.out = out;
    l.in = in;
    if (format == "f32") {
      const F32 w = spec[0].cast<F32>();
      need(w.ndim() == 2 && w.shape(0) == out && w.shape(1) == in,
           what + "weight must be [" + std::to_string(out) + ", " + std::to_string(in) + "]");
      l.weight = w.data();
      keep_.push_back(w);
    } else {
      WeightFormat f;
      need(packed_format_named(format, &f), what + "unknown format '" + format + "' (f32, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k-q6_k, bf16_pairs)");
      const auto w = spec[0].cast<py::array_t<uint8_t, py::array::c_style>>();
      const size_t row_bytes = packed_row_bytes(f, in);
      need(row_bytes > 0 && w.ndim() == 2 && w.shape(0) == out && static_cast<size_t>(w.shape(1)) == row_bytes,
           what + "packed weight must be [" + std::to_string(out) + ", " + std::to_string(row_bytes) + "] uint8");
      need(f != WeightFormat::kBF16Pairs || out % 16 == 0, what + "bf16_pairs rows must be a multiple of 16");
      l.matrix = PackedMatrix{w.data(), out, in, row_bytes, f};
      keep_.push_back(w);
    }
    if (!spec[2].is_none()) {
      const F32 b = spec[2].cast<F32>();
      need(b.ndim() == 1 && b.shape(0) == out, what + "bias must be [" + std::to_string(out) + "]");
      l.bias = b.data();
      keep_.push_back(b);
    }
    return l;
  }

  DecodeShape shape_;
  std::vector<DecodeLayer> layers_;
  F32 final_norm_;
  float final_eps_;
  std::vector<py::object> keep_;  // the arrays the layers point into
  std::vector<std::vector<py::array>> caches_;
  bool caches_bound_ = false;
};

}  // namespace

void bind_decode(py::module_ &m) {
  py::class_<DecodeStack>(m, "LlamaDecodeStack",
                          "A Llama-family decoder stack run as one call per step of a few tokens a sequence "
                          "(llama_decode.h): the same kernels, in the same order, as the module path.")
      .def(py::init<int, int, int, int, int, float, const F32 &, float>(), py::arg("hidden"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("final_norm").noconvert(), py::arg("final_eps"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("input_norm").noconvert(), py::arg("post_norm").noconvert(), py::arg("scale"),
           py::arg("window") = 0)
      .def("set_caches", &DecodeStack::set_caches, py::arg("k_caches"), py::arg("v_caches"))
      .def("run", &DecodeStack::run, py::arg("embeddings").noconvert(), py::arg("cos").noconvert(),
           py::arg("sin").noconvert(), py::arg("slots").noconvert(), py::arg("block_tables").noconvert(),
           py::arg("context_lens").noconvert(), py::arg("query_rows").noconvert() = py::none(), py::arg("threads") = 1,
           "Hidden states after the final norm, [T, hidden], for the step's token embeddings [T, hidden].")
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}

}  // namespace deepinfer
