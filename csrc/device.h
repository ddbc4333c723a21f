// Where a kernel's tensors live, and who writes its buffers. On the CPU the kernel writes them
// itself. Device memory torch writes, on ORT's compute stream: the library links no CUDA
// runtime, so one build serves CPU-only machines and every CUDA version torch ships.
#pragma once

#include <onnxruntime_c_api.h>

#include "dlpack.h"
#include "ort_util.h"
#include "python_call.h"

namespace ortbridge {

// The execution provider a kernel is registered for, and how it moves data.
enum class Backend {
  kCpu,          // CPU execution provider: the kernel writes its buffers
  kCuda,         // CUDA execution provider: torch writes the device buffers, on ORT's stream
  kCpuViaTorch,  // CPU execution provider on kCuda's code path (torch writes the buffers, inside a
                 // stream scope): how the tests run that path on machines without a GPU
};

// The execution provider's name for OrtCustomOp::GetExecutionProviderType (null: the CPU).
const char* ExecutionProviderType(Backend backend);

struct Placement {
  Backend backend = Backend::kCpu;
  dl::Device device{dl::kCPU, 0};  // where the kernel's inputs and outputs live

  bool via_torch() const { return backend != Backend::kCpu; }
};

// The placement of a kernel being created: its device is that of ORT's allocator for the node.
Placement PlacementOf(const OrtApi& api, const OrtKernelInfo* info, Backend backend);

// For its lifetime, torch's current stream on the kernel's device is ORT's compute stream for
// this call (the runner's use_stream), so everything torch launches, the Function's kernels and
// the copies into ORT's buffers, is ordered on it without a synchronization. Nothing on the CPU
// backend. GIL held.
class StreamScope {
 public:
  StreamScope(const OrtApi& api, OrtKernelContext* context, const Placement& placement,
              const py::object& runner);
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;
  ~StreamScope();

 private:
  py::object runner_;
  py::object previous_;  // what restore_stream puts back
};

// Buffer writes by torch on its current stream (the runner's copy_into and fill); on the CPU,
// large copies, which torch's threads share. GIL held.
// Copies `src`'s elements in row-major order into the compact buffer `dst` (which may overlap
// src: a view of that buffer).
void TorchCopy(const py::object& runner, void* dst, const ImportedTensor& src);
// A compact tensor on `device` into the distinct buffer `dst`.
void TorchCopy(const py::object& runner, void* dst, const TensorView& src, dl::Device device);
// Sets every element of `dst` (a buffer on `device`) to `value`.
void TorchFill(const py::object& runner, const TensorView& dst, dl::Device device, int64_t value);

}  // namespace ortbridge
