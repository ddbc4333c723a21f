#include "saved_tensors.h"

#include <algorithm>

#include <pybind11/gil_safe_call_once.h>

#include "run_scope.h"

namespace ortbridge {
namespace {

thread_local std::vector<BorrowedBuffers> t_borrowed;  // per open scope, innermost last

struct Hooks {
  py::object pack, unpack;
};

const Hooks& SavedTensorHooks();

// The pack hook: for a tensor whose data lies in one of the innermost scope's borrowed buffers,
// what the runner's _kept_from_borrowed keeps (a copy, or the buffer the graph run lent, or a
// view of it); the tensor detached otherwise. (Its data pointer, not its storage's: one call less.)
py::object Pack(py::handle t) {
  if (!t_borrowed.empty()) {
    const auto data = t.attr(Runner().data_ptr)().cast<uintptr_t>();
    const BorrowedBuffers& borrowed = t_borrowed.back();
    if (std::any_of(borrowed.begin(), borrowed.end(),
                    [&](const BorrowedBuffer& b) { return b.Holds(data); })) {
      return Runner().kept_from_borrowed(t);
    }
  }
  return t.attr(Runner().detach)();
}

const Hooks& SavedTensorHooks() {  // (kept for the process's life: never destroyed after Python)
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<Hooks> hooks;
  return hooks
      .call_once_and_store_result([] {
        Hooks h;
        h.pack = py::cpp_function(Pack);
        h.unpack = py::cpp_function([](py::object t) { return t; });
        return h;
      })
      .get_stored();
}

}  // namespace

void BeginSaving(BorrowedBuffers borrowed) {
  const Hooks& hooks = SavedTensorHooks();
  // (looked up per call, not kept: benchmarks/step_memory.py wraps it to see what is saved)
  Call(Runner().module.attr(Runner().push_saved_hooks), {hooks.pack, hooks.unpack});
  t_borrowed.push_back(std::move(borrowed));
}

void EndSaving() {
  if (t_borrowed.empty()) return;
  t_borrowed.pop_back();
  Call(Runner().pop_saved_hooks);
}

SavingScope::SavingScope(BorrowedBuffers borrowed) {
  RunScope* scope = DirectRunScope();
  if (scope && scope->saving_open) {
    t_borrowed.back() = std::move(borrowed);
  } else {
    BeginSaving(std::move(borrowed));
    if (scope) scope->saving_open = true;
  }
  stays_open_ = scope != nullptr;
}

namespace {
void EndSavingKeepingError() noexcept {
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);  // (a pending error would make the pop fail)
  try {
    EndSaving();
  } catch (py::error_already_set&) {
    // torch's pop only fails when the stack is empty, which this scope's push rules out
  }
  PyErr_Restore(type, value, trace);
}
}  // namespace

SavingScope::~SavingScope() {
  if (!stays_open_) EndSavingKeepingError();
}

void CloseOpenSaving(RunScope* scope) noexcept {
  if (!scope || !scope->saving_open) return;
  scope->saving_open = false;
  EndSavingKeepingError();
}

}  // namespace ortbridge
