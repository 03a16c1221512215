// pybind11 bindings: deepinfer_dp._C. Arrays cross as NumPy views over the C++ buffers,
// kept alive by the Python object that owns them; nothing here links against PyTorch.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
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

py::object last_token_or_none(const RequestOutputData &d) {
  // A final output made by abort()/finish_request() carries no new token.
  return d.token_ids.empty() ? py::object(py::none()) : py::object(py::int_(d.token_ids.back()));
}

py::object logprob_or_none(const RequestOutputData &d) {
  return d.has_logprob ? py::object(py::float_(d.logprob)) : py::object(py::none());
}

// {token id: logprob} of n alternatives, best first (dicts keep insertion order).
py::dict top_dict(const int32_t *ids, const float *logprobs, size_t n) {
  py::dict d;
  for (size_t j = 0; j < n; ++j) d[py::int_(ids[j])] = py::float_(logprobs[j]);
  return d;
}

// One dict per token of the output; None when the request asked for no alternatives.
py::object top_logprobs_or_none(const RequestOutputData &d) {
  if (d.top_token_ids.empty()) return py::none();
  py::list per_token;
  per_token.append(top_dict(d.top_token_ids.data(), d.top_logprobs.data(), d.top_token_ids.size()));
  return std::move(per_token);
}

// vLLM's shape: one entry per prompt token, None for the first (nothing precedes it).
py::object prompt_logprobs_or_none(const RequestOutputData &d) {
  if (!d.has_prompt_logprobs) return py::none();
  py::list out;
  out.append(py::none());
  for (float lp : d.prompt_logprobs) out.append(py::float_(lp));
  return std::move(out);
}

py::object prompt_top_logprobs_or_none(const RequestOutputData &d) {
  if (!d.has_prompt_logprobs || d.prompt_top_k == 0) return py::none();
  py::list out;
  out.append(py::none());
  const size_t k = static_cast<size_t>(d.prompt_top_k);
  for (size_t p = 0; p < d.prompt_logprobs.size(); ++p)
    out.append(top_dict(d.prompt_top_token_ids.data() + p * k, d.prompt_top_logprobs.data() + p * k, k));
  return std::move(out);
}

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

void set_top_logprobs(StepOutputs &s, const I64Array &ids, const F32Array &logprobs, const I32Array &row_k) {
  if (ids.ndim() != 2 || logprobs.ndim() != 2 || ids.shape(0) != logprobs.shape(0) ||
      ids.shape(1) != logprobs.shape(1))
    throw std::invalid_argument("set_top_logprobs: ids and logprobs must both be [num_rows, k]");
  if (row_k.ndim() != 1 || row_k.shape(0) != ids.shape(0))
    throw std::invalid_argument("set_top_logprobs: row_k must be [num_rows]");
  s.set_top_logprobs(ids.data(), logprobs.data(), static_cast<size_t>(ids.shape(0)), static_cast<int>(ids.shape(1)),
                     row_k.data());
}

