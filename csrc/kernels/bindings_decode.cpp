// pybind11 entry for the whole-stack decode step (llama_decode.h): the weights are handed
// over once (the object keeps the arrays alive), the caches whenever they are (re)bound, and
// every step's indices are checked before the GIL is dropped, so a bad call raises
// ValueError("llama_decode: <what>") instead of writing out of bounds.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
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
using OptF32 = std::optional<F32>;

void need(bool ok, const std::string &what) {
  if (!ok) throw py::value_error("llama_decode: " + what);
}

class DecodeStack {
 public:
  DecodeStack(int hidden, int heads, int kv_heads, int head_dim, int intermediate, float eps, const F32 &final_norm,
              float final_eps, const std::string &activation)
      : shape_{hidden, heads, kv_heads, head_dim, intermediate, 0, 0, KvDtype::kF32, eps, Activation::kSiLU},
        final_norm_(final_norm), final_eps_(final_eps) {
    need(activation == "silu" || activation == "gelu_tanh",
         "unknown activation '" + activation + "' (silu, gelu_tanh)");
    shape_.act = activation == "silu" ? Activation::kSiLU : Activation::kGeluTanh;
    need(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && intermediate > 0, "sizes must be positive");
    need(heads % kv_heads == 0 && head_dim % 2 == 0, "heads must be a multiple of kv_heads, head_dim even");
    need(final_norm.ndim() == 1 && final_norm.shape(0) == hidden, "final_norm must be [hidden]");
  }

  // Each projection is (weight, format, bias): format "f32" with weight [out, in] float32, or
  // a packed format with weight [out, bytes per row] uint8; bias [out] or None. Norm weights
  // are [hidden] (q_norm, k_norm [head_dim]); the optional ones are None where the layer has none.
  void add_layer(const py::tuple &qkv, const py::tuple &o, const py::tuple &gate_up, const py::tuple &down,
                 const F32 &input_norm, const F32 &ffn_norm, float scale, int window, const OptF32 &attn_out_norm,
                 const OptF32 &mlp_out_norm, const OptF32 &q_norm, const OptF32 &k_norm, int rope, int group) {
    const DecodeShape &s = shape_;
    const int q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    DecodeLayer L;
    L.qkv = linear(qkv, q + 2 * kv, s.hidden, "qkv");
    L.o = linear(o, s.hidden, q, "o");
    L.gate_up = linear(gate_up, 2 * s.intermediate, s.hidden, "gate_up");
    L.down = linear(down, s.hidden, s.intermediate, "down");
    L.input_norm = norm_weight(input_norm, s.hidden, "input_norm");
    L.ffn_norm = norm_weight(ffn_norm, s.hidden, "ffn_norm");
    L.attn_out_norm = attn_out_norm ? norm_weight(*attn_out_norm, s.hidden, "attn_out_norm") : nullptr;
    L.mlp_out_norm = mlp_out_norm ? norm_weight(*mlp_out_norm, s.hidden, "mlp_out_norm") : nullptr;
    need(!q_norm == !k_norm, "q_norm and k_norm come together");
    L.q_norm = q_norm ? norm_weight(*q_norm, s.head_dim, "q_norm") : nullptr;
    L.k_norm = k_norm ? norm_weight(*k_norm, s.head_dim, "k_norm") : nullptr;
    L.scale = scale;
    need(window >= 0, "window must be >= 0 (0: no sliding window)");
    L.window = window;
    need(rope >= 0 && group >= 0, "rope and group must be >= 0");
    L.rope = rope;
    L.group = group;
    num_ropes_ = std::max(num_ropes_, rope + 1);
    num_groups_ = std::max(num_groups_, group + 1);
    layers_.push_back(L);
    caches_bound_ = false;
  }

  // One K and one V cache per layer, each [num_blocks, block_size, kv_heads, head_dim]: float32,
  // or bf16 viewed as uint16 (kv_cache_dtype), the same in every layer. Checked as given, never
  // converted: the step writes into them.
  void set_caches(const std::vector<py::array> &k, const std::vector<py::array> &v, bool bf16_attention) {
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
    shape_.bf16_attention = bf16_attention;
    caches_ = {k, v};
    caches_bound_ = true;
  }

