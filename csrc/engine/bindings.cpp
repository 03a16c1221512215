// pybind11 bindings: deepinfer_dp._C, the module and the scheduler's classes (the sequence and
// output classes are in bindings_outputs.cpp, the kernels in csrc/kernels/bindings_*.cpp).
// Arrays cross as NumPy views over the C++ buffers, kept alive by the Python object that owns
// them; nothing here links against PyTorch.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "block_manager.h"
#include "request_output.h"
#include "scheduler.h"
#include "sequence.h"

namespace py = pybind11;
using namespace deepinfer;

namespace {

// A read-only NumPy view of `v` whose lifetime is tied to `owner`. Read-only because the
// scheduler reads a batch back when it post-processes it; NumPy refuses to make it writable
// again, since `owner` exposes no writable buffer.
template <typename T>
py::array view(const std::vector<T> &v, py::handle owner, std::vector<py::ssize_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<py::ssize_t>(v.size())};
  py::array_t<T> a(shape, v.data(), owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

void bind_scheduler_output(py::module_ &m) {
  py::class_<SequenceMetadata>(m, "SequenceMetadata")
      .def_readonly("request_id", &SequenceMetadata::request_id)
      .def_readonly("seq_id", &SequenceMetadata::seq_id)
      .def_readonly("is_prompt", &SequenceMetadata::is_prompt)
      .def_readonly("token_ids", &SequenceMetadata::token_ids)
      .def_readonly("block_table", &SequenceMetadata::block_table)
      .def_readonly("seqlen_q", &SequenceMetadata::seqlen_q)
      .def_readonly("seqlen_k", &SequenceMetadata::seqlen_k)
      .def_readonly("do_sample", &SequenceMetadata::do_sample);

  using SO = SchedulerOutput;
  py::class_<SO, std::shared_ptr<SO>>(m, "SchedulerOutput")
      .def_readonly("step_id", &SO::step_id)
      .def_readonly("is_prompt", &SO::is_prompt)
      .def_readonly("has_inflight_inputs", &SO::has_inflight_inputs)
      .def_readonly("num_kv_groups", &SO::num_kv_groups,
                    "KV groups: slot_mapping holds num_kv_groups slots per token, and each block-table row "
                    "interleaves the groups' blocks (entry i * num_kv_groups + g: group g's block i).")
      .def_property_readonly("num_seqs", &SO::num_seqs)
      .def_property_readonly("num_tokens", &SO::num_tokens)
      .def_property_readonly("num_samples", &SO::num_samples)
      .def("is_empty", &SO::is_empty)
      .def_property_readonly("seq_ids", [](py::object self) { return view(self.cast<SO &>().seq_ids, self); })
      .def_property_readonly("input_ids", [](py::object self) { return view(self.cast<SO &>().input_ids, self); })
      .def_property_readonly("input_from_prev",
                             [](py::object self) { return view(self.cast<SO &>().input_from_prev, self); })
      .def_property_readonly("positions", [](py::object self) { return view(self.cast<SO &>().positions, self); })
      .def_property_readonly("slot_mapping",
                             [](py::object self) { return view(self.cast<SO &>().slot_mapping, self); })
      .def_property_readonly("query_start_loc",
                             [](py::object self) { return view(self.cast<SO &>().query_start_loc, self); })
      .def_property_readonly("seq_lens", [](py::object self) { return view(self.cast<SO &>().seq_lens, self); })
      .def_property_readonly("block_tables",
                             [](py::object self) {
                               SO &o = self.cast<SO &>();
                               return view(o.block_tables, self, {o.num_seqs(), o.max_blocks});
                             })
      .def_property_readonly("num_drafts", [](py::object self) { return view(self.cast<SO &>().num_drafts, self); })
      .def_property_readonly("sample_indices",
                             [](py::object self) { return view(self.cast<SO &>().sample_indices, self); })
      .def_property_readonly("request_ids",
                             [](const SO &o) {
                               std::vector<std::string> ids;
                               ids.reserve(o.seqs.size());
                               for (const auto &s : o.seqs) ids.push_back(s->request_id);
                               return ids;
                             })
      .def_property_readonly("sample_request_ids",
                             [](const SO &o) {
                               // One per sample row: a sequence with drafts has 1 + k rows.
                               std::vector<std::string> ids;
                               for (size_t i = 0; i < o.seqs.size(); ++i)
                                 if (o.samples[i])
                                   for (int j = 0; j <= o.num_drafts[i]; ++j) ids.push_back(o.seqs[i]->request_id);
                               return ids;
                             })
      .def("seq_metadata", &build_seq_metadata);
}

void bind_scheduler(py::module_ &m) {
  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init([](int max_num_seqs, int max_num_batched_tokens, int block_size, int num_blocks, int max_model_len,
                       int vocab_size, bool enable_prefix_caching, int sliding_window, int num_kv_groups,
                       int num_full_kv_groups, int max_num_encoder_input_tokens) {
             return SchedulerConfig{max_num_seqs,  max_num_batched_tokens, block_size,     num_blocks,
                                    max_model_len, vocab_size,             enable_prefix_caching, sliding_window,
                                    num_kv_groups, num_full_kv_groups, max_num_encoder_input_tokens};
           }),
           py::arg("max_num_seqs") = 256, py::arg("max_num_batched_tokens") = 2048, py::arg("block_size") = 16,
           py::arg("num_blocks") = 1024, py::arg("max_model_len") = 2048, py::arg("vocab_size") = 32000,
           py::arg("enable_prefix_caching") = true, py::arg("sliding_window") = 0, py::arg("num_kv_groups") = 1,
           py::arg("num_full_kv_groups") = 0, py::arg("max_num_encoder_input_tokens") = 0)
      .def_readonly("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readonly("block_size", &SchedulerConfig::block_size)
      .def_readonly("num_blocks", &SchedulerConfig::num_blocks)
      .def_readonly("max_model_len", &SchedulerConfig::max_model_len)
      .def_readonly("vocab_size", &SchedulerConfig::vocab_size)
      .def_readonly("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readonly("sliding_window", &SchedulerConfig::sliding_window,
                    "The sliding groups' window: a sequence's blocks of those groups wholly before it are freed "
                    "as it grows (0: none).")
      .def_readonly("num_kv_groups", &SchedulerConfig::num_kv_groups,
                    "KV groups (vLLM's hybrid allocator): a sequence holds one block per group for each block_size "
                    "positions, all groups drawing on the one pool of num_blocks.")
      .def_readonly("num_full_kv_groups", &SchedulerConfig::num_full_kv_groups,
                    "Groups [0, num_full_kv_groups) keep every block; the others free theirs as they leave the window.")
      .def_readonly("max_num_encoder_input_tokens", &SchedulerConfig::max_num_encoder_input_tokens,
                    "Image tokens the vision encoder may make in one step (0: no limit).");

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<const SchedulerConfig &>(), py::arg("config"))
      .def("add_sequence", &Scheduler::add_sequence, py::arg("seq"))
      .def("schedule", &Scheduler::schedule)
      .def(
          "process_outputs",
          [](Scheduler &s, const SchedulerOutput &out, py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens,
             std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> logprobs) {
            const float *lp = logprobs ? logprobs->data() : nullptr;
            if (logprobs && static_cast<size_t>(logprobs->size()) != static_cast<size_t>(tokens.size()))
              throw std::invalid_argument("process_outputs: logprobs and tokens differ in length");
            return s.process_outputs(out, tokens.data(), static_cast<size_t>(tokens.size()), lp);
          },
          py::arg("scheduler_output"), py::arg("sampled_token_ids"), py::arg("logprobs") = py::none())
      .def("abort", &Scheduler::abort, py::arg("request_id"),
           "Aborts the request and frees its blocks; returns its final output (finished, reason 'abort', no\n"
           "new token; pooled until the next schedule), or None if no unfinished request has this id.")
      .def("finish_request", &Scheduler::finish_request, py::arg("request_id"), py::arg("status"),
           "Like abort, with another finished status (a stop string matched outside the scheduler).")
      .def("release_outputs", &Scheduler::release_outputs)
      .def("draft_candidates", &Scheduler::draft_candidates,
           "Running sequences that may get drafts for the next step (decode-ready, nothing in flight).")
      .def("may_draft", &Scheduler::may_draft,
           "Whether a running sequence may draft now or, with a token in flight, at the next step.")
      .def("set_drafts", &Scheduler::set_drafts, py::arg("seq"), py::arg("drafts"),
           "Sets a candidate's draft tokens for the next schedule() (ValueError naming a bad one).")
      .def(
          "propose_ngram",
          [](Scheduler &s, int k, int min_n, int max_n) {
            if (k < 1 || min_n < 1 || max_n < min_n)
              throw py::value_error("propose_ngram: needs k >= 1 and 1 <= min_n <= max_n");
            return s.propose_ngram(k, min_n, max_n);
          },
          py::arg("k"), py::arg("min_n"), py::arg("max_n"),
          "Prompt-lookup drafts for every candidate; returns how many got some.")
      .def("set_draft_backoff", &Scheduler::set_draft_backoff, py::arg("max_misses"), py::arg("pause_tokens"),
           py::arg("skip_requests") = false,
           "Draft lengths follow what verification keeps, and a sequence whose last max_misses verification\n"
           "steps kept no draft pauses drafting for its next pause_tokens tokens (max_misses 0: off);\n"
           "skip_requests: new requests start without drafting while earlier ones kept too few drafts.")
      .def(
          "draft_limit",
          [](const Scheduler &s, const std::shared_ptr<Sequence> &seq, int k) {
            if (!seq) throw py::value_error("draft_limit: seq is None");
            return s.draft_limit(*seq, k);
          },
          py::arg("seq"), py::arg("k"),
          "How many drafts to propose for a draft candidate now: at most k, within its acceptance back-off\n"
          "and what it may still append.")
      .def("reset_prefix_cache", &Scheduler::reset_prefix_cache,
           "Forgets every cached prefix; False (nothing forgotten) while a sequence holds blocks.")
      .def("discard_unprocessed", &Scheduler::discard_unprocessed)
      .def("has_unfinished_seqs", &Scheduler::has_unfinished_seqs)
      .def("get_sequence", &Scheduler::get_sequence, py::arg("request_id"))
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("num_free_blocks", [](const Scheduler &s) { return s.block_manager().num_free_blocks(); })
      .def_property_readonly("num_usable_blocks",
                             [](const Scheduler &s) { return s.block_manager().num_usable_blocks(); })
      .def_property_readonly("kv_cache_usage",
                             [](const Scheduler &s) {
                               const auto &b = s.block_manager();
                               return 1.0 - static_cast<double>(b.num_free_blocks()) / b.num_usable_blocks();
                             })
      .def("block_ref_count",
           [](const Scheduler &s, int b) {
             const int n = s.block_manager().num_blocks();
             if (b < 0 || b >= n)
               throw py::index_error("block_ref_count: block " + std::to_string(b) + " is outside [0, " +
                                     std::to_string(n) + ")");
             return s.block_manager().ref_count(b);
           },
           py::arg("block"))
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("max_seq_len", &Scheduler::max_seq_len,
                             "The longest a sequence may grow: max_model_len, or what the whole KV cache holds "
                             "(plus the last sampled token) if less.")
      .def_property_readonly("step_id", &Scheduler::step_id)
      .def_property_readonly("stats", [](const Scheduler &s) {
        const auto &st = s.stats();
        py::dict d;
        d["num_preemptions"] = st.num_preemptions;
        d["prefix_query_tokens"] = st.prefix_query_tokens;
        d["prefix_hit_tokens"] = st.prefix_hit_tokens;
        d["prompt_tokens"] = st.prompt_tokens;
        d["generation_tokens"] = st.generation_tokens;
        d["spec_decode_num_drafts"] = st.spec_num_drafts;
        d["spec_decode_num_draft_tokens"] = st.spec_num_draft_tokens;
        d["spec_decode_num_accepted_tokens"] = st.spec_num_accepted_tokens;
        d["spec_decode_num_accepted_tokens_per_pos"] = st.spec_accepted_per_pos;
        d["spec_decode_num_skipped_requests"] = st.spec_skipped_requests;
        d["encoder_budget_cuts"] = st.encoder_budget_cuts;
        return d;
      });
}

}  // namespace

