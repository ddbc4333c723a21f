// What a training-mode forward saves for backward. Its tensor inputs view ONNX Runtime's buffers,
// which ORT reuses once the call returns: a tensor saved from one of them must be a copy, unless
// torch owns that buffer (an output the graph run bound and lent: runner.lending), whose
// owner the saved view then keeps alive. Every other saved tensor is kept detached, which also
// breaks the cycle output -> node -> saved output.
// Both ways of making a training call (the kernel's own, the runner's `run`) go through here.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "small_vector.h"

namespace ortbridge {

namespace py = pybind11;

// The bytes of one of a call's inputs, [begin, end]: a tensor whose data starts there views it
// (its storage is that buffer: DLPack gave it no room before or after).
struct BorrowedBuffer {
  uintptr_t begin, end;
  bool Holds(uintptr_t data) const { return begin <= data && data <= end; }
};
using BorrowedBuffers = SmallVector<BorrowedBuffer, 8>;

// For its lifetime, torch's saved-tensor hooks on this thread copy what is saved from the
// `borrowed` buffers (the inputs'). Scopes nest (a Function may run a session itself); torch's
// hook stack is per thread, like ours. GIL held.
// A scope of a training forward that a run scope's session calls directly (see DirectRunScope)
// leaves the hooks pushed when it ends, and the scope's next such call only points them at its
// own buffers: a push and a pop less a call. Between the two only ORT's own kernels run; the next
// kernel call of another kind (KernelGil), a call's fallback to the runner, and the scope's end
// pop them (CloseOpenSaving).
class SavingScope {
 public:
  explicit SavingScope(BorrowedBuffers borrowed);
  SavingScope(const SavingScope&) = delete;
  SavingScope& operator=(const SavingScope&) = delete;
  ~SavingScope();  // may run while a Python error is being handled: it keeps that error intact

 private:
  bool stays_open_ = false;
};

// Pops the hooks a SavingScope left pushed in `scope`, if any (`scope` may be null). GIL held.
struct RunScope;
void CloseOpenSaving(RunScope* scope) noexcept;

// The Python face of SavingScope, for the runner's `run`: opens a scope over `borrowed`, closed
// by EndSaving on the same thread. GIL held.
void BeginSaving(BorrowedBuffers borrowed);
void EndSaving();

}  // namespace ortbridge
