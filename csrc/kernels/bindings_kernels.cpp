// pybind11 entry for the CPU kernels: checks shapes, dtypes and block ids up front, so a
// bad call raises a Python error instead of reading out of bounds, then drops the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_fused_ops.h"
#include "cpu_linear.h"
#include "kv_store.h"
#include "paged_attention.h"
#include "paged_attention_bf16.h"
#include "thread_pool.h"

namespace py = pybind11;

namespace deepinfer {

namespace {

using F32 = py::array_t<float, py::array::c_style>;
using I32 = py::array_t<int32_t, py::array::c_style>;
using U16 = py::array_t<uint16_t, py::array::c_style>;  // a bf16 cache, viewed as uint16
using F32Rows = py::array_t<float>;  // [T, heads, D] rows any stride (heads_row_stride)

// Every check raises ValueError("<op>: <what was wrong>").
void need(bool ok, const char *op, const std::string &what) {
  if (!ok) throw py::value_error(std::string(op) + ": " + what);
}

void require(bool ok, const std::string &what) { need(ok, "paged_attention", what); }

// Dimension d of `a` as an int (the kernels index with ints), or ValueError.
int dim(const py::array &a, int d, const char *op) {
  need(a.shape(d) <= INT_MAX, op, "a dimension of " + std::to_string(a.shape(d)) + " is too large");
  return static_cast<int>(a.shape(d));
}

// Rows of a [T, heads, D] float32 array whose heads are contiguous and whose rows may lie
// apart (q, k or v inside the fused qkv output, read in place): floats between rows. An empty
// array has nothing to read (NumPy gives it zero strides).
int64_t heads_row_stride(const py::array_t<float> &x, const char *op, const char *name) {
  const auto f = static_cast<py::ssize_t>(sizeof(float));
  need(x.ndim() == 3, op, std::string(name) + " must be [T, heads, D]");
  if (x.size() == 0) return x.shape(1) * x.shape(2);
  need(x.strides(2) == f && x.strides(1) == x.shape(2) * f && x.strides(0) % f == 0 &&
           x.strides(0) >= x.shape(1) * x.shape(2) * f,
       op, std::string(name) + " must be [T, heads, D] float32 with each row's heads contiguous");
  return x.strides(0) / f;
}

template <class Cache>
PagedAttentionShape check_shapes(const F32Rows &q, const Cache &k_cache, const Cache &v_cache, const I32 &block_tables,
                                 const I32 &context_lens, const py::array &out) {
  require(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 4 && v_cache.ndim() == 4 &&
              block_tables.ndim() == 2 && context_lens.ndim() == 1,
          "want q/out [T, H, D], caches [blocks, block_size, Hkv, D], block_tables [S, n], context_lens [T]");
  const char *op = "paged_attention";
  PagedAttentionShape s{};
  s.num_queries = dim(q, 0, op);
  s.num_rows = dim(block_tables, 0, op);
  s.num_heads = dim(q, 1, op);
  s.head_dim = dim(q, 2, op);
  s.num_blocks = dim(k_cache, 0, op);
  s.block_size = dim(k_cache, 1, op);
  s.num_kv_heads = dim(k_cache, 2, op);
  s.max_blocks = dim(block_tables, 1, op);
  for (int d = 0; d < 4; ++d) require(k_cache.shape(d) == v_cache.shape(d), "k_cache and v_cache differ in shape");
  for (int d = 0; d < 3; ++d) require(out.shape(d) == q.shape(d), "out must have q's shape");
  // Only the number of queries (and of block-table rows) may be zero: nothing to do.
  require(s.num_heads > 0 && s.head_dim > 0 && s.num_blocks > 0 && s.block_size > 0 && s.num_kv_heads > 0 &&
              s.max_blocks > 0,
          "heads, head_dim, cache blocks, block_size, KV heads and block-table columns must be non-zero");
  require(k_cache.shape(3) == s.head_dim, "cache head_dim differs from q's");
  require(s.num_heads % s.num_kv_heads == 0, "query heads must be a multiple of KV heads");
  require(context_lens.shape(0) == s.num_queries, "context_lens needs one entry per query");
  require(out.writeable(), "out must be writable");
  s.q_stride = heads_row_stride(q, op, "q");
  return s;
}

// Where paged_attention writes: out float32, or uint16 for the outputs rounded to bf16 (a
// bf16 product's rows), which only the bf16 kernel writes.
void check_out(const py::array &out, const PagedAttentionShape &s, bool bf16_cache) {
  const bool f32 = out.dtype().is(py::dtype::of<float>()), u16 = out.dtype().is(py::dtype::of<uint16_t>());
  if (!(f32 || u16) || !(out.flags() & py::array::c_style))  // as a mistyped array of the other arguments
    throw py::type_error("paged_attention: out must be C-contiguous float32, or uint16 (bf16)");
  require(f32 || (s.bf16_math && bf16_cache && paged_attention_bf16_fits(s)),
          "out in bf16 (uint16) needs bf16_math over a bf16 cache where the bf16 kernel runs (bf16_attention_form)");
}

// Cache: F32, or U16 for a bf16 cache (the overload pybind11 picks by the caches' dtype).
template <class Cache>
void paged_attention_py(const F32Rows &q, const Cache &k_cache, const Cache &v_cache, const I32 &block_tables,
                        const I32 &context_lens, py::array &out, float scale, int num_threads,
                        const std::optional<I32> &query_rows, int window, bool bf16_math) {
  PagedAttentionShape s = check_shapes(q, k_cache, v_cache, block_tables, context_lens, out);
  s.bf16_math = bf16_math;
  const bool bf16_cache = std::is_same<Cache, U16>::value;
  check_out(out, s, bf16_cache);
  require(num_threads >= 1, "num_threads must be >= 1");
  require(window >= 0, "window must be >= 0 (0: no sliding window)");
  s.window = window;
  // The indices are copied before they are checked: the kernel runs without the GIL, and
  // another Python thread writing into these arrays meanwhile must not undo the checks.
  std::vector<int32_t> row_ids;
  if (query_rows) {
    require(query_rows->ndim() == 1 && query_rows->shape(0) == s.num_queries, "query_rows needs one entry per query");
    row_ids.assign(query_rows->data(), query_rows->data() + s.num_queries);
  } else {
    require(s.num_rows == s.num_queries, "without query_rows, block_tables needs one row per query");
  }
  const std::vector<int32_t> table_ids(block_tables.data(), block_tables.data() + block_tables.size());
  const std::vector<int32_t> context(context_lens.data(), context_lens.data() + s.num_queries);
  const int32_t *rows = query_rows ? row_ids.data() : nullptr, *tables = table_ids.data(), *lens = context.data();
  const std::string error = paged_context_error(s, tables, rows, lens);
  require(error.empty(), error);
  require(static_cast<int64_t>(s.num_queries) * s.num_kv_heads <= INT_MAX, "too many queries x KV heads");
  void *dst = out.mutable_data();
  const float *qp = q.data();
  const void *kp = k_cache.data(), *vp = v_cache.data();
  const KvDtype dtype = bf16_cache ? KvDtype::kBF16 : KvDtype::kF32;
  const bool rounded = out.dtype().is(py::dtype::of<uint16_t>());
  py::gil_scoped_release release;  // the host thread keeps working while this runs
  if (rounded)
    paged_attention_bf16(s, qp, static_cast<const uint16_t *>(kp), static_cast<const uint16_t *>(vp), tables, rows,
                         lens, scale, nullptr, num_threads, static_cast<uint16_t *>(dst));
  else
    paged_attention_threaded(s, qp, kp, vp, dtype, tables, rows, lens, scale, static_cast<float *>(dst), num_threads);
}

// Cache: F32, or U16 for a bf16 cache. The slots are copied and checked against the cache
// before the GIL is dropped (a bad slot raises instead of writing outside the cache).
template <class Cache>
void store_kv_py(const F32Rows &k, const F32Rows &v, Cache &k_cache, Cache &v_cache,
                 const py::array_t<int64_t, py::array::c_style> &slots, int num_threads) {
  auto check = [](bool ok, const std::string &what) { need(ok, "store_kv", what); };
  const int64_t k_stride = heads_row_stride(k, "store_kv", "k"), v_stride = heads_row_stride(v, "store_kv", "v");
  check(k_cache.ndim() == 4 && v_cache.ndim() == 4, "want caches [blocks, block_size, Hkv, D]");
  for (int d = 0; d < 4; ++d) check(k_cache.shape(d) == v_cache.shape(d), "k_cache and v_cache differ in shape");
  for (int d = 0; d < 3; ++d) check(k.shape(d) == v.shape(d), "k and v differ in shape");
  check(k.shape(1) == k_cache.shape(2) && k.shape(2) == k_cache.shape(3), "k's heads differ from the cache's");
  check(slots.ndim() == 1 && slots.shape(0) == k.shape(0), "slots needs one entry per row of k");
  check(k_cache.writeable() && v_cache.writeable(), "the caches must be writable");
  check(num_threads >= 1, "num_threads must be >= 1");
  const int rows = dim(k, 0, "store_kv");
  const int64_t capacity = static_cast<int64_t>(k_cache.shape(0)) * k_cache.shape(1);
  std::vector<int64_t> ids(slots.data(), slots.data() + rows);
  for (const int64_t slot : ids)
    check(slot >= 0 && slot < capacity, "slot " + std::to_string(slot) + " outside the cache's " +
                                            std::to_string(capacity));
  const KvRows r{k.data(), v.data(), k_stride, v_stride, rows, dim(k, 1, "store_kv") * dim(k, 2, "store_kv"),
                 ids.data()};
  void *kp = k_cache.mutable_data(), *vp = v_cache.mutable_data();
  const KvDtype dtype = std::is_same<Cache, U16>::value ? KvDtype::kBF16 : KvDtype::kF32;
  py::gil_scoped_release release;
  kv_store_rows(r, kp, vp, dtype, num_threads);
}

void linear_py(const F32 &x, const F32 &weight, const std::optional<F32> &bias, F32 &out, int num_threads) {
  auto check = [](bool ok, const std::string &what) { need(ok, "linear", what); };
  check(x.ndim() == 2 && weight.ndim() == 2 && out.ndim() == 2, "want x [M, K], weight [N, K], out [M, N]");
  const int M = dim(x, 0, "linear"), K = dim(x, 1, "linear"), N = dim(weight, 0, "linear");
  check(K > 0 && N > 0, "K and N must be non-zero");
  check(weight.shape(1) == K, "weight's K differs from x's");
  check(out.shape(0) == M && out.shape(1) == N, "out must be [M, N]");
  check(out.writeable(), "out must be writable");
  check(!bias || (bias->ndim() == 1 && bias->shape(0) == N), "bias must be [N]");
  check(num_threads >= 1, "num_threads must be >= 1");
  const float *xp = x.data(), *wp = weight.data(), *bp = bias ? bias->data() : nullptr;
  float *yp = out.mutable_data();
  py::gil_scoped_release release;
  linear_threaded(xp, wp, bp, yp, M, N, K, num_threads);
}

// Out: F32, or U16 for the norm's floats rounded to bf16 (the input of a bf16 product).
template <class Out>
void rms_norm_py(F32 &x, const std::optional<F32> &residual, const F32 &weight, float eps, Out &out,
                 int num_threads) {
  need(x.ndim() == 2 && out.ndim() == 2 && weight.ndim() == 1, "rms_norm", "want x/out [T, H], weight [H]");
  const int T = dim(x, 0, "rms_norm"), H = dim(x, 1, "rms_norm");
  need(H > 0, "rms_norm", "the hidden size must be non-zero");
  need(weight.shape(0) == H && out.shape(0) == T && out.shape(1) == H, "rms_norm", "x, weight and out differ in size");
  need(!residual || (residual->ndim() == 2 && residual->shape(0) == T && residual->shape(1) == H), "rms_norm",
       "residual must have x's shape");
  need(out.writeable() && (!residual || x.writeable()), "rms_norm", "out (and x, with a residual) must be writable");
  need(num_threads >= 1, "rms_norm", "num_threads must be >= 1");
  float *xp = residual ? x.mutable_data() : const_cast<float *>(x.data());
  const float *rp = residual ? residual->data() : nullptr, *wp = weight.data();
  auto *op = out.mutable_data();
  py::gil_scoped_release release;
  split_rows(T, num_threads, [&](int begin, int end) {
    if constexpr (std::is_same<Out, U16>::value)
      rms_norm_rows_rounded(xp, rp, wp, eps, op, H, begin, end);
    else
      rms_norm_rows(xp, rp, wp, eps, op, H, begin, end);
  });
}

// An activation of a gated MLP (silu_mul, gelu_tanh_mul) over gate_up [T, 2I] -> out [T, I].
template <void (*Act)(const float *, const float *, float *, int)>
void gated_act_py(const F32 &gate_up, F32 &out, int num_threads, const char *op) {
  need(gate_up.ndim() == 2 && out.ndim() == 2, op, "want gate_up [T, 2I], out [T, I]");
  const int T = dim(gate_up, 0, op), I = dim(out, 1, op);
  need(gate_up.shape(1) == 2 * static_cast<int64_t>(I) && out.shape(0) == T, op,
       "gate_up must be [T, 2I] for out [T, I]");
  need(out.writeable(), op, "out must be writable");
  need(num_threads >= 1, op, "num_threads must be >= 1");
  const float *g = gate_up.data();
  float *o = out.mutable_data();
  py::gil_scoped_release release;
  split_rows(T, num_threads, [&](int begin, int end) {
    for (int t = begin; t < end; ++t)
      Act(g + static_cast<size_t>(t) * 2 * I, g + static_cast<size_t>(t) * 2 * I + I, o + static_cast<size_t>(t) * I,
          I);
  });
}

void silu_mul_py(const F32 &gate_up, F32 &out, int num_threads) {
  gated_act_py<silu_mul>(gate_up, out, num_threads, "silu_mul");
}

void gelu_tanh_mul_py(const F32 &gate_up, F32 &out, int num_threads) {
  gated_act_py<gelu_tanh_mul>(gate_up, out, num_threads, "gelu_tanh_mul");
}

void rotary_py(F32Rows &x, const F32 &cos, const F32 &sin, int num_threads) {
  need(x.ndim() == 3 && cos.ndim() == 2 && sin.ndim() == 2, "rotary", "want x [T, heads, D], cos/sin [T, D]");
  const int T = dim(x, 0, "rotary"), heads = dim(x, 1, "rotary"), D = dim(x, 2, "rotary");
  need(heads > 0 && D > 0, "rotary", "heads and D must be non-zero");
  need(D % 2 == 0 && cos.shape(0) == T && cos.shape(1) == D && sin.shape(0) == T && sin.shape(1) == D, "rotary",
       "cos and sin must be [T, D] with D even");
  const int64_t stride = heads_row_stride(x, "rotary", "x");
  need(x.writeable(), "rotary", "x must be writable");
  need(num_threads >= 1, "rotary", "num_threads must be >= 1");
  float *xp = x.mutable_data();
  const float *cp = cos.data(), *sp = sin.data();
  py::gil_scoped_release release;
  split_rows(T, num_threads, [&](int begin, int end) { rotary_rows(xp, stride, heads, D, cp, sp, begin, end); });
}

py::array_t<int64_t> argmax_py(const F32 &x, int num_threads) {
  need(x.ndim() == 2 && x.shape(1) > 0, "argmax", "want x [N, V] with V > 0");
  need(num_threads >= 1, "argmax", "num_threads must be >= 1");
  const int N = dim(x, 0, "argmax"), V = dim(x, 1, "argmax");
  py::array_t<int64_t> out(N);
  int64_t *op = out.mutable_data();
  const float *xp = x.data();
  py::gil_scoped_release release;
  split_rows(N, num_threads, [&](int begin, int end) { argmax_rows(xp, V, op, begin, end); });
  return out;
}

// Every row index and the mask's width are checked before the GIL is dropped: a bad call
// raises instead of reading outside x or the bitmask.
py::array_t<int64_t> masked_argmax_py(const F32 &x, const py::array_t<int64_t, py::array::c_style> &rows,
                                      const I32 &bitmask, int num_threads) {
  const char *op = "masked_argmax";
  need(num_threads >= 1, op, "num_threads must be >= 1");
  need(x.ndim() == 2 && x.shape(1) > 0, op, "want x [N, V] with V > 0");
  need(rows.ndim() == 1 && bitmask.ndim() == 2, op, "want rows [M] and bitmask [M, W]");
  const int N = dim(x, 0, op), V = dim(x, 1, op), M = dim(rows, 0, op), W = dim(bitmask, 1, op);
  need(bitmask.shape(0) == M, op,
       "bitmask has " + std::to_string(bitmask.shape(0)) + " rows for " + std::to_string(M) + " row indices");
  need(static_cast<int64_t>(W) * 32 >= V, op,
       "bitmask rows of " + std::to_string(W) + " words cover fewer than the " + std::to_string(V) + " logits");
  std::vector<const int32_t *> masks(N, nullptr);
  const int64_t *rp = rows.data();
  const int32_t *bp = bitmask.data();
  for (int i = 0; i < M; ++i) {
    need(rp[i] >= 0 && rp[i] < N, op, "row index " + std::to_string(rp[i]) + " outside [0, " + std::to_string(N) + ")");
    need(masks[rp[i]] == nullptr, op, "row index " + std::to_string(rp[i]) + " given twice");
    masks[rp[i]] = bp + static_cast<size_t>(i) * W;
  }
  py::array_t<int64_t> out(N);
  int64_t *outp = out.mutable_data();
  const float *xp = x.data();
  py::gil_scoped_release release;
  const int32_t *const *mp = masks.data();
  split_rows(N, num_threads, [&](int begin, int end) { masked_argmax_rows(xp, V, mp, outp, begin, end); });
  return out;
}

}  // namespace

void bind_kernels(py::module_ &m) {
  m.def("rms_norm", &rms_norm_py<F32>, py::arg("x").noconvert(), py::arg("residual").noconvert(),
        py::arg("weight").noconvert(), py::arg("eps"), py::arg("out").noconvert(), py::arg("num_threads") = 1,
        "out = RMSNorm(x) * weight over rows of x [T, H] float32; with residual [T, H], x += residual first\n"
        "(in place: the decoder's residual stream), then the norm of the sum. num_threads > 1 splits\n"
        "the rows (each row's floats are the same whatever the split).");
  m.def("rms_norm", &rms_norm_py<U16>, py::arg("x").noconvert(), py::arg("residual").noconvert(),
        py::arg("weight").noconvert(), py::arg("eps"), py::arg("out").noconvert(), py::arg("num_threads") = 1,
        "The same with out [T, H] uint16: the norm's floats rounded to bf16 (bf16_round_rows), for a bf16\n"
        "product's input.");
  m.def("silu_mul", &silu_mul_py, py::arg("gate_up").noconvert(), py::arg("out").noconvert(),
        py::arg("num_threads") = 1,
        "out[t] = silu(gate_up[t, :I]) * gate_up[t, I:] over gate_up [T, 2I] float32 (e^x by Cephes'\n"
        "polynomial, the same for every element): the Llama MLP's activation on CPU. num_threads > 1\n"
        "splits the rows.");
  m.def("gelu_tanh_mul", &gelu_tanh_mul_py, py::arg("gate_up").noconvert(), py::arg("out").noconvert(),
        py::arg("num_threads") = 1,
        "out[t] = gelu_tanh(gate_up[t, :I]) * gate_up[t, I:] over gate_up [T, 2I] float32 (GeGLU, Gemma's\n"
        "MLP; tanh GELU as x / (1 + e^-z) with silu_mul's e^x, the same for every element). num_threads > 1\n"
        "splits the rows.");
  m.def("rotary", &rotary_py, py::arg("x").noconvert(), py::arg("cos").noconvert(), py::arg("sin").noconvert(),
        py::arg("num_threads") = 1,
        "RoPE (rotate_half layout) in place on x [T, heads, D] float32 (rows may be strided, e.g. q or k\n"
        "inside a fused qkv output) with cos/sin [T, D]. num_threads > 1 splits the rows.");
  m.def("argmax", &argmax_py, py::arg("x").noconvert(), py::arg("num_threads") = 1,
        "Row-wise argmax of x [N, V] float32 as int64 [N] (first index on ties, first NaN if any).\n"
        "num_threads > 1 splits the rows.");
  m.def("masked_argmax", &masked_argmax_py, py::arg("x").noconvert(), py::arg("rows").noconvert(),
        py::arg("bitmask").noconvert(), py::arg("num_threads") = 1,
        "Row-wise argmax of x [N, V] float32 as int64 [N], where row rows[i] (int64 [M], distinct) only\n"
        "considers the tokens allowed by bitmask[i] (int32 [M, W], W * 32 >= V; bit b of word w allows\n"
        "token 32 * w + b, xgrammar's and llguidance's layout): the argmax of x with the others set to\n"
        "-inf, ties and NaN as in argmax, without copying x. Other rows: plain argmax. num_threads > 1\n"
        "splits the rows.");
  m.def("paged_attention", &paged_attention_py<F32>, py::arg("q").noconvert(), py::arg("k_cache").noconvert(),
        py::arg("v_cache").noconvert(), py::arg("block_tables").noconvert(), py::arg("context_lens").noconvert(),
        py::arg("out").noconvert(), py::arg("scale"), py::arg("num_threads") = 1,
        py::arg("query_rows").noconvert() = py::none(), py::arg("window") = 0, py::arg("bf16_math") = false,
        "Attention of each query row over its own context, read in place from the paged KV cache.\n"
        "q/out [T, H, D] float32 (out uint16: the outputs rounded to bf16, with bf16_math over a bf16 cache\n"
        "where bf16_attention_form is not ''), caches [num_blocks, block_size, Hkv, D] float32, block_tables\n"
        "[S, max_blocks] int32, context_lens [T] int32 (positions each query sees, itself included),\n"
        "query_rows [T] int32 (its block-table row; None: row t, as in decode); all C-contiguous but q,\n"
        "whose rows may lie apart (its heads contiguous: q inside a fused qkv output).\n"
        "num_threads > 1 splits the queries across that many threads (the caller's and the pool's).\n"
        "window > 0: each query sees only its last `window` positions (a sliding window).\n"
        "bf16_math: with a bf16 cache, bf16 arithmetic where the CPU has AMX or AVX512-BF16 (dtype=bfloat16).");
  m.def("paged_attention", &paged_attention_py<U16>, py::arg("q").noconvert(), py::arg("k_cache").noconvert(),
        py::arg("v_cache").noconvert(), py::arg("block_tables").noconvert(), py::arg("context_lens").noconvert(),
        py::arg("out").noconvert(), py::arg("scale"), py::arg("num_threads") = 1,
        py::arg("query_rows").noconvert() = py::none(), py::arg("window") = 0, py::arg("bf16_math") = false,
        "The same over bf16 caches, viewed as uint16 (kv_cache_dtype=bfloat16): each element widened\n"
        "exactly to fp32 as it is read.");
  m.def("store_kv", &store_kv_py<F32>, py::arg("k").noconvert(), py::arg("v").noconvert(),
        py::arg("k_cache").noconvert(), py::arg("v_cache").noconvert(), py::arg("slots").noconvert(),
        py::arg("num_threads") = 1,
        "Row t of k and v [T, Hkv, D] float32 (heads contiguous, rows any stride) into slot slots[t]\n"
        "(int64 [T]) of k_cache and v_cache [num_blocks, block_size, Hkv, D] float32.\n"
        "num_threads > 1 splits the rows.");
  m.def("store_kv", &store_kv_py<U16>, py::arg("k").noconvert(), py::arg("v").noconvert(),
        py::arg("k_cache").noconvert(), py::arg("v_cache").noconvert(), py::arg("slots").noconvert(),
        py::arg("num_threads") = 1,
        "The same into bf16 caches, viewed as uint16: each value rounded as torch's .to(torch.bfloat16).");
  m.def("bf16_attention_form", [](int head_dim) {
        PagedAttentionShape s{};
        s.head_dim = head_dim;
        return std::string(paged_attention_bf16_form(s));
      }, py::arg("head_dim"),
        "Which form paged_attention's bf16_math takes here for this head size: 'amx' (AMX tiles),\n"
        "'native' (vdpbf16ps), or '' (it widens the cache to fp32 instead).");
  m.def("linear", &linear_py, py::arg("x").noconvert(), py::arg("weight").noconvert(),
        py::arg("bias").noconvert() = py::none(), py::arg("out").noconvert(), py::arg("num_threads") = 1,
        "out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N]), float32, C-contiguous; for the small M of decode\n"
        "steps. num_threads > 1 splits the output columns across the caller and the pool's workers.");
}

}  // namespace deepinfer
