#include "apply_route.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace ortbridge {
namespace {

constexpr int kApplyFlags = METH_CLASS | METH_VARARGS | METH_KEYWORDS;

PyMethodDef* g_entry = nullptr;                   // torch's entry for apply, once seen
PyCFunctionWithKeywords g_torch_apply = nullptr;  // its function
PyObject* g_route = nullptr;                      // interception.py's router (kept for the process)
PyMethodDef g_unrouted{};                         // a copy of torch's entry, for UnroutedApply

PyObject* RoutedApply(PyObject* cls, PyObject* args, PyObject* kwargs) {
  // (a fresh dict where torch got none: the router may hand it on to code that changes it)
  PyObject* keywords = kwargs ? Py_NewRef(kwargs) : PyDict_New();
  if (!keywords) return nullptr;
  PyObject* result = PyObject_CallFunctionObjArgs(g_route, cls, args, keywords, nullptr);
  Py_DECREF(keywords);
  return result;
}

// torch's entry behind `descriptor`, checked to be what this code was written for.
PyMethodDef* Entry(PyObject* descriptor) {
  if (!PyObject_TypeCheck(descriptor, &PyClassMethodDescr_Type)) {
    PyErr_Format(
        PyExc_RuntimeError,
        "ortbridge: torch's _C._FunctionBase.apply is a %s, not a classmethod descriptor: this torch "
        "release implements Function.apply in a way ortbridge does not know",
        Py_TYPE(descriptor)->tp_name);
    return nullptr;
  }
  PyMethodDef* entry = reinterpret_cast<PyMethodDescrObject*>(descriptor)->d_method;
  if ((entry->ml_flags & ~METH_COEXIST) != kApplyFlags) {
    PyErr_Format(
        PyExc_RuntimeError,
        "ortbridge: torch's _C._FunctionBase.apply has calling convention flags 0x%x, where ortbridge "
        "knows 0x%x (METH_CLASS | METH_VARARGS | METH_KEYWORDS): this torch release changed how "
        "Function.apply is called",
        entry->ml_flags, kApplyFlags);
    return nullptr;
  }
  if (g_entry && entry != g_entry) {
    PyErr_SetString(PyExc_RuntimeError,
                    "ortbridge: torch's _C._FunctionBase.apply was replaced after it was routed");
    return nullptr;
  }
  if (!g_entry) {
    g_entry = entry;
    g_torch_apply = reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)()>(entry->ml_meth));
  }
  return entry;
}

// The entry is in torch's writable data in every release seen; made writable here (once, before
// its first change) should a build place it in memory that is read-only after relocation.
bool MakeWritable(PyMethodDef* entry) {
  static bool writable = false;
  if (writable) return true;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto field = reinterpret_cast<uintptr_t>(&entry->ml_meth);
  const uintptr_t start = field & ~(page - 1);
  if (mprotect(reinterpret_cast<void*>(start), field + sizeof(entry->ml_meth) - start,
               PROT_READ | PROT_WRITE) != 0) {
    PyErr_SetFromErrno(PyExc_OSError);
    return false;
  }
  return writable = true;
}

}  // namespace

bool RouteApply(PyObject* descriptor, PyObject* route) {
  PyMethodDef* entry = Entry(descriptor);
  if (!entry || !MakeWritable(entry)) return false;
  if (g_route == nullptr) g_route = Py_NewRef(route);
  if (route != g_route) {
    PyErr_SetString(PyExc_RuntimeError, "ortbridge: Function.apply is routed to one router per process");
    return false;
  }
  entry->ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(RoutedApply));
  return true;
}

int ApplyRouted(PyObject* descriptor) {
  PyMethodDef* entry = Entry(descriptor);
  if (!entry) return -1;
  return entry->ml_meth == reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(RoutedApply));
}

bool UnrouteApply(PyObject* descriptor) {
  PyMethodDef* entry = Entry(descriptor);
  if (!entry) return false;
  entry->ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(g_torch_apply));
  return true;
}

PyObject* UnroutedApply(PyObject* descriptor) {
  PyMethodDef* entry = Entry(descriptor);
  if (!entry) return nullptr;
  if (g_unrouted.ml_name == nullptr) {
    g_unrouted = *entry;
    g_unrouted.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(g_torch_apply));
  }
  return PyDescr_NewClassMethod(reinterpret_cast<PyDescrObject*>(descriptor)->d_type, &g_unrouted);
}

}  // namespace ortbridge