  // cos/sin [ropes, T, head_dim] (or [T, head_dim] for one table); slots [T * groups] and
  // block_tables [rows, blocks * groups] interleave the KV groups as the scheduler hands them
  // over (entry i * groups + g is group g's).
  F32 run(const F32 &embeddings, const F32 &cos, const F32 &sin, const I64 &slots, const I32 &block_tables,
          const I32 &context_lens, const std::optional<I32> &query_rows, int threads) {
    need(caches_bound_, "caches are not set (set_caches after the last add_layer)");
    need(embeddings.ndim() == 2 && embeddings.shape(0) > 0 && embeddings.shape(0) <= INT_MAX &&
             embeddings.shape(1) == shape_.hidden,
         "embeddings must be [T > 0, hidden]");
    const int T = static_cast<int>(embeddings.shape(0)), G = num_groups_;
    check_rope(cos, T, "cos");
    check_rope(sin, T, "sin");
    need(slots.ndim() == 1 && slots.shape(0) == static_cast<int64_t>(T) * G && context_lens.ndim() == 1 &&
             context_lens.shape(0) == T,
         "slots need one entry per token and KV group (" + std::to_string(G) + "), context_lens one per token");
    need(block_tables.ndim() == 2 && block_tables.shape(1) > 0 && block_tables.shape(1) % G == 0,
         "block_tables must be [rows, blocks * KV groups (" + std::to_string(G) + ")]");
    need(!query_rows || (query_rows->ndim() == 1 && query_rows->shape(0) == T), "query_rows needs one entry per token");
    need(query_rows || block_tables.shape(0) == T, "without query_rows, block_tables needs one row per token");
    need(threads >= 1, "threads must be >= 1");
    const int64_t capacity = static_cast<int64_t>(shape_.num_blocks) * shape_.block_size;
    // Copies of the indices, one table and slot list per group, checked: the step runs without the GIL.
    const int rows_n = static_cast<int>(block_tables.shape(0)), nb = static_cast<int>(block_tables.shape(1)) / G;
    std::vector<int64_t> slot(static_cast<size_t>(T) * G);
    std::vector<int32_t> tables(static_cast<size_t>(rows_n) * nb * G);
    for (int g = 0; g < G; ++g) {
      for (int t = 0; t < T; ++t) {
        const int64_t x = slots.data()[static_cast<size_t>(t) * G + g];
        need(x >= 0 && x < capacity, "slot " + std::to_string(x) + " outside the cache");
        slot[static_cast<size_t>(g) * T + t] = x;
      }
      for (size_t e = 0; e < static_cast<size_t>(rows_n) * nb; ++e)
        tables[static_cast<size_t>(g) * rows_n * nb + e] = block_tables.data()[e * G + g];
    }
    const std::vector<int32_t> lens(context_lens.data(), context_lens.data() + T);
    std::vector<int32_t> rows;
    if (query_rows) rows.assign(query_rows->data(), query_rows->data() + T);
    DecodeStep step{T, cos.data(), sin.data(), slot.data(), tables.data(), rows_n, nb, lens.data(),
                    query_rows ? rows.data() : nullptr};
    const PagedAttentionShape ps{T, rows_n, shape_.heads, shape_.kv_heads, shape_.head_dim,
                                 shape_.block_size, nb, shape_.num_blocks};
    for (int g = 0; g < G; ++g) {
      const std::string error = paged_context_error(ps, tables.data() + static_cast<size_t>(g) * rows_n * nb,
                                                    step.query_rows, step.context_lens);
      need(error.empty(), error);
    }
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
  int num_groups() const { return num_groups_; }

 private:
  // cos or sin: [ropes, T, head_dim], or [T, head_dim] when the layers use one table.
  void check_rope(const F32 &a, int T, const char *name) const {
    const bool one = a.ndim() == 2 && num_ropes_ == 1 && a.shape(0) == T && a.shape(1) == shape_.head_dim;
    const bool many = a.ndim() == 3 && a.shape(0) == num_ropes_ && a.shape(1) == T && a.shape(2) == shape_.head_dim;
    need(one || many, std::string(name) + " must be [" + std::to_string(num_ropes_) + " RoPE tables, T, head_dim]" +
                          (num_ropes_ == 1 ? " or [T, head_dim]" : ""));
  }

  const float *norm_weight(const F32 &w, int size, const char *name) {
    need(w.ndim() == 1 && w.shape(0) == size, std::string(name) + " must be [" + std::to_string(size) + "]");
    keep_.push_back(w);
    return w.data();
  }

  PackedMatrix packed(const py::handle &array, const std::string &format, int out, int in, const std::string &what) {
    WeightFormat f;
    need(packed_format_named(format, &f), what + "unknown format '" + format + "' (f32, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k-q6_k, bf16_pairs)");
    const auto w = array.cast<py::array_t<uint8_t, py::array::c_style>>();
    const size_t row_bytes = packed_row_bytes(f, in);
    need(row_bytes > 0 && w.ndim() == 2 && w.shape(0) == out && static_cast<size_t>(w.shape(1)) == row_bytes,
         what + "packed weight must be [" + std::to_string(out) + ", " + std::to_string(row_bytes) + "] uint8");
    need(f != WeightFormat::kBF16Pairs || out % 16 == 0, what + "bf16_pairs rows must be a multiple of 16");
    keep_.push_back(w);
    return PackedMatrix{w.data(), out, in, row_bytes, f};
  }

  // "q4_k+q6_k": one array a part, [rows_i, bytes a row] in row order, the rows adding up to `out`.
  PackedParts parts(const py::list &arrays, const std::string &formats, int out, int in, const std::string &what) {
    PackedParts result;
    size_t start = 0;
    for (const py::handle array : arrays) {
      const size_t end = std::min(formats.find('+', start), formats.size());
      const std::string format = formats.substr(start, end - start);
      start = end + 1;
      const auto w = array.cast<py::array>();
      need(w.ndim() == 2, what + "each part must be a 2-d uint8 array");
      result.push_back(packed(array, format, static_cast<int>(w.shape(0)), in, what));
      need(result.back().format != WeightFormat::kBF16Pairs, what + "bf16_pairs cannot be a part");
    }
    need(start == formats.size() + 1 && result.size() >= 2, what + "want one array per format of '" + formats + "'");
    need(packed_parts_rows(result) == out, what + "the parts' rows must add up to " + std::to_string(out));
    return result;
  }

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
    } else if (format.find('+') != std::string::npos) {
      l.parts = parts(spec[0].cast<py::list>(), format, out, in, what);
    } else {
      l.matrix = packed(spec[0], format, out, in, what);
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
  int num_ropes_ = 1, num_groups_ = 1;  // RoPE tables and KV groups the layers use
};

}  // namespace

