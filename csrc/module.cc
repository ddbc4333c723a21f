// The Python module ortbridge._C. The same shared library is the ORT custom-op library: when ORT
// loads it by path it gets this already-loaded copy, so kernels and Python share one context pool.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "context_id.h"
#include "element_types.h"
#include "kernel_io.h"
#include "proxy.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ortbridge kernel library: PythonOp and PythonOpGrad for ONNX Runtime";
  m.def("context_pool_size", [] { return ortbridge::Contexts().Size(); },
        "Number of live autograd contexts (forwards in training mode whose backward has not run).");
  m.def(
      "release_context",
      [](int64_t id) {
        auto saved = ortbridge::Contexts().Take(id);
        return saved.has_value();
      },
      py::arg("context_id"), "Drops a context whose backward will never run. Returns whether it was live.");
  m.def(
      "context_id_capsule",
      [] {
        PyObject* capsule = ortbridge::NewContextIdCapsule();
        if (!capsule) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(capsule);
      },
      "A DLPack capsule over a 0-d int64 tensor for a forward session to write a context id into; "
      "freeing the tensor releases that context unless a backward took it.");
  m.def(
      "element_types",
      [] {
        py::dict types;
        for (const ortbridge::ElementType& t : ortbridge::kElementTypes) types[py::int_(int(t.onnx))] = t.name;
        return types;
      },
      "The ONNX element types that cross to torch: {ONNX TensorProto type: torch dtype name}.");
  m.def("skipped_output_copies", &ortbridge::SkippedOutputCopies,
        "Outputs written without a copy since the process started: the Function wrote in place into the "
        "buffer ONNX Runtime gave the output.");
  m.def("_begin_run", &ortbridge::BeginRunScope);
  m.def("_end_run", &ortbridge::EndRunScope, py::arg("failed"),
        "Closes this thread's run scope; returns the ids of the contexts the run left live that no "
        "context-id tensor holds (the caller releases those its outputs do not hold).");
  m.def("_shutdown", &ortbridge::Shutdown);
  py::module_::import("atexit").attr("register")(m.attr("_shutdown"));
}
