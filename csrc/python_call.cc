#include "python_call.h"

#include <atomic>
#include <stdexcept>

#include "dlpack.h"

namespace ortbridge {
namespace {
std::atomic<bool> g_stopped{false};
}  // namespace

void RequirePython() {
  if (!Py_IsInitialized() || g_stopped.load()) {
    throw std::runtime_error(
        "no Python interpreter is running (ortbridge kernels call torch.autograd.Functions in this "
        "process's interpreter; it has exited or was never started)");
  }
}

void StopCallingPython() { g_stopped.store(true); }

py::object Call(py::handle f, std::initializer_list<py::handle> args) {
  static_assert(sizeof(py::handle) == sizeof(PyObject*), "a handle is its pointer");
  PyObject* returned =
      PyObject_Vectorcall(f.ptr(), reinterpret_cast<PyObject* const*>(args.begin()), args.size(), nullptr);
  if (!returned) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(returned);
}

ReturnedList ReturnedItems(PyObject* returned) {
  if (PyObject_TypeCheck(returned, Runner().tensor_type)) return {returned};
  ReturnedList items;
  if (PyTuple_CheckExact(returned)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(returned); ++i)
      items.push_back(PyTuple_GET_ITEM(returned, i));
  }
  return items;
}

py::object ExportCpuTensor(PyObject* o) {
  const RunnerApi& torch = Runner();
  if (!PyObject_TypeCheck(o, torch.tensor_type)) return {};
  PyObject* capsule = PyObject_Vectorcall(torch.to_dlpack.ptr(), &o, 1, nullptr);
  if (!capsule || !IsHostCapsule(capsule)) {
    PyErr_Clear();  // (torch refused it: a sparse or meta tensor; the runner's checks say so)
    Py_XDECREF(capsule);
    return {};
  }
  return py::reinterpret_steal<py::object>(capsule);
}

std::string FormatPythonError(const py::error_already_set& error) {
  try {
    return Runner().format_exception(error.value(), error.trace()).cast<std::string>();
  } catch (const std::exception&) {
    return error.what();
  }
}

void ReleasePython(py::object& obj) noexcept {
  if (!obj) return;
  if (!Py_IsInitialized() || g_stopped.load()) {
    obj.release();  // the interpreter is gone or going: leaking is the only safe choice
    return;
  }
  py::gil_scoped_acquire gil;
  obj = py::object();
}

}  // namespace ortbridge
