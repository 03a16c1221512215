// pybind11 bindings: deepinfer_dp._C. Arrays cross as NumPy views over the C++ buffers,
// kept alive by the Python object that owns them; nothing here links against PyTorch.
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

// A NumPy view of `v` whose lifetime is tied to `owner`. It stays writable so that
// torch.from_numpy can wrap it without a copy; the step's arrays are the worker's to use.
template <typename T>
py::array view(const std::vector<T> &v, py::handle owner, std::vector<py::ssize_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<py::ssize_t>(v.size())};
  return py::array_t<T>(shape, v.data(), owner);
}

py::object logprob_or_none(const RequestOutputData &d) {
  return d.has_logprob ? py::object(py::float_(d.logprob)) : py::object(py::none());
}

void bind_sequence(py::module_ &m) {
  py::enum_<SequenceStatus>(m, "SequenceStatus")
      .value("WAITING", SequenceStatus::WAITING)
      .value("RUNNING", SequenceStatus::RUNNING)
      .value("SWAPPED", SequenceStatus::SWAPPED)
      .value("FINISHED_STOPPED", SequenceStatus::FINISHED_STOPPED)
      .value("FINISHED_LENGTH", SequenceStatus::FINISHED_LENGTH)
      .value("FINISHED_ABORTED", SequenceStatus::FINISHED_ABORTED);

  py::class_<SequenceLimits>(m, "SequenceLimits")
      .def(py::init([](int max_tokens, int min_tokens, std::vector<int32_t> stop_token_ids, int32_t eos_token_id,
                       bool ignore_eos) {
             return SequenceLimits{max_tokens, min_tokens, std::move(stop_token_ids), eos_token_id, ignore_eos};
           }),
           py::arg("max_tokens") = 16, py::arg("min_tokens") = 0, py::arg("stop_token_ids") = std::vector<int32_t>{},
           py::arg("eos_token_id") = -1, py::arg("ignore_eos") = false)
      .def_readwrite("max_tokens", &SequenceLimits::max_tokens)
      .def_readwrite("min_tokens", &SequenceLimits::min_tokens)
      .def_readwrite("stop_token_ids", &SequenceLimits::stop_token_ids)
      .def_readwrite("eos_token_id", &SequenceLimits::eos_token_id)
      .def_readwrite("ignore_eos", &SequenceLimits::ignore_eos);

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
      .def_readonly("limits", &Sequence::limits)
      .def_readonly("status", &Sequence::status)
      .def_property_readonly("finish_reason", [](const Sequence &s) { return finish_reason_name(s.status); })
      .def_property_readonly("is_finished", &Sequence::is_finished)
      .def_readonly("arrival_time", &Sequence::arrival_time)
      .def_readonly("num_computed", &Sequence::num_computed)
      .def_readonly("num_processed", &Sequence::num_processed)
      .def_readonly("num_pending", &Sequence::num_pending)
      .def_readonly("num_cached_tokens", &Sequence::num_cached_tokens)
      .def_readonly("num_preemptions", &Sequence::num_preemptions)
      .def_readonly("block_table", &Sequence::block_table);
}

void bind_outputs(py::module_ &m) {
  py::register_exception<ReleasedOutputError>(m, "ReleasedOutputError", PyExc_RuntimeError);

  py::class_<RequestOutput>(m, "RequestOutput")
      .def_property_readonly("request_id", [](const RequestOutput &o) { return o.data().request_id; })
      .def_property_readonly("seq_id", [](const RequestOutput &o) { return o.data().seq_id; })
      .def_property_readonly("token_ids", [](const RequestOutput &o) { return o.data().token_ids; })
      .def_property_readonly("token_id", [](const RequestOutput &o) { return o.data().token_ids.back(); })
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
      .def_property_readonly("is_valid", &RequestOutput::is_valid)
      .def_property_readonly("is_pooled", &RequestOutput::is_pooled)
      .def("clone", &RequestOutput::clone, "An owned copy that stays valid after the pool is released.")
      .def("clone_finished", &RequestOutput::clone_finished, py::arg("status"),
           "An owned copy marked finished with `status` (e.g. a stop string matched).")
      .def("__repr__", [](const RequestOutput &o) {
        if (!o.is_valid()) return std::string("RequestOutput(<released>)");
        const auto &d = o.data();
        return "RequestOutput(request_id='" + d.request_id + "', token_id=" + std::to_string(d.token_ids.back()) +
               ", finished=" + (d.finished ? "True" : "False") + ", finish_reason='" + finish_reason_name(d.status) +
               "', output_len=" + std::to_string(d.output_len) + ")";
      });

  py::class_<StepOutputs>(m, "StepOutputs")
      .def("__len__", &StepOutputs::size)
      .def("__getitem__", [](const StepOutputs &s, py::ssize_t i) {
        if (i < 0) i += static_cast<py::ssize_t>(s.size());
        if (i < 0 || static_cast<size_t>(i) >= s.size()) throw py::index_error("StepOutputs index out of range");
        return s.at(static_cast<size_t>(i));
      });
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
                               std::vector<std::string> ids;
                               for (size_t i = 0; i < o.seqs.size(); ++i)
                                 if (o.samples[i]) ids.push_back(o.seqs[i]->request_id);
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
      .def("abort", &Scheduler::abort, py::arg("request_id"))
      .def("finish_request", &Scheduler::finish_request, py::arg("request_id"), py::arg("status"))
      .def("release_outputs", &Scheduler::release_outputs)
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
      .def("block_ref_count", [](const Scheduler &s, int b) { return s.block_manager().ref_count(b); })
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("step_id", &Scheduler::step_id)
      .def_property_readonly("stats", [](const Scheduler &s) {
        const auto &st = s.stats();
        py::dict d;
        d["num_preemptions"] = st.num_preemptions;
        d["prefix_query_tokens"] = st.prefix_query_tokens;
        d["prefix_hit_tokens"] = st.prefix_hit_tokens;
        d["prompt_tokens"] = st.prompt_tokens;
        d["generation_tokens"] = st.generation_tokens;
        return d;
      });
}

}  // namespace

namespace deepinfer {
void bind_kernels(py::module_ &m);  // csrc/kernels/bindings_kernels.cpp
void bind_moe(py::module_ &m);  // csrc/kernels/bindings_moe.cpp
}

PYBIND11_MODULE(_C, m) {
  m.doc() = "deepinfer-dp C++ core: sequences, scheduler, paged KV blocks, output pool, CPU decode attention";
  bind_sequence(m);
  bind_outputs(m);
  bind_scheduler_output(m);
  bind_scheduler(m);
  bind_kernels(m);
  bind_moe(m);
}
