// pybind11 bindings of a request's side of deepinfer_dp._C: its limits and sequence, and the
// outputs the scheduler hands back (RequestOutput, StepOutputs). The module itself and the
// scheduler's bindings are in bindings.cpp.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <stdexcept>
#include <tuple>

#include "request_output.h"
#include "sequence.h"

namespace py = pybind11;

namespace deepinfer {
namespace {

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

}  // namespace

// max_tokens has no default here: Python's SamplingParams owns it (DEFAULT_MAX_TOKENS) and
// the engine always passes it.
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
           py::arg("max_tokens"), py::arg("min_tokens") = 0, py::arg("stop_token_ids") = std::vector<int32_t>{},
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
           py::arg("request_id"), py::arg("prompt_token_ids"), py::arg("limits"))
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
      .def(
          "set_image_spans",
          [](Sequence &s, const std::vector<std::tuple<int, int, int>> &spans) {
            s.image_spans.clear();
            int last_end = 0;
            for (const auto &[start, end, tokens] : spans) {
              if (start < last_end || end <= start || end > s.data.get_prompt_len() || tokens < 1)
                throw std::invalid_argument("set_image_spans: spans must be ascending, non-empty, within the "
                                            "prompt, and cost at least one token each");
              s.image_spans.push_back({start, end, tokens});
              last_end = end;
            }
          },
          py::arg("spans"),
          "The prompt's images as (start, end, encoder tokens), ascending; before add_sequence. The "
          "scheduler's encoder budget counts them.")
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

}  // namespace deepinfer
