// Context ids as a tensor that owns their contexts: torch keeps it between the forward and the
// backward graph, and when torch frees it each context that no backward took is released.
#pragma once

#include <Python.h>

#include <cstdint>
#include <unordered_set>
#include <vector>

namespace ortbridge {

// A new "dltensor" capsule over a 1-d int64 tensor holding `ids` (a forward run's saved context
// ids: one tensor for all of them, so that torch saves one tensor, not one per Function call).
// The DLPack deleter (run when the tensor is freed, on any thread) releases each context still live.
PyObject* NewContextIdsCapsule(std::vector<int64_t> ids);

// The ids that live context-id tensors hold (torch, not a run scope, decides their lifetime).
std::unordered_set<int64_t> HeldByContextIdTensors();

}  // namespace ortbridge
