// A context id as a tensor that owns its context: torch keeps it between the forward and the
// backward graph, and when torch frees it the context is released if no backward took it.
#pragma once

#include <Python.h>

#include <cstdint>
#include <unordered_set>

namespace ortbridge {

// A new "dltensor" capsule over a 0-d int64 tensor holding `id`. The DLPack deleter (run when the
// tensor is freed, on any thread) releases that context if it is still live.
PyObject* NewContextIdCapsule(int64_t id);

// The ids that live context-id tensors hold (torch, not a run scope, decides their lifetime).
std::unordered_set<int64_t> HeldByContextIdTensors();

}  // namespace ortbridge
