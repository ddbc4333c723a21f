#include "runner_api.h"

#include <iterator>
#include <utility>

#include <pybind11/gil_safe_call_once.h>

namespace ortbridge {
namespace {

// (name in ortbridge._kernel.runner, where it goes)
constexpr std::pair<const char*, py::object RunnerApi::*> kRunnerNames[] = {
    {"ForwardNode", &RunnerApi::forward_node},
    {"BackwardNode", &RunnerApi::backward_node},
    {"format_exception", &RunnerApi::format_exception},
    {"_from_dlpack", &RunnerApi::from_dlpack},
    {"_to_dlpack", &RunnerApi::to_dlpack},
    {"_is_grad_enabled", &RunnerApi::is_grad_enabled},
    {"_set_grad_enabled", &RunnerApi::set_grad_enabled},
    {"_functorch_active", &RunnerApi::functorch_active},
    {"_node_owner", &RunnerApi::node_owner},
    {"_own_borrowed_attributes", &RunnerApi::own_borrowed_attributes},
    {"_pop_saved_hooks", &RunnerApi::pop_saved_hooks},
    {"_kept_from_borrowed", &RunnerApi::kept_from_borrowed},
    {"Tensor", &RunnerApi::tensor_class},
};
constexpr const char* kPushSavedHooks = "_push_saved_hooks";

// (name on a ForwardNode or BackwardNode, where it goes)
constexpr std::pair<const char*, py::str RunnerApi::*> kNodeNames[] = {
    {"func", &RunnerApi::func},
    {"run", &RunnerApi::run},
    {"direct", &RunnerApi::direct},
    {"result", &RunnerApi::result},
    {"use_stream", &RunnerApi::use_stream},
    {"restore_stream", &RunnerApi::restore_stream},
    {"copy_into", &RunnerApi::copy_into},
    {"fill", &RunnerApi::fill},
};

// (field of the runner's DirectCall, where it goes)
constexpr std::pair<const char*, py::str RunnerApi::*> kDirectCallNames[] = {
    {"call", &RunnerApi::direct_call},
    {"args", &RunnerApi::direct_args},
    {"tensor_positions", &RunnerApi::direct_tensor_positions},
};

template <class Table>
std::vector<std::string> NamesOf(const Table& table) {
  std::vector<std::string> names;
  for (const auto& entry : table) names.emplace_back(entry.first);
  return names;
}

}  // namespace

const RunnerApi& Runner() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<RunnerApi> api;
  return api
      .call_once_and_store_result([] {
        RunnerApi a;
        a.module = py::module_::import("ortbridge._kernel.runner");
        for (const auto& [name, member] : kRunnerNames) a.*member = a.module.attr(name);
        a.tensor_type = reinterpret_cast<PyTypeObject*>(a.tensor_class.ptr());
        a.push_saved_hooks = py::str(kPushSavedHooks);
        a.module.attr(a.push_saved_hooks);  // (declared: checked here too)
        for (const auto& [name, member] : kNodeNames) a.*member = py::str(name);
        for (const auto& [name, member] : kDirectCallNames) a.*member = py::str(name);
        a.version = py::str("_version");
        a.requires_grad = py::str("requires_grad");
        a.grad_fn = py::str("grad_fn");
        a.data_ptr = py::str("data_ptr");
        a.detach = py::str("detach");
        return a;
      })
      .get_stored();
}

std::vector<std::string> RunnerNames() {
  std::vector<std::string> names = NamesOf(kRunnerNames);
  names.emplace_back(kPushSavedHooks);
  return names;
}

std::vector<std::string> NodeNames() { return NamesOf(kNodeNames); }

std::vector<std::string> DirectCallNames() { return NamesOf(kDirectCallNames); }

}  // namespace ortbridge
