// Function.apply routed to Python while ortbridge records, exports or captures a model, where torch
// implements apply in C (torch 2.14 and later: `Function.apply` is `_C._FunctionBase.apply`).
//
// A model reaches apply in many ways (`Fn.apply`, a bound method stored before ortbridge was
// imported, an alias, a closure, functools.partial); every one of them calls the one PyMethodDef
// entry behind that classmethod descriptor, whose function CPython reads at each call. While
// routed, that entry's function is ours and passes each call to a Python `route(cls, args,
// kwargs)`; outside, torch's own function is back in place and a call costs what it did.
#pragma once

#include <Python.h>

namespace ortbridge {

// `descriptor` is torch's `_C._FunctionBase.__dict__["apply"]`. Raises (returns false with a Python
// error set) where it is not a classmethod descriptor of the expected calling convention, naming
// what differs: a torch release that changed it gets a clear error, not a wrong call.
bool RouteApply(PyObject* descriptor, PyObject* route);
bool UnrouteApply(PyObject* descriptor);
int ApplyRouted(PyObject* descriptor);  // 1 or 0; -1 with a Python error set

// A classmethod descriptor that calls torch's own apply function, routed or not: `unrouted(cls,
// *args, **kwargs)` is `cls.apply(*args, **kwargs)` as torch runs it.
PyObject* UnroutedApply(PyObject* descriptor);

}  // namespace ortbridge
