// Calling Python from the kernels: whether an interpreter can run them, calls through vectorcall
// (the runner's names: runner_api.h), what a Function returned, CPU tensors as DLPack, Python
// errors as text, references dropped from any thread. Everything here expects the GIL unless it
// says otherwise.
#pragma once

#include <pybind11/pybind11.h>

#include <initializer_list>
#include <string>

#include "runner_api.h"
#include "small_vector.h"

namespace ortbridge {

namespace py = pybind11;

// Throws std::runtime_error when no interpreter can run kernels (none, or it is exiting).
// Callable without the GIL.
void RequirePython();

// From interpreter exit on (Shutdown): RequirePython throws, ReleasePython leaks.
void StopCallingPython();

// f(), f(arg), f(a, b) through CPython's vectorcall (pybind11's calls build an argument tuple
// first); a Python error becomes py::error_already_set.
py::object Call(py::handle f, std::initializer_list<py::handle> args = {});

// What a Function's forward or backward returned, as a list of its items (borrowed): itself when
// it is a tensor, the items of a tuple, nothing for anything else (which the runner's checks take).
using ReturnedList = SmallVector<PyObject*, 8>;
ReturnedList ReturnedItems(PyObject* returned);

// `o` as a DLPack capsule, where it is a torch.Tensor on the CPU that torch exports; null
// otherwise (no Python error left set). (The capsule's device, not the tensor's `is_cpu`: one
// attribute read less a call.)
py::object ExportCpuTensor(PyObject* o);

// "ExceptionType: message" followed by the Python traceback.
std::string FormatPythonError(const py::error_already_set& error);

// Drops a reference from any thread: takes the GIL, or leaks the object when the interpreter is
// already gone (destroying it then would crash).
void ReleasePython(py::object& obj) noexcept;

}  // namespace ortbridge
