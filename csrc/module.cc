// The Python module ortbridge._C. The same shared library is the ORT custom-op library: when ORT
// loads it by path it gets this already-loaded copy, so kernels and Python share one context pool.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "apply_route.h"
#include "attribute_map.h"
#include "attributes.h"
#include "context_id.h"
#include "custom_op.h"
#include "element_types.h"
#include "kernel_io.h"
#include "run_scope.h"
#include "runner_api.h"
#include "saved_tensors.h"

namespace py = pybind11;

namespace {

PyObject* RefuseNew(PyTypeObject* type, PyObject*, PyObject*) {
  PyErr_Format(PyExc_TypeError, "%s objects are made by the ortbridge kernel library only", type->tp_name);
  return nullptr;
}

// For the classes below, whose objects only the kernel library makes (pybind11 makes its objects
// with tp_alloc, not tp_new): Python reads them, and cannot make or copy one. pybind11's __new__
// allocates the C++ object without constructing it, so a bare object (cls.__new__(cls), as
// copyreg makes them) read uninitialized memory: a std::vector copied from garbage. And where a
// class has no __reduce__, pickle protocols 0 and 1 call pybind11's base type, which throws
// through C: std::terminate.
template <class T>
void MadeByKernelsOnly(py::class_<T>& cls) {
  const std::string name = "ortbridge._C." + cls.attr("__qualname__").template cast<std::string>();
  cls.def("__reduce__", [name](const py::object&) -> py::object {
    throw py::type_error(name + " cannot be copied or pickled: the kernel library makes it for one node");
  });
  cls.def_static("__new__", [name](const py::args&, const py::kwargs&) -> py::object {
    throw py::type_error(name + " objects are made by the ortbridge kernel library only");
  });
  // (after __new__, whose assignment set tp_new to call it): cls() and base.__new__(cls) refused too
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  type->tp_new = RefuseNew;
  PyType_Modified(type);
}

// What _C._kernels() says of each custom op (tests/python/test_device_path.py).
struct KernelDescription {
  std::string op, provider;
  bool via_torch = false;
  std::vector<std::string> input_memory;
};

// The kernel<->runner contract: the parsed node, read-only, from which ortbridge._kernel.runner builds
// its node (every Python value of a constant is made there).
void BindLayouts(py::module_& m) {
  using ortbridge::BackwardLayout;
  using ortbridge::Constant;
  using ortbridge::ForwardLayout;
  py::class_<Constant> constant(m, "Constant",
                                "One constant argument of Function.apply, fixed in the graph.");
  py::enum_<Constant::Kind>(constant, "Kind")
      .value("BOOL", Constant::Kind::kBool)
      .value("INT", Constant::Kind::kInt)
      .value("FLOAT", Constant::Kind::kFloat)
      .value("BOOL_TUPLE", Constant::Kind::kBoolTuple)
      .value("INT_TUPLE", Constant::Kind::kIntTuple)
      .value("FLOAT_TUPLE", Constant::Kind::kFloatTuple)
      .value("OBJECT", Constant::Kind::kObject)
      .value("LITERAL", Constant::Kind::kLiteral)
      // A value: pickled as Kind(int). (pybind11 gives enums no __reduce__: pickle protocols 0 and 1
      // reached std::terminate, as for the classes below.)
      .def("__reduce__", [](const py::object& self) {
        return py::make_tuple(py::type::of(self), py::make_tuple(py::int_(self)));
      });
  constant.def_readonly("kind", &Constant::kind)
      .def_readonly("position", &Constant::position)
      .def_readonly("ints", &Constant::ints)
      .def_readonly("floats", &Constant::floats);
  py::class_<ForwardLayout> forward(m, "ForwardLayout", "A PythonOp node's attributes, validated.");
  forward.def_readonly("func_name", &ForwardLayout::func_name)
      .def_readonly("input_convention", &ForwardLayout::input_convention)
      .def_readonly("training_mode", &ForwardLayout::training_mode)
      .def_readonly("safe_run_mode", &ForwardLayout::safe_run_mode)
      .def_readonly("requires_grad", &ForwardLayout::requires_grad)
      .def_readonly("tensor_positions", &ForwardLayout::tensor_positions)
      .def_readonly("constants", &ForwardLayout::constants)
      .def_readonly("literals", &ForwardLayout::literals)
      .def_readonly("output_tensor_types", &ForwardLayout::output_tensor_types)
      .def_readonly("in_place", &ForwardLayout::in_place);
  py::class_<BackwardLayout> backward(m, "BackwardLayout", "A PythonOpGrad node's attributes, validated.");
  backward.def_readonly("func_name", &BackwardLayout::func_name)
      .def_readonly("output_convention", &BackwardLayout::output_convention)
      .def_readonly("output_positions", &BackwardLayout::output_positions)
      .def_readonly("output_requires_grad", &BackwardLayout::output_requires_grad)
      .def_readonly("output_tensor_types", &BackwardLayout::output_tensor_types);
  MadeByKernelsOnly(constant);
  MadeByKernelsOnly(forward);
  MadeByKernelsOnly(backward);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ortbridge kernel library: PythonOp and PythonOpGrad for ONNX Runtime";
  BindLayouts(m);
  m.def(
      "context_pool_size", [] { return ortbridge::Contexts().Size(); },
      "Number of live autograd contexts (forwards in training mode whose backward has not run).");
  m.def(
      "release_context",
      [](int64_t id) {
        auto saved = ortbridge::Contexts().Take(id);
        return saved.has_value();
      },
      py::arg("context_id"), "Drops a context whose backward will never run. Returns whether it was live.");
  m.def(
      "context_ids_capsule",
      [](const py::buffer& ids) {
        // (a buffer, as a numpy view of the ids' tensor: no list of Python ints made)
        const py::buffer_info info = ids.request();
        if (info.ndim != 1 || info.itemsize != sizeof(int64_t) || info.strides[0] != info.itemsize ||
            (info.format != "q" && info.format != "l"))
          throw py::type_error("context ids: a 1-d contiguous buffer of int64, not format '" + info.format +
                               "'");
        const auto* data = static_cast<const int64_t*>(info.ptr);
        PyObject* capsule = ortbridge::NewContextIdsCapsule(std::vector<int64_t>(data, data + info.shape[0]));
        if (!capsule) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(capsule);
      },
      py::arg("context_ids"),
      "A DLPack capsule over a 1-d int64 tensor holding context ids; freeing the tensor releases "
      "each of those contexts that no backward took.");
  m.def(
      "element_types",
      [] {
        py::dict types;
        for (const ortbridge::ElementType& t : ortbridge::kElementTypes)
          types[py::int_(int(t.onnx))] = t.name;
        return types;
      },
      "The ONNX element types that cross to torch: {ONNX TensorProto type: torch dtype name}.");
  m.def("skipped_output_copies", &ortbridge::SkippedOutputCopies,
        "Outputs written without a copy since the process started: the Function wrote in place into the "
        "buffer ONNX Runtime gave the output.");
  py::class_<KernelDescription> kernel(m, "KernelDescription",
                                       "One custom op the library registers with ORT.");
  kernel.def_readonly("op", &KernelDescription::op)
      .def_readonly("provider", &KernelDescription::provider)
      .def_readonly("via_torch", &KernelDescription::via_torch, "Whether it takes the device path.")
      .def_readonly("input_memory", &KernelDescription::input_memory,
                    "Where ORT puts inputs 0 and 1: 'cpu' or 'default' (the provider's device).");
  MadeByKernelsOnly(kernel);
  m.def(
      "_kernels",
      [] {
        using ortbridge::Backend;
        std::vector<KernelDescription> kernels;
        for (Backend backend : {Backend::kCpu, Backend::kCuda, Backend::kCpuViaTorch}) {
          for (const OrtCustomOp* op : {ortbridge::PythonOp(backend), ortbridge::PythonOpGrad(backend)}) {
            const char* provider = op->GetExecutionProviderType(op);
            KernelDescription& k = kernels.emplace_back();
            k.op = op->GetName(op);
            k.provider = provider ? provider : "CPUExecutionProvider";
            k.via_torch = backend == Backend::kCpuViaTorch;
            for (size_t i = 0; i < 2; ++i)
              k.input_memory.push_back(op->GetInputMemoryType(op, i) == OrtMemTypeCPUInput ? "cpu"
                                                                                           : "default");
          }
        }
        return kernels;
      },
      "Every kernel of the library.");
  m.def(
      "parse_forward",
      [](std::map<std::string, int64_t> ints, std::map<std::string, std::string> strings,
         std::map<std::string, std::vector<int64_t>> int_lists,
         std::map<std::string, std::vector<float>> float_lists, size_t input_count, size_t output_count) {
        ortbridge::MapAttributes attributes;
        attributes.ints = std::move(ints);
        attributes.strings = std::move(strings);
        attributes.int_lists = std::move(int_lists);
        attributes.float_lists = std::move(float_lists);
        try {
          return ortbridge::ParseForward(attributes, input_count, output_count);
        } catch (const ortbridge::AttributeError& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("ints"), py::arg("strings"), py::arg("int_lists"), py::arg("float_lists"),
      py::arg("input_count"), py::arg("output_count"),
      "A PythonOp node's attributes (by ONNX attribute type), validated as the kernel does it: its "
      "ForwardLayout.");
  m.def("_lend_output", &ortbridge::LendOutput, py::arg("output"), py::arg("shape"),
        "In an inference PythonOp's call on the CPU, a DLPack capsule over ONNX Runtime's buffer for the "
        "call's "
        "output `output` (from 0) with `shape`, valid until the call returns: returned as that output, it is "
        "written without a copy. None in any other kernel call and outside one.");
  m.def("_begin_run", &ortbridge::BeginRunScope);
  m.def("_end_run", &ortbridge::EndRunScope, py::arg("failed"),
        "Closes this thread's run scope; returns the ids of the contexts the run left live that no "
        "context-id tensor holds (the caller releases those its outputs do not hold).");
  m.def(
      "_begin_saving",
      [](const std::vector<std::pair<uintptr_t, size_t>>& borrowed) {
        ortbridge::BorrowedBuffers buffers;
        for (const auto& [address, bytes] : borrowed) buffers.push_back({address, address + bytes});
        ortbridge::BeginSaving(std::move(buffers));
      },
      py::arg("borrowed"),
      "Until _end_saving, what a Function on this thread saves for backward from the buffers (address, "
      "bytes) is copied, anything else detached (torch's saved-tensor hooks).");
  m.def("_end_saving", &ortbridge::EndSaving);
  m.def(
      "_route_apply",
      [](const py::object& descriptor, const py::object& route) {
        if (!ortbridge::RouteApply(descriptor.ptr(), route.ptr())) throw py::error_already_set();
      },
      py::arg("descriptor"), py::arg("route"),
      "Until _unroute_apply, every call of torch's C Function.apply (`descriptor`) is `route(cls, args, "
      "kwargs)`.");
  m.def(
      "_unroute_apply",
      [](const py::object& descriptor) {
        if (!ortbridge::UnrouteApply(descriptor.ptr())) throw py::error_already_set();
      },
      py::arg("descriptor"));
  m.def(
      "_apply_routed",
      [](const py::object& descriptor) {
        const int routed = ortbridge::ApplyRouted(descriptor.ptr());
        if (routed < 0) throw py::error_already_set();
        return routed == 1;
      },
      py::arg("descriptor"));
  m.def(
      "_unrouted_apply",
      [](const py::object& descriptor) {
        PyObject* unrouted = ortbridge::UnroutedApply(descriptor.ptr());
        if (!unrouted) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(unrouted);
      },
      py::arg("descriptor"), "A classmethod descriptor calling torch's own apply, routed or not.");
  m.def(
      "_runner_names",
      [] {
        py::dict names;
        names["module"] = ortbridge::RunnerNames();
        names["node"] = ortbridge::NodeNames();
        names["direct_call"] = ortbridge::DirectCallNames();
        return names;
      },
      "The Python names the kernels call: {'module': of ortbridge._kernel.runner, 'node': of its node "
      "objects, 'direct_call': of a ForwardNode's DirectCall}.");
  m.def("_shutdown", &ortbridge::Shutdown);
  py::module_::import("atexit").attr("register")(m.attr("_shutdown"));
}