RequestOutput with_prompt_logprobs(const RequestOutput &o, const F32Array &logprobs, const I64Array &top_ids,
                                   const F32Array &top_logprobs) {
  if (logprobs.ndim() != 1) throw std::invalid_argument("with_prompt_logprobs: logprobs must be 1-D");
  if (top_ids.ndim() != 2 || top_logprobs.ndim() != 2 || top_ids.shape(0) != logprobs.shape(0) ||
      top_logprobs.shape(0) != logprobs.shape(0) || top_ids.shape(1) != top_logprobs.shape(1))
    throw std::invalid_argument("with_prompt_logprobs: top ids and logprobs must be [len(logprobs), k]");
  std::vector<int32_t> ids(top_ids.data(), top_ids.data() + top_ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    if (top_ids.data()[i] < 0 || top_ids.data()[i] > INT32_MAX)
      throw std::invalid_argument("with_prompt_logprobs: token id outside int32");
  return o.clone_with_prompt_logprobs(std::vector<float>(logprobs.data(), logprobs.data() + logprobs.size()),
                                      static_cast<int>(top_ids.shape(1)), std::move(ids),
                                      std::vector<float>(top_logprobs.data(), top_logprobs.data() + top_logprobs.size()));
}

void bind_sequence(py::module_ &m) {
  py::enum_<SequenceStatus>(m, "SequenceStatus")
      .value("WAITING", SequenceStatus::WAITING)
      .value("RUNNING", SequenceStatus::RUNNING)
      .value("PREEMPTED", SequenceStatus::PREEMPTED)
      .value("FINISHED_STOPPED", SequenceStatus::FINISHED_STOPPED)
      .value("FINISHED_LENGTH", SequenceStatus::FINISHED_LENGTH)
      .value("FINISHED_ABORTED", SequenceStatus::FINISHED_ABORTED);

  py::class_<SequenceLimits>(m, "SequenceLimits")
      .def(py::init([](int max_tokens, int min_tokens, std::vector<int32_t> stop_token_ids, int32_t eos_token_id,
                       bool ignore_eos, bool read_prefix_cache, bool allow_drafts) {
             return SequenceLimits{max_tokens,  min_tokens, std::move(stop_token_ids), eos_token_id,
                                   ignore_eos, read_prefix_cache, allow_drafts};
           }),
           py::arg("max_tokens") = 16, py::arg("min_tokens") = 0, py::arg("stop_token_ids") = std::vector<int32_t>{},
           py::arg("eos_token_id") = -1, py::arg("ignore_eos") = false, py::arg("read_prefix_cache") = true,
           py::arg("allow_drafts") = true)
      .def_readwrite("max_tokens", &SequenceLimits::max_tokens)
      .def_readwrite("min_tokens", &SequenceLimits::min_tokens)
      .def_readwrite("stop_token_ids", &SequenceLimits::stop_token_ids)
      .def_readwrite("eos_token_id", &SequenceLimits::eos_token_id)
      .def_readwrite("ignore_eos", &SequenceLimits::ignore_eos)
      .def_readwrite("read_prefix_cache", &SequenceLimits::read_prefix_cache)
      .def_readwrite("allow_drafts", &SequenceLimits::allow_drafts);

  py::class_<SequenceData>(m, "SequenceData")
      .def("get_len", &SequenceData::get_len)
      .def("get_prompt_len", &SequenceData::get_prompt_len)
      .def("get_output_len", &SequenceData::get_output_len)
      .def("get_last_token_id", &SequenceData::get_last_token_id)
      .def("get_token_ids", &SequenceData::get_token_ids)
      .def("get_output_token_ids", [](const SequenceData &d) {
        const auto &t = d.get_token_ids();
        return std::vector<int32_t>(t.begin() + d.get_prompt_len(), t.end());
      });

  py::class_<Sequence, std::shared_ptr<Sequence>>(m, "Sequence")
      .def(py::init([](std::string request_id, std::vector<int32_t> prompt_token_ids, SequenceLimits limits) {
             return std::make_shared<Sequence>(std::move(request_id), std::move(prompt_token_ids), std::move(limits));
           }),
           py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("limits") = SequenceLimits{})
      .def_readonly("seq_id", &Sequence::seq_id)
      .def_readonly("request_id", &Sequence::request_id)
      .def_readonly("data", &Sequence::data, py::return_value_policy::reference_internal)
      .def_property_readonly("limits", [](const Sequence &s) { return s.limits; })  // a copy: limits are fixed
      .def_readonly("status", &Sequence::status)
      .def_property_readonly("finish_reason", [](const Sequence &s) { return finish_reason_name(s.status); })
      .def_property_readonly("is_finished", &Sequence::is_finished)
      .def_readonly("arrival_time", &Sequence::arrival_time)
      .def_readonly("num_computed", &Sequence::num_computed)
      .def_readonly("num_processed", &Sequence::num_processed)
      .def_readonly("num_pending", &Sequence::num_pending)
      .def_readonly("num_cached_tokens", &Sequence::num_cached_tokens)
      .def_readonly("num_preemptions", &Sequence::num_preemptions)
      .def_readonly("draft_token_ids", &Sequence::draft_token_ids)
      .def_readonly("block_table", &Sequence::block_table);
}

void bind_outputs(py::module_ &m) {
  py::register_exception<ReleasedOutputError>(m, "ReleasedOutputError", PyExc_RuntimeError);

  py::class_<RequestOutput>(m, "RequestOutput")
      .def_property_readonly("request_id", [](const RequestOutput &o) { return o.data().request_id; })
      .def_property_readonly("seq_id", [](const RequestOutput &o) { return o.data().seq_id; })
      .def_property_readonly("token_ids", [](const RequestOutput &o) { return o.data().token_ids; })
      .def_property_readonly("token_id", [](const RequestOutput &o) { return last_token_or_none(o.data()); })
      .def_property_readonly("finished", [](const RequestOutput &o) { return o.data().finished; })
      .def_property_readonly("status", [](const RequestOutput &o) { return o.data().status; })
      .def_property_readonly("finish_reason",
                             [](const RequestOutput &o) -> py::object {
                               const char *r = finish_reason_name(o.data().status);
                               return *r ? py::object(py::str(r)) : py::object(py::none());
                             })
      .def_property_readonly("prompt_len", [](const RequestOutput &o) { return o.data().prompt_len; })
      .def_property_readonly("output_len", [](const RequestOutput &o) { return o.data().output_len; })
      .def_property_readonly("logprob", [](const RequestOutput &o) { return logprob_or_none(o.data()); })
      .def_property_readonly("top_logprobs", [](const RequestOutput &o) { return top_logprobs_or_none(o.data()); },
                             "Per token: {token id: logprob} of the k most likely tokens, best first; "
                             "None unless SamplingParams.logprobs > 0.")
      .def_property_readonly("prompt_logprobs",
                             [](const RequestOutput &o) { return prompt_logprobs_or_none(o.data()); },
                             "Per prompt token its logprob (None for the first); set on a request's first "
                             "output when SamplingParams.prompt_logprobs is set.")
      .def_property_readonly("prompt_top_logprobs",
                             [](const RequestOutput &o) { return prompt_top_logprobs_or_none(o.data()); },
                             "Per prompt token {token id: logprob} of the k most likely (None for the first).")
      .def("with_prompt_logprobs", &with_prompt_logprobs, py::arg("logprobs"), py::arg("top_ids"),
           py::arg("top_logprobs"),
           "An owned copy carrying prompt logprobs: logprobs [prompt_len - 1], top ids/logprobs [prompt_len - 1, k].")
      .def_property_readonly("is_valid", &RequestOutput::is_valid)
      .def_property_readonly("is_pooled", &RequestOutput::is_pooled)
      .def("clone", &RequestOutput::clone, "An owned copy that stays valid after the pool is released.")
      .def("clone_finished",
           [](const RequestOutput &o, SequenceStatus status) {
             if (!is_finished_status(status))
               throw py::value_error("clone_finished: status must be a finished one (FINISHED_*)");
             return o.clone_finished(status);
           },
           py::arg("status"),
           "An owned copy marked finished with `status` (e.g. a stop string matched).")
      .def("__repr__", [](const RequestOutput &o) {
        if (!o.is_valid()) return std::string("RequestOutput(<released>)");
        const auto &d = o.data();
        const std::string token = py::repr(last_token_or_none(d));
        return "RequestOutput(request_id='" + d.request_id + "', token_id=" + token +
               ", finished=" + (d.finished ? "True" : "False") + ", finish_reason='" + finish_reason_name(d.status) +
               "', output_len=" + std::to_string(d.output_len) + ")";
      });

  py::class_<StepOutputs>(m, "StepOutputs")
      .def("__len__", &StepOutputs::size)
      .def("__getitem__", [](const StepOutputs &s, py::ssize_t i) {
        if (i < 0) i += static_cast<py::ssize_t>(s.size());
        if (i < 0 || static_cast<size_t>(i) >= s.size()) throw py::index_error("StepOutputs index out of range");
        return s.at(static_cast<size_t>(i));
      })
      .def("set_top_logprobs", &set_top_logprobs, py::arg("ids"), py::arg("logprobs"), py::arg("row_k"),
           "Gives every output its sample row's top alternatives (ids/logprobs [rows, k]; row r keeps row_k[r]).");
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
                       int vocab_size, bool enable_prefix_caching) {
             return SchedulerConfig{max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
                                    max_model_len, vocab_size, enable_prefix_caching};
           }),
           py::arg("max_num_seqs") = 256, py::arg("max_num_batched_tokens") = 2048, py::arg("block_size") = 16,
           py::arg("num_blocks") = 1024, py::arg("max_model_len") = 2048, py::arg("vocab_size") = 32000,
           py::arg("enable_prefix_caching") = true)
      .def_readonly("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readonly("block_size", &SchedulerConfig::block_size)
      .def_readonly("num_blocks", &SchedulerConfig::num_blocks)
      .def_readonly("max_model_len", &SchedulerConfig::max_model_len)
      .def_readonly("vocab_size", &SchedulerConfig::vocab_size)
      .def_readonly("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching);

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
        return d;
      });
}

}  // namespace

namespace deepinfer {
void bind_kernels(py::module_ &m);  // csrc/kernels/bindings_kernels.cpp
void bind_packed_kernels(py::module_ &m);  // csrc/kernels/bindings_packed.cpp
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
  bind_moe(m);
  bind_decode(m);
}
