// A session run's scope on this thread: the contexts its kernels made (the context pool), the
// kernel calls inside it (KernelGil holds the GIL for one), torch's grad mode and saved-tensor hooks
// it puts back at its end; and the pool's end at interpreter exit. Everything here expects the GIL
// unless it says otherwise.
#pragma once

#include <pybind11/pybind11.h>

#include <new>
#include <optional>
#include <vector>

#include "ort_util.h"
#include "pool.h"
#include "python_call.h"
#include "small_vector.h"

namespace ortbridge {

// What a training-mode forward keeps for its backward: the autograd context (None when no output
// needed a gradient), the Function that made it (only its backward may take it), and the types
// and shapes of that call's tensor inputs and outputs (in place for up to two of each: the pool
// entry is then the context's one allocation).
struct SavedContext {
  py::object ctx;
  // What keeps ctx's autograd node alive, where ctx does not own it (torch 2.12 and older: see
  // torch_private.CONTEXT_OWNS_NODE); null elsewhere.
  py::object node_owner;
  const PyObject* function = nullptr;
  SmallVector<TensorMeta, 2> inputs;
  SmallVector<TensorMeta, 2> outputs;
};

using PythonContextPool = ContextPool<SavedContext>;
PythonContextPool& Contexts();

// Adds a context to the pool, remembering it in this thread's innermost run scope.
int64_t AddContext(SavedContext saved);

// A run scope covers one session run on this thread (ortbridge.InferenceSession opens one), so
// that no context outlives every reference to its id: a run which fails releases the contexts it
// created (their ids never reached the caller); a run which succeeds returns the ids of those
// still live and not held by a context-id tensor, which the caller keeps only if the run's outputs
// hold them. Scopes nest, as a Function may run a session itself. Contexts created on other
// threads (ORT's parallel executor) are not covered. A scope's end also puts back torch's grad
// mode as it was at its start (see CallWithGradMode) and pops the saved-tensor hooks its training
// forwards left pushed (see SavingScope).
void BeginRunScope();
std::vector<int64_t> EndRunScope(bool failed);

// Ids that a context-id tensor now holds (NewContextIdsCapsule) need no check at the end of the
// innermost run scope: they leave its list when they are the first it made, as a forward graph's
// saved contexts are (training/session.py), at no cost per id. (Any others stay listed; the end
// checks them as before.)
void HeldFromNowOn(const std::vector<int64_t>& ids);

struct RunScope {
  std::vector<int64_t> ids;       // the contexts its kernels made
  int kernel_depth = 0;           // the kernel calls open on this thread when it began
  std::optional<bool> grad_mode;  // torch's grad mode at its start, once a kernel changed it
  bool saving_open = false;       // a training forward left torch's saved-tensor hooks pushed (SavingScope)
};

// The innermost run scope on this thread when the kernel now running is one that the scope's
// session called directly; null otherwise (no scope, or a kernel inside a Function's call).
RunScope* DirectRunScope();

// Holds the GIL for a kernel call, as py::gil_scoped_acquire does, except when the call is being
// unwound because CPython is ending this (daemon) thread at interpreter exit: CPython has freed
// the thread's state by then, so releasing it would touch freed memory (ASan showed it). The
// process is exiting; the state is left as it is.
class KernelGil {
 public:
  // (Also counts the kernel calls open on this thread: see DirectRunScope.) A kernel that keeps
  // saved-tensor hooks left pushed is a direct training forward; any other pops them (SavingScope).
  explicit KernelGil(bool keeps_saving_hooks = false);
  KernelGil(const KernelGil&) = delete;
  KernelGil& operator=(const KernelGil&) = delete;
  ~KernelGil();

 private:
  static bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
  }
  alignas(py::gil_scoped_acquire) unsigned char storage_[sizeof(py::gil_scoped_acquire)];
};

// callable(*args) with torch's grad mode set to `grad_enabled`, and restored after it, also when
// it raises (then py::error_already_set); for a kernel of the session that the innermost run
// scope runs, restored when that scope ends instead.
py::object CallWithGradMode(py::handle callable, const py::tuple& args, bool grad_enabled);

// Called once at interpreter exit: drops every live context and stops kernels from calling in.
void Shutdown();

}  // namespace ortbridge