void bind_decode(py::module_ &m) {
  py::class_<DecodeStack>(m, "LlamaDecodeStack",
                          "A Llama-family decoder stack run as one call per step of a few tokens a sequence "
                          "(llama_decode.h): the same kernels, in the same order, as the module path.")
      .def(py::init<int, int, int, int, int, float, const F32 &, float, const std::string &>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("final_norm").noconvert(), py::arg("final_eps"), py::arg("activation") = "silu")
      .def("add_layer", &DecodeStack::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("input_norm").noconvert(), py::arg("ffn_norm").noconvert(), py::arg("scale"),
           py::arg("window") = 0, py::kw_only(), py::arg("attn_out_norm").noconvert() = py::none(),
           py::arg("mlp_out_norm").noconvert() = py::none(), py::arg("q_norm").noconvert() = py::none(),
           py::arg("k_norm").noconvert() = py::none(), py::arg("rope") = 0, py::arg("group") = 0)
      .def("set_caches", &DecodeStack::set_caches, py::arg("k_caches"), py::arg("v_caches"),
           py::arg("bf16_attention") = false)
      .def("run", &DecodeStack::run, py::arg("embeddings").noconvert(), py::arg("cos").noconvert(),
           py::arg("sin").noconvert(), py::arg("slots").noconvert(), py::arg("block_tables").noconvert(),
           py::arg("context_lens").noconvert(), py::arg("query_rows").noconvert() = py::none(), py::arg("threads") = 1,
           "Hidden states after the final norm, [T, hidden], for the step's token embeddings [T, hidden].")
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def_property_readonly("num_groups", &DecodeStack::num_groups);
}

}  // namespace deepinfer
