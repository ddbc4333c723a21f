#include "run_scope.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

#include "context_id.h"
#include "saved_tensors.h"

namespace ortbridge {
namespace {
thread_local std::vector<RunScope> t_run_scopes;  // innermost last
thread_local int t_kernel_depth = 0;              // kernel calls holding a KernelGil on this thread

void SetGradMode(bool enabled) { Call(Runner().set_grad_enabled, {enabled ? Py_True : Py_False}); }
}  // namespace

PythonContextPool& Contexts() {
  static auto* pool = new PythonContextPool;  // never destroyed: entries must die under the GIL
  return *pool;
}

int64_t AddContext(SavedContext saved) {
  int64_t id = Contexts().Add(std::move(saved));
  if (!t_run_scopes.empty()) t_run_scopes.back().ids.push_back(id);
  return id;
}

void BeginRunScope() { t_run_scopes.push_back({{}, t_kernel_depth, std::nullopt, false}); }

void HeldFromNowOn(const std::vector<int64_t>& ids) {
  if (t_run_scopes.empty()) return;
  std::vector<int64_t>& made = t_run_scopes.back().ids;
  if (ids.size() <= made.size() && std::equal(ids.begin(), ids.end(), made.begin())) {
    made.erase(made.begin(), made.begin() + static_cast<std::ptrdiff_t>(ids.size()));
  }
}

RunScope* DirectRunScope() {
  if (t_run_scopes.empty() || t_run_scopes.back().kernel_depth + 1 != t_kernel_depth) return nullptr;
  return &t_run_scopes.back();
}

std::vector<int64_t> EndRunScope(bool failed) {
  if (t_run_scopes.empty()) return {};
  CloseOpenSaving(&t_run_scopes.back());
  RunScope scope = std::move(t_run_scopes.back());
  t_run_scopes.pop_back();
  if (scope.grad_mode) SetGradMode(*scope.grad_mode);
  std::vector<int64_t>& ids = scope.ids;
  std::vector<int64_t> unheld;
  if (failed) {
    for (int64_t id : ids) Contexts().Take(id);  // dropped here, GIL held
    return unheld;
  }
  if (ids.empty()) return unheld;
  const std::unordered_set<int64_t> held = HeldByContextIdTensors();
  for (int64_t id : ids) {
    if (Contexts().Contains(id) && held.count(id) == 0) unheld.push_back(id);
  }
  return unheld;
}

KernelGil::KernelGil(bool keeps_saving_hooks) {
  new (&storage_) py::gil_scoped_acquire();
  ++t_kernel_depth;
  if (!keeps_saving_hooks) CloseOpenSaving(DirectRunScope());
}

KernelGil::~KernelGil() {
  --t_kernel_depth;
  if (!InterpreterFinalizing()) reinterpret_cast<py::gil_scoped_acquire*>(&storage_)->~gil_scoped_acquire();
}

py::object CallWithGradMode(py::handle callable, const py::tuple& args, bool grad_enabled) {
  const bool was_enabled = Call(Runner().is_grad_enabled).ptr() == Py_True;
  // A kernel that a run scope's session calls directly leaves the mode it set to the next
  // kernel, and the scope puts back the caller's: a graph of inference nodes switches once a run,
  // not twice a node. Elsewhere (no scope; a session run by a Function, inside another call) the
  // mode is restored after the call.
  RunScope* scope = DirectRunScope();
  const bool switched = was_enabled != grad_enabled;
  if (switched) {
    if (scope && !scope->grad_mode) scope->grad_mode = was_enabled;
    SetGradMode(grad_enabled);
  }
  PyObject* returned = PyObject_Call(callable.ptr(), args.ptr(), nullptr);
  std::optional<py::error_already_set> error;
  if (!returned) error.emplace();  // (taken off the interpreter before grad mode is restored)
  if (switched && !scope) SetGradMode(was_enabled);
  if (error) throw *error;
  return py::reinterpret_steal<py::object>(returned);
}

void Shutdown() {
  auto entries = Contexts().TakeAll();
  entries.clear();  // GIL held: called from atexit
  StopCallingPython();
}

}  // namespace ortbridge
