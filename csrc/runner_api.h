// The Python the kernels call: ortbridge._kernel.runner's names and the names they read off its node
// objects and off tensors, each declared once (kRunnerNames, kNodeNames in runner_api.cc; the
// runner's KERNEL_NAMES and NODE_NAMES say the same, which tests/python/test_layout.py checks
// through _C._runner_names) and resolved once. Everything here expects the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace ortbridge {

namespace py = pybind11;

struct RunnerApi {
  py::module_ module;  // ortbridge._kernel.runner
  // Its callables.
  py::object forward_node, backward_node;  // ForwardNode(layout, device), BackwardNode(layout, device)
  py::object format_exception;             // (exception, traceback) -> str
  py::object from_dlpack, to_dlpack, is_grad_enabled, set_grad_enabled, functorch_active;
  py::object node_owner;  // None where a context owns its autograd node
  py::object own_borrowed_attributes, pop_saved_hooks, kept_from_borrowed;
  py::object tensor_class;              // torch.Tensor
  PyTypeObject* tensor_type = nullptr;  // its type object
  py::str push_saved_hooks;             // (read off the module per call: benchmarks/step_memory.py wraps it)
  // What the kernels read off a node object.
  py::str func, run, direct, result, use_stream, restore_stream, copy_into, fill;
  // What they read off a ForwardNode's `direct` (a DirectCall).
  py::str direct_call, direct_args, direct_tensor_positions;
  // What they read off tensors (torch's names).
  py::str version, requires_grad, grad_fn, data_ptr, detach;
};

// ortbridge._kernel.runner's API, resolved on first use; a name the runner lacks is an AttributeError naming
// it.
const RunnerApi& Runner();

// The declared names: of the runner module, and of its node objects.
std::vector<std::string> RunnerNames();
std::vector<std::string> NodeNames();
std::vector<std::string> DirectCallNames();

}  // namespace ortbridge