namespace deepinfer {
void bind_sequence(py::module_ &m);  // csrc/engine/bindings_outputs.cpp
void bind_outputs(py::module_ &m);  // csrc/engine/bindings_outputs.cpp
void bind_kernels(py::module_ &m);  // csrc/kernels/bindings_kernels.cpp
void bind_packed_kernels(py::module_ &m);  // csrc/kernels/bindings_packed.cpp
void bind_bf16_kernels(py::module_ &m);    // csrc/kernels/bindings_bf16.cpp
void bind_moe(py::module_ &m);  // csrc/kernels/bindings_moe.cpp
void bind_decode(py::module_ &m);  // csrc/kernels/bindings_decode.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepinfer-dp C++ core: sequences, scheduler, paged KV blocks, output pool, CPU decode attention";
  bind_sequence(m);
  bind_outputs(m);
  bind_scheduler_output(m);
  bind_scheduler(m);
  m.def("ngram_propose", &ngram_propose, py::arg("tokens"), py::arg("k"), py::arg("min_n"), py::arg("max_n"),
        "Prompt lookup: up to k tokens that followed the latest earlier occurrence of the history's last n\n"
        "tokens (largest n in [min_n, max_n] first); empty when no suffix recurs.");
  bind_kernels(m);
  bind_packed_kernels(m);
  bind_bf16_kernels(m);
  bind_moe(m);
  bind_decode(m);
}
